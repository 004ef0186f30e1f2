"""What one pipeline stage computes for one chunk, and its stash-able backward.

The pipeline runs any model shaped "pre-stack → scanned stack of identical blocks →
post-stack": :class:`StackedModel` is that protocol, and the built-in ``Transformer``
implements it. The parameters are a state dict whose ``"blocks"`` entry is the stack (a
leading layers axis, split over stages); every other entry (``pieces``) belongs to the pre- or
post-stack and is replicated over ``pipe``.

:class:`Stage` is the model between two pipeline cuts: the pre-stack if the chunk is the
first, the chunk's blocks, and the post-stack if it is the last — the summed, globally
normalised loss (training, evaluation) or the logits (decode, which also reads and writes the
chunk's KV cache). ``first``/``last`` are traced flags (the stage index is only known inside
``shard_map``), so every chunk has the same residual structure and shares one stash.

    >>> import jax, jax.numpy as jnp
    >>> from triax.models import config
    >>> from triax.sharding.partition import abstract_model
    >>> am = abstract_model(config.TINY)
    >>> pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    >>> stage = Stage(am.graphdef, head="loss")
    >>> stage.activation(am.shapes["blocks"], pieces, {"tokens": jnp.zeros((2, 8), jnp.int32)})
    ShapeDtypeStruct(shape=(2, 8, 64), dtype=float32)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models.attention import packed_visibility
from triax.models.layers import ExecConfig
from triax.models.loss import head_nll_sum


class StackedModel(Protocol):
    """A model the pipeline can split: pre-stack, a scanned stack named ``blocks``, post-stack.

    ``run_blocks`` must be a scan over the ``blocks`` stack (any leading layer count), so a
    stage runs it on its own slice; ``cache`` is optional per-layer state scanned alongside.
    """

    def embed_tokens(self, tokens_BT, exe: ExecConfig): ...

    def run_blocks(self, x_BTD, positions_BT=None, vis=None, exe: ExecConfig = ...,
                   cache: Optional[Any] = None): ...  # -> (x_BTD, aux, cache)

    def logits(self, x_BTD, exe: ExecConfig): ...


@dataclass(frozen=True, eq=False)
class Stage:
    """``stage(chunk, pieces, x_BTD, extras, state) -> (y_BTD, loss, out, state)``.

    ``extras`` is ``(inputs, consts, first, last)``: this micro-batch's inputs, step-wide
    constants, and the chunk's place in the model. ``head="loss"``: inputs ``tokens``,
    ``targets``, ``weights`` (and, for packed documents, ``segment_ids`` and ``positions``),
    consts ``inv_total_weight`` (and ``aux_scale`` for MoE); the last chunk adds
    ``Σ w·nll / total weight`` to the loss, ``out`` and ``state`` are empty. A MoE model's
    loss is a dict with its auxiliary losses (:func:`_with_aux`). ``head="logits"``
    (decode): inputs ``tokens``, ``positions``; ``state`` is the chunk's KV cache for this
    micro-batch, ``out`` the logits (zeros on chunks that are not the last).
    """

    graphdef: Any                 # an nnx GraphDef of a StackedModel
    exe: ExecConfig = ExecConfig()
    head: str = "loss"

    def __post_init__(self):
        if self.head not in ("loss", "logits"):
            raise ValueError(f"Stage head={self.head!r}: choose 'loss' or 'logits'")

    def model(self, chunk, pieces) -> StackedModel:
        return nnx.merge(self.graphdef, {**pieces, "blocks": chunk})

    def activation(self, chunk, pieces, inputs) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the activation that flows between stages."""
        return jax.eval_shape(lambda c, p, t: self.model(c, p).embed_tokens(t, self.exe),
                              chunk, pieces, inputs["tokens"])

    def __call__(self, chunk, pieces, x_in_BTD, extras, state):
        inputs, consts, first, last = extras
        model = self.model(chunk, pieces)
        x = jax.lax.cond(first,
                         lambda: model.embed_tokens(inputs["tokens"], self.exe).astype(
                             x_in_BTD.dtype),
                         lambda: x_in_BTD)
        if self.head == "loss":
            y_BTD, aux, _ = model.run_blocks(x, inputs.get("positions"),
                                             packed_visibility(inputs.get("segment_ids"),
                                                               inputs.get("order")),
                                             exe=self.exe)

            def loss():
                nll = head_nll_sum(lambda y: model.logits(y, self.exe), y_BTD,
                                   inputs["targets"], inputs["weights"], self.exe.loss_chunks)
                return nll * consts["inv_total_weight"]
            ce = jax.lax.cond(last, loss, lambda: jnp.zeros((), jnp.float32))
            return y_BTD, _with_aux(ce, aux, consts), {}, state
        y_BTD, _, state = model.run_blocks(x, inputs["positions"], exe=self.exe, cache=state)
        logits = lambda: model.logits(y_BTD, self.exe).astype(jnp.float32)  # noqa: E731
        out = jax.lax.cond(last, logits,
                           lambda: jnp.zeros(jax.eval_shape(logits).shape, jnp.float32))
        return y_BTD, jnp.zeros((), jnp.float32), out, state


