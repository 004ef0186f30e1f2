"""Online softmax: attention over keys seen one block at a time, carrying an unnormalised
output with the running max and sum of every query row (:class:`Partial`), so a kernel never
holds more than one block's scores. Blockwise attention scans these over key blocks; ring
attention (context parallelism) applies them to the K/V blocks passed around the ring;
partials over disjoint keys combine by :func:`merge`, or across devices by :func:`combine`.

    >>> import jax.numpy as jnp
    >>> from triax.models.visibility import Visibility
    >>> q = k = v = jnp.ones((1, 4, 2, 8))
    >>> part = accumulate(empty_partial(q), q, k, v, Visibility.causal(1, 4))
    >>> finish(part, q.dtype).shape
    (1, 4, 2, 8)
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from triax.models.axes import constrain
from triax.models.visibility import Visibility

# Masked scores: the most negative finite float, so a row never meets inf - inf.
_MASKED = float(jnp.finfo(jnp.float32).min)


def repeat_kv(x_BSKH, num_heads: int):
    """KV heads repeated to the query heads (query head ``n`` reads KV head ``n // G``), local
    on every tensor rank whether KV heads are sharded or replicated."""
    G = num_heads // x_BSKH.shape[2]
    x_BSNH = jnp.repeat(x_BSKH, G, axis=2)
    return constrain(x_BSNH, ("batch", "kv_seq", "act_heads", "act_head_dim"))


def _scores(q_BTNH, k_BSNH, visible_BTS):
    scale = 1.0 / math.sqrt(q_BTNH.shape[-1])
    s_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH).astype(jnp.float32) * scale
    return jnp.where(visible_BTS[:, None, :, :], s_BNTS, _MASKED)


class Partial(NamedTuple):
    """Attention over the keys seen so far: unnormalised output, running row max and sum."""

    o_BTNH: jax.Array   # float32, sum over seen keys of exp(s - m) v
    m_BNT: jax.Array    # running max of visible scores (_MASKED while none is visible)
    l_BNT: jax.Array    # running sum of exp(s - m) over visible keys


def empty_partial(q_BTNH) -> Partial:
    """The partial of queries ``q_BTNH`` that have seen no key yet. Built ``_like`` q, so
    inside a ``shard_map`` it varies over the same manual axes (a scan carry must)."""
    B, T, N, H = q_BTNH.shape
    return Partial(jnp.zeros_like(q_BTNH, jnp.float32),
                   jnp.full_like(q_BTNH, _MASKED, jnp.float32, shape=(B, N, T)),
                   jnp.zeros_like(q_BTNH, jnp.float32, shape=(B, N, T)))


def accumulate(part: Partial, q_BTNH, k_BSKH, v_BSKH, vis: Visibility) -> Partial:
    """Fold one block of keys/values (``vis`` names their order/segments) into ``part``."""
    N = q_BTNH.shape[2]
    k_BSNH, v_BSNH = repeat_kv(k_BSKH, N), repeat_kv(v_BSKH, N)
    visible_BTS = vis.mask()
    s_BNTS = _scores(q_BTNH, k_BSNH, visible_BTS)
    m_BNT = jnp.maximum(part.m_BNT, s_BNTS.max(axis=-1))
    # Masked entries add nothing, also while a row has seen no visible key yet (m = _MASKED).
    p_BNTS = jnp.where(visible_BTS[:, None], jnp.exp(s_BNTS - m_BNT[..., None]), 0.0)
    correction_BNT = jnp.exp(part.m_BNT - m_BNT)
    l_BNT = part.l_BNT * correction_BNT + p_BNTS.sum(axis=-1)
    pv_BTNH = jnp.einsum("BNTS,BSNH->BTNH", p_BNTS.astype(v_BSNH.dtype), v_BSNH)
    o_BTNH = part.o_BTNH * correction_BNT.transpose(0, 2, 1)[..., None] + pv_BTNH
    return Partial(o_BTNH, m_BNT, l_BNT)


def combine(parts: Partial, reduce_max: Callable, reduce_sum: Callable) -> Partial:
    """Partials over disjoint key sets combined into one over their union; the sets lie
    along whatever ``reduce_max``/``reduce_sum`` reduce: a stacked leading axis
    (:func:`merge`), or a mesh axis (``lax.pmax``/``lax.psum``, one set per device)."""
    m_BNT = reduce_max(parts.m_BNT)
    c_BNT = jnp.exp(parts.m_BNT - m_BNT)   # each set rescaled to the common max
    o_BTNH = reduce_sum(parts.o_BTNH * jnp.swapaxes(c_BNT, -1, -2)[..., None])
    return Partial(o_BTNH, m_BNT, reduce_sum(parts.l_BNT * c_BNT))


def merge(a: Partial, b: Partial) -> Partial:
    """Two partials over disjoint key sets combined into one over their union."""
    both = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
    out = combine(both, lambda x: x.max(axis=0, keepdims=True),
                  lambda x: x.sum(axis=0, keepdims=True))
    return jax.tree.map(lambda x: x[0], out)


def finish(part: Partial, dtype) -> jax.Array:
    """``o_BTNH`` normalised; a row that saw no key at all is zero (never met in self- or
    cache attention, where a query always sees itself)."""
    l_BTN = part.l_BNT.transpose(0, 2, 1)
    safe = jnp.where(l_BTN > 0, l_BTN, 1.0)
    return (part.o_BTNH / safe[..., None]).astype(dtype)
