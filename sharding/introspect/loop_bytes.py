"""What one iteration of a compiled loop moves besides its work: the bytes of its ``copy``
instructions and the fresh results of its conditionals.

A loop carries its state in place; XLA inserts a ``copy`` where it cannot (a buffer read by
one conditional and written in place by another, say). A conditional's branch returns each
result element either in place — passed through from the branch's operand, or an update of
it (a dynamic-update-slice, an elementwise op over a same-shaped operand element) — or as a
fresh buffer (zeros, a new value), which is what the tick pays for. An element a nested
conditional returns is in place where each of its branches returns it in place over an
element of the outer branch's parameter (an accumulator carried through B_in's ordering
conditional). For the pipeline's tick
loop both should scale with what an op produces (activations), never with the stage's
parameters.

    >>> from triax.sharding.introspect.hlo_text import parse_module
    >>> text = '''
    ... %body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
    ...   %p = (s32[], f32[64]{0}) parameter(0)
    ...   %a = f32[64]{0} get-tuple-element(%p), index=1
    ...   %c = f32[64]{0} copy(%a)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   ROOT %t = (s32[], f32[64]{0}) tuple(%i, %c)
    ... }
    ... %cond (p: (s32[], f32[64])) -> pred[] {
    ...   %p = (s32[], f32[64]{0}) parameter(0)
    ...   ROOT %r = pred[] constant(true)
    ... }
    ... ENTRY %main (x: (s32[], f32[64])) -> (s32[], f32[64]) {
    ...   %x = (s32[], f32[64]{0}) parameter(0)
    ...   ROOT %w = (s32[], f32[64]{0}) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
    ... }'''
    >>> loop_bytes(text)
    LoopBytes(trips=7, copies=256, fresh_results=0, branch_copies=0)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from triax.sharding.introspect.hlo_text import Module, compiled_text, parse_module


@dataclass(frozen=True)
class LoopBytes:
    """Per iteration of the loop: ``copies`` in its body; ``fresh_results`` and
    ``branch_copies``, the fresh result elements and the copies of the body's conditionals'
    branches, summed as if every branch ran (an upper bound)."""

    trips: int
    copies: int
    fresh_results: int
    branch_copies: int

    @property
    def total(self) -> int:
        return self.copies + self.fresh_results + self.branch_copies


def _longest_loop(m: Module) -> tuple[int, str]:
    loops = [(ins.trip_count or 0, dict(ins.calls)["body"])
             for comp in m.comps.values() for ins in comp if ins.op == "while"]
    if not loops:
        raise ValueError("the program has no while loop")
    return max(loops)


def loop_bytes(compiled_or_text) -> LoopBytes:
    """:class:`LoopBytes` of the loop with the most iterations (a pipeline's tick loop)."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else \
        compiled_text(compiled_or_text)
    m = parse_module(text)
    trips, body = _longest_loop(m)
    conds = [i for i in m.comps[body] if i.branches]
    branch_copies = sum(i.bytes for c in conds for b in c.branches for i in m.comps[b]
                        if i.op == "copy")
    fresh = sum(_fresh_bytes(m, b) for c in conds for b in c.branches)
    return LoopBytes(trips, sum(i.bytes for i in m.comps[body] if i.op == "copy"), fresh,
                     branch_copies)


def _fresh_bytes(m: Module, branch: str) -> int:
    """Bytes of the branch's result elements that are not in place (see the module doc)."""
    root = m.root(branch)
    if root is None:
        return 0
    params = {i.name: i for i in m.comps[branch] if i.op == "parameter"}
    gte = {i.name: i for i in m.comps[branch] if i.op == "get-tuple-element"
           and i.operands and i.operands[0] in params}
    elements = root.operands if root.op == "tuple" else [root.name]
    total = 0
    for name in elements:
        ins = m.instr(branch, name)
        if ins is None or name in gte or name in params or _updates_operand(m, branch, ins, gte) \
                or _through_conditional(m, branch, ins, gte):
            continue
        total += ins.bytes
    return total


def _index(ins) -> int:
    return int(re.search(r"\bindex=(\d+)", ins.rest).group(1))


def _source(m: Module, branch: str, k: int) -> int | None:
    """The element of ``branch``'s (tuple) parameter that its result element ``k`` is in
    place over: passed through or updated (None: fresh, or the parameter is no tuple)."""
    root = m.root(branch)
    if root is None:
        return None
    if root.op == "parameter":
        return k
    if root.op != "tuple":
        return None
    params = {i.name for i in m.comps[branch] if i.op == "parameter"}
    gte = {i.name: i for i in m.comps[branch] if i.op == "get-tuple-element"
           and i.operands and i.operands[0] in params}
    ins = m.instr(branch, root.operands[k])
    if ins is None:
        return None
    if ins.name in gte:
        return _index(ins)
    if _updates_operand(m, branch, ins, gte):
        return next(_index(gte[o]) for o in ins.operands
                    if o in gte and gte[o].shapes == ins.shapes)
    return None


def _through_conditional(m: Module, comp: str, ins, gte: dict) -> bool:
    """``ins`` is an element of a conditional in ``comp`` that every branch returns in
    place over the operand element that is, in ``comp``, an element of its parameter."""
    cond = m.instr(comp, ins.operands[0]) if ins.op == "get-tuple-element" else None
    if cond is None or not cond.branches:
        return False
    k, args = _index(ins), cond.operands[1:]
    if "true_computation" in cond.rest:    # operands (pred, true, false); branches false, true
        args = args[::-1]
    for branch, name in zip(cond.branches, args):
        j, arg = _source(m, branch, k), m.instr(comp, name)
        if j is None or arg is None or arg.op != "tuple" or j >= len(arg.operands):
            return False
        src = gte.get(arg.operands[j])
        if src is None or src.shapes != ins.shapes:
            return False
    return True


def _updates_operand(m: Module, comp: str, ins, gte: dict) -> bool:
    """``ins`` may write into one of its operands: one with its shape that is an element of
    the branch's parameter, and it is a dynamic-update-slice or an elementwise fusion."""
    same = [o for o in ins.operands if o in gte and gte[o].shapes == ins.shapes]
    if not same:
        return False
    if ins.op == "dynamic-update-slice":
        return True
    callee = dict(ins.calls).get("calls") if ins.op == "fusion" else None
    root = m.root(callee) if callee else None
    return root is not None and (root.op == "dynamic-update-slice" or "kLoop" in ins.rest
                                 or root.op in ("add", "select"))
