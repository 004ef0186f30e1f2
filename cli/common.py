"""Device start-up shared by the subcommands that run JAX."""
from __future__ import annotations


def start_devices() -> None:
    """Simulate 8 CPU devices when no accelerator is present (must precede JAX start-up)."""
    # Imported here: this is the first triax module a command loads that touches JAX.
    from triax.mesh.simulate import simulate_cpu_devices
    simulate_cpu_devices()
