"""What each pipeline stage's ops compute under uneven stages, read from the compiled program
(``tests/test_stage_layers_uneven.py`` and ``bench/pipeline.py``'s uneven rows measure it).

Every stage runs the same SPMD program; a stage shorter than the longest runs its chunk's
``Lc`` layer slots each as a two-branch conditional (the runtime's ``layer_count``,
named scope ``LAYER_SLOT_SCOPE``): branch 1 runs the layer, branch 0 passes the activation
through, and a stage with ``count`` layers takes branch 1 on its first ``count`` slots. So one
execution of an op (its run branch: ``branch_costs.op_conditionals``) on a stage of ``count``
layers costs

    (the op's matmuls outside every conditional)
    + Σ over the op's slot conditionals: count × run branch + (Lc − count) × skip branch,

each branch measured on the compiled program (``branch_costs.computation_cost``); the
embedding's and head's conditionals (first and last chunk) are left out, as
``Cost.cheapest`` leaves them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from triax.models.protocol import LAYER_SLOT_SCOPE
from triax.sharding.introspect.branch_costs import (OP_SCOPE, Cost, computation_cost,
                                                    ordering_only, _loop_conditionals)
from triax.sharding.introspect.hlo_text import Module, compiled_text, parse_module


@dataclass
class SlotConditional:
    """One layer slot's two-branch conditional and how often it runs per op."""

    slots: int               # executions per run of the op (the layer loop's trip count)
    skip: Cost               # branch 0: the slot passed through
    run: Cost                # branch 1: the layer


def _op_name(ins) -> str:
    name = re.search(r'op_name="([^"]*)"', ins.rest)
    return name.group(1) if name else ""


def _slot_conditionals(m: Module, comp: str, times: int, depth: int = 0) -> list:
    """The slot conditionals reached from ``comp`` (through loops and calls, not through
    other conditionals but an ordering one), with their executions per run of ``comp``."""
    found = []
    for ins in m.comps.get(comp, ()):
        if ins.branches:
            if LAYER_SLOT_SCOPE in _op_name(ins) and len(ins.branches) == 2:
                found.append(SlotConditional(times, *(computation_cost(m, b)
                                                      for b in ins.branches)))
            elif ordering_only(ins) and depth < 32:
                found += _slot_conditionals(m, ins.branches[1], times, depth + 1)
            continue
        for role, c in ins.calls:
            if depth < 32 and (ins.op == "while" and role == "body" or ins.op == "call"):
                n = ins.trip_count if ins.op == "while" else 1
                if n is None:
                    raise ValueError(f"a layer slot sits in loop {ins.name} of unknown trip "
                                     f"count")
                found += _slot_conditionals(m, c, times * n, depth + 1)
    return found


def op_slot_conditionals(compiled_or_text) -> dict[str, tuple[Cost, list[SlotConditional]]]:
    """``{op label: (its run branch's own cost, its slot conditionals)}`` for every pipeline
    op (``OP_SCOPE + label``) whose run branch holds layer slots."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else \
        compiled_text(compiled_or_text)
    m = parse_module(text)
    out = {}
    for _, ins in _loop_conditionals(m):
        label = re.search(re.escape(OP_SCOPE) + r"(\w+)", _op_name(ins))
        if label and len(ins.branches) == 2 and label.group(1) not in out:
            run = ins.branches[1]
            out[label.group(1)] = (computation_cost(m, run), _slot_conditionals(m, run, 1))
    return out


def stage_op_flops(compiled_or_text, counts, per_chunk: int) -> dict[str, list[int]]:
    """``{op label: [matmul FLOPs of one execution on each stage]}`` of a pipelined step
    compiled with uneven ``counts`` layers per stage, each chunk padded to ``per_chunk``
    slots (module docstring). An op without layer slots is left out; none at all is an
    error (the step has no uneven stages)."""
    found = {k: v for k, v in op_slot_conditionals(compiled_or_text).items() if v[1]}
    if not found:
        raise ValueError(f"no layer-slot conditional (named scope {LAYER_SLOT_SCOPE}) in any "
                         f"pipeline op: was the step compiled with uneven stage_layers?")
    out = {}
    for label, (own, slots) in found.items():
        per_stage = []
        for c in counts:
            flops = own.flops
            for sc in slots:
                if sc.slots % per_chunk:
                    raise ValueError(f"{label}: a layer slot runs {sc.slots} times per op, "
                                     f"not a multiple of the {per_chunk} slots of a chunk")
                runs = sc.slots // per_chunk * c
                flops += runs * sc.run.flops + (sc.slots - runs) * sc.skip.flops
            per_stage.append(int(flops))
        out[label] = per_stage
    return out
