"""The table validator: every dependency, every op exactly once, one op per stage per tick.

Errors name the tick, the stage and the op::

    >>> from triax.pipeline import build
    >>> validate(build("1f1b", stages=2, microbatches=2))  # passes silently
"""
from __future__ import annotations

from triax.pipeline.schedules import (Op, OpKind, Schedule, ScheduleError, _dep_keys, _finish,
                                      _key, _other_backward, prerequisites)


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


def _check_op(t: int, s: int, cell: Op, op: Op, sched: Schedule) -> None:
    where = f"tick {t}, stage {s}, op {cell}"
    if cell.kind is OpKind.FB and cell.kind not in sched.kind.backward_kinds:
        raise ScheduleError(f"{where}: {sched.kind.value} runs no overlapped F&B")
    if not 0 <= op.mb < sched.microbatches:
        raise ScheduleError(f"{where}: micro-batch out of range 0..{sched.microbatches - 1}")
    if not 0 <= op.chunk < sched.num_chunks:
        raise ScheduleError(f"{where}: chunk out of range 0..{sched.num_chunks - 1}")
    if sched.stage_of(op.chunk) != s:
        rule = "the V: c, then 2S-1-c" if sched.kind.v_shape else "circular placement c % S"
        raise ScheduleError(f"{where}: chunk {op.chunk} lives on stage "
                            f"{sched.stage_of(op.chunk)} ({rule})")
    allowed = sched.kind.backward_kinds
    if not sched.has_backward and op.kind is not OpKind.F:
        raise ScheduleError(f"{where}: a forward-only schedule has no backward ops")
    if op.kind is not OpKind.F and op.kind not in allowed and cell.kind not in allowed:
        names = " + ".join(k.name for k in sorted(allowed))
        raise ScheduleError(f"{where}: {sched.kind.value} uses {names} for backwards, "
                            f"not {op.kind.name}")


def validate(sched: Schedule) -> None:
    """Raise :class:`ScheduleError` on the first broken rule (tick, stage and op named)."""
    done: dict[tuple, int] = {}     # by ``schedules._key``
    for t, s, cell in _cells(sched):
        for op in cell.parts():
            _check_op(t, s, cell, op, sched)
            again = _finish(done, _key(op), _other_backward(op))
            if again is not None:
                raise ScheduleError(f"tick {t}, stage {s}, op {op}: runs twice (first at "
                                    f"tick {again})")
            for j, (key, alt) in enumerate(_dep_keys(op, sched.num_chunks)):
                when = _finish(done, key, alt)
                if when is None or when >= t:
                    dep = prerequisites(op, sched.num_chunks)[j]
                    raise ScheduleError(
                        f"tick {t}, stage {s}, op {op}: needs {dep} to finish in an earlier "
                        f"tick, but it {'has not run' if when is None else f'runs at tick {when}'}")
        for op in cell.parts():
            done[_key(op)] = t
    _check_complete(sched, done)


def _check_complete(sched: Schedule, done: dict) -> None:
    """Every (micro-batch, chunk) ran F and, with a backward, B or B_in then W."""
    for m in range(sched.microbatches):
        for c in range(sched.num_chunks):
            need = [Op(OpKind.F, m, c)]
            if sched.has_backward and _key(Op(OpKind.B, m, c)) not in done:
                need += [Op(OpKind.B_IN, m, c), Op(OpKind.W, m, c)]
                if sched.kind.backward_kinds == {OpKind.B}:
                    need = [Op(OpKind.F, m, c), Op(OpKind.B, m, c)]
            for op in need:
                if _key(op) not in done:
                    raise ScheduleError(f"stage {sched.stage_of(c)}: op {op} never runs "
                                        f"(each micro-batch needs one of each per chunk)")
