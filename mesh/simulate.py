"""Simulated CPU devices for laptops and CI.

XLA reads ``JAX_NUM_CPU_DEVICES`` (and the older ``--xla_force_host_platform_device_count``)
only when the backend starts, so this must run before anything touches ``jax.devices()``.
"""
from __future__ import annotations

import importlib.util
import os
import sys

DEFAULT_SIMULATED = 8


def simulate_cpu_devices(n: int = DEFAULT_SIMULATED, *, announce: bool = True) -> int | None:
    """Ask JAX for ``n`` CPU devices unless the user already chose.

    Returns the count it set, or None when it left the environment alone: the user set
    ``JAX_NUM_CPU_DEVICES`` or ``XLA_FLAGS`` device count, or an accelerator platform is
    requested via ``JAX_PLATFORMS``. Respecting the user's choice is the contract.
    """
    if "JAX_NUM_CPU_DEVICES" in os.environ:
        return None
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return None
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cpu" not in platforms.split(","):
        return None
    if _backend_started():
        return None
    if _has_accelerator():
        return None
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    if "jax" in sys.modules:  # jax reads the variable at import; tell its config directly
        sys.modules["jax"].config.update("jax_num_cpu_devices", n)
    if announce:
        print(f"triax: no accelerator found; simulating {n} CPU devices "
              f"(set JAX_NUM_CPU_DEVICES to choose another count)", file=sys.stderr)
    return n


def _backend_started() -> bool:
    # A private JAX name, read without importing JAX (listed and tested in triax.private_jax).
    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and getattr(xb, "_backends", None))


def _has_accelerator() -> bool:
    """Cheap check that does not start a JAX backend (that would freeze the device count)."""
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return False
    for plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin", "libtpu"):
        if importlib.util.find_spec(plugin) is not None:
            return True
    return False
