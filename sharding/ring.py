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

from triax.models.attention import (BLOCK_SIZE, fold_blocks, grad_blocks, log_sum_exp, no_grad,
                                    out_grad_dot, tie_to_queries)
from triax.models.online_softmax import Partial, empty_partial, finish
from triax.models.visibility import Visibility

LAYOUTS = ("zigzag", "contiguous")   # the orders a caller may vouch for (None: any order)
BRANCHES = {"zigzag": ("keys_head", "queries_tail"), "contiguous": ("skip", "full"),
            None: ("skip", "full")}
# Named scopes of each ring step's switch, forward and backward (introspection finds them).
FWD_SCOPE, BWD_SCOPE = "context_ring_fwd", "context_ring_bwd"


@dataclass(frozen=True)
class RingSpec:
    """Static facts of one ring: its mesh axis and size, the layout the caller vouches for
    (:func:`static_branch` reads it) and the keys per tile inside each step."""

    axis: str                       # the mesh axis the ring runs over (manual here)
    size: int                       # C, its size
    layout: Optional[str] = None    # "zigzag", "contiguous", or None (any order)
    block: int = BLOCK_SIZE         # keys per tile inside each step

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


def region(branch: str, T: int) -> Optional[tuple[slice, slice]]:
    """``(queries, keys)`` of the local block's T queries and the arriving block's T keys
    that ``branch`` computes (None: nothing): the one place the branches' halves are cut."""
    h = T // 2
    return {"full": (slice(0, T), slice(0, T)), "keys_head": (slice(0, T), slice(0, h)),
            "queries_tail": (slice(h, T), slice(0, T)), "skip": None}[branch]


def _rows(x, sl: slice, axis: int):
    """``x[sl]`` along ``axis`` (x itself when ``sl`` covers it)."""
    if sl.start == 0 and sl.stop == x.shape[axis]:
        return x
    return jax.lax.slice_in_dim(x, sl.start, sl.stop, axis=axis)


def _put_rows(x, sl: slice, axis: int, new):
    if sl.start == 0 and sl.stop == x.shape[axis]:
        return new
    return jax.lax.dynamic_update_slice_in_dim(x, new, sl.start, axis=axis)


def _add_rows(x, sl: slice, axis: int, add):
    return _put_rows(x, sl, axis, _rows(x, sl, axis) + add)


def _queries(vis: Visibility, qs: slice) -> Visibility:
    seg = None if vis.q_segment_BT is None else _rows(vis.q_segment_BT, qs, 1)
    return Visibility(_rows(vis.q_order_BT, qs, 1), vis.k_order_BS, seg, vis.k_segment_BS)


def _keys(blk, ks: slice):
    """``(k, v, order, segments)`` of the arriving block's keys ``ks``."""
    k, v, order, seg = _unpack(blk)
    return (_rows(k, ks, 1), _rows(v, ks, 1), _rows(order, ks, 1),
            None if seg is None else _rows(seg, ks, 1))


def _tile(spec: RingSpec, keys: int) -> int:
    return max(1, min(spec.block, keys))


# ---- forward ------------------------------------------------------------------------------

def _forward_branches(spec: RingSpec, q_BTNH, vis: Visibility):
    """``(part, blk) -> part`` for each of ``BRANCHES[spec.layout]``: the arriving block's
    keys of the branch's :func:`region` folded into its queries' rows of ``part``."""
    T = q_BTNH.shape[1]

    def branch(name):
        if region(name, T) is None:
            return lambda part, blk: part
        qs, ks = region(name, T)

        def run(part, blk):
            k, v, order, seg = _keys(blk, ks)
            sub = Partial(_rows(part.o_BTNH, qs, 1), _rows(part.m_BNT, qs, 2),
                          _rows(part.l_BNT, qs, 2))
            sub = fold_blocks(sub, _rows(q_BTNH, qs, 1), k, v,
                              _queries(vis, qs).keys(order, seg), _tile(spec, k.shape[1]),
                              skip_masked=False)
            return Partial(_put_rows(part.o_BTNH, qs, 1, sub.o_BTNH),
                           _put_rows(part.m_BNT, qs, 2, sub.m_BNT),
                           _put_rows(part.l_BNT, qs, 2, sub.l_BNT))
        return run
    return [branch(b) for b in BRANCHES[spec.layout]]


def _step_index(spec: RingSpec, rank, step, vis: Visibility, blk):
    if spec.layout is None:
        return _maybe_visible(vis, blk[1][0])
    return jnp.asarray(static_branch(spec.layout, spec.size, rank, step), jnp.int32)


def _perm(C: int):
    return [(r, (r + 1) % C) for r in range(C)]


def _forward(spec: RingSpec, q_BTNH, k_BSKH, v_BSKH, vis: Visibility):
    """``(o_BTNH, lse_BNT)`` of the local queries against every rank's keys."""
    q_BTNH, vis = tie_to_queries(q_BTNH, vis)   # no masks hoisted out of the layer scan
    rank = jax.lax.axis_index(spec.axis)
    part = fold_blocks(empty_partial(q_BTNH), q_BTNH, k_BSKH, v_BSKH, vis,
                       _tile(spec, k_BSKH.shape[1]), skip_masked=False)   # the local block
    branches = _forward_branches(spec, q_BTNH, vis)

    def step(carry, s):
        part, blk = carry
        blk = jax.lax.ppermute(blk, spec.axis, _perm(spec.size))   # rank i - s's block
        # The index is tied to the carry for the reason ``tie_to_queries`` gives: a switch on
        # an index JAX knows (rank and step) would have its branches' constant parts
        # hoisted out of the layer scan, stacked over the ring's steps.
        index, part = jax.lax.optimization_barrier((_step_index(spec, rank, s, vis, blk), part))
        with jax.named_scope(FWD_SCOPE):
            part = jax.lax.switch(index, branches, part, blk)
        return (part, blk), None

    (part, _), _ = jax.lax.scan(step, (part, _pack(k_BSKH, v_BSKH, vis)),
                                jnp.arange(1, spec.size))
    return finish(part, q_BTNH.dtype), log_sum_exp(part)


# ---- backward -----------------------------------------------------------------------------

def _backward_branches(spec: RingSpec, q_BTNH, vis: Visibility, do_BTNH, lse_BNT, d_BNT):
    """``(dq_BTNH, dkv, blk) -> (dq_BTNH, dkv)`` for each of ``BRANCHES[spec.layout]``;
    ``dkv`` is the travelling block's float32 ``[2, B, S, K, H]`` dK/dV accumulator, to
    which the branch's :func:`region` adds this rank's part."""
    T = q_BTNH.shape[1]

    def branch(name):
        if region(name, T) is None:
            return lambda dq, dkv, blk: (dq, dkv)
        qs, ks = region(name, T)

        def run(dq, dkv, blk):
            k, v, order, seg = _keys(blk, ks)
            dq_b, dk, dv = grad_blocks(_rows(q_BTNH, qs, 1), k, v,
                                       _queries(vis, qs).keys(order, seg),
                                       _rows(do_BTNH, qs, 1), _rows(lse_BNT, qs, 2),
                                       _rows(d_BNT, qs, 2), _tile(spec, k.shape[1]),
                                       skip_masked=False)
            return _add_rows(dq, qs, 1, dq_b), _add_rows(dkv, ks, 2, jnp.stack([dk, dv]))
        return run
    return [branch(b) for b in BRANCHES[spec.layout]]


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
