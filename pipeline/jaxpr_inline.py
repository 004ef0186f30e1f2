"""Jaxpr plumbing the split stands on: :func:`inline` retraces a jaxpr with every call
(``jit``, ``remat``, custom derivatives) inlined, in scan and cond bodies too, so what is
inside a call splits like the rest; :func:`reads` says which inputs a function's results
depend on (dead-code elimination, as XLA drops a value nothing reads); ``read`` and ``bind``
evaluate one equation.

    >>> import jax.numpy as jnp
    >>> reads(lambda a, b: a * 2, jnp.ones(3), jnp.ones(3))
    [True, False]
"""
from __future__ import annotations

from functools import partial

import jax
from triax.private_jax import partial_eval as pe  # jaxpr DCE: no public API
from jax.extend.core import ClosedJaxpr, Literal, jaxprs_in_params
from jax.extend.core import primitives as P


_CALLS = {P.jit_p: "jaxpr", P.remat_p: "jaxpr", P.closed_call_p: "call_jaxpr",
          P.custom_jvp_call_p: "call_jaxpr", P.custom_vjp_call_p: "call_jaxpr"}


def sds(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def has_inner(eqn) -> bool:
    return any(True for _ in jaxprs_in_params(eqn.params))


def read(env, v):
    return v.val if isinstance(v, Literal) else env[v]


def bind(eqn, invals, params=None):
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params or eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def _eval_inlined(jaxpr, consts, *args):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(env, v) for v in eqn.invars]
        key = _CALLS.get(eqn.primitive)
        if key:
            inner = eqn.params[key]
            inner = inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())
            outs = _eval_inlined(inner.jaxpr, inner.consts, *ins)
        elif eqn.primitive is P.scan_p:
            outs = bind(eqn, ins, dict(eqn.params, jaxpr=inline(eqn.params["jaxpr"])))
        elif eqn.primitive is P.cond_p:
            branches = tuple(inline(b) for b in eqn.params["branches"])
            outs = bind(eqn, ins, dict(eqn.params, branches=branches))
        else:
            outs = bind(eqn, ins)
        env.update(zip(eqn.outvars, outs))
    return [read(env, v) for v in jaxpr.outvars]


def inline(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` retraced with every call inlined, in scan and cond bodies too."""
    fn = partial(_eval_inlined, closed.jaxpr, closed.consts)
    return jax.make_jaxpr(fn)(*[sds(a) for a in closed.in_avals])


def reads(fn, *args) -> list[bool]:
    """Per leaf of ``args`` (flattened, in order): whether ``fn``'s results depend on it, by
    dead-code elimination of its jaxpr (what XLA does with a value nothing reads)."""
    closed = jax.make_jaxpr(fn)(*args)
    _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return list(used)
