"""Running a planned split (``jaxpr_split.plan``): part B, then part W from B's cut, each
evaluating its nodes in program order; and the nodes that split a ``scan`` or a ``cond`` in
its body. B's scan emits the body's cut as stacked outputs and W's scan takes them as extra
``xs`` (a carry W reads but B owns is cut per iteration); a cond's two parts switch on the
same index, its branches sharing cut slots of equal shape, each filling the slots it does
not produce with zeros. A node is built by the planner, which hands it ``plan`` to split
the body with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from triax.pipeline.jaxpr_inline import bind, read
from triax.private_jax import scan_counts  # a scan eqn's consts and carries: private params


class Slot:
    """A cut value that is no variable of the jaxpr: a split scan's stacked per-iteration
    cut, or a split cond's cut slot."""

    def __init__(self, aval):
        self.aval = aval


def run_b(s, consts, args) -> tuple[list, list]:
    """B: ``(b outputs, cut)`` from the inputs B reads (``s.b_reads``), in order."""
    env = _run(s, dict(zip(s.jaxpr.constvars, consts)), s.b_reads, args, s.b_nodes, "run_b")
    return [read(env, v) for v in s.b_outs], [env[k] for k in s.cut]


def run_w(s, consts, args, cut) -> list:
    """W: the ``w`` outputs from the inputs W reads (``s.w_reads``), in order, and the cut."""
    env = dict(zip(s.jaxpr.constvars, consts)) | dict(zip(s.cut, cut))
    env = _run(s, env, s.w_reads, args, s.w_nodes, "run_w")
    return [read(env, v) for v in s.w_outs]


def _run(s, env: dict, reads, args, nodes, part: str) -> dict:
    """Evaluate one part's nodes in order (split scan/cond nodes run their ``part``)."""
    env.update(zip([v for v, r in zip(s.jaxpr.invars, reads) if r], args))
    for node in nodes:
        if isinstance(node, (ScanNode, CondNode)):
            getattr(node, part)(env)
        else:
            env.update(zip(node.outvars, bind(node, [read(env, v) for v in node.invars])))
    return env


def _set(env, outvars, used, vals):
    vals = iter(vals)
    for v, u in zip(outvars, used):
        if u:
            env[v] = next(vals)


@dataclass(eq=False)
class ScanNode:
    eqn: Any
    inner: Any                    # the body, split (a jaxpr_split.Split)
    b_out: list                   # per scan output: B produces it (carries: B owns them)
    w_out: list                   # per scan output: W produces it
    slots: list                   # the body's cut, stacked over iterations

    @classmethod
    def build(cls, e, b_new, want, b_ok, plan):
        nc, nk = scan_counts(e)
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
        (nc, nk), n = scan_counts(e), len(e.invars)
        consts = {i: read(env, e.invars[i]) for i in range(nc) if reads[i]}
        carry_idx = [nc + j for j in range(nk) if owned[j]]
        assert all(i in carry_idx for i in range(nc, nc + nk) if reads[i]), "carry not owned"
        x_idx = [i for i in range(nc + nk, n) if reads[i]]

        def args(carry, xs):
            vals = consts | dict(zip(carry_idx, carry)) | dict(zip(x_idx, xs))
            return [vals[i] for i in range(n) if reads[i]]
        return ([read(env, e.invars[i]) for i in carry_idx],
                [read(env, e.invars[i]) for i in x_idx], args)

    def _scan(self, fn, init, xs):
        p = self.eqn.params
        return jax.lax.scan(fn, init, xs, length=p["length"], reverse=p["reverse"],
                            unroll=p["unroll"])

    def run_b(self, env):
        nk, consts = scan_counts(self.eqn)[1], self.eqn.params["jaxpr"].consts
        init, xs, args = self._feed(env, self.inner.b_reads, self.b_out[:nk])

        def fn(carry, x):
            outs, cut = run_b(self.inner, consts, args(carry, x))
            return outs[:len(carry)], (outs[len(carry):], cut)
        carry, (ys, stacked) = self._scan(fn, init, xs)
        _set(env, self.eqn.outvars, self.b_out, carry + ys)
        env.update(zip(self.slots, stacked))

    def run_w(self, env):
        nk, consts = scan_counts(self.eqn)[1], self.eqn.params["jaxpr"].consts
        init, xs, args = self._feed(env, self.inner.w_reads, self.w_out[:nk])

        def fn(carry, x):
            outs = run_w(self.inner, consts, args(carry, x[0]), x[1])
            return outs[:len(carry)], outs[len(carry):]
        carry, ys = self._scan(fn, init, (xs, [env[s] for s in self.slots]))
        _set(env, self.eqn.outvars, self.w_out, carry + ys)

    def _inputs(self, reads, owned):
        e = self.eqn
        nc, nk = scan_counts(e)
        carries = [e.invars[nc + j] for j in range(nk) if owned[j]]
        return [v for i, v in enumerate(e.invars) if reads[i] and not nc <= i < nc + nk] \
            + carries

    def w_inputs(self):
        return self._inputs(self.inner.w_reads, self.w_out) + self.slots

    def b_inputs(self):
        return self._inputs(self.inner.b_reads, self.b_out)


@dataclass(eq=False)
class CondNode:
    eqn: Any
    inners: list                  # per branch, split
    b_out: list
    w_out: list
    slots: list                   # cut slots shared by the branches
    assign: list                  # per branch: the slot of each of its cut values

    @classmethod
    def build(cls, e, b_new, want, b_ok, plan):
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
        ops = [read(env, v) for v, u in zip(self.eqn.invars[1:], used) if u]

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
        outs, full = jax.lax.switch(read(env, self.eqn.invars[0]),
                                    [branch(k, br) for k, br in
                                     enumerate(self.eqn.params["branches"])], ops)
        _set(env, self.eqn.outvars, self.b_out, outs)
        env.update(zip(self.slots, full))

    def run_w(self, env):
        used = self._ops("w_reads")
        ops = [read(env, v) for v, u in zip(self.eqn.invars[1:], used) if u]

        def branch(k, br):
            def fn(ops, full):
                args = dict(zip([i for i, u in enumerate(used) if u], ops))
                return run_w(self.inners[k], br.consts,
                             [args[i] for i, r in enumerate(self.inners[k].w_reads) if r],
                             [full[j] for j in self.assign[k]])
            return fn
        outs = jax.lax.switch(read(env, self.eqn.invars[0]),
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
