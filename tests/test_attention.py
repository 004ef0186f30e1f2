"""Attention's mask description and online-softmax pieces against the plain reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.models import attention as A
from triax.models import runtime
from triax.models import online_softmax as OS
from triax.models import visibility as V


def _qkv(B=2, T=8, N=4, K=2, H=8, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, N, H)), jax.random.normal(kk, (B, T, K, H)),
            jax.random.normal(kv, (B, T, K, H)))


def _segments():
    return jnp.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 2, 2]])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_online_softmax_over_key_blocks_equals_reference(packed, blocks):
    q, k, v = _qkv()
    B, T = q.shape[:2]
    vis = V.packed_visibility(_segments()) if packed else V.Visibility.causal(B, T)
    want = A.reference(q, k, v, vis)
    part, S = OS.empty_partial(q), T // blocks
    for b in range(blocks):   # keys in reverse order: the result must not depend on it
        sl = slice(T - (b + 1) * S, T - b * S)
        kvis = vis.keys(vis.k_order_BS[:, sl],
                        None if vis.k_segment_BS is None else vis.k_segment_BS[:, sl])
        part = OS.accumulate(part, q, k[:, sl], v[:, sl], kvis)
    np.testing.assert_allclose(OS.finish(part, q.dtype), want, rtol=1e-5, atol=1e-6)


def test_merge_of_disjoint_partials_equals_reference():
    q, k, v = _qkv(seed=1)
    vis = V.Visibility.causal(*q.shape[:2])
    lo = OS.accumulate(OS.empty_partial(q), q, k[:, :3], v[:, :3], vis.keys(vis.k_order_BS[:, :3]))
    hi = OS.accumulate(OS.empty_partial(q), q, k[:, 3:], v[:, 3:], vis.keys(vis.k_order_BS[:, 3:]))
    np.testing.assert_allclose(OS.finish(OS.merge(hi, lo), q.dtype), A.reference(q, k, v, vis),
                               rtol=1e-5, atol=1e-6)


def test_cache_visibility_sees_slots_up_to_the_position():
    m = V.Visibility.cache(jnp.array([[2], [0]]), 4).mask()
    assert np.asarray(m)[:, 0].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_hook_replaces_attention_and_unknown_implementation_is_named():
    q, k, v = _qkv()
    vis = V.Visibility.causal(*q.shape[:2])
    with runtime.using(attention=lambda q, k, v, vis, impl: jnp.zeros_like(q)):
        assert float(jnp.abs(A.attention(q, k, v, vis)).sum()) == 0.0
    with pytest.raises(ValueError, match="'nope'.*reference"):
        A.attention(q, k, v, vis, "nope")


def test_a_query_that_sees_no_key_gets_zeros():
    q, k, v = _qkv(T=4)
    vis = V.Visibility.causal(*q.shape[:2])
    later = vis.keys(vis.k_order_BS + 4)            # every key after every query
    part = OS.accumulate(OS.empty_partial(q), q, k, v, later)
    assert float(jnp.abs(OS.finish(part, q.dtype)).max()) == 0.0
