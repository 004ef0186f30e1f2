"""Schedule generators: each writes every stage's op order; ``build`` places and validates.

    >>> from triax.pipeline import build
    >>> build("interleaved", stages=2, microbatches=4, virtual=2).ticks
    18
"""
from __future__ import annotations

import functools
from typing import Callable

from triax.memo_on_disk import on_disk
from triax.pipeline.dualpipe_v import dualpipe_v_orders
from triax.pipeline.bounds import UNIT_COSTS, makespan_lower_bound
from triax.pipeline.schedules import (Op, OpKind, Schedule, ScheduleError, ScheduleKind, place,
                                      prerequisites)
from triax.pipeline.validate import validate

F, B, B_IN, W = OpKind.F, OpKind.B, OpKind.B_IN, OpKind.W
Orders = list[list[Op]]


def gpipe_orders(S: int, M: int, v: int) -> Orders:
    """All forwards, then all backwards: every micro-batch's activations live at once."""
    return [[Op(F, m, s) for m in range(M)] + [Op(B, m, s) for m in range(M)] for s in range(S)]


def one_f_one_b_orders(S: int, M: int, v: int) -> Orders:
    """PipeDream-flush: S-s-1 warm-up forwards, then alternate F and B, then drain."""
    orders = []
    for s in range(S):
        w = min(S - s - 1, M)
        o = [Op(F, m, s) for m in range(w)]
        for i in range(M - w):
            o += [Op(F, w + i, s), Op(B, i, s)]
        o += [Op(B, m, s) for m in range(M - w, M)]
        orders.append(o)
    return orders


def _chunk_sequence(S: int, M: int, v: int, s: int, backward: bool) -> list[tuple[int, int]]:
    """Megatron's interleaved order: groups of S micro-batches sweep the local chunks."""
    out = []
    for k in range(M * v):
        group, within = divmod(k, S * v)
        j = within // S
        if backward:
            j = v - 1 - j
        out.append((group * S + within % S, j * S + s))
    return out


def interleaved_orders(S: int, M: int, v: int) -> Orders:
    """Interleaved 1F1B: v chunks per stage, chunk c on stage c % S (circular placement)."""
    orders = []
    for s in range(S):
        fwd = _chunk_sequence(S, M, v, s, backward=False)
        bwd = _chunk_sequence(S, M, v, s, backward=True)
        w = min((S - s - 1) * 2 + (v - 1) * S, M * v)
        o = [Op(F, *fwd[k]) for k in range(w)]
        for i in range(M * v - w):
            o += [Op(F, *fwd[w + i]), Op(B, *bwd[i])]
        o += [Op(B, *bwd[k]) for k in range(M * v - w, M * v)]
        orders.append(o)
    return orders


def forward_only_orders(S: int, M: int, v: int) -> Orders:
    return [[Op(F, *mc) for mc in _chunk_sequence(S, M, v, s, backward=False)] for s in range(S)]


def zb_h1_orders(S: int, M: int, v: int) -> Orders:
    """Zero-bubble H1: backward split into B_in and W; W fills what would idle.

    Greedy list scheduling with unit op times, each stage taking the first op that can run,
    in priority F > B_in > W. F may run while fewer than S-s micro-batches await their B_in
    (1F1B's warm-up bound) and fewer than S await their W, so a micro-batch's stash is
    held from F until W on at most S micro-batches: 1F1B's peak on every stage. For M >= S
    the table reaches the bubble (S-1)/(3M+S-1), a third of 1F1B's.
    """
    orders: Orders = [[] for _ in range(S)]
    done: dict[Op, int] = {}
    nf, nb, nw = [0] * S, [0] * S, [0] * S
    t = 0
    while any(nw[s] < M for s in range(S)):
        ran = [_zb_pick(s, S, M, nf[s], nb[s], nw[s], done, t) for s in range(S)]
        for s, op in enumerate(ran):
            if op is None:
                continue
            orders[s].append(op)
            done[op] = t
            nf[s] += op.kind is F
            nb[s] += op.kind is B_IN
            nw[s] += op.kind is W
        t += 1
        if t > 10 * (M + S) * 3:
            raise ScheduleError("zb-h1 generator did not converge")
    return orders


