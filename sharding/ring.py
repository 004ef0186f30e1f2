"""Ring attention over one mesh axis, with a flash-style backward and causal block skipping.

Inside a ``shard_map`` manual over the ring's axis (``sharding.context`` builds it), rank
``i`` of ``C`` holds the queries, keys and values of its own T/C tokens. **Forward**: the
local block first, then C−1 ring steps; at step ``s`` the K/V block of rank ``j = i − s``
arrives by ``ppermute`` (with the keys' order and segment ids) and is folded into the
online softmax (``models.attention.fold_blocks``: ``block`` keys at a time, so the scores
held at once are ``[B, N, T/C, block]``). The forward keeps q, the local k and v, the output
and each row's log-sum-exp: O(T/C) per device, nothing of size (T/C) × T.

**Backward** (``jax.custom_vjp``): the ring runs again. Each arriving block's probabilities
are recomputed from q and the saved log-sum-exp (``models.attention.grad_blocks``, the same
math blockwise attention's backward uses); dQ accumulates locally, while the block's
dK/dV accumulator travels with the block, each rank adding its part, and one last
``ppermute`` takes it home to the block's owner.

**Causal skipping** (:func:`static_branch`): which part of an arriving block any query can
see follows from the layout, the rank and the step, so each step is a ``lax.switch`` between
branches of known cost, chosen from static facts:

- zigzag (``sharding.context.zigzag_order``: rank i holds chunks i and 2C−1−i): from a rank
  j < i all queries see the block's first chunk and none of its second (``keys_head``);
  from j > i only the second query chunk sees anything, and it sees the whole block
  (``queries_tail``). Both are exactly half a block, so every ring step costs every rank the
  same.
- contiguous (rank i holds chunk i): earlier ranks' blocks are fully visible (``full``),
  later ones fully masked (``skip``).
- any other order (``layout=None``): ``full`` or ``skip`` by a data-dependent test (does
  some row's earliest key come at or before its latest query).

Within the computed part the mask is still applied (packed documents' segment ids).

    >>> static_branch("zigzag", 4, rank=2, step=1), BRANCHES["zigzag"]   # block of rank 1
    (0, ('keys_head', 'queries_tail'))
    >>> [static_branch("contiguous", 4, rank=1, step=s) for s in (1, 2, 3)]   # ranks 0, 3, 2
    [1, 0, 0]
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from triax.models.attention import (Partial, Visibility, empty_partial, finish, fold_blocks,
                                    grad_blocks, log_sum_exp, no_grad, out_grad_dot)

LAYOUTS = ("zigzag", "contiguous")   # the orders a caller may vouch for (None: any order)
BRANCHES = {"zigzag": ("keys_head", "queries_tail"), "contiguous": ("skip", "full"),
            None: ("skip", "full")}
# Named scopes of each ring step's switch, forward and backward (introspection finds them).
FWD_SCOPE, BWD_SCOPE = "context_ring_fwd", "context_ring_bwd"


@dataclass(frozen=True)
class RingSpec:
    axis: str                       # the mesh axis the ring runs over (manual here)
    size: int                       # C, its size
    layout: Optional[str] = None    # "zigzag", "contiguous", or None (any order)
    block: int = 512                # keys per tile inside each step

    def __post_init__(self):
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"ring attention layout {self.layout!r}: choose one of "
                             f"{', '.join(LAYOUTS)} or None (any order)")


def source_rank(rank, step, C: int):
    """The rank whose K/V block rank ``rank`` holds at ring step ``step``."""
    return (rank - step) % C


def static_branch(layout: str, C: int, rank, step):
    """Index into ``BRANCHES[layout]`` of what rank ``rank`` computes at ring step ``step``
    (1 … C−1), from the layout alone: Python ints in, an int out, or traced ints in and a
    traced int out (the ring's ``lax.switch`` index)."""
    j = source_rank(rank, step, C)
    if layout == "zigzag":
        return (j > rank) + 0      # 0: keys_head (an earlier rank), 1: queries_tail (a later)
    if layout == "contiguous":
        return (j < rank) + 0      # 0: skip (a later rank), 1: full (an earlier)
    raise ValueError(f"no static branch for layout {layout!r}")


def _maybe_visible(vis: Visibility, k_order_BS) -> jax.Array:
    """1 when some row's earliest key comes at or before its latest query (the block may
    hold a visible pair; segments are left to the mask), else 0: ``full`` or ``skip``."""
    seen = k_order_BS.min(axis=1) <= vis.q_order_BT.max(axis=1)
    return seen.any().astype(jnp.int32)


# ---- the blocks that travel: K and V stacked, the keys' order (and segments) stacked -----

def _pack(k_BSKH, v_BSKH, vis: Visibility):
    ids = [vis.k_order_BS] + ([] if vis.k_segment_BS is None else [vis.k_segment_BS])
    return jnp.stack([k_BSKH, v_BSKH]), jnp.stack(ids)


def _unpack(blk):
    kv, ids = blk
    return kv[0], kv[1], ids[0], (ids[1] if ids.shape[0] > 1 else None)


def _rows(vis: Visibility, sl: slice) -> Visibility:
    """The queries ``sl`` of ``vis`` (keys unchanged)."""
    seg = None if vis.q_segment_BT is None else vis.q_segment_BT[:, sl]
    return Visibility(vis.q_order_BT[:, sl], vis.k_order_BS, seg, vis.k_segment_BS)


def _keys(k_BSKH, v_BSKH, order_BS, seg_BS, sl: slice):
    return (k_BSKH[:, sl], v_BSKH[:, sl], order_BS[:, sl],
            None if seg_BS is None else seg_BS[:, sl])


def _tile(spec: RingSpec, keys: int) -> int:
    return max(1, min(spec.block, keys))


# ---- forward ------------------------------------------------------------------------------

def _forward_branches(spec: RingSpec, q_BTNH, vis: Visibility):
    """``(part, blk) -> part`` for each of ``BRANCHES[spec.layout]``."""
    T = q_BTNH.shape[1]
    h = T // 2

    def fold(part, q, vis, k, v, order, seg):
        return fold_blocks(part, q, k, v, vis.keys(order, seg), _tile(spec, k.shape[1]),
                           skip_masked=False)

    def full(part, blk):
        return fold(part, q_BTNH, vis, *_unpack(blk))

    def keys_head(part, blk):      # all queries x the block's first chunk
        return fold(part, q_BTNH, vis, *_keys(*_unpack(blk), slice(0, h)))

    def queries_tail(part, blk):   # the second query chunk x the whole block
        tail = Partial(part.o_BTNH[:, h:], part.m_BNT[..., h:], part.l_BNT[..., h:])
        tail = fold(tail, q_BTNH[:, h:], _rows(vis, slice(h, None)), *_unpack(blk))
        return Partial(part.o_BTNH.at[:, h:].set(tail.o_BTNH),
                       part.m_BNT.at[..., h:].set(tail.m_BNT),
                       part.l_BNT.at[..., h:].set(tail.l_BNT))

    def skip(part, blk):
        return part

    named = {"full": full, "keys_head": keys_head, "queries_tail": queries_tail, "skip": skip}
    return [named[b] for b in BRANCHES[spec.layout]]


def _step_index(spec: RingSpec, rank, step, vis: Visibility, blk):
    if spec.layout is None:
        return _maybe_visible(vis, blk[1][0])
    return jnp.asarray(static_branch(spec.layout, spec.size, rank, step), jnp.int32)


def _perm(C: int):
    return [(r, (r + 1) % C) for r in range(C)]


def _forward(spec: RingSpec, q_BTNH, k_BSKH, v_BSKH, vis: Visibility):
    """``(o_BTNH, lse_BNT)`` of the local queries against every rank's keys."""
    rank = jax.lax.axis_index(spec.axis)
    part = fold_blocks(empty_partial(q_BTNH), q_BTNH, k_BSKH, v_BSKH, vis,
                       _tile(spec, k_BSKH.shape[1]), skip_masked=False)   # the local block
    branches = _forward_branches(spec, q_BTNH, vis)

    def step(carry, s):
        part, blk = carry
        blk = jax.lax.ppermute(blk, spec.axis, _perm(spec.size))   # rank i - s's block
        with jax.named_scope(FWD_SCOPE):
            part = jax.lax.switch(_step_index(spec, rank, s, vis, blk), branches, part, blk)
        return (part, blk), None

    (part, _), _ = jax.lax.scan(step, (part, _pack(k_BSKH, v_BSKH, vis)),
                                jnp.arange(1, spec.size))
    return finish(part, q_BTNH.dtype), log_sum_exp(part)


# ---- backward -----------------------------------------------------------------------------

def _backward_branches(spec: RingSpec, q_BTNH, vis: Visibility, do_BTNH, lse_BNT, d_BNT):
    """``(dq_BTNH, dkv, blk) -> (dq_BTNH, dkv)`` for each of ``BRANCHES[spec.layout]``;
    ``dkv`` is the travelling block's float32 ``[2, B, S, K, H]`` dK/dV accumulator."""
    T = q_BTNH.shape[1]
    h = T // 2

    def grads(q, vis, do, lse, d, k, v, order, seg):
        dq, dk, dv = grad_blocks(q, k, v, vis.keys(order, seg), do, lse, d,
                                 _tile(spec, k.shape[1]), skip_masked=False)
        return dq, jnp.stack([dk, dv])

    def full(dq, dkv, blk):
        dq_b, dkv_b = grads(q_BTNH, vis, do_BTNH, lse_BNT, d_BNT, *_unpack(blk))
        return dq + dq_b, dkv + dkv_b

    def keys_head(dq, dkv, blk):
        dq_b, dkv_b = grads(q_BTNH, vis, do_BTNH, lse_BNT, d_BNT,
                            *_keys(*_unpack(blk), slice(0, h)))
        return dq + dq_b, dkv.at[:, :, :h].add(dkv_b)

    def queries_tail(dq, dkv, blk):
        t = slice(h, None)
        dq_b, dkv_b = grads(q_BTNH[:, t], _rows(vis, t), do_BTNH[:, t], lse_BNT[..., t],
                            d_BNT[..., t], *_unpack(blk))
        return dq.at[:, t].add(dq_b), dkv + dkv_b

    def skip(dq, dkv, blk):
        return dq, dkv

    named = {"full": full, "keys_head": keys_head, "queries_tail": queries_tail, "skip": skip}
    return [named[b] for b in BRANCHES[spec.layout]]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(spec: RingSpec, q_BTNH, k_BSKH, v_BSKH, vis: Visibility):
    """Attention of the local queries over the keys of every rank of ``spec.axis``
    (called inside a ``shard_map`` manual over it); each rank holds T/C tokens."""
    return _forward(spec, q_BTNH, k_BSKH, v_BSKH, vis)[0]


def _ring_fwd(spec, q_BTNH, k_BSKH, v_BSKH, vis):
    o_BTNH, lse_BNT = _forward(spec, q_BTNH, k_BSKH, v_BSKH, vis)
    return o_BTNH, (q_BTNH, k_BSKH, v_BSKH, vis, o_BTNH, lse_BNT)


def _ring_bwd(spec, res, do_BTNH):
    q_BTNH, k_BSKH, v_BSKH, vis, o_BTNH, lse_BNT = res
    rank = jax.lax.axis_index(spec.axis)
    d_BNT = out_grad_dot(do_BTNH, o_BTNH)
    do_BTNH = do_BTNH.astype(q_BTNH.dtype)
    dq, dk, dv = grad_blocks(q_BTNH, k_BSKH, v_BSKH, vis, do_BTNH, lse_BNT, d_BNT,
                             _tile(spec, k_BSKH.shape[1]), skip_masked=False)
    branches = _backward_branches(spec, q_BTNH, vis, do_BTNH, lse_BNT, d_BNT)
    perm = _perm(spec.size)

    def step(carry, s):
        dq, blk, dkv = carry
        # the block of rank i - s arrives with its accumulator (ranks i-s … i-1 added theirs)
        blk, dkv = jax.lax.ppermute((blk, dkv), spec.axis, perm)
        with jax.named_scope(BWD_SCOPE):
            dq, dkv = jax.lax.switch(_step_index(spec, rank, s, vis, blk), branches, dq, dkv,
                                     blk)
        return (dq, blk, dkv), None

    (dq, _, dkv), _ = jax.lax.scan(step, (dq, _pack(k_BSKH, v_BSKH, vis), jnp.stack([dk, dv])),
                                   jnp.arange(1, spec.size))
    dkv = jax.lax.ppermute(dkv, spec.axis, perm)   # rank i holds block i+1's: take it home
    return (dq.astype(q_BTNH.dtype), dkv[0].astype(k_BSKH.dtype), dkv[1].astype(v_BSKH.dtype),
            no_grad(vis))


ring_attention.defvjp(_ring_fwd, _ring_bwd)
