"""Mixtral-style mixture-of-experts feed-forward (token-choice top-k routing).

Extra shape letters: R the top-k routes of one token, C expert capacity (slots per expert
per sequence). The layer runs in four steps, all mesh-free:

  1. route:    logits_BTE = x_BTD·router_DE (fp32); top-k; gates = softmax over the k logits.
  2. dispatch: every (token, route) goes to slot ``pos`` of its expert's buffer buf_BECD.
               ``pos`` counts earlier assignments to that expert *in the same sequence*, all
               first choices before all second choices (then token order). ``pos >= C``
               drops the assignment (its gate contributes nothing) and is counted.
  3. experts:  SwiGLU per expert on buf_BECD.
  4. combine:  y_BTD = Σ_r gate_BTR · out[b, e, pos].

By default all of this runs here on whole arrays. ``triax.sharding.experts`` installs a runner
(the runtime's ``moe_runner``, see ``models.runtime``) that runs steps 1-4 per token shard and
wraps step 3 in an all-to-all over the ``expert`` mesh axis, so models/ never names a mesh.

Capacity is per sequence, so what is dropped never depends on the mesh. Dropless mode
(``capacity_factor=None``) uses C = T, the most any expert can receive from one sequence.

Capacity is a training device (static buffers, balanced all-to-all). Inference routes
dropless (the runtime's ``moe_inference``, which the engine and the no-cache reference set
while tracing): with capacity a token's output would depend on what else shares its forward
call: the other requests of a batch, a prefill bucket's padding (whose first choices would
sort ahead of real tokens' second choices), or whether it is decoded one token at a time.
Dropless, a request's tokens are the same in every batch, bucket and cache mode, and equal
``transformers``' Mixtral.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from triax.models import config
    >>> layer = MoE(config.TINY_MOE, nnx.Rngs(0))
    >>> y_BTD, aux = layer(jnp.ones((2, 16, 64)), jnp.float32)
    >>> sorted(aux)
    ['moe_dropped_tokens', 'moe_lb_loss', 'moe_loss_weighted', 'moe_z_loss']
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models import runtime
from triax.models.axes import constrain
from triax.models.config import ModelConfig, MoEConfig
from triax.models.layers import param

AUX_KEYS = ("moe_lb_loss", "moe_z_loss", "moe_dropped_tokens", "moe_loss_weighted")

# How the token work runs: runner(token_fn, x_BTD, router_DE, weights) -> (y_BTD, stats).
# token_fn(x_BTD, router_DE, weights, experts) does routing, dispatch and combine on the
# tokens it is given and calls experts(buf_BECD, weights) -> out_BECD; stats are token sums.
MoERunner = Callable[..., tuple]


def aux_zeros() -> dict:
    """The MoE auxiliary scalars, zeroed (the scan carry that sums them over layers)."""
    return {k: jnp.zeros((), jnp.float32) for k in AUX_KEYS}


def run_locally(token_fn, x_BTD, router_DE, weights):
    """The runner ``None`` stands for: the token work on the arrays as given."""
    return token_fn(x_BTD, router_DE, weights, expert_ffn)


def _run(token_fn, x_BTD, router_DE, weights):
    return (runtime.current().moe_runner or run_locally)(token_fn, x_BTD, router_DE, weights)


def capacity(moe: MoEConfig, seq_len: int) -> int:
    """Slots per expert per sequence: ``ceil(cf·T·k/E)`` capped at T; T when dropless (or
    under the runtime's ``moe_inference``)."""
    if moe.capacity_factor is None or runtime.current().moe_inference:
        return seq_len
    c = math.ceil(moe.capacity_factor * seq_len * moe.top_k / moe.num_experts)
    return max(1, min(seq_len, c))


def route(logits_BTE, top_k: int):
    """Top-k experts per token and their gates (softmax over the chosen logits, Mixtral)."""
    top_BTR, idx_BTR = jax.lax.top_k(logits_BTE, top_k)
    return idx_BTR, jax.nn.softmax(top_BTR, axis=-1)


def slots(idx_TR, num_experts: int):
    """Buffer slot of each assignment of one sequence: first choices first, then token order."""
    T, R = idx_TR.shape
    onehot_XE = jax.nn.one_hot(idx_TR.T.reshape(-1), num_experts, dtype=jnp.int32)  # X = R·T
    pos_XE = jnp.cumsum(onehot_XE, axis=0) - 1
    return jnp.sum(pos_XE * onehot_XE, axis=-1).reshape(R, T).T


def _dispatch(x_TD, idx_TR, pos_TR, num_experts: int, C: int):
    T, R = idx_TR.shape
    x_TRD = jnp.broadcast_to(x_TD[:, None, :], (T, R, x_TD.shape[-1]))
    buf_ECD = jnp.zeros((num_experts, C, x_TD.shape[-1]), x_TD.dtype)
    return buf_ECD.at[idx_TR, pos_TR].add(x_TRD, mode="drop")


def _combine(out_ECD, idx_TR, pos_TR, gates_TR):
    out_TRD = out_ECD.at[idx_TR, pos_TR].get(mode="fill", fill_value=0)
    return jnp.einsum("TRD,TR->TD", out_TRD, gates_TR.astype(out_TRD.dtype))


def expert_ffn(buf_ECD, weights):
    """SwiGLU of each expert on its own slots; leading dims (``...``) are token groups."""
    # Master weights arrive as stored (fp32) and are cast here, so the gradient reduction
    # over replicated token shards happens in full precision.
    w_gate_EDF, w_up_EDF, w_down_EFD = (w.astype(buf_ECD.dtype) for w in weights)
    g = jnp.einsum("...ECD,EDF->...ECF", buf_ECD, w_gate_EDF)
    u = jnp.einsum("...ECD,EDF->...ECF", buf_ECD, w_up_EDF)
    return jnp.einsum("...ECF,EFD->...ECD", jax.nn.silu(g) * u, w_down_EFD)


def router_stats(logits_BTE, idx_BTR, dropped) -> dict:
    """Token sums the aux losses need (sums, so shards add them with one psum)."""
    B, T, E = logits_BTE.shape
    return {"tokens": jnp.full((), B * T, jnp.float32),
            "assigned_E": jnp.sum(jax.nn.one_hot(idx_BTR, E, dtype=jnp.float32), axis=(0, 1, 2)),
            "prob_E": jnp.sum(jax.nn.softmax(logits_BTE, axis=-1), axis=(0, 1)),
            "lse2": jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1))),
            "dropped": dropped}