def _with_aux(ce, aux: dict, consts: dict):
    """The stage's loss: ``ce`` alone (dense), or with the chunk's auxiliary losses (MoE)
    ``{"loss": ce + w·aux, "ce": ce, **aux}``, every aux term times ``consts["aux_scale"]``.

    The auxiliary losses are per micro-batch, as under gradient accumulation: the router's
    load balance is a product of two token sums, so it does not split over micro-batches,
    and a micro-batch's backward runs before the last one's forward. ``aux_scale`` (1 / (M ·
    data shards)) makes the sum over micro-batches, data shards and stages the mean over
    micro-batches of each scalar summed over layers, as the unpipelined model reports it.
    Only ``loss`` is differentiated; the rest are reported."""
    if not aux:
        return ce
    scale = consts["aux_scale"]
    weighted = sum(v for k, v in aux.items() if k.endswith("_loss_weighted"))
    return {"loss": ce + scale * weighted, "ce": jax.lax.stop_gradient(ce),
            **{k: jax.lax.stop_gradient(v) * scale for k, v in aux.items()}}


class PipelineModel(Protocol):
    """The protocol any model follows to be pipelined (a user's ViT, an encoder, …).

    ``blocks`` is a stack of identical blocks with a leading layers axis (``nnx.vmap`` with
    ``PARTITION_NAME: "layers"``); every other parameter belongs to the pre- or post-stack.
    ``batch`` is the micro-batch (a dict of arrays, leading axis = rows).
    """

    blocks: Any

    def embed(self, batch): ...                   # pre-stack (first stage): -> x

    @staticmethod
    def block(block, x, batch): ...               # one block of the stack (every stage)

    def head_loss(self, x, batch): ...            # post-stack (last stage): summed loss

    # Optional: ``loss_weight(batch)``, what the summed loss is divided by (default: rows).


def loss_weight(model, batch):
    """The total a :class:`PipelineModel`'s summed loss is divided by, for the whole batch."""
    fn = getattr(model, "loss_weight", None)
    if fn is not None:
        return jnp.asarray(fn(batch), jnp.float32)
    return jnp.float32(jax.tree.leaves(batch)[0].shape[0])


def run_stack(model, x, batch):
    """``model.block`` scanned over the ``blocks`` stack (any leading layer count, so a stage
    runs it on its own chunk)."""
    graphdef, stack = nnx.split(model.blocks)

    def body(x, layer):
        return type(model).block(nnx.merge(graphdef, layer), x, batch).astype(x.dtype), None
    return jax.lax.scan(body, x, stack)[0]


def protocol_loss(model, batch):
    """The unpipelined loss of a :class:`PipelineModel`: ``(head_loss / loss_weight, {})`` —
    what ``Trainer.for_model`` uses when no ``loss_fn`` is given, so pipelined and
    unpipelined runs share one definition of the loss."""
    y = run_stack(model, model.embed(batch), batch)
    return model.head_loss(y, batch).astype(jnp.float32) / loss_weight(model, batch), {}


def missing_protocol(model) -> list[str]:
    """The :class:`PipelineModel` members ``model`` lacks (empty when it can be pipelined)."""
    return [name for name in ("blocks", "embed", "block", "head_loss")
            if not hasattr(model, name)]


@dataclass(frozen=True, eq=False)
class ProtocolStage:
    """:class:`Stage`'s ``head="loss"`` for any :class:`PipelineModel`: ``embed`` on the first
    chunk, ``block`` scanned over the chunk's layers, ``head_loss × inv_total_weight`` on the
    last."""

    graphdef: Any

    def model(self, chunk, pieces) -> PipelineModel:
        return nnx.merge(self.graphdef, {**pieces, "blocks": chunk})

    def activation(self, chunk, pieces, inputs) -> jax.ShapeDtypeStruct:
        return jax.eval_shape(lambda c, p, b: self.model(c, p).embed(b), chunk, pieces, inputs)

    def __call__(self, chunk, pieces, x_in, extras, state):
        inputs, consts, first, last = extras
        model = self.model(chunk, pieces)
        x = jax.lax.cond(first, lambda: model.embed(inputs).astype(x_in.dtype), lambda: x_in)
        y = run_stack(model, x, inputs)

        def loss():
            return model.head_loss(y, inputs).astype(jnp.float32) * consts["inv_total_weight"]
        return y, jax.lax.cond(last, loss, lambda: jnp.zeros((), jnp.float32)), {}, state
