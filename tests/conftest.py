"""Test-wide setup: 8 simulated CPU devices and strict JAX, set once before JAX starts."""
import os
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One persistent compilation cache for the run's workers and the processes they start: many
# tests, docstrings and notebooks compile the same step (notebooks/conftest.py sets the same).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax"))

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
