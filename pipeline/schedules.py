"""Pipeline schedules as data: per-stage op orders placed onto a tick table.

Pure Python (no JAX): a schedule is a static table ``table[tick][stage]`` holding ``None``
(idle) or an :class:`Op` ``(kind, mb, chunk)``. ``chunk`` is the *global* model chunk; with
``v`` virtual chunks per stage and circular placement, chunk ``c`` runs on stage ``c % S``;
ZB-V places its two chunks per stage in a V (``chunk_stage``).

Every generator first writes each stage's op *order* (the policy: GPipe, 1F1B, ...), then
:func:`place` puts the orders onto unit ticks as early as the dependencies allow (a message
sent in tick t is usable from tick t+1). The same orders give the cost-weighted figures.

    >>> from triax.pipeline import build
    >>> s = build("1f1b", stages=4, microbatches=8)
    >>> s.ticks, s.peak_in_flight
    (22, 4)
    >>> round(s.bubble_fraction(), 4) == round(3 / 11, 4)
    True
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence


class ScheduleError(ValueError):
    """A schedule request or table that cannot work; the message says which rule and why."""


class OpKind(enum.IntEnum):
    """Op kinds; the integer values are what the executor switches on (0 is idle)."""

    F = 1      # forward of one chunk for one micro-batch
    B = 2      # full backward (input and weight gradients)
    B_IN = 3   # backward for the input gradient only (zero-bubble split)
    W = 4      # backward for the weight gradients only (zero-bubble split)
    FB = 5     # DualPipe's F&B: one micro-batch's F and another's full B, overlapped


# F&B defaults to F + B: it saves no compute, it hides one op's communication behind the
# other's (DualPipe's F&B is at most F + B).
DEFAULT_COSTS = {OpKind.F: 1.0, OpKind.B: 2.0, OpKind.B_IN: 1.0, OpKind.W: 1.0, OpKind.FB: 3.0}


@dataclass(frozen=True)
class Op:
    """One cell of a schedule: what (``kind``) for which micro-batch (``mb``) and model chunk.
    F&B (``OpKind.FB``) is two ops in one cell: F of (``mb``, ``chunk``) and B of
    (``b_mb``, ``b_chunk``).

        >>> [str(op) for op in Op(OpKind.FB, 3, 0, b_mb=1, b_chunk=7).parts()]
        ['F(mb=3, chunk=0)', 'B(mb=1, chunk=7)']
    """

    kind: OpKind
    mb: int
    chunk: int
    b_mb: int = -1       # F&B only: the backward's micro-batch
    b_chunk: int = -1    # F&B only: the backward's chunk

    def parts(self) -> tuple["Op", ...]:
        """The single ops this cell runs: F&B's F and B, else the op itself."""
        if self.kind is OpKind.FB:
            return Op(OpKind.F, self.mb, self.chunk), Op(OpKind.B, self.b_mb, self.b_chunk)
        return (self,)

    def __str__(self) -> str:
        if self.kind is OpKind.FB:
            return f"FB(F mb={self.mb} chunk={self.chunk}, B mb={self.b_mb} chunk={self.b_chunk})"
        return f"{self.kind.name}(mb={self.mb}, chunk={self.chunk})"


class ScheduleKind(enum.Enum):
    """The schedules ``build`` knows, by the name the CLI and configs use."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_V = "zb-v"
    DUALPIPE_V = "dualpipev"
    FORWARD_ONLY = "forward-only"

    @property
    def split_backward(self) -> bool:
        """Runs backwards as B_in then W (zero-bubble schedules; DualPipeV for some of its
        backwards, so its stash slot holds the cut too)."""
        return self in (ScheduleKind.ZB_H1, ScheduleKind.ZB_V, ScheduleKind.DUALPIPE_V)

    @property
    def v_shape(self) -> bool:
        """Places two chunks per stage in a V (``chunk_stage``)."""
        return self in (ScheduleKind.ZB_V, ScheduleKind.DUALPIPE_V)

    @property
    def backward_kinds(self) -> frozenset:
        """The op kinds that may run a backward in this schedule's tables."""
        if self is ScheduleKind.FORWARD_ONLY:
            return frozenset()
        if self is ScheduleKind.DUALPIPE_V:
            return frozenset((OpKind.B, OpKind.B_IN, OpKind.W, OpKind.FB))
        if self.split_backward:
            return frozenset((OpKind.B_IN, OpKind.W))
        return frozenset((OpKind.B,))

    @classmethod
    def parse(cls, name: "str | ScheduleKind") -> "ScheduleKind":
        """The kind named ``name``; a ``ScheduleError`` lists the choices otherwise."""
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ScheduleError(f"unknown schedule {name!r}; choose one of: "
                                f"{', '.join(k.value for k in cls)}") from None


