"""Collective-permutes inside conditionals that only some stages run (``pipeline.permute_parity``):
the reproducer of XLA:CPU mixing them up, fixed by giving the skip branch as many identity
permutes; and the jaxpr count that sizes them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from triax.mesh import make_mesh
from triax.pipeline.permute_parity import permutes, run_or_skip


def test_permutes_counts_scans_and_conditionals():
    def f(x):
        def step(c, _):
            c = jax.lax.ppermute(c, "i", [(0, 1), (1, 0)])
            return jax.lax.cond(c.sum() > 0, lambda c: jax.lax.ppermute(c, "i", [(0, 0)]),
                                lambda c: jax.lax.ppermute(-c, "i", [(1, 1)]), c), None
        return jax.lax.scan(step, x, None, length=3)[0]
    jaxpr = jax.make_jaxpr(f, axis_env=[("i", 2)])(jnp.ones(2))
    assert permutes(jaxpr.jaxpr) == 3 * 2

    def uneven(x):
        return jax.lax.cond(x.sum() > 0, lambda x: jax.lax.ppermute(x, "i", [(0, 1)]),
                            lambda x: x, x)
    with pytest.raises(ValueError, match="fall out of step"):
        permutes(jax.make_jaxpr(uneven, axis_env=[("i", 2)])(jnp.ones(2)).jaxpr)


def test_stage_conditional_permutes_keep_the_stages_sends_right(devices):
    """Per tick, stage t permutes over ``context`` inside a conditional the other stage
    skips, then every stage sends to the other over ``pipe`` (the pipeline's tick). Without
    parity the skipping stage's send meets the other's context permute (XLA:CPU: one
    rendezvous for every collective-permute) and reads its buffer."""
    mesh = make_mesh(pipe=2, context=2, devices=devices[:4])

    def body(x):
        stage = jax.lax.axis_index("pipe")

        def tick(t, x):
            def run(w):
                return {"x": jax.lax.ppermute(w["x"], "context", [(0, 1), (1, 0)])}
            x = run_or_skip((stage == t).astype(jnp.int32), run, {"x": x}, "pipe", 2)["x"]
            return jax.lax.ppermute(x, "pipe", [(0, 1), (1, 0)])
        return jax.lax.fori_loop(0, 2, tick, x)

    spec = P(("pipe", "context"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.arange(1.0, 5.0)[:, None], jax.NamedSharding(mesh, spec))
    # tick 0: stage 0 swaps over context, [2,1,3,4]; pipe swap, [3,4,2,1];
    # tick 1: stage 1 swaps, [3,4,1,2]; pipe swap, [1,2,3,4]
    np.testing.assert_array_equal(np.asarray(f(x)).ravel(), [1, 2, 3, 4])
