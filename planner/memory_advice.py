"""What to run instead when a run is predicted not to fit (``costs.fits``): the planner's
best plan on the same devices, as flags.

The check sits below training and inference and never runs the search; its error carries
the workload and the layout that ran (``costs.fits.Replan``), and whoever called (the CLI's
error path, ``triax.cli.main``) asks ``advise`` here for the sentence to add.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax

from triax.costs.fits import OutOfMemoryPredicted, Replan
from triax.costs.hardware import Catalog, load_catalog
from triax.costs.memory import Assumptions
from triax.planner.recommend import plan
from triax.units import human_bytes

# The catalogue device whose speeds the planner ranks plans with; only its memory is
# replaced by the measured one, and only memory decides what fits.
_REFERENCE_DEVICE = "h100-80gb"


def advise(err: OutOfMemoryPredicted) -> OutOfMemoryPredicted:
    """``err`` saying what the planner would run instead (unchanged when it carries no
    workload, or already says)."""
    if err.replan is None or err.advice:
        return err
    return err.advised(planner_suggestion(err.replan, err.capacity[0]))


def planner_suggestion(replan: Replan, capacity: int) -> str:
    """What ``triax plan`` would run for ``replan.workload`` on ``replan.devices`` (default:
    this process's devices, on every process) with ``capacity`` bytes each: the best plan
    that differs from the layout that ran (its mesh sizes, strategy and remat), as flags, or
    the planner's own reason why nothing fits."""
    w = replan.workload
    base = load_catalog().device(_REFERENCE_DEVICE)
    device = dataclasses.replace(base, name="this device", memory=float(capacity))
    per_node, nodes = (jax.local_device_count(), jax.process_count()) \
        if replan.devices is None else (replan.devices, 1)
    cluster = Catalog(devices={device.name: device}).cluster(device.name, per_node, nodes)
    try:
        # The capacity is what the allocator gives (bytes_limit or free host memory), so the
        # planner's fixed CUDA-context overhead is already paid.
        rec = plan(w, cluster, top=8, assume=Assumptions(overhead_bytes=0))
    except ValueError as e:
        return f"the planner finds no layout of {cluster.devices} device(s) that fits: {e}"
    ran = (_sizes(replan.mesh), replan.strategy, replan.remat)
    for p in rec.plans:
        lay = p.layout
        if (_sizes(lay.sizes), lay.strategy.name, p.workload.remat) == ran:
            continue
        flags = f"--mesh {lay.mesh_str}"
        if w.train:   # generate's --mesh is the whole serving layout (tensor/pipe, no remat)
            flags += f" --strategy {lay.strategy.name} --remat {p.workload.remat}"
            if lay.pipe > 1 and lay.schedule is not None:
                flags += f" --schedule {lay.schedule.value} --microbatches {lay.microbatches}"
        return (f"the planner (triax plan, an analytic model) suggests {flags} "
                f"({human_bytes(p.memory.total)} per device modelled)")
    return ("the planner's analytic model expects the current layout to fit, but the measured "
            "need does not: use a smaller batch or shorter sequences, or add devices")


def _sizes(sizes: Mapping[str, int]) -> dict:
    return {a: n for a, n in sizes.items() if n > 1}
