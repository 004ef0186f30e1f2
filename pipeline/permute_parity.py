"""Collective-permute parity: every stage runs the same number of collective-permutes per op.

An op that communicates by ``ppermute`` inside its conditional (ring attention over
``context`` runs C−1 of them per layer forward, more backward) runs on some stages while the
others skip it. XLA:CPU's in-process collectives meet every collective-permute of a program
at one rendezvous over *all* devices, keyed by the channel id, which JAX sets to 1 for every
collective (``jax._src.interpreters.mlir.COLLECTIVE_CHANNEL_ID``). So while stage 0 permutes
its K/V blocks inside F, stage 1, which skips F, meets it with its next collective-permute:
the stage-to-stage send. Each device then copies from its source's buffer, and stage 1
reads stage 0's K/V block as its activation (a different size: garbage, NaN). With nothing
to meet it, the permute waits for ever (the reproducer in docs/long_context.md).

The fix is an invariant: **between two stage-to-stage sends every device runs the same
number of collective-permutes.** :func:`run_or_skip` counts the permutes of an op's run
branch in its jaxpr and gives the skip branch as many identity permutes (each device sends a
scalar to itself). A permute over ``context`` then only ever meets permutes that stay inside each
device's own context group or on the device itself, whatever other stages run, so the data
is right; and no rendezvous waits for a device that never comes.

    >>> import jax
    >>> f = lambda x: jax.lax.scan(lambda c, _: (c + 1, None), x, None, length=3)[0]
    >>> permutes(jax.make_jaxpr(f)(1.0).jaxpr)
    0
"""
from __future__ import annotations

import jax
from jax.extend.core import jaxpr_as_fun, jaxprs_in_params


def permutes(jaxpr) -> int:
    """Collective-permutes one evaluation of ``jaxpr`` runs (each ``ppermute`` output is one
    HLO instruction; a scan multiplies by its length; a conditional's branches must agree)."""
    n = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "ppermute":
            n += len(eqn.outvars)
        elif name == "scan":
            n += eqn.params["length"] * permutes(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            counts = {permutes(b.jaxpr) for b in eqn.params["branches"]}
            if len(counts) > 1:
                raise ValueError(f"a conditional inside a pipeline op whose branches run "
                                 f"{sorted(counts)} collective-permutes: the stages would fall "
                                 f"out of step (pipeline/permute_parity.py); make them equal")
            n += counts.pop()
        else:
            inner = sum(permutes(j) for j in jaxprs_in_params(eqn.params))
            if inner and name == "while":
                raise ValueError("collective-permutes in a while loop of unknown trip count "
                                 "inside a pipeline op: the skipping stages cannot match them; "
                                 "use lax.scan or a fori_loop with static bounds")
            n += inner
    return n


def run_or_skip(flag, run, live, axis: str, size: int):
    """One op's two-branch conditional: ``run(live)`` where ``flag`` is 1, else ``live``
    untouched (the op skipped); the skip branch runs as many identity collective-permutes
    over ``axis`` (of ``size``, manual here) as ``run`` does, on ``live``'s smallest leaf.
    ``live`` is any pytree: the buffers the op writes."""
    closed, out_shape = jax.make_jaxpr(run, return_shape=True)(live)
    n = permutes(closed.jaxpr)
    out_tree = jax.tree.structure(out_shape)

    def run_traced(w):   # the jaxpr just traced, not a second trace of ``run``
        return jax.tree.unflatten(out_tree, jaxpr_as_fun(closed)(*jax.tree.leaves(w)))

    def skip(w):
        if not n:
            return w
        leaves, tree = jax.tree.flatten(w)
        i = min(range(len(leaves)), key=lambda k: leaves[k].size)
        identity = [(s, s) for s in range(size)]
        leaves[i] = jax.lax.fori_loop(
            0, n, lambda _, x: jax.lax.ppermute(x, axis, identity), leaves[i])
        return jax.tree.unflatten(tree, leaves)
    return jax.lax.switch(flag, [skip, run_traced], live)

