"""The table validator: every dependency, every op exactly once, one op per stage per tick.

Errors name the tick, the stage and the op::

    >>> from triax.pipeline import build
    >>> validate(build("1f1b", stages=2, microbatches=2))  # passes silently
"""
from __future__ import annotations

from triax.pipeline.schedules import Op, OpKind, Schedule, ScheduleError, _find, prerequisites


def _cells(sched: Schedule):
    """(tick, stage, op) for every non-idle cell, checking the table's shape on the way."""
    for t, row in enumerate(sched.table):
        if len(row) != sched.stages:
            raise ScheduleError(f"tick {t}: row has {len(row)} cells for {sched.stages} stages")
        for s, cell in enumerate(row):
            if cell is None:
                continue
            if not isinstance(cell, Op):
                raise ScheduleError(f"tick {t}, stage {s}: {cell!r} is not one Op; a stage "
                                    f"runs at most one op per tick")
            yield t, s, cell


def _check_op(t: int, s: int, op: Op, sched: Schedule) -> None:
    where = f"tick {t}, stage {s}, op {op}"
    if not 0 <= op.mb < sched.microbatches:
        raise ScheduleError(f"{where}: micro-batch out of range 0..{sched.microbatches - 1}")
    if not 0 <= op.chunk < sched.num_chunks:
        raise ScheduleError(f"{where}: chunk out of range 0..{sched.num_chunks - 1}")
    if sched.stage_of(op.chunk) != s:
        rule = "the V: c, then 2S-1-c" if sched.kind.v_shape else "circular placement c % S"
        raise ScheduleError(f"{where}: chunk {op.chunk} lives on stage "
                            f"{sched.stage_of(op.chunk)} ({rule})")
    split = sched.kind.split_backward
    if not sched.has_backward and op.kind is not OpKind.F:
        raise ScheduleError(f"{where}: a forward-only schedule has no backward ops")
    if op.kind is OpKind.B and split or op.kind in (OpKind.B_IN, OpKind.W) and not split:
        raise ScheduleError(f"{where}: {sched.kind.value} uses "
                            f"{'B_IN + W' if split else 'B'} for backwards, not {op.kind.name}")


def validate(sched: Schedule) -> None:
    """Raise :class:`ScheduleError` on the first broken rule (tick, stage and op named)."""
    done: dict[Op, int] = {}
    for t, s, op in _cells(sched):
        _check_op(t, s, op, sched)
        if op in done:
            raise ScheduleError(f"tick {t}, stage {s}, op {op}: runs twice (first at tick "
                                f"{done[op]})")
        for dep in prerequisites(op, sched.num_chunks):
            when = _find(done, dep)
            if when is None or when >= t:
                raise ScheduleError(f"tick {t}, stage {s}, op {op}: needs {dep} to finish in "
                                    f"an earlier tick, but it "
                                    f"{'has not run' if when is None else f'runs at tick {when}'}")
        done[op] = t
    _check_complete(sched, done)


def _check_complete(sched: Schedule, done: dict) -> None:
    split = sched.kind.split_backward
    need = [OpKind.F] + ([] if not sched.has_backward else
                         [OpKind.B_IN, OpKind.W] if split else [OpKind.B])
    for m in range(sched.microbatches):
        for c in range(sched.num_chunks):
            for k in need:
                if Op(k, m, c) not in done:
                    raise ScheduleError(f"stage {sched.stage_of(c)}: op {Op(k, m, c)} never runs "
                                        f"(each micro-batch needs one of each per chunk)")
