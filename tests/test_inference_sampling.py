"""Sampling filters and seeding (pure functions on small logits, no model)."""
import jax
import jax.numpy as jnp
import numpy as np

from triax.inference.sampling import SamplingConfig, sample

LOGITS = jax.random.normal(jax.random.PRNGKey(0), (64, 264)) * 3.0
SEEDS = jnp.arange(64, dtype=jnp.int32)
POS = jnp.full((64,), 5, jnp.int32)
GREEDY = np.asarray(jnp.argmax(LOGITS, -1))


def test_greedy_is_argmax():
    assert (np.asarray(sample(LOGITS, SamplingConfig(), SEEDS, POS)) == GREEDY).all()


def test_top_k_one_and_tiny_top_p_reduce_to_greedy():
    for cfg in (SamplingConfig(temperature=1.0, top_k=1, seed=4),
                SamplingConfig(temperature=1.0, top_p=1e-6, seed=4)):
        assert (np.asarray(sample(LOGITS, cfg, SEEDS, POS)) == GREEDY).all()


def test_samples_stay_in_top_k_and_depend_only_on_seed_and_position():
    cfg = SamplingConfig(temperature=2.0, top_k=5, seed=9)
    a = np.asarray(sample(LOGITS, cfg, SEEDS, POS))
    top5 = np.asarray(jax.lax.top_k(LOGITS, 5)[1])
    assert all(a[i] in top5[i] for i in range(64))
    assert (a != GREEDY).any()                      # it does sample
    # Row i's draw depends on (seed, request seed, position), not on its neighbours.
    perm = np.random.RandomState(0).permutation(64)
    b = np.asarray(sample(LOGITS[perm], cfg, SEEDS[perm], POS))
    assert (b == a[perm]).all()
    c = np.asarray(sample(LOGITS, cfg.__class__(temperature=2.0, top_k=5, seed=10), SEEDS, POS))
    assert (c != a).any()
