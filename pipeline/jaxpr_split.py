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
fills the slots it does not produce with zeros. Calls (``jit``, ``remat``, custom derivatives)
are inlined first, so their insides split too. Other primitives with inner jaxprs run whole
in B.

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
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from triax.private_jax import partial_eval as pe  # jaxpr DCE: no public API
from jax.extend.core import ClosedJaxpr, Literal, Var, jaxprs_in_params
from jax.extend.core import primitives as P

from triax.pipeline.buffers import nbytes

_CALLS = {P.jit_p: "jaxpr", P.remat_p: "jaxpr", P.closed_call_p: "call_jaxpr",
          P.custom_jvp_call_p: "call_jaxpr", P.custom_vjp_call_p: "call_jaxpr"}


def _sds(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _has_inner(eqn) -> bool:
    return any(True for _ in jaxprs_in_params(eqn.params))


def _read(env, v):
    return v.val if isinstance(v, Literal) else env[v]


def _bind(eqn, invals, params=None):
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params or eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def _eval_inlined(jaxpr, consts, *args):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        key = _CALLS.get(eqn.primitive)
        if key:
            inner = eqn.params[key]
            inner = inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())
            outs = _eval_inlined(inner.jaxpr, inner.consts, *ins)
        elif eqn.primitive is P.scan_p:
            outs = _bind(eqn, ins, dict(eqn.params, jaxpr=inline(eqn.params["jaxpr"])))
        elif eqn.primitive is P.cond_p:
            branches = tuple(inline(b) for b in eqn.params["branches"])
            outs = _bind(eqn, ins, dict(eqn.params, branches=branches))
        else:
            outs = _bind(eqn, ins)
        env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]


