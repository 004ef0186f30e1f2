"""Compile a schedule table into the named integer arrays the executor scans over.

Besides each cell's op, the executor needs buffer slots: where an arriving activation or
gradient waits until its op runs, where a forward's residuals wait for their backward (and,
zero-bubble schedules, B_in's cut for W: in the same slot, ``pipeline.stash_layout``), and
where a micro-batch's output is kept. Slots are assigned here, in Python, by a first-free allocator, so the buffers hold exactly the
schedule's live items plus one scratch slot (index = the buffer's slot count) that absorbs
the writes of ticks that have nothing to keep. Every field is an ``int32[ticks, S]`` array,
and every slot in it is a real index: no sentinel is left for the executor to resolve.

    >>> from triax.pipeline import build
    >>> p = compile_program(build("1f1b", stages=2, microbatches=4))
    >>> p.ticks.kind.shape, p.stash_slots
    ((10, 2), 2)
    >>> p.ticks.stash_w[:, 0].tolist()   # stage 0: F writes its residuals, others: scratch 2
    [0, 1, 2, 2, 0, 2, 1, 2, 2, 2]
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from triax.pipeline.schedules import FINAL_KINDS, Op, OpKind, Schedule


@jax.tree_util.register_dataclass
@dataclass(frozen=True, eq=False)
class Ticks:
    """What every stage does at every tick: one ``int32[ticks, S]`` array per field.

    Idle cells have kind 0 and read/write scratch slots. ``*_w`` is the slot a tick writes,
    ``*_r`` the slot it reads, per buffer: the forward inbox (an arriving activation is filed
    at ``fwd_in_w``, F reads ``fwd_in_r``), the backward inbox (likewise for gradients), the
    stash (F writes residuals at ``stash_w``, B/B_in/W read ``stash_r``, B_in writes its cut
    for W there too; B or W frees it) and the per-micro-batch outputs (the last chunk's F
    writes). ``head_w``/``head_r`` are the stash's head cells (``stash_layout``: the
    post-stack's residuals), in slots of their own, which only the last chunk's micro-batches
    take.

    Messages travel on two ``ppermute`` channels, "up" (stage s to s+1) and "down" (s to
    s-1), and, where consecutive chunks share a stage (ZB-V's turn at stage S-1), stay on the
    stage. Usually activations go up and gradients down (``fwd_in_w``, ``bwd_in_w``); in a V
    the second leg's activations come down (``fwd_in_down_w``) and its gradients go up
    (``bwd_in_up_w``), and the turn files the stage's own output (``*_turn_w``). ``up_b``:
    the up channel carries this tick's gradient, not its activation; ``down_f`` the reverse.
    Fields a schedule never uses hold only scratch slots and zeros, and cost nothing.

    A backward op reads its own ``b_mb``, ``b_chunk``, ``b_first``, ``b_last`` (for B, B_in
    and W the same as ``mb`` ... ``last``): DualPipeV's F&B (``OpKind.FB``) runs the F of
    ``mb``/``chunk`` and the B of ``b_mb``/``b_chunk`` in one tick, and sends both an
    activation and a gradient; such a program sends every buffer both ways every tick
    (``TickProgram.both_ways``), so ``up_b`` and ``down_f`` stay zero.
    """

    kind: np.ndarray       # OpKind value; 0 idle
    mb: np.ndarray         # micro-batch (0 when idle)
    chunk: np.ndarray      # local chunk j of the stage (global chunk j*S + s)
    first: np.ndarray      # 1: the chunk is the model's first (the pre-stack runs)
    last: np.ndarray       # 1: the chunk is the model's last (the post-stack and loss run)
    fwd_in_w: np.ndarray
    fwd_in_r: np.ndarray
    bwd_in_w: np.ndarray
    bwd_in_r: np.ndarray
    stash_w: np.ndarray
    stash_r: np.ndarray
    head_w: np.ndarray
    head_r: np.ndarray
    out_w: np.ndarray
    fwd_in_down_w: np.ndarray
    fwd_in_turn_w: np.ndarray
    bwd_in_up_w: np.ndarray
    bwd_in_turn_w: np.ndarray
    up_b: np.ndarray
    down_f: np.ndarray
    b_mb: np.ndarray       # the backward's micro-batch (B, B_in, W, F&B's B)
    b_chunk: np.ndarray    # its local chunk
    b_first: np.ndarray
    b_last: np.ndarray

    def at(self, t: int, s: int) -> dict:
        """One cell as ``{field: int}`` (for reading and tests)."""
        return {f.name: int(getattr(self, f.name)[t, s]) for f in dataclasses.fields(self)}


SLOT_FIELDS = ("fwd_in", "bwd_in", "stash", "head", "out")


@dataclass(frozen=True, eq=False)
class TickProgram:
    """A schedule's :class:`Ticks` and its buffer sizes (live slots; scratch not counted)."""

    schedule: Schedule
    ticks: Ticks
    stash_slots: int
    fwd_slots: int
    bwd_slots: int
    head_slots: int

    @property
    def out_slots(self) -> int:
        return self.schedule.microbatches

    @property
    def both_ways(self) -> bool:
        """Some tick sends two messages (F&B): every buffer goes up and down each tick."""
        return self.schedule.sends_two


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
    names = [f.name for f in dataclasses.fields(Ticks)]
    cols = {n: np.full((s.ticks, S), -1 if n.endswith(("_w", "_r")) else 0, np.int32)
            for n in names}
    stash, fin, bin_, head = ([_Slots() for _ in range(S)] for _ in range(4))
    # The op that frees a forward's stash: B, or (ZB-H1, ZB-V) W, which reads it with the cut.
    keeps = s.has_backward
    two = s.sends_two
    for t, row in enumerate(s.table):
        # Messages sent in tick t-1 arrive at the start of tick t.
        for st, op in ((st, p) for st, c in enumerate(s.table[t - 1] if t else ())
                       for p in (c.parts() if c is not None else (None,))):
            forward = op is not None and op.kind is OpKind.F
            if op is None or (op.chunk == C - 1 if forward else
                              op.kind is OpKind.W or op.chunk == 0):
                continue
            to = op.chunk + 1 if forward else op.chunk - 1
            dst, way = s.stage_of(to), _way(s, st, forward, to)
            if forward:
                cols[_FWD_FIELD[way]][t, dst] = fin[dst].take((op.mb, to))
                cols["down_f"][t - 1, st] = int(way == "down" and not two)
            else:
                cols[_BWD_FIELD[way]][t, dst] = bin_[dst].take((op.mb, to))
                cols["up_b"][t - 1, st] = int(way == "up" and not two)
        for st, op in enumerate(row):
            for part in () if op is None else op.parts():   # F&B: its F takes before B frees
                cell = _cell(part, S, C, stash[st], fin[st], bin_[st], head[st], keeps,
                             paired=op.kind is OpKind.FB)
                for name, value in cell.items():
                    cols[name][t, st] = value
            if op is not None:
                cols["kind"][t, st] = int(op.kind)
    size = lambda alloc: max(1, max(len(a.owner) for a in alloc))  # noqa: E731
    sizes = {"stash": size(stash), "fwd_in": size(fin), "bwd_in": size(bin_),
             "head": size(head), "out": s.microbatches}
    for name, a in cols.items():  # unassigned slots → that buffer's scratch slot
        if name.endswith(("_w", "_r")):
            a[a < 0] = sizes[next(b for b in SLOT_FIELDS if name.startswith(b))]
    return TickProgram(s, Ticks(**cols), sizes["stash"], sizes["fwd_in"], sizes["bwd_in"],
                       sizes["head"])


# Where an arriving message is filed, by the way it came (up, down, or staying on the stage).
_FWD_FIELD = {"up": "fwd_in_w", "down": "fwd_in_down_w", "turn": "fwd_in_turn_w"}
_BWD_FIELD = {"down": "bwd_in_w", "up": "bwd_in_up_w", "turn": "bwd_in_turn_w"}


def _way(s: Schedule, st: int, forward: bool, to: int) -> str:
    """How a message from stage ``st`` reaches chunk ``to``: "turn" (same stage), else along
    the V (up to a higher stage, down to a lower), else circular: activations up, gradients
    down (they may wrap around)."""
    dst = s.stage_of(to)
    if dst == st:
        return "turn"
    if s.kind.v_shape:
        return "up" if dst > st else "down"
    return "up" if forward else "down"


def _cell(op: Op, S: int, C: int, stash, fin, bin_, head, keeps: bool,
          paired: bool = False) -> dict:
    """The fields of one single op (slots left out are scratch); an F&B cell (``paired``)
    is its F's fields then its B's. ``keeps``: the schedule has a backward (F stashes)."""
    key = (op.mb, op.chunk)
    where = {"mb": op.mb, "chunk": op.chunk // S, "first": int(op.chunk == 0),
             "last": int(op.chunk == C - 1)}
    if op.kind is OpKind.F:
        cell = dict(where)
        if op.chunk > 0:
            cell["fwd_in_r"] = fin.free(key)
        if op.chunk == C - 1:
            cell["out_w"] = op.mb
        if keeps:  # forward-only keeps no residuals
            cell["stash_r"] = cell["stash_w"] = stash.take(key)
            if op.chunk == C - 1:
                cell["head_r"] = cell["head_w"] = head.take(key)
        return cell
    cell = {"b_" + k: v for k, v in where.items()}
    if not paired:   # a lone backward's cell names its op in mb ... last too
        cell.update(where)
    if op.kind in (OpKind.B, OpKind.B_IN):
        if op.chunk < C - 1:
            cell["bwd_in_r"] = bin_.free(key)
    final = op.kind in FINAL_KINDS
    cell["stash_r"] = stash.free(key) if final else stash.owner.index(key)
    # B_in computes the post-stack's gradients itself: W reads no head cell.
    if op.chunk == C - 1 and op.kind is not OpKind.W:
        cell["head_r"] = head.free(key)
    elif paired:   # not the F's head cell: scratch
        cell["head_r"] = -1
    return cell
