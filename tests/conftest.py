"""Test-wide setup: 8 simulated CPU devices and strict JAX, set once before JAX starts."""
from suite_env import apply

apply()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_threefry_partitionable", True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 simulated devices, got {len(devs)}"
    return devs
