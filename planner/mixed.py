"""Mixed GPU generations: one pipeline stage per group of devices (or per equal share of a
group), the layers per stage sized by each group's speed within every group's memory.

``triax plan --gpu h100-80gb:8,a100-80gb:8`` (``hardware.parse_gpu``): every stage gets the
same number of devices (the counts' greatest common divisor: one SPMD program runs every
stage on the same mesh), laid out as ``data`` × ``pipe``. Per stage kind the planner's own
step model of that layout on a cluster of the kind alone (``evaluate``) gives the compute
seconds of one layer per step (the stage's compute over its layers); the split minimising the
slowest stage (``pipeline.stage_counts.split_by_time``) gives the slower kind fewer layers.

**The timing is modelled, not measured**: a pipelined step is paced by its slowest stage, so
the predicted step is ``max_s(layers_s × seconds per layer_s) / (1 − bubble)`` (the
schedule's bubble: ``op_costs.measured_bubble``) plus the communication the same model
leaves exposed (the largest of the kinds'), against the same with equal stages.

Memory is asked of ``memory.estimate`` for the uneven layout: the executor pads every stage's
chunk to the longest stage's layers (one program, one set of buffers on every stage; each pipe
rank stores its own stage's layers, so padded), so every stage needs the same bytes, which must fit each group's devices; the longest stage is
shortened (its layers moved to the next fastest) until it does.

    >>> from triax.models import config
    >>> from triax.costs.workload import Workload
    >>> w = Workload.of(config.get("llama3-8b"), train=True, batch=32, seq=2048, remat="full")
    >>> m = plan_mixed(w, hardware.parse_gpu("h100-80gb:8,a100-80gb:8"))
    >>> m.by_speed, m.uneven, m.uneven_step_s < m.equal_step_s   # 25 layers would not fit
    ((25, 7), (19, 13), True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from triax.pipeline import ScheduleKind
from triax.pipeline.pipelined import default_microbatches
from triax.pipeline.stage_counts import StageCountsError, equal_counts, split_by_time
from triax.costs import hardware
from triax.planner.evaluate import evaluate
from triax.costs.memory import Memory, estimate
from triax.costs.pipeline_math import microbatch_constraint
from triax.planner.op_costs import measured_bubble
from triax.costs.workload import Layout, Workload
from triax.units import decimal_bytes


@dataclass(frozen=True)
class MixedPlan:
    workload: Workload
    stages: tuple[hardware.Device, ...]        # each stage's device kind, in pipeline order
    stage_devices: int                          # devices per stage (its `data`)
    layout: Layout                              # the uneven layout (stage_layers set)
    seconds_per_layer: tuple[float, ...]        # per stage: one layer's compute per step
    bubble: float
    comm_s: float                               # exposed communication (the same for both)
    uneven: tuple[int, ...]
    equal: tuple[int, ...]
    by_speed: tuple[int, ...]                   # the split speed alone would choose
    memory: Memory                              # per device, every stage alike
    fits: tuple[bool, ...]                      # per stage: within its device's memory

    def step_s(self, counts) -> float:
        busy = max(c * t for c, t in zip(counts, self.seconds_per_layer))
        return busy / (1.0 - self.bubble) + self.comm_s

    @property
    def uneven_step_s(self) -> float:
        return self.step_s(self.uneven)

    @property
    def equal_step_s(self) -> float:
        return self.step_s(self.equal)

    def to_json(self) -> dict:
        lay = self.layout
        return {"mixed": True, "stages": [d.name for d in self.stages],
                "devices_per_stage": self.stage_devices, "mesh": lay.mesh_str,
                "strategy": lay.strategy.name, "schedule": lay.schedule.value,
                "microbatches": lay.microbatches, "stage_layers": list(self.uneven),
                "equal_stage_layers": list(self.equal),
                "speed_only_stage_layers": list(self.by_speed),
                "seconds_per_layer": list(self.seconds_per_layer), "bubble": self.bubble,
                "exposed_comm_s": self.comm_s,
                "predicted_step_s": self.uneven_step_s,
                "predicted_equal_step_s": self.equal_step_s,
                "timing": "modelled", "memory_per_device": self.memory.as_dict(),
                "fits": list(self.fits)}

    def describe(self) -> str:
        lay, S = self.layout, len(self.stages)
        kinds = ", ".join(f"stage {s}: {d.name}" for s, d in enumerate(self.stages))
        per = ", ".join(f"{t * 1e3:.3g} ms" for t in self.seconds_per_layer)
        fits = "fits" if all(self.fits) else "does NOT fit"
        layers = ",".join(map(str, self.uneven))
        capped = "" if self.by_speed == self.uneven else (
            f" (by speed alone {','.join(map(str, self.by_speed))}: the longest stage is "
            f"shortened until the memory fits)")
        return "\n".join([
            f"Mixed generations: {S} pipeline stages of {self.stage_devices} device(s) each "
            f"({kinds}); {lay.mesh_str} {lay.strategy.name}, {lay.schedule.value} "
            f"M={lay.microbatches}.",
            f"  Layers per stage: {layers}{capped}; equal: {','.join(map(str, self.equal))}. "
            f"One layer's compute per step, by stage: {per}.",
            f"  Predicted step: {self.uneven_step_s * 1e3:.4g} ms uneven against "
            f"{self.equal_step_s * 1e3:.4g} ms with equal stages (bubble "
            f"{self.bubble:.1%}, exposed communication {self.comm_s * 1e3:.3g} ms).",
            "  The timing is modelled (the planner's compute and link model, the slowest "
            "stage setting the pace), not measured.",
            f"  Memory: {decimal_bytes(self.memory.total)} per device on every stage (the "
            f"executor pads each stage to the longest's {max(self.uneven)} layers); {fits} "
            + ", ".join(f"{d.name} {decimal_bytes(d.memory)}" for d in self.stages) + ". "
            "Modelled too (compiled peaks within 8% of it on tiny and small, "
            "docs/planner.md): --plan auto --plan-gpu compiles it before it runs.",
            f"  Run it: --mesh {lay.mesh_str} --strategy {lay.strategy.name} --schedule "
            f"{lay.schedule.value} --microbatches {lay.microbatches} --stage-layers {layers}"])


def stages_of(groups) -> tuple[tuple[hardware.Device, ...], int]:
    """Each stage's device kind and the devices per stage: the groups' counts' greatest
    common divisor (every stage runs on the same mesh)."""
    per = math.gcd(*(n for _, n in groups))
    return tuple(d for d, n in groups for _ in range(n // per)), per


def plan_mixed(w: Workload, groups, strategy: str = "fsdp",
               schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
               microbatches: Optional[int] = None,
               catalog: Optional[hardware.Catalog] = None) -> MixedPlan:
    """The uneven split for ``groups`` (``hardware.parse_gpu``'s), the predicted step against
    equal stages, and the memory per device (module docstring)."""
    if w.cfg is None or not w.train:
        raise ValueError("mixed generations are sized for training a model: give --model "
                         "(or --model-dir) and --train")
    stages, per = stages_of(groups)
    S, L = len(stages), w.cfg.num_layers
    if S < 2:
        raise ValueError(f"--gpu {groups[0][0].name}:{groups[0][1]} is one group: give two or "
                         f"more kinds (e.g. h100-80gb:8,a100-80gb:8), or --gpus-per-node "
                         f"and --nodes for one kind")
    if schedule.split_backward or schedule in (ScheduleKind.INTERLEAVED,
                                               ScheduleKind.FORWARD_ONLY):
        raise StageCountsError(f"uneven stages run gpipe or 1f1b, not {schedule.value}")
    M = microbatches or default_microbatches(S)
    reason = microbatch_constraint(schedule, S, M)
    if reason:
        raise ValueError(reason)
    equal_lay = Layout(data=per, pipe=S, strategy=strategy, schedule=schedule, microbatches=M)
    cat = catalog or hardware.Catalog()
    per_kind = {}
    for d in set(stages):   # the kind's own step model of the layout, equal stages
        res = evaluate(w, equal_lay, cat.cluster(d.name, per, S))
        longest = max(equal_counts(L, S))
        per_kind[d.name] = (res.compute_time_s / longest,
                            res.step_time_s - res.compute_time_s / (1.0 - res.bubble))
    seconds = tuple(per_kind[d.name][0] for d in stages)
    comm = max(c for _, c in per_kind.values())
    bubble = measured_bubble(schedule, S, M, 1, w.remat)
    equal = equal_counts(L, S)
    by_speed = split_by_time(L, seconds)
    cap = max(by_speed)
    while cap >= max(equal):   # shorten the longest stage until every stage's memory fits
        counts = split_by_time(L, seconds, (cap,) * S)
        lay = Layout(data=per, pipe=S, strategy=strategy, schedule=schedule, microbatches=M,
                     stage_layers=counts)
        mem = estimate(w, lay)
        if all(mem.total <= d.memory for d in stages):
            break
        cap -= 1
    return MixedPlan(w, stages, per, lay, seconds, bubble, comm, counts, equal, by_speed, mem,
                     tuple(mem.total <= d.memory for d in stages))
