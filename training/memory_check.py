"""Out of memory predicted, not hit: the per-device need of a run against what a device has,
checked before any state is allocated.

``triax train`` compiles its step on abstract inputs (``Trainer.lower``: nothing allocated)
and compares ``memory_analysis()``'s per-device peak with a device's memory; ``triax
generate`` compares the weights and KV cache each device holds. When the need does not fit,
``OutOfMemoryPredicted`` names the need, its largest terms and what the planner
(``triax.planner.plan``) would run instead on the same devices.

What a device has: ``$TRIAX_DEVICE_MEMORY`` when set (e.g. ``16GiB``: a GPU shared with
other jobs, or a test); else the accelerator's ``bytes_limit``; on CPU, the host's available
memory divided among the local (simulated) devices.

    >>> check_fits("the training step", {"temporaries": 3 << 30, "parameters": 1 << 30},
    ...            capacity=(8 << 30, "a test device"))
    >>> check_fits("the training step", {"temporaries": 3 << 30, "parameters": 1 << 30},
    ...            capacity=(2 << 30, "a test device"), suggestion="use more devices")
    Traceback (most recent call last):
    ...
    triax.training.memory_check.OutOfMemoryPredicted: the training step needs 4.0 GiB per device but a device has 2.0 GiB (a test device); largest terms: temporaries 3.0 GiB, parameters 1.0 GiB. Instead: use more devices. Nothing was allocated; --skip-memory-check runs it anyway.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, Optional

import jax
import psutil

from triax.mesh import mesh_sizes
from triax.models.config import ModelConfig
from triax.sharding.introspect import MemoryReport, memory_from_compiled
from triax.units import human_bytes, parse_bytes

# The planner sits above training (it builds runs to verify its plans), so it is imported
# only where a suggestion is asked for, after a check has failed.

MEMORY_ENV = "TRIAX_DEVICE_MEMORY"
# The catalogue device whose speeds the planner ranks plans with; only its memory is
# replaced by the measured one, and only memory decides what fits.
_REFERENCE_DEVICE = "h100-80gb"
_SHOWN_TERMS = 3


class OutOfMemoryPredicted(ValueError):
    """The run needs more memory per device than a device has (found before allocating)."""


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
               suggestion: str | None = None) -> None:
    """Raise ``OutOfMemoryPredicted`` when ``sum(terms)`` bytes exceed ``capacity`` (a
    ``(bytes, source)`` pair; ``device_capacity()`` when None, no check when unknown).
    ``suggestion`` may be a callable of the capacity's bytes, asked only when the need
    does not fit."""
    capacity = device_capacity() if capacity is None else capacity
    need = sum(terms.values())
    if capacity is None or need <= capacity[0]:
        return
    largest = sorted(terms.items(), key=lambda kv: -kv[1])[:_SHOWN_TERMS]
    hint = suggestion(capacity[0]) if callable(suggestion) else suggestion
    raise OutOfMemoryPredicted(
        f"{what} needs {human_bytes(need)} per device but a device has "
        f"{human_bytes(capacity[0])} ({capacity[1]}); largest terms: "
        + ", ".join(f"{name} {human_bytes(b)}" for name, b in largest)
        + (f". Instead: {hint}" if hint else "")
        + ". Nothing was allocated; --skip-memory-check runs it anyway.")


def planner_suggestion(w, capacity: int, current: Mapping[str, object],
                       devices: Optional[int] = None) -> str:
    """What ``triax plan`` would run for workload ``w`` on ``devices`` (default: this
    process's devices, on every process) with ``capacity`` bytes each: the best plan that
    differs from ``current`` (its mesh sizes, strategy and remat), as flags, or the
    planner's own reason why nothing fits."""
    from triax.planner import Assumptions, Catalog, load_catalog, plan  # see the imports
    base = load_catalog().device(_REFERENCE_DEVICE)
    device = dataclasses.replace(base, name="this device", memory=float(capacity))
    per_node, nodes = (jax.local_device_count(), jax.process_count()) if devices is None \
        else (devices, 1)
    cluster = Catalog(devices={device.name: device}).cluster(device.name, per_node, nodes)
    try:
        # The capacity is what the allocator gives (bytes_limit or free host memory), so the
        # planner's fixed CUDA-context overhead is already paid.
        rec = plan(w, cluster, top=8, assume=Assumptions(overhead_bytes=0))
    except ValueError as e:
        return f"the planner finds no layout of {cluster.devices} device(s) that fits: {e}"
    for p in rec.plans:
        lay = p.layout
        if (_sizes(lay.sizes), lay.strategy, p.workload.remat) == \
                (_sizes(current["mesh"]), current["strategy"], current["remat"]):
            continue
        flags = f"--mesh {lay.mesh_str}"
        if w.train:   # generate's --mesh is the whole serving layout (tensor/pipe, no remat)
            flags += f" --strategy {lay.strategy} --remat {p.workload.remat}"
            if lay.pipe > 1 and lay.schedule is not None:
                flags += f" --schedule {lay.schedule.value} --microbatches {lay.microbatches}"
        return (f"the planner (triax plan, an analytic model) suggests {flags} "
                f"({human_bytes(p.memory.total)} per device modelled)")
    return ("the planner's analytic model expects the current layout to fit, but the measured "
            "need does not: use a smaller batch or shorter sequences, or add devices")


def _sizes(sizes: Mapping[str, int]) -> dict:
    return {a: n for a, n in sizes.items() if n > 1}


def train_terms(built, mem: MemoryReport) -> dict[str, int]:
    """The compiled step's per-device peak split into what it holds: the state (from its
    shardings), the batch (the other arguments), temporaries and undonated outputs."""
    state = built.trainer.abstract_state()
    held = {"parameters": _per_device(state["params"]),
            "optimizer state": _per_device([state["opt_state"], state["step"]])}
    return {**held, "batch": mem.argument_bytes - sum(held.values()),
            "temporaries (activations, gradients)": mem.temp_bytes,
            "outputs not donated": mem.output_bytes - mem.alias_bytes}


def _per_device(tree) -> int:
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
               for s in jax.tree.leaves(tree))


def check_train_memory(built, capacity=None) -> MemoryReport:
    """Compile ``built``'s step on abstract inputs (cached for the run) and raise
    ``OutOfMemoryPredicted`` if its per-device peak exceeds a device's memory."""
    mem = memory_from_compiled(built.compiled.step)
    run, cfg = built.config, built.model

    def suggest(capacity_bytes: int) -> Optional[str]:
        if not isinstance(cfg, ModelConfig):
            return None
        from triax.planner import Workload  # see the imports
        w = Workload.of(cfg, train=True, dtype=run.precision, batch=run.batch_size,
                        seq=run.seq_len, remat=run.remat)
        return planner_suggestion(w, capacity_bytes, {"mesh": mesh_sizes(built.mesh),
                                              "strategy": built.trainer.strategy.name,
                                              "remat": run.remat})

    if capacity is None and run.device_memory is not None:
        capacity = device_capacity(run.device_memory)
    check_fits("the training step", train_terms(built, mem), capacity, suggest)
    return mem
