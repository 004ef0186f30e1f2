"""Compiled HLO text as data: computations, instructions, shapes, constants and call edges.

The one parser the collective counter (``hlo``), the branch-frequency derivation
(``branch_frequency``) and the per-branch cost counter (``branch_costs``) share.

    >>> m = parse_module('''
    ... ENTRY %main (a: f32[4,8]) -> f32[4,8] {
    ...   %a = f32[4,8]{1,0} parameter(0)
    ...   ROOT %r = f32[4,8]{1,0} add(%a, %a)
    ... }''')
    >>> m.entry, [(i.name, i.op, i.shapes) for i in m.comps["main"]]
    ('main', [('a', 'parameter', [((4, 8), 'f32')]), ('r', 'add', [((4, 8), 'f32')])])
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)="
                    r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass(frozen=True)
class Instr:
    """One HLO instruction: ``name = type op(rest``; ``rest`` is operands and attributes."""

    name: str
    type_text: str
    op: str
    rest: str
    root: bool = False

    @cached_property
    def shapes(self) -> list[tuple[tuple[int, ...], str]]:
        """(dims, dtype) of every array in the result type (a tuple gives several)."""
        return [(tuple(int(d) for d in dims.split(",") if d), dt)
                for dt, dims in _ARRAY.findall(self.type_text) if dt in DTYPE_BYTES]

    @property
    def bytes(self) -> int:
        return sum(int(np.prod(s)) * DTYPE_BYTES[dt] for s, dt in self.shapes)

    @cached_property
    def operands(self) -> list[str]:
        """Operand names, in order (the text up to the call's closing parenthesis)."""
        depth, end = 1, len(self.rest)
        for i, ch in enumerate(self.rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                end = i
                break
        return re.findall(r"%([\w.\-]+)", self.rest[:end])

    @property
    def trip_count(self) -> int | None:
        """A while loop's ``known_trip_count`` (None when XLA does not know it)."""
        m = _TRIP.search(self.rest)
        return int(m.group(1)) if m else None

    @cached_property
    def branches(self) -> list[str]:
        """A conditional's branch computations, in index order (false, true for a pred)."""
        m = _BRANCHES.search(self.rest)
        if m:
            return re.findall(r"%?([\w.\-]+)", m.group(1))
        calls = dict((k, v) for k, v in _CALLS.findall(self.rest))
        if "true_computation" in calls:
            return [calls["false_computation"], calls["true_computation"]]
        return []

    @cached_property
    def calls(self) -> list[tuple[str, str]]:
        """(role, computation) of every non-branch callee: body, condition, calls, to_apply."""
        return [(k, v) for k, v in _CALLS.findall(self.rest)
                if k not in ("true_computation", "false_computation")]

    def attr(self, key: str) -> str | None:
        m = re.search(re.escape(key) + r"=\{([^}]*)\}", self.rest)
        return m.group(1) if m else None

    def literal(self) -> np.ndarray | None:
        """A constant's value (None when the text elides it as ``{...}``)."""
        if self.op != "constant" or not self.shapes or "..." in self.rest.split("),")[0]:
            return None
        dims, dt = self.shapes[0]
        body = self.rest[:self.rest.rfind(")")] if "metadata" not in self.rest else \
            self.rest[:self.rest.find("metadata")]
        nums = re.findall(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?|true|false", body)
        vals = [1 if v == "true" else 0 if v == "false" else float(v) for v in nums]
        if len(vals) < int(np.prod(dims)):
            return None
        return np.array(vals[:int(np.prod(dims))]).reshape(dims)


@dataclass
class Module:
    comps: dict[str, list[Instr]]
    entry: str
    _by_name: dict = field(default_factory=dict, repr=False)

    def instr(self, comp: str, name: str) -> Instr | None:
        """Instruction ``name`` of computation ``comp`` (None if absent)."""
        if comp not in self._by_name:
            self._by_name[comp] = {i.name: i for i in self.comps.get(comp, ())}
        return self._by_name[comp].get(name)

    def root(self, comp: str) -> Instr | None:
        return next((i for i in self.comps.get(comp, ()) if i.root), None)


def parse_module(text: str) -> Module:
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMP_HEADER.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        i = _INSTR.match(line)
        if i:
            comps[current].append(Instr(*i.groups(), root=line.lstrip().startswith("ROOT")))
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return Module(comps, entry)


def compiled_text(compiled) -> str:
    """The compiled module's text with large constants printed (a tick table, say), so
    branch frequencies can be read off it; falls back to ``compiled.as_text()``."""
    from triax.private_jax import hlo_print_options   # imports JAX: only when compiled
    try:
        opts = hlo_print_options()
        opts.print_large_constants = True
        return "\n\n".join(m.to_string(opts)
                           for m in compiled.runtime_executable().hlo_modules())
    except (AttributeError, TypeError):   # elided constants: frequencies become unknown
        return compiled.as_text()
