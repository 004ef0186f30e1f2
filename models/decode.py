"""The KV cache: its layout and how new keys/values are written into it.

The cache is one pair of arrays per model, ``k_LBSKH`` and ``v_LBSKH`` (layers, batch rows,
cache positions, KV heads, head dim), with logical axes ``CACHE_AXES``. The forward that uses
it is the training forward: pass ``cache=`` to ``Transformer.__call__`` (or to
``models.protocol.run_stack``), and every block's attention writes the keys/values of its ``T`` new tokens at
``positions_BT`` and lets each query see every cache slot at or before its own position. Rows
are independent, so a batch mixes prompts of different lengths (and, in serving, requests at
different steps).

Slots after a row's current position may hold stale values from padding or an earlier
request; the cache's visibility (``models.visibility.Visibility.cache``) hides them, and they
are overwritten before any query can see them (a position is always written in the same call
that first attends to it).

**Hook** (:func:`cached_attention`): writing a layer's new keys/values and attending over
its cache is one step that a parallelism may replace while tracing
(:func:`using_cache_attention`), as ``models.attention.using_attention`` replaces attention:
context parallelism keeps the cache split along its positions
(``triax.sharding.context_cache``), which places entries and combines per-slice results its
own way. The model never names a mesh.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from triax.models import Transformer, config
    >>> model = Transformer(config.TINY, nnx.Rngs(0))
    >>> cache = init_cache(config.TINY, batch=2, length=32)
    >>> pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    >>> logits_BTV, aux, cache = model(jnp.zeros((2, 8), jnp.int32), pos, cache=cache)
    >>> cache["k"].shape
    (4, 2, 32, 2, 8)
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from triax.models.attention import attention
from triax.models.visibility import Visibility
from triax.models.axes import constrain
from triax.models.config import ModelConfig

CACHE_AXES = ("layers", "batch", "kv_seq", "act_kv_heads", "act_head_dim")
Cache = dict  # {"k": [L, B, S, K, H], "v": [L, B, S, K, H]}; one layer's: [B, S, K, H]


def cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, ...]:
    return (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> Cache:
    shape = cache_shape(cfg, batch, length)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def write_rows(cache_BSKH, new_BTKH, start_B):
    """Write each row's ``T`` new entries at its own start position."""
    def one(c_SKH, n_TKH, s):
        return jax.lax.dynamic_update_slice_in_dim(c_SKH, n_TKH.astype(c_SKH.dtype), s, axis=0)
    return jax.vmap(one)(cache_BSKH, new_BTKH, start_B)


def write_layer(layer_cache: Cache, k_BTKH, v_BTKH, positions_BT) -> Cache:
    """One layer's cache with the new keys/values written; a row's new tokens sit at
    consecutive positions starting at ``positions_BT[:, 0]``."""
    start_B = positions_BT[:, 0]
    return {"k": constrain(write_rows(layer_cache["k"], k_BTKH, start_B), CACHE_AXES[1:]),
            "v": constrain(write_rows(layer_cache["v"], v_BTKH, start_B), CACHE_AXES[1:])}


# (q_BTNH, k_BTKH, v_BTKH, layer_cache, positions_BT, implementation) -> (o_BTNH, layer_cache)
CacheAttentionFn = Callable[..., tuple[jax.Array, Cache]]
_HOOK: contextvars.ContextVar[Optional[CacheAttentionFn]] = contextvars.ContextVar(
    "triax_cache_attention", default=None)


def cached_attention(q_BTNH, k_BTKH, v_BTKH, layer_cache: Cache, positions_BT,
                     implementation: str = "reference"):
    """``(o_BTNH, layer_cache)``: the ``T`` new keys/values written at ``positions_BT``, then
    the queries attend over every cache slot at or before their position; or whatever the
    installed hook does with the same arguments."""
    hook = _HOOK.get()
    if hook is not None:
        return hook(q_BTNH, k_BTKH, v_BTKH, layer_cache, positions_BT, implementation)
    layer_cache = write_layer(layer_cache, k_BTKH, v_BTKH, positions_BT)
    k_BSKH, v_BSKH = (layer_cache[n].astype(q_BTNH.dtype) for n in ("k", "v"))
    vis = Visibility.cache(positions_BT, k_BSKH.shape[1])
    return attention(q_BTNH, k_BSKH, v_BSKH, vis, implementation), layer_cache


@contextlib.contextmanager
def using_cache_attention(fn: Optional[CacheAttentionFn]):
    """Route every :func:`cached_attention` call through ``fn`` while the context is open."""
    token = _HOOK.set(fn)
    try:
        yield
    finally:
        _HOOK.reset(token)