def inline(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` retraced with every call inlined, in scan and cond bodies too."""
    fn = partial(_eval_inlined, closed.jaxpr, closed.consts)
    return jax.make_jaxpr(fn)(*[_sds(a) for a in closed.in_avals])


def reads(fn, *args) -> list[bool]:
    """Per leaf of ``args`` (flattened, in order): whether ``fn``'s results depend on it, by
    dead-code elimination of its jaxpr (what XLA does with a value nothing reads).

    >>> reads(lambda a, b: a * 2, jnp.ones(3), jnp.ones(3))
    [True, False]
    """
    closed = jax.make_jaxpr(fn)(*args)
    _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return list(used)


class Slot:
    """A cut value that is no variable of the jaxpr: a split scan's stacked per-iteration
    cut, or a split cond's cut slot."""

    def __init__(self, aval):
        self.aval = aval


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
        slots = {id(k) for n in self.b_nodes if isinstance(n, _CondNode)
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
        if not any(used) and not pe.has_effects(e):
            continue
        if e.primitive in (P.scan_p, P.cond_p) or not _has_inner(e):
            used_ins, new = pe.dce_rules.get(e.primitive, pe._default_dce_rule)(used, e)
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
                kind = _ScanNode if e.primitive is P.scan_p else _CondNode
                nodes[i] = w_node[i] = kind.build(e, b_eqn[i], want, b_ok)
                for v in nodes[i].w_inputs():
                    need(v)
                continue
            used_ins, w_node[i] = pe.dce_rules.get(e.primitive, pe._default_dce_rule)(want, e)
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
        if i in nodes or e.primitive.name in MATMULS or _has_inner(e) \
                or pe.has_effects(e) \
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


def run_b(s: Split, consts, args) -> tuple[list, list]:
    """B: ``(b outputs, cut)`` from the inputs B reads (``s.b_reads``), in order."""
    env = _run(s, dict(zip(s.jaxpr.constvars, consts)), s.b_reads, args, s.b_nodes, "run_b")
    return [_read(env, v) for v in s.b_outs], [env[k] for k in s.cut]


def run_w(s: Split, consts, args, cut) -> list:
    """W: the ``w`` outputs from the inputs W reads (``s.w_reads``), in order, and the cut."""
    env = dict(zip(s.jaxpr.constvars, consts)) | dict(zip(s.cut, cut))
    env = _run(s, env, s.w_reads, args, s.w_nodes, "run_w")
    return [_read(env, v) for v in s.w_outs]


def _run(s: Split, env: dict, reads, args, nodes, part: str) -> dict:
    """Evaluate one part's nodes in order (split scan/cond nodes run their ``part``)."""
    env.update(zip([v for v, r in zip(s.jaxpr.invars, reads) if r], args))
    for node in nodes:
        if isinstance(node, (_ScanNode, _CondNode)):
            getattr(node, part)(env)
        else:
            env.update(zip(node.outvars, _bind(node, [_read(env, v) for v in node.invars])))
    return env


def _set(env, outvars, used, vals):
    vals = iter(vals)
    for v, u in zip(outvars, used):
        if u:
            env[v] = next(vals)


@dataclass(eq=False)
class _ScanNode:
    eqn: Any
    inner: Split                  # the body, split
    b_out: list                   # per scan output: B produces it (carries: B owns them)
    w_out: list                   # per scan output: W produces it
    slots: list                   # the body's cut, stacked over iterations

    @classmethod
    def build(cls, e, b_new, want, b_ok):
        nc, nk = e.params["num_consts"], e.params["num_carry"]
        body = e.params["jaxpr"].jaxpr
        kept = set(b_new.outvars)
        b_out = [v in kept for v in e.outvars]
        w_out = [w and not b for w, b in zip(want, b_out)]
        while True:               # W's carries: those it reads that B does not own
            avail = [True] * nc + w_out[:nk] + [True] * (len(body.invars) - nc - nk)
            free = [b_ok(v) for v in e.invars[:nc]] + b_out[:nk] \
                + [b_ok(v) for v in e.invars[nc + nk:]]
            inner = plan(body, b_out, w_out, avail, free)
            more = [j for j, v in enumerate(body.invars[nc:nc + nk])
                    if v in inner.cut and not b_out[j] and not w_out[j]]
            if not more:
                break
            for j in more:
                w_out[j] = True
        n = e.params["length"]
        slots = [Slot(jax.ShapeDtypeStruct((n,) + tuple(k.aval.shape), k.aval.dtype))
                 for k in inner.cut]
        return cls(e, inner, b_out, w_out, slots)

    def _feed(self, env, reads, owned):
        """Carry inits, xs, and ``args(carry, xs)``: the body inputs a part reads."""
        e = self.eqn
        nc, nk, n = e.params["num_consts"], e.params["num_carry"], len(e.invars)
        consts = {i: _read(env, e.invars[i]) for i in range(nc) if reads[i]}
        carry_idx = [nc + j for j in range(nk) if owned[j]]
        assert all(i in carry_idx for i in range(nc, nc + nk) if reads[i]), "carry not owned"
        x_idx = [i for i in range(nc + nk, n) if reads[i]]

        def args(carry, xs):
            vals = consts | dict(zip(carry_idx, carry)) | dict(zip(x_idx, xs))
            return [vals[i] for i in range(n) if reads[i]]
        return ([_read(env, e.invars[i]) for i in carry_idx],
                [_read(env, e.invars[i]) for i in x_idx], args)

    def _scan(self, fn, init, xs):
        p = self.eqn.params
        return jax.lax.scan(fn, init, xs, length=p["length"], reverse=p["reverse"],
                            unroll=p["unroll"])

    def run_b(self, env):
        nk, consts = self.eqn.params["num_carry"], self.eqn.params["jaxpr"].consts
        init, xs, args = self._feed(env, self.inner.b_reads, self.b_out[:nk])

        def fn(carry, x):
            outs, cut = run_b(self.inner, consts, args(carry, x))
            return outs[:len(carry)], (outs[len(carry):], cut)
        carry, (ys, stacked) = self._scan(fn, init, xs)
        _set(env, self.eqn.outvars, self.b_out, carry + ys)
        env.update(zip(self.slots, stacked))

    def run_w(self, env):
        nk, consts = self.eqn.params["num_carry"], self.eqn.params["jaxpr"].consts
        init, xs, args = self._feed(env, self.inner.w_reads, self.w_out[:nk])

        def fn(carry, x):
            outs = run_w(self.inner, consts, args(carry, x[0]), x[1])
            return outs[:len(carry)], outs[len(carry):]
        carry, ys = self._scan(fn, init, (xs, [env[s] for s in self.slots]))
        _set(env, self.eqn.outvars, self.w_out, carry + ys)

    def _inputs(self, reads, owned):
        e = self.eqn
        nc, nk = e.params["num_consts"], e.params["num_carry"]
        carries = [e.invars[nc + j] for j in range(nk) if owned[j]]
        return [v for i, v in enumerate(e.invars) if reads[i] and not nc <= i < nc + nk] \
            + carries

    def w_inputs(self):
        return self._inputs(self.inner.w_reads, self.w_out) + self.slots

    def b_inputs(self):
        return self._inputs(self.inner.b_reads, self.b_out)


@dataclass(eq=False)
class _CondNode:
    eqn: Any
    inners: list                  # per branch, split
    b_out: list
    w_out: list
    slots: list                   # cut slots shared by the branches
    assign: list                  # per branch: the slot of each of its cut values

    @classmethod
    def build(cls, e, b_new, want, b_ok):
        kept = set(b_new.outvars)
        b_out = [v in kept for v in e.outvars]
        w_out = [w and not b for w, b in zip(want, b_out)]
        free = [b_ok(v) for v in e.invars[1:]]
        inners = [plan(br.jaxpr, b_out, w_out, [True] * len(br.jaxpr.invars), free)
                  for br in e.params["branches"]]
        slots, assign = [], []
        for inner in inners:      # branches share a slot where shapes match
            taken = []
            for k in inner.cut:
                free = [j for j, s in enumerate(slots) if j not in taken
                        and (s.aval.shape, s.aval.dtype) == (k.aval.shape, k.aval.dtype)]
                if not free:
                    slots.append(Slot(k.aval))
                    free = [len(slots) - 1]
                taken.append(free[0])
            assign.append(taken)
        return cls(e, inners, b_out, w_out, slots, assign)

    def _ops(self, which):
        return [any(getattr(s, which)[i] for s in self.inners)
                for i in range(len(self.eqn.invars) - 1)]

    def run_b(self, env):
        used = self._ops("b_reads")
        ops = [_read(env, v) for v, u in zip(self.eqn.invars[1:], used) if u]

        def branch(k, br):
            def fn(ops):
                args = dict(zip([i for i, u in enumerate(used) if u], ops))
                outs, cut = run_b(self.inners[k], br.consts,
                                  [args[i] for i, r in enumerate(self.inners[k].b_reads) if r])
                full = [jnp.zeros(s.aval.shape, s.aval.dtype) for s in self.slots]
                for j, c in zip(self.assign[k], cut):
                    full[j] = c
                return outs, full
            return fn
        outs, full = jax.lax.switch(_read(env, self.eqn.invars[0]),
                                    [branch(k, br) for k, br in
                                     enumerate(self.eqn.params["branches"])], ops)
        _set(env, self.eqn.outvars, self.b_out, outs)
        env.update(zip(self.slots, full))

    def run_w(self, env):
        used = self._ops("w_reads")
        ops = [_read(env, v) for v, u in zip(self.eqn.invars[1:], used) if u]

        def branch(k, br):
            def fn(ops, full):
                args = dict(zip([i for i, u in enumerate(used) if u], ops))
                return run_w(self.inners[k], br.consts,
                             [args[i] for i, r in enumerate(self.inners[k].w_reads) if r],
                             [full[j] for j in self.assign[k]])
            return fn
        outs = jax.lax.switch(_read(env, self.eqn.invars[0]),
                              [branch(k, br) for k, br in enumerate(self.eqn.params["branches"])],
                              ops, [env[s] for s in self.slots])
        _set(env, self.eqn.outvars, self.w_out, outs)

    def w_inputs(self):
        used = self._ops("w_reads")
        return [self.eqn.invars[0]] + [v for v, u in zip(self.eqn.invars[1:], used) if u] \
            + self.slots

    def b_inputs(self):
        used = self._ops("b_reads")
        return [self.eqn.invars[0]] + [v for v, u in zip(self.eqn.invars[1:], used) if u]