Table = tuple[tuple[Optional[Op], ...], ...]


@dataclass(frozen=True)
class Schedule:
    """A validated tick table plus the facts derived from it."""

    kind: ScheduleKind
    stages: int
    microbatches: int
    virtual: int
    table: Table

    @property
    def ticks(self) -> int:
        return len(self.table)

    @property
    def num_chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def has_backward(self) -> bool:
        return self.kind is not ScheduleKind.FORWARD_ONLY

    @cached_property
    def sends_two(self) -> bool:
        """A stage sends an activation and a gradient in one tick (an F&B cell), so the
        executor sends each buffer both ways every tick (twice the permutes)."""
        return any(op is not None and op.kind is OpKind.FB for row in self.table for op in row)

    def stage_of(self, chunk: int) -> int:
        """The stage global ``chunk`` runs on (``chunk_stage``)."""
        return chunk_stage(chunk, self.stages, self.kind.v_shape)

    @property
    def wraps(self) -> bool:
        """Messages wrap from the last stage to the first (circular placement, ``v > 1``)."""
        return self.virtual > 1 and not self.kind.v_shape

    def orders(self) -> list[list[Op]]:
        """Each stage's ops in execution order (the table without its idle ticks)."""
        return [[row[s] for row in self.table if row[s] is not None] for s in range(self.stages)]

    @cached_property
    def peak_in_flight(self) -> int:
        """Most micro-batch chunks any stage holds activations for (F done, backward not)."""
        return max(in_flight_profile(self)) if self.has_backward else 0

    def bubble_fraction(self, costs: dict = DEFAULT_COSTS) -> float:
        """Idle share of stage-time when ops take ``costs`` (default F=1, B_in=W=1, B=2,
        F&B=3)."""
        return cost_bubble(self.orders(), self.stages, self.num_chunks, costs)

    def idle_times(self, costs: dict = DEFAULT_COSTS) -> list[float]:
        """Per stage, the time it idles when the orders run with ``costs`` (its bubble in
        time units, the figure DualPipe's table gives)."""
        return run_orders(self.orders(), self.stages, self.num_chunks, costs)[1]

    def summary(self) -> dict:
        return {"kind": self.kind.value, "stages": self.stages,
                "microbatches": self.microbatches, "virtual": self.virtual,
                "ticks": self.ticks, "bubble_fraction": self.bubble_fraction(),
                "peak_in_flight": self.peak_in_flight,
                "closed_form_bubble": closed_form_bubble(self.kind, self.stages,
                                                         self.microbatches, self.virtual)}

    def __str__(self) -> str:
        cell = {OpKind.F: "F", OpKind.B: "B", OpKind.B_IN: "b", OpKind.W: "W", OpKind.FB: "X"}
        lines = []
        for s in range(self.stages):
            row = "".join(" ." if r[s] is None else f"{cell[r[s].kind]}{r[s].mb % 10}"
                          for r in self.table)
            lines.append(f"stage {s}:{row}")
        return "\n".join(lines)


def chunk_stage(chunk: int, stages: int, v_shape: bool = False) -> int:
    """The stage a global chunk runs on. Circular: ``c % S``. V (ZB-V, two chunks per stage):
    chunks ``0..S-1`` run down the stages, chunks ``S..2S-1`` back up, so the last chunk (the
    head and loss) sits on stage 0 beside the embedding.

        >>> [chunk_stage(c, 4, v_shape=True) for c in range(8)]
        [0, 1, 2, 3, 3, 2, 1, 0]
    """
    if v_shape and chunk >= stages:
        return 2 * stages - 1 - chunk
    return chunk % stages


def closed_form_bubble(kind: ScheduleKind, S: int, M: int, v: int = 1) -> Optional[float]:
    """Textbook bubble fractions (None for the zero-bubble schedules, whose greedy tables
    have no closed form for every S and M)."""
    if kind.split_backward:
        return None
    if kind is ScheduleKind.INTERLEAVED or kind is ScheduleKind.FORWARD_ONLY:
        return (S - 1) / (v * M + S - 1)
    return (S - 1) / (M + S - 1)


# ---- dependencies (shared by placement, validation and the cost model) -------------------

def prerequisites(op: Op, num_chunks: int) -> list[Op]:
    """Ops that must finish before ``op`` may start (the backward ones are B *or* B_in;
    F&B waits for both its parts')."""
    if op.kind is OpKind.FB:
        return [d for part in op.parts() for d in prerequisites(part, num_chunks)]
    if op.kind is OpKind.F:
        return [Op(OpKind.F, op.mb, op.chunk - 1)] if op.chunk > 0 else []
    if op.kind is OpKind.W:
        return [Op(OpKind.B_IN, op.mb, op.chunk)]
    deps = [Op(OpKind.F, op.mb, op.chunk)]
    if op.chunk < num_chunks - 1:
        deps.append(Op(op.kind, op.mb, op.chunk + 1))
    return deps


