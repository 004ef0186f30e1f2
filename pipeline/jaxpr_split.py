"""Split a jaxpr in two by what its outputs need: part B computes the ``b`` outputs and hands
part W a *cut*, the values W needs that B already computed; W computes the ``w`` outputs from
the cut and the inputs it may read, repeating nothing B did.

For a backward pass, ``b`` is the input gradient and ``w`` the weight gradients: B is the
dead-code elimination of the jaxpr down to ``b``; W is what is left, and the cut is what W
reads from B, typically each weight matmul's output cotangent (the matmul's input is an input
of both parts). A ``scan`` (a stack of layers) is split in its body: B's scan emits the body's
cut as stacked outputs, W's scan takes them as extra ``xs``; a carry that W reads but B owns
(the cotangent flowing down the stack) is cut per iteration. A ``cond`` is split per branch,
both parts switching on the same index; branches share cut slots of equal shape, and a branch
fills the slots it does not produce with zeros (``jaxpr_split_run``). Calls (``jit``, ``remat``,
custom derivatives) are inlined first (``jaxpr_inline``), so their insides split too. Other
primitives with inner jaxprs run whole in B.

    >>> import jax, jax.numpy as jnp
    >>> f = lambda w, x: jnp.tanh(x @ w)
    >>> _, pullback = jax.vjp(f, jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> closed = inline(jax.make_jaxpr(pullback)(jnp.ones((4, 2))))
    >>> s = plan(closed.jaxpr, b_used=[False, True], w_used=[True, False],
    ...          avail=[False] * len(closed.jaxpr.invars))
    >>> [v.aval.shape for v in s.cut]   # the cotangent of tanh's input (x is a constant)
    [(4, 2)]
    >>> (dx,), cut = run_b(s, closed.consts, [jnp.ones((4, 2))])
    >>> (dw,) = run_w(s, closed.consts, [], cut)
    >>> [bool(jnp.array_equal(a, b)) for a, b in zip((dw, dx), pullback(jnp.ones((4, 2))))]
    [True, True]
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from jax.extend.core import Literal, Var
from jax.extend.core import primitives as P

from triax.pipeline.buffers import nbytes
from triax.pipeline.jaxpr_inline import has_inner, inline, reads
from triax.pipeline.jaxpr_split_run import CondNode, ScanNode, Slot, run_b, run_w
from triax.private_jax import dce_eqn, eqn_has_effects  # jaxpr DCE: no public API

# The split's whole interface: plan it, run its parts (and the plumbing they stand on).
__all__ = ["MATMULS", "Split", "inline", "plan", "reads", "run_b", "run_w"]


@dataclass
class Split:
    """How one jaxpr runs as B then W (see :func:`plan`)."""

    jaxpr: Any
    b_nodes: list                 # eqns, or split scan/cond nodes, in program order
    w_nodes: list
    b_outs: list                  # outvars B returns (before the cut)
    w_outs: list                  # outvars W returns
    cut: list                     # Vars or Slots: what B hands W
    b_reads: list[bool] = field(default_factory=list)   # per invar
    w_reads: list[bool] = field(default_factory=list)   # per invar: available ones W reads

    def cond_cut(self, index_inputs) -> list[bool]:
        """Per cut value: a slot of a top-level ``cond`` whose index is one of the inputs
        ``index_inputs`` (positions in the invars): it carries a value only where that
        input selects the branch producing it."""
        at = {v: i for i, v in enumerate(self.jaxpr.invars)}
        slots = {id(k) for n in self.b_nodes if isinstance(n, CondNode)
                 and at.get(n.eqn.invars[0]) in index_inputs for k in n.slots}
        return [id(k) in slots for k in self.cut]


def plan(jaxpr, b_used: Sequence[bool], w_used: Sequence[bool], avail: Sequence[bool],
         b_free: Sequence[bool] | None = None) -> Split:
    """Split ``jaxpr`` (calls inlined): B computes the outputs flagged in ``b_used``, W those
    in ``w_used``; W may read the inputs flagged in ``avail``, any other it needs is cut.
    Where it shrinks the cut, a cheap op W would run on cut values moves into B (a norm
    scale's gradient: a reduction of its output cotangent); it may read the inputs flagged in
    ``b_free`` (default all)."""
    eqns, n_in = jaxpr.eqns, len(jaxpr.invars)
    b_free = [True] * n_in if b_free is None else list(b_free)
    live: set = {v for v, u in zip(jaxpr.outvars, b_used) if u and isinstance(v, Var)}
    b_eqn: dict[int, Any] = {}
    for i in reversed(range(len(eqns))):
        e = eqns[i]
        used = [v in live for v in e.outvars]
        if not any(used) and not eqn_has_effects(e):
            continue
        if e.primitive in (P.scan_p, P.cond_p) or not has_inner(e):
            used_ins, new = dce_eqn(e, used)
        else:                     # an opaque inner jaxpr (shard_map, while, ...): B runs it all
            used_ins, new = [True] * len(e.invars), e
        if new is not None:
            b_eqn[i] = new
            live.update(v for v, u in zip(e.invars, used_ins) if u and isinstance(v, Var))
    free = {v for v, f in zip(jaxpr.invars, b_free) if f}
    unavailable = {v for v, a in zip(jaxpr.invars, avail) if not a}

    def w_pass(hoisted):
        b_defined = {v for new in b_eqn.values() for v in new.outvars}
        b_defined |= {v for i in hoisted for v in eqns[i].outvars}
        b_ok = lambda v: isinstance(v, Literal) or v in b_defined or v in free  # noqa: E731
        cut, wlive, w_node, nodes = {}, set(), {}, {}

        def need(v):
            if isinstance(v, (Var, Slot)):
                if isinstance(v, Slot) or v in b_defined or v in unavailable:
                    cut[v] = None
                else:
                    wlive.add(v)
        for v, u in zip(jaxpr.outvars, w_used):
            if u:
                need(v)
        for i in reversed(range(len(eqns))):
            e = eqns[i]
            want = [v in wlive for v in e.outvars]
            if not any(want) or i in hoisted:
                continue
            if i in b_eqn:        # B runs this eqn but not all W needs of it: split its body
                kind = ScanNode if e.primitive is P.scan_p else CondNode
                nodes[i] = w_node[i] = kind.build(e, b_eqn[i], want, b_ok, plan)
                for v in nodes[i].w_inputs():
                    need(v)
                continue
            used_ins, w_node[i] = dce_eqn(e, want)
            for v, u in zip(e.invars, used_ins):
                if u:
                    need(v)
        return b_defined | free, cut, w_node, nodes, wlive

    b_ok, cut, w_node, nodes, wlive = w_pass(set())
    hoisted = _hoistable(jaxpr, w_used, b_ok, cut, w_node, nodes)
    if hoisted:
        _, cut, w_node, nodes, wlive = w_pass(hoisted)
    for i in hoisted:
        live.update(v for v in eqns[i].invars if isinstance(v, Var))
    for node in nodes.values():
        live.update(v for v in node.b_inputs() if isinstance(v, Var))
    live.update(v for v in cut if isinstance(v, Var))   # an input W may not read: B passes it
    b_nodes = [nodes.get(i) or b_eqn.get(i) or eqns[i] for i in sorted(set(b_eqn) | hoisted)]
    return Split(jaxpr, b_nodes, [w_node[i] for i in sorted(w_node)],
                 [v for v, u in zip(jaxpr.outvars, b_used) if u],
                 [v for v, u in zip(jaxpr.outvars, w_used) if u], list(cut),
                 [v in live for v in jaxpr.invars],
                 [v in wlive for v in jaxpr.invars])


MATMULS = {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}


def _hoistable(jaxpr, w_used, b_ok, cut, w_node, nodes) -> set:
    """W's cheap ops to run in B instead, greedily in program order: those whose inputs B has
    and whose move does not grow the cut (what they free of it ≥ what they add)."""
    readers: Counter = Counter()
    for i, e in w_node.items():
        readers.update(v for v in (nodes[i].w_inputs() if i in nodes else e.invars)
                       if isinstance(v, (Var, Slot)))
    readers.update(v for v, u in zip(jaxpr.outvars, w_used) if u and isinstance(v, Var))
    ok, in_cut, chosen = set(b_ok), set(cut), set()
    for i in sorted(w_node):
        e = w_node[i]
        if i in nodes or e.primitive.name in MATMULS or has_inner(e) \
                or eqn_has_effects(e) \
                or not all(isinstance(v, Literal) or v in ok for v in e.invars):
            continue
        uses = Counter(v for v in e.invars if isinstance(v, Var))
        freed = [v for v in uses if v in in_cut and readers[v] == uses[v]]
        added = [o for o in e.outvars if readers[o]]
        if sum(nbytes(v.aval) for v in freed) < sum(nbytes(v.aval) for v in added):
            continue
        chosen.add(i)
        ok.update(e.outvars)
        in_cut.difference_update(freed)
        in_cut.update(added)
        readers.subtract(uses)
    return chosen
