"""How many iterations of a loop select each branch of a ``conditional``, read off the HLO.

The pipeline executor switches on ``table[tick, stage, kind]``: XLA compiles the table to an
int32 constant inside the tick loop and the branch index to a lookup into it (a
``dynamic-slice`` by the loop counter and the stage, then ``slice``/``clamp``/``bitcast``).
When the index is such a chain over a printed constant (``hlo_text.compiled_text`` prints
large constants), the table is evaluated here for every iteration: the dimension as long as
the loop's trip count is the iteration (any one-to-one use of the counter gives the same
counts); the other dynamically indexed dimensions depend on the device (the stage) and are
enumerated. The result is one count vector per device position; the caller decides what a
disagreement between positions means. Anything else is "not derivable" (None), never a guess.

    >>> from triax.sharding.introspect.hlo_text import parse_module
    >>> m = parse_module('''
    ... ENTRY %main () -> s32[] {
    ...   %t = s32[4,2]{1,0} constant({ {0, 1}, {1, 1}, {1, 0}, {2, 2} })
    ...   %i = s32[] parameter(0)
    ...   %s = s32[] parameter(1)
    ...   %d = s32[1,1]{1,0} dynamic-slice(%t, %i, %s), dynamic_slice_sizes={1,1}
    ...   ROOT %b = s32[] bitcast(%d)
    ... }''')
    >>> branch_counts(m, "main", "b", trips=4, num_branches=3).tolist()
    [[1, 2, 1], [1, 2, 1]]
"""
from __future__ import annotations

import itertools
import re
from typing import Optional

import numpy as np

from triax.sharding.introspect.hlo_text import Module

_SAME_VALUES = {"bitcast", "reshape", "copy", "convert"}


def _chain(m: Module, comp: str, name: str):
    """``(table, ops)``: the value of ``name`` is ``ops`` (first to last) applied to the
    constant ``table``; None when the chain leaves the supported ops."""
    ops, stack = [], []
    for _ in range(256):
        ins = m.instr(comp, name)
        if ins is None:
            return None
        if ins.op == "constant":
            table = ins.literal()
            return None if table is None else (table, ops[::-1])
        if ins.op == "parameter" and stack:       # a fusion's parameter: back to its operand
            comp, fusion = stack.pop()
            name = fusion.operands[int(re.match(r"\s*(\d+)", ins.rest).group(1))]
            continue
        if ins.op == "fusion":
            callee = dict(ins.calls).get("calls")
            root = m.root(callee) if callee else None
            if root is None:
                return None
            stack.append((comp, ins))
            comp, name = callee, root.name
            continue
        if not ins.shapes or not ins.operands:
            return None
        if ins.op in _SAME_VALUES:
            ops.append(("reshape", ins.shapes[0][0]))
        elif ins.op == "clamp":
            lo, hi = (_scalar(m, comp, ins.operands[k]) for k in (0, 2))
            if lo is None or hi is None:
                return None
            ops.append(("clamp", lo, hi))
            name = ins.operands[1]
            continue
        elif ins.op == "slice":
            bounds = [tuple(int(x) for x in b.split(":")[:2])
                      for b in re.findall(r"\[([\d:]+)\]", ins.attr("slice") or "")]
            ops.append(("slice", bounds))
        elif ins.op == "dynamic-slice":
            ops.append(("dslice", tuple(int(x) for x in ins.attr("dynamic_slice_sizes")
                                        .split(","))))
        else:
            return None
        name = ins.operands[0]
    return None


def _scalar(m: Module, comp: str, name: str) -> Optional[float]:
    ins = m.instr(comp, name)
    if ins is not None and ins.op == "broadcast" and ins.operands:
        ins = m.instr(comp, ins.operands[0])
    lit = None if ins is None else ins.literal()
    return None if lit is None or lit.size != 1 else float(lit.ravel()[0])


def _evaluate(table: np.ndarray, ops, trips: int) -> Optional[np.ndarray]:
    """Values ``[trip, position, ...]``: every iteration at every device position."""
    v, sliced = table, False
    for op in ops:
        kind = op[0]
        if kind == "dslice":
            sizes = op[1]
            if sliced or v.ndim != len(sizes) or v.shape[0] != trips or sizes[0] != 1:
                return None
            spans = [range(v.shape[d] - sizes[d] + 1) for d in range(1, v.ndim)]
            picks = [v[(slice(None),) + tuple(slice(c, c + s) for c, s in zip(at, sizes[1:]))]
                     for at in itertools.product(*spans)]
            v, sliced = np.stack(picks, axis=1)[:, :, None], True
            continue
        lead = v.shape[:2] if sliced else ()
        if kind == "reshape":
            v = v.reshape(lead + tuple(op[1]))
        elif kind == "slice":
            v = v[(slice(None),) * len(lead) + tuple(slice(a, b) for a, b in op[1])]
        elif kind == "clamp":
            v = np.clip(v, op[1], op[2])
    if not sliced:      # the index does not depend on the iteration
        v = np.broadcast_to(v, (trips, 1) + v.shape)
    return v.reshape(trips, v.shape[1], -1)[:, :, 0] if v[0, 0].size == 1 else None


def branch_counts(m: Module, comp: str, index: str, trips: int,
                  num_branches: int) -> Optional[np.ndarray]:
    """``counts[position, branch]``: of the ``trips`` iterations of the loop whose body is
    ``comp``, how many select each branch, for each device position the index depends on
    (one row when it depends on none). None when the index is not a table lookup."""
    chain = _chain(m, comp, index)
    if chain is None:
        return None
    values = _evaluate(*chain, trips)
    if values is None:
        return None
    idx = values.astype(np.int64)
    idx = np.where((idx < 0) | (idx >= num_branches), num_branches - 1, idx)  # XLA's rule
    return np.stack([np.bincount(idx[:, p], minlength=num_branches)
                     for p in range(idx.shape[1])])