# The placement, the cost model and the validator look up finish times of every op's
# dependencies many times over: they key their tables by ``_key`` (a plain tuple: hashed and
# compared in C, where an ``Op`` runs its dataclass ``__hash__``/``__eq__``) and work out each
# op's dependencies once (``_dep_keys``, shared by every table with that op and chunk count).

def _key(op: Op) -> tuple:
    """``op`` as a table key: equal exactly when the ops are."""
    return op.kind, op.mb, op.chunk, op.b_mb, op.b_chunk


@functools.lru_cache(maxsize=1 << 17)
def _dep_keys(op: Op, num_chunks: int) -> tuple:
    """``prerequisites(op)`` as (key, ``_other_backward``) pairs, for ``_finish``."""
    return tuple((_key(d), _other_backward(d)) for d in prerequisites(op, num_chunks))


@functools.lru_cache(maxsize=1 << 17)
def _other_backward(op: Op) -> Optional[tuple]:
    """The key of the op that meets a backward dependency ``op`` as well (B for B_in and
    back), else None."""
    if op.kind not in (OpKind.B, OpKind.B_IN):
        return None
    return _key(Op(OpKind.B_IN if op.kind is OpKind.B else OpKind.B, op.mb, op.chunk))


def _finish(done: dict, key: tuple, alt: Optional[tuple]):
    """Finish time of the dependency ``key`` in ``done`` (keyed by ``_key``; None: not
    run); a backward one is met by either a B or a B_in (``alt``: ``_other_backward``)."""
    t = done.get(key)     # finish times are never None
    return done.get(alt) if t is None and alt is not None else t


def place(orders: Sequence[Sequence[Op]], num_chunks: int) -> Table:
    """Put per-stage orders onto unit ticks, each op as early as its dependencies allow."""
    S = len(orders)
    pos = [0] * S
    done: dict[tuple, int] = {}
    deps = [[_dep_keys(op, num_chunks) for op in o] for o in orders]
    rows = []
    while any(pos[s] < len(orders[s]) for s in range(S)):
        row: list[Optional[Op]] = [None] * S
        for s in range(S):
            if pos[s] < len(orders[s]):
                op = orders[s][pos[s]]
                ready = [_finish(done, k, a) for k, a in deps[s][pos[s]]]
                if all(t is not None and t < len(rows) for t in ready):
                    row[s] = op
        if not any(row):
            stuck = [str(orders[s][pos[s]]) for s in range(S) if pos[s] < len(orders[s])]
            raise ScheduleError(f"schedule deadlocks at tick {len(rows)}: next ops {stuck} "
                                f"wait on each other")
        for s, op in enumerate(row):
            if op is not None:
                for part in op.parts():
                    done[_key(part)] = len(rows)
                pos[s] += 1
        rows.append(tuple(row))
    return tuple(rows)


def cost_bubble(orders, S: int, num_chunks: int, costs: dict) -> float:
    """Run the orders with real op durations; bubble = 1 - busy / (S * makespan)."""
    makespan, idle = run_orders(orders, S, num_chunks, costs)
    return sum(idle) / (S * makespan)


def run_orders(orders, S: int, num_chunks: int, costs: dict) -> tuple[float, list[float]]:
    """Run the orders with op durations ``costs``, each op as soon as its stage is free and
    its inputs are done: ``(makespan, per-stage idle time)``."""
    pos, free, done = [0] * S, [0.0] * S, {}
    deps = [[_dep_keys(op, num_chunks) for op in o] for o in orders]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                op = orders[s][pos[s]]
                ready = [_finish(done, k, a) for k, a in deps[s][pos[s]]]
                if any(t is None for t in ready):
                    break
                start = max([free[s]] + ready)
                free[s] = start + costs[op.kind]
                for part in op.parts():
                    done[_key(part)] = free[s]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("orders deadlock under the cost model")
    makespan = max(free)
    return makespan, [makespan - sum(costs[op.kind] for op in o) for o in orders]


def in_flight_profile(s: Schedule) -> list[int]:
    """Per stage, the most chunks whose forward ran and whose last backward op (B, or W after
    B_in) has not. F&B holds both its micro-batches in its tick: its F stashes before its B
    frees."""
    peaks = []
    for st in range(s.stages):
        live = peak = 0
        for row in s.table:
            for part in () if row[st] is None else row[st].parts():
                live += 1 if part.kind is OpKind.F else -1 if part.kind in FINAL_KINDS else 0
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


FINAL_KINDS = (OpKind.B, OpKind.W)   # the op that ends a chunk's backward frees its stash
