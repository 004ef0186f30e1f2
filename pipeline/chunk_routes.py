"""Moving interleaved chunks between where they are stored and where they run.

Storage keeps the model's ``[L, ...]`` stack split contiguously over ``pipe``, so stage ``d``
stores chunks ``d*v … d*v + v-1`` (``v`` chunks of ``Lc`` layers), while the circular
schedules run chunk ``c`` on stage ``c % S`` as its local chunk ``c // S`` (ZB-V's V runs its
second leg backwards: ``schedules.chunk_stage``). Left to XLA, the
reshape between the two becomes all-to-alls plus permutes that move about twice the weights
that must move (measured: 1.09 MB against 0.56 MB for tiny, 8 layers, S=4, v=2). Here the
move is explicit: every stage sends exactly ``v`` chunks and receives ``v``, so the edges
"stored on ``d`` → runs on ``s``" form a ``v``-regular bipartite multigraph, which splits into
``v`` perfect matchings (König); each matching is one ``ppermute`` of one chunk per stage.
Gradients go back along the same rounds reversed.

    >>> rounds = chunk_routes(stages=4, virtual=2)
    >>> len(rounds), [(d, s) for d, _, s, _ in rounds[0]]   # (stored on, runs on)
    (2, [(0, 1), (1, 3), (2, 0), (3, 2)])
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from triax.pipeline.schedules import chunk_stage

Route = tuple[int, int, int, int]   # (storage stage, storage slot, compute stage, compute slot)


@functools.lru_cache(maxsize=None)
def chunk_routes(stages: int, virtual: int,
                 v_shape: bool = False) -> tuple[tuple[Route, ...], ...]:
    """``virtual`` rounds; in each, every stage sends one stored chunk and receives one.

        >>> [(d, s) for rd in chunk_routes(2, 2, v_shape=True) for d, _, s, _ in rd]
        [(0, 0), (1, 1), (0, 1), (1, 0)]
    """
    S, v = stages, virtual
    edges = [(c // v, c % v, chunk_stage(c, S, v_shape), c // S) for c in range(S * v)]
    rounds = []
    while edges:
        match = _perfect_matching(S, edges)
        rounds.append(tuple(sorted(match)))
        edges = [e for e in edges if e not in match]
    return tuple(rounds)


def moving_rounds(stages: int, virtual: int, v_shape: bool = False) -> int:
    """How many of :func:`chunk_routes`' rounds send a chunk over ``pipe`` (a round that keeps
    every chunk on its stage moves nothing): per device, the chunks each direction moves."""
    return sum(any(d != s for d, _, s, _ in rd)
               for rd in chunk_routes(stages, virtual, v_shape))


def routed(num_layers: int, stages: int, virtual: int) -> bool:
    """Whether the pipeline moves chunks with :func:`to_compute`: interleaved or ZB-V (v > 1) with
    whole chunks on each stage's storage (``S·v | L``). Otherwise no chunk moves (``v = 1``)
    or the stack is kept whole on every stage (uneven ``L``, ``pipeline_strategy``)."""
    return virtual > 1 and num_layers % (stages * virtual) == 0


def _perfect_matching(S: int, edges: list[Route]) -> list[Route]:
    """A perfect matching of a regular bipartite multigraph (augmenting paths; S is small)."""
    out = {d: [e for e in edges if e[0] == d] for d in range(S)}
    taken: dict[int, Route] = {}          # compute stage -> edge

    def augment(d, seen):
        for e in out[d]:
            s = e[2]
            if s in seen:
                continue
            seen.add(s)
            if s not in taken or augment(taken[s][0], seen):
                taken[s] = e
                return True
        return False

    for d in range(S):
        if not augment(d, set()):
            raise AssertionError("a regular bipartite multigraph always has a perfect matching")
    return list(taken.values())


def _tables(rounds, S: int):
    src_slot = np.array([[next(r for r in rd if r[0] == d)[1] for d in range(S)] for rd in rounds])
    dst_slot = np.array([[next(r for r in rd if r[2] == s)[3] for s in range(S)] for rd in rounds])
    return jnp.asarray(src_slot, jnp.int32), jnp.asarray(dst_slot, jnp.int32)


def to_compute(tree, stages: int, virtual: int, axis: str = "pipe", v_shape: bool = False):
    """Inside ``shard_map`` over ``axis``: this stage's stored chunks ``[v, ...]`` → the chunks
    it runs ``[v, ...]`` (local chunk j: global chunk ``j*S + stage``, or in a V the chunk
    ``chunk_stage`` puts on the stage)."""
    return _move(tree, stages, virtual, axis, reverse=False, v_shape=v_shape)


def to_storage(tree, stages: int, virtual: int, axis: str = "pipe", v_shape: bool = False,
               into=None):
    """The inverse of :func:`to_compute` (gradients of the chunks back to where they live).
    ``into``: a tree of the same shapes that is dead once read here (the compute-order
    weights, after the tick loop), whose buffers the result overwrites: every slot is
    written, so nothing of it survives, and the step holds no third stage-sized copy (the
    weights in compute order, their gradients, and the gradients in storage order)."""
    return _move(tree, stages, virtual, axis, reverse=True, v_shape=v_shape, into=into)


def _move(tree, S, v, axis, reverse, v_shape, into=None):
    rounds = chunk_routes(S, v, v_shape)
    src_slot, dst_slot = _tables(rounds, S)
    if reverse:
        src_slot, dst_slot = dst_slot, src_slot
    me = jax.lax.axis_index(axis)

    def one(a, out):
        out = jnp.zeros_like(a) if out is None else out.astype(a.dtype)
        for k, rd in enumerate(rounds):
            perm = [(s, d) if reverse else (d, s) for d, _, s, _ in rd]
            sent = jax.lax.dynamic_index_in_dim(a, src_slot[k, me], 0, keepdims=False)
            if any(i != j for i, j in perm):   # a round that stays on every stage moves nothing
                sent = jax.lax.ppermute(sent, axis, perm)
            out = jax.lax.dynamic_update_index_in_dim(out, sent, dst_slot[k, me], 0)
        return out
    return jax.tree.map(one, tree, jax.tree.map(lambda _: None, tree) if into is None else into,
                        is_leaf=lambda x: x is None)
