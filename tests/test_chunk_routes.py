"""Interleaved (and ZB-V) chunks move from their storage stage to their compute stage in ``v``
rounds of one ``ppermute`` each, and back: the same placement as ``StageLayers.to_stages``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from triax.mesh import make_mesh
from triax.pipeline.chunk_routes import chunk_routes, moving_rounds
from triax.pipeline.stage_layers import StageLayers


@pytest.mark.parametrize("S,v", [(2, 2), (4, 2), (4, 3), (4, 4), (8, 2), (3, 2), (8, 5)])
def test_rounds_are_permutations_covering_every_chunk(S, v):
    rounds = chunk_routes(S, v)
    assert len(rounds) == v
    for rd in rounds:   # each round: every stage sends one chunk and receives one
        assert sorted(d for d, _, _, _ in rd) == list(range(S))
        assert sorted(s for _, _, s, _ in rd) == list(range(S))
    moved = sorted((d * v + r, s, j) for rd in rounds for d, r, s, j in rd)
    assert moved == [(c, c % S, c // S) for c in range(S * v)]   # chunk c runs on c mod S
    assert moving_rounds(S, v) <= v


def test_v_rounds_place_each_stage_on_both_legs():
    """ZB-V: stage s runs chunk s and chunk 2S-1-s; stage d stores chunks 2d and 2d+1."""
    for S in (2, 3, 4, 8):
        rounds = chunk_routes(S, 2, v_shape=True)
        runs = sorted((s, j, d * 2 + r) for rd in rounds for d, r, s, j in rd)
        assert runs == sorted((s, j, s if j == 0 else 2 * S - 1 - s)
                              for s in range(S) for j in range(2))
    assert moving_rounds(2, 2, v_shape=True) == 1     # chunk 0 and 2 stay where they are


@pytest.mark.parametrize("S,v,v_shape", [(4, 2, False), (2, 4, False), (4, 2, True)])
def test_moves_equal_the_placement_and_return(devices, S, v, v_shape):
    mesh = make_mesh(pipe=S, data=8 // S)
    L = S * v * 2   # two layers per chunk
    x = jnp.arange(L * 3, dtype=jnp.float32).reshape(L, 3)
    layout = StageLayers(L, S, v, v_shape)
    assert layout.routed

    def body(a):   # [1, v, Lc, 3] stored -> compute order, and back
        c = layout.to_compute(a[0], "pipe")
        return c[None], layout.to_storage(c, "pipe")[None]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("pipe"), out_specs=(P("pipe"),) * 2,
                              axis_names={"pipe"}, check_vma=False))
    compute, back = f(layout.stored_chunks(x))
    np.testing.assert_array_equal(np.asarray(compute), np.asarray(layout.to_stages(x)))
    np.testing.assert_array_equal(np.asarray(layout.from_stored_chunks(back)), np.asarray(x))


def test_gradients_return_into_the_dead_compute_order_buffer(devices):
    """``to_storage(..., into=c)``: the result overwrites ``c`` (the compute-order weights,
    dead once the ticks are done) instead of a fresh buffer; the values are the same. Here
    that saves at least one chunk (of v=2 per stage); in the tiny ZB-V step (4 layers,
    pipe=2) 279 KB of 2.0 MB of temporaries."""
    from triax.sharding.introspect import memory_from_compiled
    S, v = 4, 2
    mesh = make_mesh(pipe=S, data=8 // S)
    layout = StageLayers(S * v * 2, S, v, v_shape=True)
    x = jnp.arange(S * v * 2 * 64 * 64, dtype=jnp.float32).reshape(S * v * 2, 64, 64)
    per_device = x.nbytes // S

    def step(reuse):
        def body(a):
            c = layout.to_compute(a[0], "pipe")
            # What the ticks make of the weights: their gradients, summed in a loop.
            g = jax.lax.fori_loop(0, 3, lambda i, acc: acc + jnp.sin(c * i), jnp.zeros_like(c))
            return layout.to_storage(g, "pipe", into=c if reuse else None)[None]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe"),
                                     axis_names={"pipe"}, check_vma=False))
    stored = layout.stored_chunks(x)
    (fresh, into) = (step(r).lower(stored).compile() for r in (False, True))
    np.testing.assert_array_equal(np.asarray(into(stored)), np.asarray(fresh(stored)))
    np.testing.assert_allclose(np.asarray(layout.from_stored_chunks(into(stored))),
                               np.sin(np.asarray(x)) + np.sin(2 * np.asarray(x)), rtol=1e-5,
                               atol=1e-5)
    temp = [memory_from_compiled(c).temp_bytes for c in (fresh, into)]
    assert temp[1] <= temp[0] - 0.9 * per_device // v, temp
