"""Read the collectives XLA inserted out of compiled HLO text.

For each collective: its kind, the mesh axes its replica groups span, the bytes it moves per
device, and how many times it runs per step (while-loop trip counts multiply, so a collective
in the scanned layer loop counts once per layer).

Bytes convention (per device, "payload"): all-reduce: the buffer; all-gather: the gathered
output; reduce-scatter: the full input; all-to-all and collective-permute: the buffer.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEES = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)="
                      r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    bytes_per_device: int
    count: int

    def to_json(self) -> dict:
        d = asdict(self)
        d["axes"] = list(self.axes)
        return d


def _shape_bytes(type_text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append(n * _DTYPE_BYTES[dtype])
    return out


def _split_computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMP_HEADER.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return comps, entry


def _multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            factor = int(trip.group(1)) if trip and " while(" in line else 1
            for callee in _CALLEES.findall(line):
                edges[name].append((callee, factor))
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", group):
                    edges[name].append((callee, 1))
    mult: dict[str, int] = defaultdict(int)

    def visit(name: str, m: int, depth: int = 0):
        mult[name] += m
        if depth > 64:
            return
        for callee, f in edges.get(name, ()):
            if callee in comps:
                visit(callee, m * f, depth + 1)
    visit(entry, 1)
    return mult


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


def _payload(kind: str, op: str, type_text: str, groups) -> int:
    sizes = _shape_bytes(type_text)
    if not sizes:
        return 0
    if op.endswith("-start"):
        if kind == "all-gather":  # (operands..., outputs...)
            return sum(sizes[len(sizes) // 2:])
        if kind == "collective-permute":
            return sizes[0]
    total = sum(sizes)
    if kind == "reduce-scatter":
        return total * max(len(groups[0]) if groups else 1, 1)
    return total


def parse_collectives(hlo_text: str, axis_names: Sequence[str],
                      mesh_shape: Sequence[int]) -> list[Collective]:
    """Every collective in ``hlo_text``, grouped by (kind, axes, bytes), with per-step counts."""
    comps, entry = _split_computations(hlo_text)
    mult = _multiplicities(comps, entry)
    num_devices = int(np.prod(mesh_shape))
    counts: dict[tuple, int] = defaultdict(int)
    for name, lines in comps.items():
        if not mult.get(name):
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            _, type_text, op, rest = m.groups()
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            groups = _groups(rest, num_devices)
            axes = _axes_of(groups, axis_names, mesh_shape)
            if not axes:
                continue  # a group of one device moves nothing
            key = (kind, axes, _payload(kind, op, type_text, groups))
            counts[key] += mult[name]
    return [Collective(k, a, b, c) for (k, a, b), c in sorted(counts.items())]


def collectives_from_compiled(compiled, mesh) -> list[Collective]:
    """Collectives of a ``jax.stages.Compiled`` step on ``mesh``."""
    return parse_collectives(compiled.as_text(), mesh.axis_names, mesh.devices.shape)


def summarize(collectives: Iterable[Collective]) -> dict[tuple[str, tuple[str, ...]], dict]:
    """Totals per (kind, axes): ops per step and bytes per device per step."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for c in collectives:
        out[(c.kind, c.axes)]["count"] += c.count
        out[(c.kind, c.axes)]["bytes"] += c.count * c.bytes_per_device
    return dict(out)


def bytes_over(collectives: Iterable[Collective], kind: str | None = None,
               axis: str | None = None) -> int:
    """Bytes per device per step, optionally filtered by kind and by a mesh axis spanned."""
    return sum(c.count * c.bytes_per_device for c in collectives
               if (kind is None or c.kind == kind) and (axis is None or axis in c.axes))
