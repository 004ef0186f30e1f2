"""The one model protocol: pre-stack → a scanned stack of identical blocks → post-stack.

Every model triax pipelines or trains from its protocol follows :class:`PipelineModel`: a
user's ViT and the built-in ``Transformer`` alike. This module holds the one stack scan
(:func:`run_stack`), the one loss (:func:`stack_loss`) and the one check
(:func:`missing_protocol`); a pipeline stage runs the same pieces on its own chunk.

How to run (compute dtype, remat, attention kernel, loss chunks) is not part of a model's
signature: :func:`run_stack` and :func:`stack_loss` take an ``ExecConfig`` and install it in
the runtime for the model's methods (:func:`current_exec`), as ``models.axes`` reads the
sharding hook from it (``models.runtime``).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from triax.models import Transformer, config
    >>> model = Transformer(config.TINY, nnx.Rngs(0))
    >>> missing_protocol(model)
    []
    >>> batch = {"inputs": jnp.zeros((2, 8), jnp.int32), "targets": jnp.zeros((2, 8), jnp.int32)}
    >>> loss, aux = stack_loss(model, batch)
    >>> sorted(aux)
    ['ce']
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models import runtime
from triax.models.runtime import ExecConfig

REMAT_POLICIES: dict[str, Optional[Callable]] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

REQUIRED = ("blocks", "embed", "block", "head_loss")


class PipelineModel(Protocol):
    """What a model provides to be pipelined (and to get its loss from the protocol).

    ``blocks`` is a stack of identical blocks with a leading layers axis (``nnx.vmap`` with
    ``PARTITION_NAME: "layers"``); every other parameter belongs to the pre- or post-stack.
    ``batch`` is the micro-batch (a dict of arrays, leading axis = rows).
    """

    blocks: Any

    def embed(self, batch): ...                   # pre-stack (first stage): -> x

    @staticmethod
    def block(block, x, batch): ...               # one block (every stage): -> x or (x, aux)

    def head_loss(self, x, batch): ...            # post-stack (last stage): summed loss

    # Optional, each with a default (see the functions below):
    #   loss_weight(batch): what the summed loss is divided by (default: the rows);
    #   aux_zeros(): the zeroed aux dict ``block`` returns in ``(x, aux)``, summed over the
    #     layers (default {}); a key ending in "_loss_weighted" is added to the loss;
    #   loss_metric: the aux key the head's mean loss is also reported under (default none);
    #   block_batch(batch, decoding): what every block reads, computed once before the
    #     scan (default: the batch);
    #   decoding: ``block(block, x, batch, cache) -> (x, aux, cache)`` with a per-layer
    #     cache scanned alongside, and ``head_logits(x, batch)`` (the built-in decoder).


def missing_protocol(model) -> list[str]:
    """The :class:`PipelineModel` members ``model`` lacks (empty when it follows it)."""
    return [name for name in REQUIRED if not hasattr(model, name)]


def loss_weight(model, batch):
    """The total a model's summed loss is divided by, for the whole batch."""
    fn = getattr(model, "loss_weight", None)
    if fn is not None:
        return jnp.asarray(fn(batch), jnp.float32)
    return jnp.float32(jax.tree.leaves(batch)[0].shape[0])


def aux_zeros(model) -> dict:
    """The auxiliary scalars ``model``'s blocks add up (empty unless it defines them)."""
    fn = getattr(model, "aux_zeros", None)
    return {} if fn is None else fn()


def loss_metric(model) -> Optional[str]:
    """The aux key the head's mean loss is reported under as well (None: not reported)."""
    return getattr(model, "loss_metric", None)


def current_exec() -> ExecConfig:
    """How the protocol's caller runs the model (``ExecConfig()`` outside of one)."""
    return runtime.current().exe


# Ops that only move or cast a value: a block applies them to its weights (an einsum's
# transpose, a cast to the compute dtype, a norm scale's broadcast), and saving their result
# would keep a made layer's weights for the backward in another layout.
_LAYOUT_OPS = frozenset({"transpose", "reshape", "convert_element_type", "broadcast_in_dim",
                         "squeeze", "expand_dims", "copy"})
_GATHERS = frozenset({"all_gather"})


def _all_but_layer_params(prim, *_, **params) -> bool:
    """The remat policy of a stack without remat whose layer parameters are made per layer
    (the runtime's ``layer_params``, e.g. gathered): every value is saved but the made parameters
    (a gather, or a ``shard_map`` around one and no matmul) and what a layout op makes; the
    backward makes those again from what is saved (a gather, or exact moves)."""
    if prim.name in _LAYOUT_OPS or prim.name in _GATHERS:
        return False
    inner = params.get("jaxpr")
    if prim.name == "shard_map" and inner is not None:
        names = {e.primitive.name for e in getattr(inner, "jaxpr", inner).eqns}
        return not (names & _GATHERS and not names & {"dot_general", "ragged_dot"})
    return True


