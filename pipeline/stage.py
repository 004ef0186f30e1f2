"""What one pipeline stage computes for one chunk, and its stash-able backward.

The pipeline runs any model that follows the one model protocol
(``triax.models.protocol.PipelineModel``: pre-stack ``embed``, a scanned stack of identical
``blocks``, post-stack head), the built-in ``Transformer`` as a user's model. The parameters
are a state dict whose ``"blocks"`` entry is the stack (a leading layers axis, split over
stages); every other entry (``pieces``) belongs to the pre- or post-stack and is replicated
over ``pipe``.

:class:`Stage` is the model between two pipeline cuts: ``embed`` if the chunk is the first,
the protocol's stack scan over the chunk's blocks, and the head if it is the last — the
summed loss times ``1 / loss_weight`` of the whole batch (training, evaluation) or the
logits (decode, which also reads and writes the chunk's KV cache). ``first``/``last`` are
traced flags (the stage index is only known inside ``shard_map``), so every chunk has the
same residual structure and shares one stash.

    >>> import jax, jax.numpy as jnp
    >>> from triax.models import config
    >>> from triax.sharding.partition import abstract_model
    >>> am = abstract_model(config.TINY)
    >>> pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    >>> stage = Stage(am.graphdef, head="loss")
    >>> stage.activation(am.shapes["blocks"], pieces, {"inputs": jnp.zeros((2, 8), jnp.int32)})
    ShapeDtypeStruct(shape=(2, 8, 64), dtype=float32)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models import runtime
from triax.models.runtime import ExecConfig
from triax.models.lora import freeze_base
from triax.models.protocol import PipelineModel, loss_metric, run_stack, weighted_aux


@dataclass(frozen=True, eq=False)
class Stage:
    """``stage(chunk, pieces, x, extras, state) -> (y, loss, out, state)`` for any
    :class:`PipelineModel`.

    ``extras`` is a ``StageInputs``: this micro-batch's rows of the batch, step-wide
    constants, the chunk's place in the model, its layers' indices in the whole stack (what a
    block's per-layer randomness is drawn from: ``protocol.current_layer``) and (uneven
    stages) how many of the chunk's layer slots run.
    ``head="loss"``: consts ``inv_total_weight`` (and ``aux_scale`` for a model with auxiliary losses); the last
    chunk adds ``head_loss × inv_total_weight`` to the loss, ``out`` and ``state`` are
    empty. A model whose blocks return auxiliary losses (MoE) makes the loss a dict
    (:func:`_with_aux`). ``head="logits"`` (decode): ``state`` is the chunk's KV cache for
    this micro-batch, ``out`` the model's ``head_logits`` (zeros on chunks not the last).
    """

    graphdef: Any                 # an nnx GraphDef of a PipelineModel
    exe: ExecConfig = ExecConfig()
    head: str = "loss"

    def __post_init__(self):
        if self.head not in ("loss", "logits"):
            raise ValueError(f"Stage head={self.head!r}: choose 'loss' or 'logits'")

    def model(self, chunk, pieces) -> PipelineModel:
        # With adapters the base is frozen: its pullback has no weight-gradient matmuls, so
        # the split backward's W part holds the adapters' work only.
        return nnx.merge(self.graphdef, freeze_base({**pieces, "blocks": chunk}))

    def activation(self, chunk, pieces, inputs) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the activation that flows between stages."""
        def embed(chunk, pieces, inputs):
            with runtime.using(exe=self.exe):
                return self.model(chunk, pieces).embed(inputs)
        return jax.eval_shape(embed, chunk, pieces, inputs)

    def __call__(self, chunk, pieces, x_in, extras, state):
        inputs, consts, first, last = extras.inputs, extras.consts, extras.first, extras.last
        layers = extras.layers
        model = self.model(chunk, pieces)
        # how the model's own methods run (dtype, loss chunks); which slots run
        with runtime.using(exe=self.exe, layer_count=extras.count):
            x = jax.lax.cond(first, lambda: model.embed(inputs).astype(x_in.dtype),
                             lambda: x_in)
            if self.head == "loss":
                y, aux, _ = run_stack(model, x, inputs, self.exe, layers=layers)

                def loss():
                    nll = model.head_loss(y, inputs).astype(jnp.float32)
                    return nll * consts["inv_total_weight"]
                ce = jax.lax.cond(last, loss, lambda: jnp.zeros((), jnp.float32))
                return y, _with_aux(ce, aux, consts, loss_metric(model)), {}, state
            y, _, state = run_stack(model, x, inputs, self.exe, cache=state, layers=layers)
            logits = lambda: model.head_logits(y, inputs).astype(jnp.float32)  # noqa: E731
            out = jax.lax.cond(last, logits,
                               lambda: jnp.zeros(jax.eval_shape(logits).shape, jnp.float32))
        return y, jnp.zeros((), jnp.float32), out, state


def _with_aux(ce, aux: dict, consts: dict, metric: Optional[str]):
    """The stage's loss: ``ce`` alone, or with the chunk's auxiliary losses (MoE)
    ``{"loss": ce + w·aux, metric: ce, **aux}``, every aux term times ``consts["aux_scale"]``.

    The auxiliary losses are per micro-batch, as under gradient accumulation: the router's
    load balance is a product of two token sums, so it does not split over micro-batches,
    and a micro-batch's backward runs before the last one's forward. ``aux_scale`` (1 / (M ·
    data shards)) makes the sum over micro-batches, data shards and stages the mean over
    micro-batches of each scalar summed over layers, as the unpipelined model reports it.
    Only ``loss`` is differentiated; the rest are reported."""
    if not aux:
        return ce
    scale = consts["aux_scale"]
    return {"loss": ce + scale * weighted_aux(aux),
            **({metric: jax.lax.stop_gradient(ce)} if metric else {}),
            **{k: jax.lax.stop_gradient(v) * scale for k, v in aux.items()}}


