"""Pipeline bubble and in-flight micro-batches per schedule: the one place the planner asks.

``triax.pipeline``'s validated schedule tables give the figures (peak in-flight, and the
bubble weighted by given op costs: the planner weighs it with those measured on the compiled
executor, ``triax.planner.op_costs.measured_bubble``), and its generators say which (S, M,
v) a schedule can run (:func:`microbatch_constraint`). A request no table is built for falls back to the closed
forms the tables reproduce (``triax.pipeline.closed_form_bubble``; ZB-H1 about a third of
1F1B's). ``None`` is an unpipelined layout.

    >>> from triax.pipeline import ScheduleKind
    >>> round(bubble_fraction(ScheduleKind.ONE_F_ONE_B, stages=4, microbatches=12), 6)
    0.2
"""
from __future__ import annotations

import functools
from typing import Mapping, Optional

from triax.pipeline import (DEFAULT_COSTS, OpKind, Schedule, ScheduleError, ScheduleKind, build,
                            closed_form_bubble)


@functools.lru_cache(maxsize=4096)
def schedule_table(schedule: Optional[ScheduleKind], stages: int, microbatches: int,
                   virtual: int = 1) -> Optional[Schedule]:
    """``triax.pipeline``'s validated tick table, or None when no table fits the request."""
    if schedule is None:
        return None
    try:
        return build(schedule.value, stages, microbatches, virtual)
    except ScheduleError:
        return None


def bubble_fraction(schedule: Optional[ScheduleKind], stages: int, microbatches: int,
                    virtual: int = 1, costs: Optional[Mapping[OpKind, float]] = None) -> float:
    """Idle fraction of a stage's time over one step: the table's, its ops weighted by
    ``costs`` (relative to F = 1; None: ``DEFAULT_COSTS``), else the closed form."""
    S, M, v = stages, microbatches, virtual
    if S <= 1 or schedule is None:
        return 0.0
    table = schedule_table(schedule, S, M, v)
    if table is not None:
        return float(table.bubble_fraction(costs=dict(costs or DEFAULT_COSTS)))
    closed = closed_form_bubble(schedule, S, M, v)
    if closed is not None:
        return closed
    # The zero-bubble schedules have no closed form: ZB-H1's tables run about a third of
    # 1F1B's bubble; ZB-V is priced as 1F1B (a bound, where no table is built).
    one_f_one_b = closed_form_bubble(ScheduleKind.ONE_F_ONE_B, S, M)
    return one_f_one_b / 3 if schedule is ScheduleKind.ZB_H1 else one_f_one_b


def peak_in_flight(schedule: Optional[ScheduleKind], stages: int, microbatches: int,
                   virtual: int = 1) -> float:
    """Micro-batches of activations the busiest stage holds (in whole-stage units).

    Without a pipeline the local batch is one micro-batch. From the table: its
    ``peak_in_flight`` chunks, each 1/v of the stage (the table's own v: ZB-V's two). Closed forms: GPipe keeps all M; 1F1B
    and ZB-H1 at most S; interleaved (v−1)·S + 2(S−1) + 1 chunks.
    """
    S, M, v = stages, max(microbatches, 1), virtual
    if S <= 1 or schedule in (None, ScheduleKind.FORWARD_ONLY):
        return 1.0
    table = schedule_table(schedule, S, M, v)
    if table is not None:
        return max(table.peak_in_flight / table.virtual, 1.0)
    if schedule is ScheduleKind.GPIPE:
        return float(M)
    if schedule is ScheduleKind.INTERLEAVED:
        return min(v * M, (v - 1) * S + 2 * (S - 1) + 1) / v
    return float(min(M, S))


def microbatch_constraint(schedule: Optional[ScheduleKind], stages: int, microbatches: int,
                          virtual: int = 1) -> Optional[str]:
    """Why the executor cannot run (S, M, v) with the schedule, or None: the generators'
    own check (``triax.pipeline.build``), so the planner refuses exactly what they refuse.

    >>> microbatch_constraint(ScheduleKind.ONE_F_ONE_B, stages=4, microbatches=2) is None
    True
    """
    if schedule is None:
        return None
    return _build_error(schedule, stages, microbatches, virtual)


@functools.lru_cache(maxsize=4096)
def _build_error(schedule: ScheduleKind, stages: int, microbatches: int,
                 virtual: int) -> Optional[str]:
    try:
        build(schedule.value, stages, microbatches, virtual)
    except ScheduleError as e:
        return str(e)
    return None