def _zb_pick(s, S, M, nf, nb, nw, done, t):
    def ready(op):
        return op in done and done[op] < t
    if nf < M and nf - nb < S - s and nf - nw < S and (s == 0 or ready(Op(F, nf, s - 1))):
        return Op(F, nf, s)
    if nb < nf and (s == S - 1 or ready(Op(B_IN, nb, s + 1))) and ready(Op(F, nb, s)):
        return Op(B_IN, nb, s)
    if nw < nb:
        return Op(W, nw, s)
    return None


V_CHUNKS = 2   # ZB-V's chunks per stage: one on the way down, one on the way back


@on_disk   # the greedy takes seconds at 16-32 stages (1.6 s at S=32, M=64), a read 0.03 s
def zb_v_orders(S: int, M: int, v: int) -> Orders:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory"): two chunks per stage
    in a V (stage s runs chunk s and chunk 2S-1-s), backward split into B_in and W.

    Greedy list scheduling with unit op times, each stage taking, of the ops whose inputs
    arrived, a B_in first (the oldest micro-batch's, then the deeper chunk's: it unblocks
    the neighbour or the stage's own other chunk), else an F (the deeper chunk first) while
    fewer than 2S chunks await their W, else the oldest W. 2S chunks of half a stage each
    are 1F1B's S micro-batches of a whole stage. Where that order idles, the generator
    tries the other tie-breaks (``ZBV_PRIORITIES``: F before B_in, older micro-batch before
    deeper chunk) and keeps the shortest table, every one under the same 2S cap. For every
    S <= 8 and M >= 2S the table takes 6M+S-1 ticks, the fewest any placement of these ops
    can take (``pipeline.bounds``: the last stage cannot start before tick S-1).
    """
    best, bound = None, None
    for priority in ZBV_PRIORITIES:
        orders = _zb_v_greedy(S, M, priority)
        ticks = len(place(orders, V_CHUNKS * S))
        if best is None or ticks < best[0]:
            best = (ticks, orders)
        bound = bound or makespan_lower_bound(orders, V_CHUNKS * S, UNIT_COSTS)
        if ticks <= bound:   # no placement of these ops is shorter
            break
    return best[1]


# (B_in before F, F's key, B_in's key): the greedy's tie-breaks, today's first.
_DEEPER, _OLDER = (lambda o: (o.chunk, -o.mb)), (lambda o: (-o.mb, o.chunk))
ZBV_PRIORITIES = tuple((b_first, f_key, b_key) for b_first in (True, False)
                       for f_key in (_DEEPER, _OLDER) for b_key in (_OLDER, _DEEPER))


def _zb_v_greedy(S: int, M: int, priority) -> Orders:
    C = V_CHUNKS * S
    orders: Orders = [[] for _ in range(S)]
    count = {(k, c): 0 for k in (F, B_IN, W) for c in range(C)}
    left, t = 3 * M * C, 0
    while left:
        # Each (kind, chunk) runs its micro-batches in order, so "finished before tick t"
        # is "counted before t": the counts at the tick's start stand in for finish times.
        before = dict(count)
        picks = [_zbv_pick(s, S, M, before, t, priority) for s in range(S)]
        for s, op in enumerate(picks):
            if op is not None:
                orders[s].append(op)
                count[op.kind, op.chunk] += 1
                left -= 1
        t += 1
        if t > 10 * (M + S) * 6:
            raise ScheduleError("zb-v generator did not converge")
    return orders


def _zbv_pick(s, S, M, count, t, priority):
    C = V_CHUNKS * S
    chunks = (s, C - 1 - s)
    ready = lambda op: all(count[d.kind, d.chunk] > d.mb  # noqa: E731
                           for d in prerequisites(op, C))
    cand = [Op(k, count[k, c], c) for c in chunks for k in (F, B_IN, W) if count[k, c] < M]
    cand = [op for op in cand if ready(op)]
    in_flight = sum(count[F, c] - count[W, c] for c in chunks)
    b_first, f_key, b_key = priority
    order = ((B_IN, b_key), (F, f_key)) if b_first else ((F, f_key), (B_IN, b_key))
    for kind, key in order + ((W, _OLDER),):
        ops = [o for o in cand if o.kind is kind and (kind is not F or in_flight < C)]
        if ops:
            return max(ops, key=key)
    return None


GENERATORS: dict[ScheduleKind, Callable[[int, int, int], Orders]] = {
    ScheduleKind.GPIPE: gpipe_orders,
    ScheduleKind.ONE_F_ONE_B: one_f_one_b_orders,
    ScheduleKind.INTERLEAVED: interleaved_orders,
    ScheduleKind.ZB_H1: zb_h1_orders,
    ScheduleKind.ZB_V: zb_v_orders,
    ScheduleKind.DUALPIPE_V: dualpipe_v_orders,
    ScheduleKind.FORWARD_ONLY: forward_only_orders,
}


def check_request(kind: ScheduleKind, S: int, M: int, v: int) -> None:
    """Reject (S, M, v) a schedule cannot run, saying which constraint and why."""
    if S < 1 or M < 1 or v < 1:
        raise ScheduleError(f"{kind.value}: stages, microbatches and virtual must be >= 1 "
                            f"(got S={S}, M={M}, v={v})")
    if kind is ScheduleKind.INTERLEAVED and v < 2:
        raise ScheduleError("interleaved needs --virtual v >= 2 chunks per stage "
                            "(with v=1 it is plain 1f1b)")
    if kind.v_shape and v != V_CHUNKS:
        raise ScheduleError(f"{kind.value} runs exactly {V_CHUNKS} chunks per stage (its V); "
                            f"got virtual={v}: leave it at 1 or pass {V_CHUNKS}")
    if kind not in (ScheduleKind.INTERLEAVED, ScheduleKind.FORWARD_ONLY) and v != 1 \
            and not kind.v_shape:
        raise ScheduleError(f"{kind.value} runs one chunk per stage; virtual={v} needs "
                            f"--kind interleaved (or forward-only)")
    if v > 1 and M % S and not kind.v_shape:
        raise ScheduleError(
            f"{kind.value} with v={v} needs microbatches divisible by stages: M={M} is not a "
            f"multiple of S={S}, because micro-batches sweep the {v} chunks in groups of S "
            f"(choose M in {{{S}, {2 * S}, {3 * S}, ...}})")


def chunks_per_stage(kind: "str | ScheduleKind", virtual: int = 1) -> int:
    """The chunks per stage ``kind`` runs when asked for ``virtual``: ZB-V always runs its
    two (``virtual`` 1, the default, means "the schedule's own"); the others ``virtual``.

    >>> chunks_per_stage("zb-v"), chunks_per_stage("interleaved", 2), chunks_per_stage("1f1b")
    (2, 2, 1)
    """
    return V_CHUNKS if ScheduleKind.parse(kind).v_shape and virtual == 1 else virtual


def build(kind: "str | ScheduleKind", stages: int, microbatches: int,
          virtual: int = 1) -> Schedule:
    """Generate, place and validate a schedule.

    >>> build("gpipe", stages=2, microbatches=2).ticks
    6
    >>> s = build("zb-v", stages=4, microbatches=8)     # two chunks per stage, in a V
    >>> s.virtual, s.ticks, s.peak_in_flight            # 6M+S-1 ticks; 2S half-stage chunks
    (2, 51, 8)
    """
    kind = ScheduleKind.parse(kind)
    return _build(kind, stages, microbatches, chunks_per_stage(kind, virtual))


@functools.lru_cache(maxsize=1024)
def _build(kind: ScheduleKind, stages: int, microbatches: int, virtual: int) -> Schedule:
    """``build``, cached: a Schedule is frozen (its table is nested tuples), and the planner,
    the executor and the buffer accounting ask for the same tables many times."""
    check_request(kind, stages, microbatches, virtual)
    orders = GENERATORS[kind](stages, microbatches, virtual)
    table = place(orders, stages * virtual)
    sched = Schedule(kind, stages, microbatches, virtual, table)
    validate(sched)
    return sched
