"""Attention FLOPs per context rank of a compiled ring, read from the HLO.

Every rank runs the same SPMD program; ranks differ only in which branch of each ring
step's ``lax.switch`` they take (``sharding.ring``: the forward's in the named scope
``FWD_SCOPE``, the backward's in ``BWD_SCOPE``). So the FLOPs of rank ``i`` are

    (matmul FLOPs outside every conditional: the same on every rank)
    + Σ over the ring's switches, Σ over steps s = 1 … C−1, FLOPs of the branch that
      ``ring.static_branch(layout, C, i, s)`` names,

each branch's FLOPs measured on the compiled program (``branch_costs.computation_cost``).
For a program that is attention alone (the ring's forward and backward) that is its
attention FLOPs per rank; in a whole training step the common part adds the rest of the
model, the same on every rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from triax.sharding.introspect.branch_costs import Cost, computation_cost
from triax.sharding.introspect.hlo_text import Instr, Module, compiled_text, parse_module
from triax.sharding.ring import BRANCHES, BWD_SCOPE, FWD_SCOPE, static_branch


@dataclass
class RingSwitch:
    scope: str             # FWD_SCOPE or BWD_SCOPE
    runs: int              # executions per program run (the ring loop's trip count)
    branches: list[Cost]   # one execution of each branch, in BRANCHES[layout] order


def _conditionals(m: Module):
    """``(instruction, executions)`` of every conditional inside no other conditional;
    executions multiply the trip counts of the loops around it (None: one unknown)."""
    frontier, seen = [(m.entry, 1)], set()
    while frontier:
        comp, times = frontier.pop()
        for ins in m.comps.get(comp, ()):
            if ins.branches:
                yield ins, times
                continue
            for role, c in ins.calls:
                if role in ("body", "calls") and (c, times) not in seen and \
                        (ins.op in ("while", "call") or role == "body"):
                    seen.add((c, times))
                    n = ins.trip_count if ins.op == "while" else 1
                    frontier.append((c, None if n is None or times is None else times * n))


def _scope(ins: Instr) -> str:
    name = re.search(r'op_name="([^"]*)"', ins.rest)
    return name.group(1) if name else ""


def ring_switches(compiled_or_text) -> list[RingSwitch]:
    """The ring's step switches in a compiled program (forward and backward, per layer)."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else \
        compiled_text(compiled_or_text)
    m = parse_module(text)
    found = []
    for ins, times in _conditionals(m):
        scope = next((s for s in (FWD_SCOPE, BWD_SCOPE) if s in _scope(ins)), None)
        if scope is not None:
            if times is None:
                raise ValueError(f"ring switch {ins.name} sits in a loop of unknown trip count")
            found.append(RingSwitch(scope, times,
                                    [computation_cost(m, b) for b in ins.branches]))
    return found


def flops_per_rank(compiled_or_text, layout: str, C: int) -> list[int]:
    """Matmul FLOPs each of the ``C`` context ranks runs (module docstring), for a program
    whose ring attention was built with ``layout`` (its branches chosen statically)."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else \
        compiled_text(compiled_or_text)
    m = parse_module(text)
    common = computation_cost(m, m.entry).flops
    switches = ring_switches(text)
    if not switches:
        raise ValueError("no ring step switch (named scopes "
                         f"{FWD_SCOPE}, {BWD_SCOPE}) in this program: is it ring attention "
                         f"over a context axis of size > 1?")
    per_rank = []
    for i in range(C):
        flops = common
        for sw in switches:
            if sw.runs % (C - 1) or len(sw.branches) != len(BRANCHES[layout]):
                raise ValueError(f"a {sw.scope} switch runs {sw.runs} times with "
                                 f"{len(sw.branches)} branches: not a {layout} ring of "
                                 f"{C} ranks ({C - 1} steps, {len(BRANCHES[layout])} "
                                 f"branches)")
            # one ring per (C − 1) executions (several layers: the same steps again)
            steps = [1 + k % (C - 1) for k in range(sw.runs)]
            flops += sum(sw.branches[static_branch(layout, C, i, s)].flops for s in steps)
        per_rank.append(int(flops))
    return per_rank
