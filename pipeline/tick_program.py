"""Compile a schedule table into the integer arrays the executor scans over.

Besides each cell's op, the executor needs buffer slots: where an arriving activation or
gradient waits until its op runs, where a forward's residuals wait for their backward, and
(ZB-H1) where B_in's cotangent waits for W. Slots are assigned here, in Python, by a
first-free allocator, so the buffers hold exactly the schedule's live items (plus one
scratch slot that absorbs writes of idle ticks).

    >>> from triax.pipeline import build
    >>> p = compile_program(build("1f1b", stages=2, microbatches=4))
    >>> p.rows.shape, p.stash_slots
    ((10, 2, 13), 2)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from triax.pipeline.schedules import Op, OpKind, Schedule, ScheduleKind

# Column layout of one (tick, stage) row.
FIELDS = ("kind", "mb", "local_chunk", "first", "last", "stash", "fin", "bin", "ct",
          "recv_f", "recv_b", "stash_w", "ct_w")
COL = {name: i for i, name in enumerate(FIELDS)}


@dataclass(frozen=True, eq=False)
class TickProgram:
    """``rows[tick, stage, field]`` (int32) plus buffer sizes; -1 slots mean the scratch slot.

    ``stash``/``ct`` are the slots an op reads; ``stash_w``/``ct_w`` the slots it writes
    (only F writes residuals, only B_in writes a cotangent; other ops write to scratch).
    """

    schedule: Schedule
    rows: np.ndarray
    stash_slots: int
    fwd_slots: int
    bwd_slots: int
    ct_slots: int


class _Slots:
    """First-free slot allocator for one stage's buffer."""

    def __init__(self):
        self.owner: list = []

    def take(self, key) -> int:
        for i, o in enumerate(self.owner):
            if o is None:
                self.owner[i] = key
                return i
        self.owner.append(key)
        return len(self.owner) - 1

    def free(self, key) -> int:
        i = self.owner.index(key)
        self.owner[i] = None
        return i


def compile_program(s: Schedule) -> TickProgram:
    S, C = s.stages, s.num_chunks
    rows = np.full((s.ticks, S, len(FIELDS)), -1, np.int32)
    rows[..., COL["kind"]] = 0
    stash, fin, bin_, ct = ([_Slots() for _ in range(S)] for _ in range(4))
    final_kind = (None if not s.has_backward else
                  OpKind.W if s.kind is ScheduleKind.ZB_H1 else OpKind.B)
    for t, row in enumerate(s.table):
        # Messages sent in tick t-1 arrive at the start of tick t.
        for st, op in enumerate(s.table[t - 1] if t else ()):
            if op is None:
                continue
            if op.kind is OpKind.F and op.chunk < C - 1:
                dst = (st + 1) % S
                rows[t, dst, COL["recv_f"]] = fin[dst].take((op.mb, op.chunk + 1))
            if op.kind in (OpKind.B, OpKind.B_IN) and op.chunk > 0:
                dst = (st - 1) % S
                rows[t, dst, COL["recv_b"]] = bin_[dst].take((op.mb, op.chunk - 1))
        for st, op in enumerate(row):
            if op is not None:
                _fill(rows[t, st], op, S, C, stash[st], fin[st], bin_[st], ct[st], final_kind)
    size = lambda alloc: max(1, max(len(a.owner) for a in alloc))  # noqa: E731
    return TickProgram(s, rows, size(stash), size(fin), size(bin_), size(ct))


def _fill(r, op: Op, S: int, C: int, stash, fin, bin_, ct, final_kind) -> None:
    key = (op.mb, op.chunk)
    r[COL["kind"]], r[COL["mb"]], r[COL["local_chunk"]] = int(op.kind), op.mb, op.chunk // S
    r[COL["first"]], r[COL["last"]] = int(op.chunk == 0), int(op.chunk == C - 1)
    if op.kind is OpKind.F:
        if op.chunk > 0:
            r[COL["fin"]] = fin.free(key)
        if final_kind is not None:  # forward-only keeps no residuals
            r[COL["stash"]] = r[COL["stash_w"]] = stash.take(key)
        return
    if op.kind in (OpKind.B, OpKind.B_IN):
        if op.chunk < C - 1:
            r[COL["bin"]] = bin_.free(key)
        if op.kind is OpKind.B_IN:
            r[COL["ct"]] = r[COL["ct_w"]] = ct.take(key)
    if op.kind is OpKind.W:
        r[COL["ct"]] = ct.free(key)
    r[COL["stash"]] = stash.free(key) if op.kind is final_kind else stash.owner.index(key)