# The named scope of the conditional that runs or skips one slot of the stack (the
# runtime's ``layer_count``): how the compiled program's layer slots are found.
LAYER_SLOT_SCOPE = "layer_slot"


def current_layer():
    """Inside :func:`run_stack`'s scan, the running layer's index in the whole stack (an
    int32 scalar; None outside; a pipeline stage passes its chunk's): what a block draws
    per-layer randomness from."""
    return runtime.current().layer


def _block_out(out):
    """``block``'s result as ``(x, aux, cache)``: it may return x, (x, aux) or all three."""
    if not isinstance(out, tuple):
        return out, {}, None
    return out if len(out) == 3 else (*out, None)


def run_stack(model, x, batch, exe: ExecConfig = ExecConfig(), cache: Optional[Any] = None,
              layers: Optional[Any] = None):
    """``(x, aux, cache)``: ``model.block`` scanned over the ``blocks`` stack (any leading
    layer count, so a stage runs it on its own chunk), ``aux`` summed over the layers.

    ``cache`` (leaves with the same leading layers axis) is scanned alongside the blocks and
    returned updated (None without one); ``exe.remat`` checkpoints each layer. Each layer's
    parameters are read through the runtime's ``layer_params`` when it has one; past its
    ``layer_count`` the layers are skipped (``models.runtime.Runtime``). ``layers`` (int32
    ``[n]``) are the blocks' indices in the whole stack that :func:`current_layer` reports (a
    pipeline chunk's; default ``0..n-1``)."""
    rt = runtime.current()
    layer_params, count = rt.layer_params, rt.layer_count
    with runtime.using(exe=exe):
        prepare = getattr(model, "block_batch", None)
        batch = batch if prepare is None else prepare(batch, cache is not None)
        graphdef, stack = nnx.split(model.blocks)
        block = type(model).block

        def body(carry, layer):
            x, aux = carry
            layer_state, layer_cache, index, _ = layer
            extra = () if layer_cache is None else (layer_cache,)
            if layer_params is not None:   # made again by the backward, never saved
                layer_state = layer_params(layer_state)
            with runtime.using(layer=index):
                y, a, layer_cache = _block_out(block(nnx.merge(graphdef, layer_state), x,
                                                     batch, *extra))
            return (y.astype(x.dtype), jax.tree.map(jnp.add, aux, a)), layer_cache

        if count is not None:
            def body(carry, layer, run=body):
                with jax.named_scope(LAYER_SLOT_SCOPE):
                    # the slot's place in this chunk (not its index in the stack)
                    return jax.lax.cond(layer[3] < count, run, lambda c, l: (c, l[1]),
                                        carry, layer)
        if exe.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[exe.remat], prevent_cse=False)
        elif layer_params is not None:   # keep every residual but the made parameters
            body = jax.checkpoint(body, policy=_all_but_layer_params, prevent_cse=False)
        n = jax.tree.leaves(stack)[0].shape[0]
        layers = jnp.arange(n, dtype=jnp.int32) if layers is None else jnp.asarray(layers)
        if layers.shape != (n,):
            raise ValueError(f"run_stack: layers has shape {layers.shape}; give one index per "
                             f"block of the stack ({n},)")
        (x, aux), cache = jax.lax.scan(
            body, (x, aux_zeros(model)),
            (stack, cache, layers.astype(jnp.int32), jnp.arange(n, dtype=jnp.int32)))
    return x, aux, cache


def weighted_aux(aux: dict):
    """What a model's auxiliary terms add to its loss: the sum of the keys ending in
    ``_loss_weighted`` (0 when there are none)."""
    return sum(v for k, v in aux.items() if k.endswith("_loss_weighted"))


def with_aux(loss, aux: dict, model):
    """``(loss + weighted_aux(aux), {metric: loss, **aux})``: the total a model's
    auxiliary terms add to, and what is reported (``loss_metric``)."""
    metric = loss_metric(model)
    total = loss + weighted_aux(aux)
    return total, {**({metric: loss} if metric else {}), **aux}


def stack_loss(model, batch, exe: ExecConfig = ExecConfig()):
    """The unpipelined loss ``(head_loss / loss_weight + weighted aux, aux)`` — what
    ``Trainer`` uses for the built-in model and for a user's model without a ``loss_fn``, so
    pipelined and unpipelined runs share one definition of the loss."""
    with runtime.using(exe=exe):
        y, aux, _ = run_stack(model, model.embed(batch), batch, exe)
        loss = model.head_loss(y, batch).astype(jnp.float32) / loss_weight(model, batch)
    return with_aux(loss, aux, model)
