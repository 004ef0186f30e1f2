"""What one execution of each branch of a compiled ``lax.switch`` costs: FLOPs and bytes.

For a pipelined step each op kind (F, B, B_in, W) is one two-branch conditional of the
executor's tick loop, "skip" or "run", found by its named scope (``OP_SCOPE`` + label;
:func:`op_branch_costs`), so this says what each op costs, measured on the program XLA runs
rather than assumed (F=1, B=2, ...).

* FLOPs: matmul FLOPs, ``2 · output elements · contracted size`` of every ``dot`` (and
  ``convolution``), fused or not; loops inside a branch multiply by their trip count (one
  XLA does not know is counted once and named in ``unknown_loops``: a lower bound, said so).
  Elementwise work is not counted.
* Bytes: bytes accessed, the operands plus the result of every unfused instruction (a fusion
  counts as one instruction), leaving out what moves nothing (parameters, tuples,
  get-tuple-element, bitcasts, constants).
* Dots: how many matmul instructions run (:func:`op_matmuls`).
* Permutes: how many collective-permutes run (the pipeline keeps them equal across an op's
  two branches: ``pipeline.permute_parity``).
* Conditionals nested in a branch (the stage's first/last-chunk embedding and head in
  ``pipeline.stage``) run on some executions only; their costs are kept apart, per nested
  branch, in :func:`branch_costs` and left out of the branch's own figures. With one chunk
  per stage that is exactly stage 0's F (its embedding is a gather: no FLOPs). A
  conditional in ``ORDERED_SCOPE`` is an ordering boundary that always runs: its branch 1
  counts as the enclosing branch's own.

    >>> from triax.sharding.introspect.hlo_text import parse_module
    >>> m = parse_module('''
    ... %fused (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
    ...   %a = f32[8,16]{1,0} parameter(0)
    ...   %b = f32[16,4]{1,0} parameter(1)
    ...   ROOT %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }
    ... ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
    ...   %a = f32[8,16]{1,0} parameter(0)
    ...   %b = f32[16,4]{1,0} parameter(1)
    ...   ROOT %f = f32[8,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused
    ... }''')
    >>> c = computation_cost(m, "main")
    >>> c.flops, c.bytes                   # 2·8·4·16; (8·16 + 16·4 + 8·4) · 4 bytes
    (1024, 896)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from triax.sharding.introspect.hlo_text import Instr, Module, compiled_text, parse_module

OP_SCOPE = "pipeline_op_"   # the named scope of each pipeline op's conditional (+ its label)
# The named scope of a conditional used only as an ordering boundary inside an op (B_in
# reads the stash cells its cut then overwrites): its predicate is the enclosing op's own
# flag, so branch 1 runs whenever the conditional is reached and branch 0 never.
ORDERED_SCOPE = "pipeline_ordered"
_FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
         "partition-id", "replica-id"}


@dataclass
class Cost:
    flops: int = 0
    bytes: int = 0
    dots: int = 0                 # matmul instructions run (dot, convolution)
    permutes: int = 0             # collective-permutes run
    nested: dict[str, "Cost"] = field(default_factory=dict)   # nested conditional branches
    unknown_loops: list[str] = field(default_factory=list)    # counted once: no trip count

    def add(self, other: "Cost", times: int = 1) -> None:
        self.flops += other.flops * times
        self.bytes += other.bytes * times
        self.dots += other.dots * times
        self.permutes += other.permutes * times
        self.nested.update(other.nested)
        self.unknown_loops += other.unknown_loops

    def to_json(self) -> dict:
        """``{"flops", "bytes"}``, and ``"unknown_loops"`` (the loops counted once, their
        trip count unknown, so the figures are a lower bound) when there are any."""
        out = {"flops": int(self.flops), "bytes": int(self.bytes)}
        if self.unknown_loops:
            out["unknown_loops"] = list(self.unknown_loops)
        return out

    def costliest(self) -> "Cost":
        """This execution with each nested conditional at its costliest branch (by FLOPs):
        what the stage that runs the embedding or the head pays."""
        return self._nested_at(max)

    def cheapest(self) -> "Cost":
        """This execution with each nested conditional at its cheapest branch (by FLOPs):
        what a stage that runs neither the embedding nor the head pays."""
        return self._nested_at(min)

    def _nested_at(self, pick) -> "Cost":
        total = Cost(self.flops, self.bytes, self.dots,
                     unknown_loops=list(self.unknown_loops))
        groups: dict[str, list[Cost]] = {}
        for name, c in self.nested.items():
            groups.setdefault(name.rsplit(" of ", 1)[-1], []).append(c._nested_at(pick))
        for branches in groups.values():
            total.add(pick(branches, key=lambda c: (c.flops, c.dots)))
        return total


def ordering_only(ins: Instr) -> bool:
    """``ins`` is a conditional in ``ORDERED_SCOPE``: count its branch 1 as part of the
    computation it sits in (it always runs there), never as a nested conditional."""
    name = re.search(r'op_name="([^"]*)"', ins.rest)
    return len(ins.branches) == 2 and name is not None \
        and name.group(1).rsplit("/", 2)[-2:-1] == [ORDERED_SCOPE]


def _dims(ins: Optional[Instr]) -> tuple[int, ...]:
    return ins.shapes[0][0] if ins is not None and ins.shapes else ()


def _matmul_flops(m: Module, comp: str, ins: Instr) -> int:
    out = int(np.prod(_dims(ins)))
    lhs = _dims(m.instr(comp, ins.operands[0]))
    if ins.op == "dot":
        contracted = [int(d) for d in (ins.attr("lhs_contracting_dims") or "").split(",") if d]
        return 2 * out * int(np.prod([lhs[d] for d in contracted]))
    # convolution: each output element sums over the kernel's window and input features
    # (per group, which is what the kernel holds): the kernel's size over its output features.
    rhs = _dims(m.instr(comp, ins.operands[1]))
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.rest)
    o = labels.group(1).index("o") if labels else len(rhs) - 1
    return 2 * out * int(np.prod(rhs)) // max(rhs[o], 1)


def _fused_matmuls(m: Module, comp: str, depth: int = 0) -> tuple[int, int]:
    """``(flops, dots)`` of the matmuls inside a fused computation."""
    flops = dots = 0
    for ins in m.comps.get(comp, ()):
        if ins.op in ("dot", "convolution"):
            flops, dots = flops + _matmul_flops(m, comp, ins), dots + 1
        elif depth < 16:
            for _, c in ins.calls:
                f, d = _fused_matmuls(m, c, depth + 1)
                flops, dots = flops + f, dots + d
    return flops, dots


def computation_cost(m: Module, comp: str, depth: int = 0) -> Cost:
    """FLOPs and bytes of one execution of ``comp`` (nested conditionals kept apart)."""
    cost = Cost()
    for ins in m.comps.get(comp, ()):
        if ins.op == "while":
            body = dict(ins.calls).get("body")
            n = ins.trip_count
            if n is None:
                cost.unknown_loops.append(ins.name)
            if body and depth < 32:
                cost.add(computation_cost(m, body, depth + 1), n or 1)
            continue
        if ins.branches and ordering_only(ins):
            cost.add(computation_cost(m, ins.branches[1], depth + 1))
            continue
        if ins.branches:
            for k, b in enumerate(ins.branches):
                cost.nested[f"{b} (branch {k} of {ins.name})"] = \
                    computation_cost(m, b, depth + 1)
            continue
        if ins.op in ("call", "async-start") and depth < 32:
            for _, c in ins.calls:
                cost.add(computation_cost(m, c, depth + 1))
            continue
        if ins.op in ("collective-permute", "collective-permute-start"):
            cost.permutes += 1
        if ins.op in ("dot", "convolution"):
            cost.flops += _matmul_flops(m, comp, ins)
            cost.dots += 1
        elif ins.op == "fusion":
            for _, c in ins.calls:
                f, d = _fused_matmuls(m, c)
                cost.flops, cost.dots = cost.flops + f, cost.dots + d
        if ins.op not in _FREE:
            cost.bytes += ins.bytes + sum(o.bytes for o in
                                          (m.instr(comp, n) for n in ins.operands) if o)
    return cost


def _find_switch(m: Module, num_branches: int) -> tuple[str, Instr]:
    """The first conditional with ``num_branches`` branches inside a loop and inside no
    other conditional (a tick switch)."""
    for comp, ins in _loop_conditionals(m):
        if len(ins.branches) == num_branches:
            return comp, ins
    raise ValueError(f"no conditional with {num_branches} branches inside a loop")


def branch_costs(compiled_or_text, num_branches: int) -> list[Cost]:
    """Cost of one execution of each branch of a loop's ``num_branches``-way switch."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else \
        compiled_text(compiled_or_text)
    m = parse_module(text)
    _, switch = _find_switch(m, num_branches)
    return [computation_cost(m, b) for b in switch.branches]


