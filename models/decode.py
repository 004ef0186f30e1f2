"""Cache-aware forward for generation: the training math, plus a KV cache it reads and writes.

The cache is one pair of arrays per model, ``k_LBSKH`` and ``v_LBSKH`` (layers, batch rows,
cache positions, KV heads, head dim), with logical axes ``CACHE_AXES``. A forward over
``T`` new tokens at ``positions_BT`` writes their keys/values at those positions and lets
each query see every cache slot at or before its own position. Rows are independent, so a
batch mixes prompts of different lengths (and, in serving, requests at different steps).

Slots after a row's current position may hold stale values from padding or an earlier
request; the mask hides them, and they are overwritten before any query can see them
(a position is always written in the same call that first attends to it).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from triax.models import Transformer, config
    >>> from triax.models.decode import forward_with_cache, init_cache
    >>> model = Transformer(config.TINY, nnx.Rngs(0))
    >>> cache = init_cache(config.TINY, batch=2, length=32)
    >>> pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    >>> logits_BTV, cache = forward_with_cache(model, jnp.zeros((2, 8), jnp.int32), pos, cache)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models.axes import constrain
from triax.models.config import ModelConfig
from triax.models.layers import ExecConfig, attend

CACHE_AXES = ("layers", "batch", "kv_seq", "act_kv_heads", "act_head_dim")
Cache = dict  # {"k": [L, B, S, K, H], "v": [L, B, S, K, H]}


def cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, ...]:
    return (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> Cache:
    shape = cache_shape(cfg, batch, length)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cache_mask(positions_BT, length: int):
    """True where the query at ``positions_BT`` may see cache slot ``s`` (``s <= position``)."""
    return jnp.arange(length)[None, None, :] <= positions_BT[:, :, None]


def _write_rows(cache_BSKH, new_BTKH, start_B):
    """Write each row's ``T`` new entries at its own start position."""
    def one(c_SKH, n_TKH, s):
        return jax.lax.dynamic_update_slice_in_dim(c_SKH, n_TKH.astype(c_SKH.dtype), s, axis=0)
    return jax.vmap(one)(cache_BSKH, new_BTKH, start_B)


def block_with_cache(block, x_BTD, positions_BT, k_BSKH, v_BSKH, dtype):
    """One decoder block (same math as ``Block.__call__``) reading/writing its cache layer.

    New tokens of a row sit at consecutive positions starting at ``positions_BT[:, 0]``.
    """
    attn = block.attn
    q, k, v = attn.project_qkv(block.attn_norm(x_BTD), positions_BT, dtype)
    k_BSKH = constrain(_write_rows(k_BSKH, k, positions_BT[:, 0]), CACHE_AXES[1:])
    v_BSKH = constrain(_write_rows(v_BSKH, v, positions_BT[:, 0]), CACHE_AXES[1:])
    mask_BTS = cache_mask(positions_BT, k_BSKH.shape[1])
    o = attend(q, k_BSKH.astype(dtype), v_BSKH.astype(dtype), mask_BTS)
    x_BTD = x_BTD + attn.output(o, dtype)
    y_BTD, _ = block.mlp(block.mlp_norm(x_BTD), dtype)
    return constrain(x_BTD + y_BTD, ("batch", "seq", "act_embed")), k_BSKH, v_BSKH


def scan_blocks_with_cache(block_graphdef, stacked_state, x_BTD, positions_BT, k_LBSKH, v_LBSKH,
                           exe: ExecConfig = ExecConfig()):
    """``scan_blocks`` with a cache: a pure function of a (slice of the) layer stack, so a
    pipeline stage runs it on its own layers and its own cache layers."""
    def body(x, layer):
        state, k, v = layer
        x, k, v = block_with_cache(nnx.merge(block_graphdef, state), x, positions_BT, k, v,
                                   exe.dtype)
        return x, (k, v)

    x_BTD, (k_LBSKH, v_LBSKH) = jax.lax.scan(body, x_BTD, (stacked_state, k_LBSKH, v_LBSKH))
    return x_BTD, k_LBSKH, v_LBSKH


def forward_with_cache(model, tokens_BT, positions_BT, cache: Cache,
                       exe: ExecConfig = ExecConfig()):
    """``(logits_BTV, cache)`` for ``T`` new tokens per row at ``positions_BT``."""
    gd, st = nnx.split(model.blocks)
    x = model.embed_tokens(tokens_BT, exe)
    x, k, v = scan_blocks_with_cache(gd, st, x, positions_BT, cache["k"], cache["v"], exe)
    return model.logits(x, exe), {"k": k, "v": v}
