"""The least makespan any placement of a schedule's ops can reach, from its dependency graph.

A schedule's ops (``Schedule.orders()``: which ops run on which stage) and their
dependencies (``schedules.prerequisites``) bound every placement, whatever order a
generator picks: an op cannot start before the longest chain of ops it waits for has run
(its *head*), and what waits for it takes at least the longest chain after it (its
*tail*). So a stage's ops take at least its earliest head + its work + its least tail,
and the makespan is at least the largest of these over the stages, and at least the
longest chain. With unit costs ZB-V's last stage waits S-1 ticks for its first input and
then runs 6M ops, so no table is shorter than 6M+S-1 ticks and ZB-V's bubble is at least
(S-1)/(6M+S-1): 0.059 at S=4, M=8 (``tests/test_pipeline_bounds.py``).

    >>> from triax.pipeline import build
    >>> s = build("zb-v", stages=4, microbatches=8)
    >>> makespan_lower_bound(s.orders(), s.num_chunks, UNIT_COSTS), s.ticks
    (51.0, 51)
    >>> round(bubble_lower_bound(s), 4), round(s.bubble_fraction(), 4)
    (0.0588, 0.0588)
"""
from __future__ import annotations

from triax.pipeline.schedules import DEFAULT_COSTS, Op, OpKind, Schedule, prerequisites

UNIT_COSTS = {k: 1.0 for k in OpKind}   # every op one tick: the tick table's own model


def _graph(orders, num_chunks: int):
    """Each cell's predecessor cells (a backward dependency is met by B or B_in, an F&B
    cell's by either of its parts)."""
    cell_of: dict[Op, Op] = {}
    for order in orders:
        for cell in order:
            for part in cell.parts():
                cell_of[part] = cell
                if part.kind in (OpKind.B, OpKind.B_IN):   # "the backward of (mb, chunk)"
                    cell_of[Op(OpKind.B, part.mb, part.chunk)] = cell
    preds = {cell: {cell_of[Op(OpKind.B, d.mb, d.chunk) if d.kind is OpKind.B_IN else d]
                    for d in prerequisites(cell, num_chunks)} - {cell}
             for order in orders for cell in order}
    return preds


def _longest(preds: dict, dur: dict) -> tuple[dict, dict]:
    """Per cell, the longest chain of durations before it starts and after it ends."""
    succs: dict = {c: [] for c in preds}
    for c, ps in preds.items():
        for p in ps:
            succs[p].append(c)
    head: dict = {}
    order, seen = [], set()
    def visit(c):   # noqa: E306  (iterative DFS: chains are thousands of ops long)
        stack = [(c, False)]
        while stack:
            n, done = stack.pop()
            if done:
                order.append(n)
            elif n not in seen:
                seen.add(n)
                stack.append((n, True))
                stack.extend((p, False) for p in preds[n] if p not in seen)
    for c in preds:
        visit(c)
    for c in order:                       # predecessors first
        head[c] = max((head[p] + dur[p] for p in preds[c]), default=0.0)
    tail: dict = {}
    for c in reversed(order):             # successors first
        tail[c] = max((tail[s] + dur[s] for s in succs[c]), default=0.0)
    return head, tail


def makespan_lower_bound(orders, num_chunks: int, costs: dict = DEFAULT_COSTS) -> float:
    """The least makespan of any placement of ``orders``' ops on their stages, ops taking
    ``costs``: the longest chain, and per stage its earliest head + work + least tail."""
    dur = {cell: costs[cell.kind] for order in orders for cell in order}
    head, tail = _longest(_graph(orders, num_chunks), dur)
    chain = max(head[c] + dur[c] + tail[c] for c in dur)
    per_stage = max(min(head[c] for c in o) + sum(dur[c] for c in o) + min(tail[c] for c in o)
                    for o in orders if o)
    return max(chain, per_stage)


def bubble_lower_bound(sched: Schedule, costs: dict = DEFAULT_COSTS) -> float:
    """The least bubble fraction (``Schedule.bubble_fraction``'s measure) any placement of
    ``sched``'s ops can reach under ``costs``."""
    orders = sched.orders()
    busy = sum(costs[c.kind] for o in orders for c in o)
    return 1.0 - busy / (sched.stages * makespan_lower_bound(orders, sched.num_chunks, costs))
