"""What one pipeline stage computes for one chunk, and its stash-able backward.

``stage_apply`` is the model between two pipeline cuts: embedding if the chunk is the first,
the chunk's blocks, and the final norm, head and (summed, globally normalised) cross-entropy
if it is the last. ``first``/``last`` are traced flags (the stage index is only known inside
``shard_map``), so every chunk has the same residual structure and shares one stash.

``Residuals`` turns ``jax.vjp``'s pullback into flat arrays for the stash, leaving out the
leaves that are the parameters themselves (re-inserted at backward time, never copied).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models.layers import ExecConfig, causal_mask


def make_stage_apply(graphdef, exe: ExecConfig):
    """``apply(chunk, pieces, x_BTD, extras) -> (y_BTD, loss)``; ``extras`` is
    ``(tokens_BT, targets_BT, weights_BT, first, last, inv_total_weight)``."""
    def apply(chunk, pieces, x_in_BTD, extras):
        tok_BT, tgt_BT, w_BT, first, last, inv_w = extras
        model = nnx.merge(graphdef, {**pieces, "blocks": chunk})
        b, T = tok_BT.shape
        pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T))
        x = jax.lax.cond(first, lambda: model.embed_tokens(tok_BT, exe).astype(x_in_BTD.dtype),
                         lambda: x_in_BTD)
        y_BTD, _ = model.run_blocks(x, pos_BT, causal_mask(T, b), exe)

        def head_loss():
            logp = jax.nn.log_softmax(model.logits(y_BTD, exe).astype(jnp.float32), axis=-1)
            nll_BT = -jnp.take_along_axis(logp, tgt_BT[..., None], axis=-1)[..., 0]
            return jnp.sum(nll_BT * w_BT) * inv_w
        loss = jax.lax.cond(last, head_loss, lambda: jnp.zeros((), jnp.float32))
        return y_BTD, loss
    return apply


@dataclass(frozen=True, eq=False)
class Residuals:
    """The stash layout of one forward's pullback: which leaves to store, their shapes."""

    treedef: Any
    param_index: tuple            # per pullback leaf: index into the param leaves, or None
    shapes: tuple                 # ShapeDtypeStruct of each stored leaf

    @classmethod
    def trace(cls, apply, chunk, pieces, x, extras) -> "Residuals":
        info = {}

        def f(chunk, pieces, x, extras):
            _, pullback = jax.vjp(apply, chunk, pieces, x, extras)
            leaves, info["treedef"] = jax.tree.flatten(pullback)
            info["index"] = _param_index(leaves, (chunk, pieces))
            return [l for l, i in zip(leaves, info["index"]) if i is None]
        shapes = jax.eval_shape(f, chunk, pieces, x, extras)
        return cls(info["treedef"], tuple(info["index"]), tuple(shapes))

    def forward(self, apply, chunk, pieces, x, extras):
        """Run the forward; return its outputs and the leaves to stash."""
        out, pullback = jax.vjp(apply, chunk, pieces, x, extras)
        leaves = jax.tree.leaves(pullback)
        if tuple(_param_index(leaves, (chunk, pieces))) != self.param_index:
            raise AssertionError("pullback structure changed between traces")
        return out, [l for l, i in zip(leaves, self.param_index) if i is None]

    def pullback(self, stored, chunk, pieces):
        params = jax.tree.leaves((chunk, pieces))
        it = iter(stored)
        leaves = [next(it) if i is None else params[i] for i in self.param_index]
        return jax.tree.unflatten(self.treedef, leaves)


def _param_index(leaves, params):
    ids = {id(p): k for k, p in enumerate(jax.tree.leaves(params))}
    return [ids.get(id(l)) for l in leaves]
