"""Out of memory predicted, not hit: a need per device against what a device has, checked
before any state is allocated.

``triax train`` compares its compiled step's per-device peak (``training.memory_check``),
``triax generate`` / ``serve`` a replica's weights and KV cache (``inference.generate``). A
need that does not fit raises ``OutOfMemoryPredicted``, naming the need and its largest
terms; it carries what the planner needs to suggest another layout (``Replan``), and the
layer above the check (``triax.planner.memory_advice``, asked by the CLI) adds that
suggestion: this layer never runs the search.

What a device has: ``$TRIAX_DEVICE_MEMORY`` when set (e.g. ``16GiB``: a GPU shared with
other jobs, or a test); else the accelerator's ``bytes_limit``; on CPU, the host's available
memory divided among the local (simulated) devices. No JAX at import (the CLI's error path
asks for the error type before JAX may start).

    >>> check_fits("the training step", {"temporaries": 3 << 30, "parameters": 1 << 30},
    ...            capacity=(8 << 30, "a test device"))
    >>> try:
    ...     check_fits("the training step", {"temporaries": 3 << 30, "parameters": 1 << 30},
    ...                capacity=(2 << 30, "a test device"))
    ... except OutOfMemoryPredicted as e:
    ...     print(e.advised("use more devices"))
    the training step needs 4.0 GiB per device but a device has 2.0 GiB (a test device); largest terms: temporaries 3.0 GiB, parameters 1.0 GiB. Instead: use more devices. Nothing was allocated; --skip-memory-check runs it anyway.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from triax.units import human_bytes, parse_bytes

if TYPE_CHECKING:
    from triax.costs.workload import Workload

MEMORY_ENV = "TRIAX_DEVICE_MEMORY"
_SHOWN_TERMS = 3


@dataclass(frozen=True)
class Replan:
    """What the planner needs to suggest another layout for a need that does not fit: the
    workload and the layout it ran with (mesh sizes, strategy name, remat)."""

    workload: "Workload"
    mesh: Mapping[str, int]
    strategy: str
    remat: str = "none"
    devices: Optional[int] = None   # None: this process's devices, on every process


class OutOfMemoryPredicted(ValueError):
    """The run needs more memory per device than a device has (found before allocating)."""

    def __init__(self, what: str, terms: Mapping[str, int], capacity: tuple[int, str],
                 replan: Optional[Replan] = None, advice: Optional[str] = None):
        self.what, self.terms, self.capacity = what, dict(terms), capacity
        self.replan, self.advice = replan, advice
        largest = sorted(self.terms.items(), key=lambda kv: -kv[1])[:_SHOWN_TERMS]
        super().__init__(
            f"{what} needs {human_bytes(self.need)} per device but a device has "
            f"{human_bytes(capacity[0])} ({capacity[1]}); largest terms: "
            + ", ".join(f"{name} {human_bytes(b)}" for name, b in largest)
            + (f". Instead: {advice}" if advice else "")
            + ". Nothing was allocated; --skip-memory-check runs it anyway.")

    @property
    def need(self) -> int:
        return sum(self.terms.values())

    def advised(self, advice: Optional[str]) -> "OutOfMemoryPredicted":
        """The same prediction, saying what to run instead."""
        return OutOfMemoryPredicted(self.what, self.terms, self.capacity, self.replan, advice)


def device_capacity(device_memory: Optional[str] = None) -> Optional[tuple[int, str]]:
    """(bytes one local device can hold, where the figure comes from), or None: unknown.
    ``device_memory`` (``--device-memory``, e.g. ``40GiB``) comes first, then
    ``$TRIAX_DEVICE_MEMORY``, the accelerator's ``bytes_limit``, and on CPU the host's
    available memory divided among the simulated devices."""
    if device_memory is not None:
        return parse_bytes(device_memory), f"--device-memory {device_memory}"
    given = os.environ.get(MEMORY_ENV)
    if given:
        return parse_bytes(given), f"{MEMORY_ENV}={given}"
    import jax       # the device's own figure: JAX has started by now
    import psutil
    dev = jax.local_devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without allocator stats: fall through
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{dev.device_kind} memory"
    if dev.platform == "cpu":
        n = jax.local_device_count()
        avail = psutil.virtual_memory().available
        return avail // n, (f"available host memory {human_bytes(avail)} shared by {n} "
                            f"simulated device{'s' if n > 1 else ''}")
    return None


def check_fits(what: str, terms: Mapping[str, int], capacity=None,
               replan: Optional[Replan] = None) -> None:
    """Raise ``OutOfMemoryPredicted`` (carrying ``replan``) when ``sum(terms)`` bytes exceed
    ``capacity`` (a ``(bytes, source)`` pair; ``device_capacity()`` when None, no check when
    unknown)."""
    capacity = device_capacity() if capacity is None else capacity
    if capacity is not None and sum(terms.values()) > capacity[0]:
        raise OutOfMemoryPredicted(what, terms, capacity, replan)

