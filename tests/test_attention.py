"""Attention's mask description and online-softmax pieces against the plain reference.

Each check runs as one jitted program (not one eager op at a time: a program per op)."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.models import attention as A
from triax.models import runtime
from triax.models import online_softmax as OS
from triax.models import visibility as V


def _qkv(B=2, T=8, N=4, K=2, H=8, seed=0):
    rng = np.random.default_rng(seed)     # host data: no program to draw it
    return tuple(rng.standard_normal(s, np.float32) for s in ((B, T, N, H), (B, T, K, H),
                                                                (B, T, K, H)))


def _segments():
    return jnp.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 2, 2]])


@partial(jax.jit, static_argnames=("packed", "blocks"))
def _blocked_and_reference(q, k, v, packed, blocks):
    B, T = q.shape[:2]
    vis = V.packed_visibility(_segments()) if packed else V.Visibility.causal(B, T)
    part, S = OS.empty_partial(q), T // blocks
    for b in range(blocks):   # keys in reverse order: the result must not depend on it
        sl = slice(T - (b + 1) * S, T - b * S)
        kvis = vis.keys(vis.k_order_BS[:, sl],
                        None if vis.k_segment_BS is None else vis.k_segment_BS[:, sl])
        part = OS.accumulate(part, q, k[:, sl], v[:, sl], kvis)
    return OS.finish(part, q.dtype), A.reference(q, k, v, vis)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_online_softmax_over_key_blocks_equals_reference(packed, blocks):
    got, want = _blocked_and_reference(*_qkv(), packed=packed, blocks=blocks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_merge_of_disjoint_partials_equals_reference():
    @jax.jit
    def merged_and_reference(q, k, v):
        vis = V.Visibility.causal(*q.shape[:2])
        lo = OS.accumulate(OS.empty_partial(q), q, k[:, :3], v[:, :3],
                           vis.keys(vis.k_order_BS[:, :3]))
        hi = OS.accumulate(OS.empty_partial(q), q, k[:, 3:], v[:, 3:],
                           vis.keys(vis.k_order_BS[:, 3:]))
        return OS.finish(OS.merge(hi, lo), q.dtype), A.reference(q, k, v, vis)
    got, want = merged_and_reference(*_qkv(seed=1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


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
    @jax.jit
    def attend_to_later_keys(q, k, v):
        vis = V.Visibility.causal(*q.shape[:2])
        later = vis.keys(vis.k_order_BS + 4)        # every key after every query
        return OS.finish(OS.accumulate(OS.empty_partial(q), q, k, v, later), q.dtype)
    assert float(np.abs(np.asarray(attend_to_later_keys(*_qkv(T=4)))).max()) == 0.0
