"""The training step's memory, checked before any state is allocated (``costs.fits``).

``triax train`` compiles its step on abstract inputs (``Trainer.lower``: nothing allocated)
and compares ``memory_analysis()``'s per-device peak, split into what it holds
(``train_terms``), with a device's memory. What does not fit raises
``costs.fits.OutOfMemoryPredicted`` carrying the run's workload and layout, for the planner
above to suggest another (``triax.planner.memory_advice``).
"""
from __future__ import annotations

import math

import jax

from triax.costs.fits import Replan, check_fits, device_capacity
from triax.costs.workload import Workload
from triax.mesh import mesh_sizes
from triax.models.config import ModelConfig
from triax.sharding.introspect import MemoryReport, memory_from_compiled
from triax.training.offload import HOST


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
    """Per-device bytes of ``tree``'s leaves on the device (host-offloaded ones are not)."""
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
               for s in jax.tree.leaves(tree) if s.sharding.memory_kind != HOST)


def check_train_memory(built, capacity=None) -> MemoryReport:
    """Compile ``built``'s step on abstract inputs (cached for the run) and raise
    ``OutOfMemoryPredicted`` if its per-device peak exceeds a device's memory."""
    mem = memory_from_compiled(built.compiled.step)
    run, cfg = built.config, built.model
    replan = None if not isinstance(cfg, ModelConfig) else Replan(
        Workload.of_run(run, cfg), mesh_sizes(built.mesh), built.trainer.strategy.name,
        run.compute.remat)
    if capacity is None and run.planner.device_memory is not None:
        capacity = device_capacity(run.planner.device_memory)
    check_fits("the training step", train_terms(built, mem), capacity, replan)
    return mem