def router_aux(stats: dict, moe: MoEConfig) -> dict:
    """Switch-style load balance E·Σ_e f_e·p_e, router z-loss, and their weighted sum, over
    the tokens the statistics were summed over (``stats["tokens"]`` of them)."""
    num_tokens = stats["tokens"]
    frac_E = jax.lax.stop_gradient(stats["assigned_E"]) / (num_tokens * moe.top_k)
    lb = moe.num_experts * jnp.sum(frac_E * stats["prob_E"] / num_tokens)
    z = stats["lse2"] / num_tokens
    return {"moe_lb_loss": lb, "moe_z_loss": z, "moe_dropped_tokens": stats["dropped"],
            "moe_loss_weighted": moe.aux_loss_weight * lb + moe.z_loss_weight * z}


def moe_tokens(x_BTD, router_DE, weights, experts, moe: MoEConfig):
    """Route, dispatch, run ``experts`` on the buffers, combine: ``(y_BTD, stats)``."""
    T, E = x_BTD.shape[1], moe.num_experts
    C = capacity(moe, T)
    logits_BTE = jnp.einsum("BTD,DE->BTE", x_BTD.astype(jnp.float32), router_DE)
    idx_BTR, gates_BTR = route(logits_BTE, moe.top_k)
    pos_BTR = jax.vmap(slots, in_axes=(0, None))(idx_BTR, E)
    dropped = jnp.sum(pos_BTR >= C).astype(jnp.float32)
    buf_BECD = jax.vmap(_dispatch, in_axes=(0, 0, 0, None, None))(x_BTD, idx_BTR, pos_BTR, E, C)
    out_BECD = experts(buf_BECD, weights)
    y_BTD = jax.vmap(_combine)(out_BECD, idx_BTR, pos_BTR, gates_BTR)
    return y_BTD, router_stats(logits_BTE, idx_BTR, dropped)


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts. ``__call__(x_BTD, dtype) -> (y_BTD, aux)``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        moe = cfg.moe
        D, E, F, std = cfg.embed_dim, moe.num_experts, moe.mlp_dim or cfg.mlp_dim, cfg.init_std
        self.moe = moe
        # The router is tiny and every token needs all E logits: replicate it over experts.
        self.router_DE = param(rngs, (D, E), ("embed", None), std)
        self.w_gate_EDF = param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), std)
        self.w_up_EDF = param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), std)
        self.w_down_EFD = param(rngs, (E, F, D), ("experts", "expert_mlp", "embed"), std)

    def __call__(self, x_BTD, dtype):
        weights = tuple(w[...] for w in (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD))
        token_fn = functools.partial(moe_tokens, moe=self.moe)
        y_BTD, stats = _run(token_fn, x_BTD.astype(dtype),
                            self.router_DE[...].astype(jnp.float32), weights)
        y_BTD = constrain(y_BTD, ("batch", "seq", "act_embed"))
        return y_BTD, router_aux(stats, self.moe)
