"""Pipeline bubble and in-flight micro-batches per schedule: the one place the planner asks.

``triax.pipeline``'s validated schedule tables give the figures (peak in-flight, and the
bubble weighted by the op costs measured on the compiled executor: :mod:`.op_costs`), and its generators say which (S, M, v) a schedule can run
(:func:`microbatch_constraint`). A request no table is built for falls back to the closed
forms the tables reproduce (``triax.pipeline.closed_form_bubble``; ZB-H1 about a third of
1F1B's). ``None`` is an unpipelined layout.

    >>> from triax.pipeline import ScheduleKind
    >>> round(bubble_fraction(ScheduleKind.ONE_F_ONE_B, stages=4, microbatches=12), 6)
    0.2
"""
from __future__ import annotations

import functools
from typing import Optional

from triax.pipeline import Schedule, ScheduleError, ScheduleKind, build, closed_form_bubble
from triax.planner.op_costs import op_costs_for


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


@functools.lru_cache(maxsize=4096)
def bubble_fraction(schedule: Optional[ScheduleKind], stages: int, microbatches: int,
                    virtual: int = 1, remat: str = "none") -> float:
    """Idle fraction of a stage's time over one step: the table's, its ops weighted by the
    costs measured on the compiled executor under ``remat`` (:func:`.op_costs.op_costs_for`),
    else the closed form."""
    S, M, v = stages, microbatches, virtual
    if S <= 1 or schedule is None:
        return 0.0
    table = schedule_table(schedule, S, M, v)
    if table is not None:
        costs = op_costs_for(schedule, remat).as_dict()
        return float(table.bubble_fraction(costs=costs))
    closed = closed_form_bubble(schedule, S, M, v)
    if closed is not None:
        return closed
    # The zero-bubble schedules have no closed form: ZB-H1's tables run about a third of
    # 1F1B's bubble; ZB-V is priced as 1F1B (a bound, where no table is built).
    one_f_one_b = closed_form_bubble(ScheduleKind.ONE_F_ONE_B, S, M)
    return one_f_one_b / 3 if schedule is ScheduleKind.ZB_H1 else one_f_one_b


def work_factor(schedule: Optional[ScheduleKind], remat: str = "none") -> float:
    """A micro-batch's work under ``schedule`` over a forward plus one full backward (what
    the model-FLOP compute time counts), both measured on the executor under ``remat``.
    1 for GPipe, 1F1B and interleaved; ZB-H1's F + B_in + W over F + B (1 too, with the
    split backward: B_in and W share B's matmuls)."""
    if schedule is None or schedule is ScheduleKind.FORWARD_ONLY:
        return 1.0
    return (op_costs_for(schedule, remat).per_microbatch
            / op_costs_for(ScheduleKind.ONE_F_ONE_B, remat).per_microbatch)


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
