"""Relative op costs (F, B, B_in, W) measured on the compiled pipeline executor.

The planner weighs a schedule's bubble by what each op costs. Instead of assuming unit costs
(``pipeline.DEFAULT_COSTS``: F=1, B=2, B_in=W=1) it compiles a small pipelined training
step — ``tiny`` with one layer per stage, pipe=2, M=2, on two CPU devices, abstract inputs —
and reads each op kind's matmul FLOPs from the executor's tick switch
(``sharding.introspect.op_costs``: one execution on stage 0, the embedding and head left
out, so these are per-layer FLOPs), normalised to F = 1.

The ratios are a property of the executor, not of the model's size: every op kind runs the
same block, and every dense preset's block has the same dots (attention and SwiGLU
projections), whose backward costs scale with the forward's. So one compile per op-kind set
serves every dense workload, and the result is cached (per op-kind set and remat policy). GPipe, 1F1B and interleaved run the
same F and B branches (measured on 1F1B); ZB-H1 and ZB-V run F, B_in and W (measured
on ZB-H1); DualPipeV runs all four (both probes) and its overlapped F&B, which runs exactly
F's and B's matmuls (``tests/test_dualpipe_v.py``), so it costs F + B.

Where this process cannot get two CPU devices (JAX started with one, or without a CPU
backend), the costs fall back to ``DEFAULT_COSTS`` and the source says so and why.

    >>> from triax.pipeline import ScheduleKind
    >>> c = op_costs_for(ScheduleKind.ONE_F_ONE_B)
    >>> c.measured, round(c.as_dict()[OpKind.B])
    (True, 2)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax

from triax.costs.pipeline_math import bubble_fraction
from triax.memo_on_disk import on_disk
from triax.mesh import make_mesh
from triax.models import config
from triax.models.layers import ExecConfig
from triax.pipeline import DEFAULT_COSTS, OpKind, ScheduleKind
from triax.pipeline.pipelined import PipelineConfig
from triax.pipeline.timeline import LABELS
from triax.sharding.introspect import op_costs
from triax.training.step import Trainer

# The measured step: the smallest pipelined program that runs every op kind.
PROBE_MODEL, PROBE_STAGES, PROBE_MICROBATCHES, PROBE_BATCH, PROBE_SEQ = "tiny", 2, 2, 2, 16


def _measured_as(schedule: ScheduleKind) -> tuple[ScheduleKind, ...]:
    """The probe schedules whose tick switches have ``schedule``'s op kinds: a split
    backward runs F, B_in and W (measured on ZB-H1), a full one F and B (1F1B); DualPipeV
    runs both."""
    kinds = schedule.backward_kinds
    return tuple(probe for probe, runs in ((ScheduleKind.ONE_F_ONE_B, OpKind.B in kinds),
                                           (ScheduleKind.ZB_H1, OpKind.W in kinds)) if runs)


_KIND_OF_LABEL = {label: kind for kind, label in LABELS.items()}


@dataclass(frozen=True)
class OpCosts:
    """Cost of each op kind relative to F = 1, and where the figures come from."""

    costs: tuple[tuple[OpKind, float], ...]
    source: str
    measured: bool

    def as_dict(self) -> dict[OpKind, float]:
        return dict(self.costs)

    @property
    def per_microbatch(self) -> float:
        """Work of one micro-batch through one chunk: its F and one backward (B_in + W where
        the schedule splits it; F&B is an F and a B of two micro-batches, counted there)."""
        c = self.as_dict()
        backward = (c[OpKind.B_IN] + c[OpKind.W] if OpKind.W in c else c.get(OpKind.B, 0.0))
        return c[OpKind.F] + backward

    def to_json(self) -> dict:
        return {**{LABELS[k]: v for k, v in self.costs}, "source": self.source,
                "measured": self.measured}

    def describe(self) -> str:
        figures = ", ".join(f"{LABELS[k]}={v:.3g}" for k, v in self.costs)
        return f"{figures} ({self.source})"


def assumed(why: str) -> OpCosts:
    """``DEFAULT_COSTS``, saying why they stand in for measured ones."""
    return OpCosts(tuple(DEFAULT_COSTS.items()),
                   f"assumed unit costs, not measured: {why}", measured=False)


def op_costs_for(schedule: Optional[ScheduleKind], remat: str = "none") -> OpCosts:
    """The op costs the planner weighs ``schedule``'s bubble with, under ``remat`` (a
    rematerialised backward reruns the forward: B ≈ 3F under ``full``)."""
    if schedule is None or schedule is ScheduleKind.FORWARD_ONLY:
        return OpCosts(((OpKind.F, 1.0),), "forward only: one op kind", measured=True)
    probes = [_measure(p, remat) for p in _measured_as(schedule)]
    if len(probes) == 1 and OpKind.FB not in schedule.backward_kinds:
        return probes[0]
    costs = {k: v for p in probes for k, v in p.costs}
    costs[OpKind.FB] = costs[OpKind.F] + costs[OpKind.B]   # F&B runs F's and B's matmuls
    return OpCosts(tuple(sorted(costs.items())), "; ".join(p.source for p in probes)
                   + "; F&B = F + B", all(p.measured for p in probes))


@functools.lru_cache(maxsize=4096)
def measured_bubble(schedule: Optional[ScheduleKind], stages: int, microbatches: int,
                    virtual: int = 1, remat: str = "none") -> float:
    """The schedule's bubble (``costs.pipeline_math.bubble_fraction``), its ops weighted by
    the costs measured under ``remat`` (:func:`op_costs_for`)."""
    if stages <= 1 or schedule is None:
        return 0.0
    return bubble_fraction(schedule, stages, microbatches, virtual,
                           op_costs_for(schedule, remat).as_dict())


def work_factor(schedule: Optional[ScheduleKind], remat: str = "none") -> float:
    """A micro-batch's work under ``schedule`` over a forward plus one full backward (what
    the model-FLOP compute time counts), both measured on the executor under ``remat``.
    1 for GPipe, 1F1B and interleaved; ZB-H1's F + B_in + W over F + B (1 too, with the
    split backward: B_in and W share B's matmuls)."""
    if schedule is None or schedule is ScheduleKind.FORWARD_ONLY:
        return 1.0
    return (op_costs_for(schedule, remat).per_microbatch
            / op_costs_for(ScheduleKind.ONE_F_ONE_B, remat).per_microbatch)


