"""Test-wide setup: 8 simulated CPU devices and strict JAX, set once before JAX starts."""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_threefry_partitionable", True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 simulated devices, got {len(devs)}"
    return devs


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6, what="tree"):
    """Leaf-by-leaf comparison that names the first differing path."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e), f"{what}: {len(flat_a)} leaves vs {len(flat_e)}"
    for (path, a), e in zip(flat_a, flat_e):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=f"{what} at {jax.tree_util.keystr(path)}")