def _loop_conditionals(m: Module):
    """Conditionals inside a loop and inside no other conditional, with their computation."""
    seen, frontier = set(), [(m.entry, False)]
    while frontier:
        nxt = []
        for comp, in_loop in frontier:
            for ins in m.comps.get(comp, ()):
                if ins.branches:
                    if in_loop:
                        yield comp, ins
                    continue
                for role, c in ins.calls:
                    if c not in seen and role in ("body", "calls") and \
                            (ins.op in ("while", "call") or role == "body"):
                        seen.add(c)
                        nxt.append((c, in_loop or ins.op == "while"))
        frontier = nxt


def op_conditionals(compiled_or_text) -> dict[str, tuple[Cost, Cost]]:
    """``{label: (skip, run)}``, the cost of one execution of each branch of every pipeline
    op: the conditionals the executor places in the named scope ``OP_SCOPE + label``."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else \
        compiled_text(compiled_or_text)
    m = parse_module(text)
    found = {}
    for _, ins in _loop_conditionals(m):
        name = re.search(r'op_name="([^"]*)"', ins.rest)
        label = re.search(re.escape(OP_SCOPE) + r"(\w+)", name.group(1)) if name else None
        if label and len(ins.branches) == 2 and label.group(1) not in found:
            found[label.group(1)] = tuple(computation_cost(m, b) for b in ins.branches)
    return found


def op_branch_costs(compiled_or_text) -> dict[str, Cost]:
    """``{label: cost of one run}`` of every pipeline op (:func:`op_conditionals`' run
    branch)."""
    return {k: run for k, (_, run) in op_conditionals(compiled_or_text).items()}


def op_matmuls(compiled, branch_kinds: Sequence[str]) -> dict[str, dict]:
    """``{kind: {"flops": …, "dots": …}}``: the matmuls one execution of each op kind runs,
    nested conditionals (the stage's embedding and head) at their costliest branch. A split
    backward shows here: B_in's and W's dots add up to B's, and W's are the weight-gradient
    matmuls alone. ``branch_kinds`` as for :func:`op_costs`."""
    found = op_branch_costs(compiled)
    return {k: {"flops": int(c.flops), "dots": c.dots}
            for k, c in ((k, Cost() if k == "idle" else found[k].costliest())
                         for k in branch_kinds)}


def op_costs(compiled, branch_kinds: Sequence[str]) -> dict[str, dict]:
    """``{kind: {"flops": …, "bytes": …}}`` for one execution of each op kind.

    ``branch_kinds`` names the ops: for ``triax.pipeline``'s executor that is ``"idle"``
    (every op skipped: nothing runs) then the op kinds the schedule uses, in ``OpKind``
    order (1F1B: ``("idle", "F", "B")``; ZB-H1: ``("idle", "F", "B_in", "W")``).
    """
    found = op_branch_costs(compiled)
    missing = [k for k in branch_kinds if k != "idle" and k not in found]
    if missing:
        raise ValueError(f"no conditional in named scope {OP_SCOPE}<kind> for {missing} inside "
                         f"a loop (found {sorted(found)}): is this a pipelined step, and does "
                         f"branch_kinds name the schedule's ops?")
    return {k: (Cost() if k == "idle" else found[k]).to_json() for k in branch_kinds}