@functools.lru_cache(maxsize=None)
def _measure(schedule: ScheduleKind, remat: str) -> OpCosts:
    # The device checks stay outside the disk memo: they are this process's, not the code's.
    try:
        cpus = jax.devices("cpu")
    except RuntimeError as e:          # no CPU backend in this process (JAX_PLATFORMS)
        return assumed(f"no CPU backend to compile the probe step on ({e})")
    if len(cpus) < PROBE_STAGES:
        return assumed(f"this process has {len(cpus)} CPU device(s) and the probe step needs "
                       f"{PROBE_STAGES} (start with JAX_NUM_CPU_DEVICES≥{PROBE_STAGES})")
    return _compiled_costs(schedule, remat)


@on_disk
def _compiled_costs(schedule: ScheduleKind, remat: str) -> OpCosts:
    """The op costs read from the compiled probe step (needs ``PROBE_STAGES`` CPU devices)."""
    cpus = jax.devices("cpu")
    cfg = config.get(PROBE_MODEL, num_layers=PROBE_STAGES)
    mesh = make_mesh(pipe=PROBE_STAGES, devices=cpus[:PROBE_STAGES])
    trainer = Trainer(cfg, mesh, "dp", pipeline=PipelineConfig(schedule.value, PROBE_MICROBATCHES),
                      exe=ExecConfig(remat=remat))
    compiled = trainer.lower(PROBE_BATCH, PROBE_SEQ).compile()
    measured = op_costs(compiled, trainer.pipeline.branch_kinds)
    unknown = {label: c["unknown_loops"] for label, c in measured.items() if "unknown_loops" in c}
    if unknown:
        return assumed(f"the probe step's ops run loops of unknown trip count ({unknown}), so "
                       f"their FLOPs are not known")
    flops = {label: c["flops"] for label, c in measured.items() if label != "idle"}
    if not flops.get("F"):
        raise ValueError(f"the compiled {schedule.value} probe step has no forward matmul "
                         f"FLOPs ({flops}); the tick switch's branches are not what "
                         f"pipeline.executor.branch_kinds says")
    costs = tuple(sorted(((_KIND_OF_LABEL[k], v / flops["F"]) for k, v in flops.items()),
                         key=lambda kv: kv[0]))
    return OpCosts(costs, f"measured from the compiled executor: matmul FLOPs per layer of "
                          f"the {schedule.value} tick switch's branches, remat {remat}",
                   measured=True)
