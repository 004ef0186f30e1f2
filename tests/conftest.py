"""Test-wide setup: 8 simulated CPU devices and strict JAX, set once before JAX starts."""
from suite_env import STRICT_JAX, apply, share_programs_across_devices

apply()

import jax  # noqa: E402
import pytest  # noqa: E402

for _name, _value in STRICT_JAX.items():
    jax.config.update(_name, _value)
share_programs_across_devices()


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 simulated devices, got {len(devs)}"
    return devs
