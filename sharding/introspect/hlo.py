"""Read the collectives XLA inserted out of compiled HLO text.

For each collective: its kind, the mesh axes its replica groups span, the bytes it moves per
device, and how many times it runs per step. A while loop's ``known_trip_count`` multiplies
(a collective in the scanned layer loop counts once per layer). A ``conditional`` branch is
weighted by how often it runs: read off the HLO when the branch index is a lookup into a
constant table indexed by the loop counter (the pipeline executor's tick table, see
``branch_frequency``), or given by the caller (``branch_counts``). Where neither says, the
op is reported per execution of its branch (``frequency_known=False``, the branch named,
``at_most`` the most it could run per step); a loop without a known trip count likewise,
per iteration, with no bound. Nothing is multiplied silently.

Bytes convention (per device, "payload"): all-reduce: the buffer; all-gather: the gathered
output; reduce-scatter: the full input; all-to-all and collective-permute: the buffer.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from triax.sharding.introspect.branch_costs import ordering_only
from triax.sharding.introspect.branch_frequency import branch_counts as derive_branch_counts
from triax.sharding.introspect.hlo_text import DTYPE_BYTES, Module, compiled_text, parse_module

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    """``bytes_per_device`` per op; ``count`` per step when ``frequency_known``, else per
    execution of ``branch`` (a conditional branch or a loop of unknown trip count), which
    runs at most ``at_most`` times per step (None: no bound is known)."""

    kind: str
    axes: tuple[str, ...]
    bytes_per_device: int
    count: int
    frequency_known: bool = True
    branch: str = ""
    at_most: Optional[int] = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["axes"] = list(self.axes)
        return d


@dataclass(frozen=True)
class _Reach:
    """How often a computation runs: ``count`` per step, or per execution of ``branch``
    (frequency unknown), which runs at most ``at_most`` times per step."""

    count: int
    branch: str = ""
    at_most: Optional[int] = None


def _branch_weights(m: Module, comp: str, cond, loop_trips: Optional[int],
                    given: Sequence[Sequence[int]]) -> Optional[list[int]]:
    """Per-branch executions per loop run of ``comp`` (a loop body of ``loop_trips``
    iterations), or None when neither the caller nor the HLO says."""
    n = len(cond.branches)
    if not loop_trips:
        return None
    for counts in given:
        if len(counts) == n and sum(counts) == loop_trips:
            return list(counts)
    counts = derive_branch_counts(m, comp, cond.operands[0], loop_trips, n)
    if counts is None or (counts != counts[0]).any():   # unknown, or differs by device
        return None
    return counts[0].tolist()


def _reaches(m: Module, given: Sequence[Sequence[int]]) -> dict[str, list[_Reach]]:
    out: dict[str, list[_Reach]] = defaultdict(list)

    def visit(comp: str, r: _Reach, loop_trips: Optional[int], depth: int) -> None:
        out[comp].append(r)
        if depth > 64:
            return
        for ins in m.comps.get(comp, ()):
            if ins.op == "while":
                n = ins.trip_count
                for role, callee in ins.calls:
                    if n is not None:
                        sub = _Reach(r.count * n, r.branch, r.at_most)
                    else:
                        where = f"while {ins.name} (trip count unknown)"
                        sub = _Reach(1, f"{r.branch} > {where}" if r.branch else where, None)
                    visit(callee, sub, n if role == "body" else None, depth + 1)
            elif ins.branches and ordering_only(ins):   # always its branch 1 (branch_costs)
                visit(ins.branches[1], r, loop_trips, depth + 1)
            elif ins.branches:
                weights = _branch_weights(m, comp, ins, loop_trips, given)
                for k, b in enumerate(ins.branches):
                    if weights is not None:
                        per_trip = r.count // loop_trips
                        sub = _Reach(per_trip * weights[k], r.branch, r.at_most)
                    else:
                        where = f"{b} (branch {k} of {ins.name})"
                        most = r.count if not r.branch else \
                            None if r.at_most is None else r.at_most * r.count
                        sub = _Reach(1, f"{r.branch} > {where}" if r.branch else where, most)
                    visit(b, sub, None, depth + 1)
            else:
                for _, callee in ins.calls:
                    visit(callee, r, loop_trips, depth + 1)
    visit(m.entry, _Reach(1), None, 0)
    return out


def _device_ids(text: str | None, shape: list[int]) -> np.ndarray:
    """Device ids laid out over a replica-group mesh: iota by default, or ``device_ids=``
    given as an iota tile (``[4,2]T(1,0)``, optionally ``<=[8]``) or an explicit list."""
    n = int(np.prod(shape))
    if not text:
        return np.arange(n).reshape(shape)
    t = re.fullmatch(r"\s*\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\s*", text)
    if t:
        src = [int(x) for x in (t.group(2) or t.group(1)).split(",")]
        ids = np.arange(n).reshape(src)
        if t.group(3):
            ids = ids.transpose([int(x) for x in t.group(3).split(",")])
        return ids.reshape(shape)
    return np.array([int(x) for x in re.findall(r"\d+", text)]).reshape(shape)


def _groups(attrs: str, num_devices: int) -> list[list[int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m.group(0))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(?:,\s*device_ids=\(([^)]*\)?)\))?"
                  r"\s*\{([^}]*)\}", attrs)
    if m:
        dims = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        chosen = re.findall(r"'([^']+)'", m.group(3))
        ids = _device_ids(m.group(2), [d for _, d in dims])
        names = [k for k, _ in dims]
        order = [i for i, k in enumerate(names) if k not in chosen] + \
                [names.index(k) for k in chosen]
        size = int(np.prod([dict(dims)[k] for k in chosen])) if chosen else 1
        return ids.transpose(order).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        src = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(src))).reshape(src)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{(.*?)\}(?:,|\s|$)", attrs)
    if m and m.group(1).strip():
        return [[int(x) for x in g.split(",") if x.strip()]
                for g in re.findall(r"\{([\d,\s]*)\}", m.group(0))]
    return [list(range(num_devices))]


def _axes_of(groups: Sequence[Sequence[int]], axis_names: Sequence[str],
             mesh_shape: Sequence[int]) -> tuple[str, ...]:
    varying: set[int] = set()
    total = int(np.prod(mesh_shape))
    for g in groups:
        coords = np.array([np.unravel_index(i % total, mesh_shape) for i in g])
        if len(coords):
            varying.update(int(a) for a in np.nonzero(coords.max(0) != coords.min(0))[0])
    return tuple(axis_names[a] for a in sorted(varying))


def _payload(kind: str, ins, groups) -> int:
    sizes = [int(np.prod(d)) * DTYPE_BYTES[dt] for d, dt in ins.shapes]
    if not sizes:
        return 0
    if ins.op.endswith("-start"):
        if kind == "all-gather":  # (operands..., outputs...)
            return sum(sizes[len(sizes) // 2:])
        if kind == "collective-permute":
            return sizes[0]
    total = sum(sizes)
    if kind == "reduce-scatter":
        return total * max(len(groups[0]) if groups else 1, 1)
    return total


def parse_collectives(hlo_text: str, axis_names: Sequence[str], mesh_shape: Sequence[int],
                      branch_counts: Sequence[Sequence[int]] = ()) -> list[Collective]:
    """Every collective in ``hlo_text``, grouped by (kind, axes, bytes, branch), with counts.

    ``branch_counts``: per-branch executions per run of a loop, for conditionals whose
    frequency the HLO does not show (say, a pipeline's tick table passed as data): a
    conditional with ``len(c)`` branches directly in a loop of ``sum(c)`` iterations takes
    ``c``. Each device must run the same counts (true of every pipeline schedule).
    """
    m = parse_module(hlo_text)
    reach = _reaches(m, [tuple(int(x) for x in c) for c in branch_counts])
    num_devices = int(np.prod(mesh_shape))
    counts: dict[tuple, list] = {}
    for name, instrs in m.comps.items():
        for ins in instrs:
            kind = ins.op[:-len("-start")] if ins.op.endswith("-start") else ins.op
            if kind not in KINDS or not reach.get(name):
                continue
            groups = _groups(ins.rest, num_devices)
            axes = _axes_of(groups, axis_names, mesh_shape)
            if not axes:
                continue  # a group of one device moves nothing
            for j, r in enumerate(reach[name]):
                key = (kind, axes, _payload(kind, ins, groups), r.branch)
                acc = counts.setdefault(key, [0, {}])
                acc[0] += r.count
                acc[1][(name, j)] = r.at_most   # a bound per branch run, not per op
    return [Collective(k, a, b, c, not br, br, None if not br or None in most.values()
                       else sum(most.values()))
            for (k, a, b, br), (c, most) in sorted(counts.items())]


def collectives_from_compiled(compiled, mesh,
                              branch_counts: Sequence[Sequence[int]] = ()) -> list[Collective]:
    """Collectives of a ``jax.stages.Compiled`` step on ``mesh`` (constants printed, so a
    tick table's branch frequencies are read off the program)."""
    return parse_collectives(compiled_text(compiled), mesh.axis_names, mesh.devices.shape,
                             branch_counts)


def summarize(collectives: Iterable[Collective]) -> dict[tuple[str, tuple[str, ...]], dict]:
    """Totals per (kind, axes): ops per step and bytes per device per step, over the ops
    whose frequency is known; ``unknown`` counts the distinct ops reported per branch."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "unknown": 0})
    for c in collectives:
        if not c.frequency_known:
            out[(c.kind, c.axes)]["unknown"] += 1
            continue
        out[(c.kind, c.axes)]["count"] += c.count
        out[(c.kind, c.axes)]["bytes"] += c.count * c.bytes_per_device
    return dict(out)


def bytes_over(collectives: Iterable[Collective], kind: str | None = None,
               axis: str | None = None, unknown: str = "skip") -> int:
    """Bytes per device per step, optionally filtered by kind and by a mesh axis spanned.

    Ops whose frequency is unknown are skipped (``unknown="skip"``) or counted at their
    bound (``"at_most"``: as if their branch ran every time its conditional did)."""
    if unknown not in ("skip", "at_most"):
        raise ValueError(f"unknown={unknown!r}: choose 'skip' or 'at_most'")
    total = 0
    for c in collectives:
        if (kind is not None and c.kind != kind) or (axis is not None and axis not in c.axes):
            continue
        if c.frequency_known:
            total += c.count * c.bytes_per_device
        elif unknown == "at_most":
            if c.at_most is None:
                raise ValueError(f"{c.kind} over {c.axes} in {c.branch}: no bound on how "
                                 f"often it runs; count it per execution instead")
            total += c.at_most * c.count * c.bytes_per_device
    return total
