"""``--plan auto --plan-gpu KIND:N,KIND:N``: a mixed-generation run, laid out by
``planner.mixed`` (one pipeline stage per group, the layers sized by each kind's speed within
every group's memory) and proved by compile like every auto plan.

The groups' devices are this process's (their count must be JAX's; simulated CPU devices
stand in for them, as for ``triax plan --verify``). The uneven split ``plan_mixed`` gives is
compiled on abstract inputs (``build_run``; nothing allocated): every stage runs the same
program, padded to the longest stage, so the compiled peak per device is each stage's and must
fit the smallest group's memory less ``auto.FIT_MARGIN`` (``--device-memory`` when given).
Where it does not, the equal split (the least any stage holds) is compiled next; where neither
fits, nothing is run.

    >>> from triax.training.config import RunConfig
    >>> run = RunConfig(model="tiny", batch_size=8, seq_len=16, plan="auto",
    ...                 plan_gpu="h100-80gb:4,a100-80gb:4")
    >>> choice = choose_mixed(run, frozenset({"model"}))      # doctest: +SKIP
    >>> choice.run.stage_layers                                 # doctest: +SKIP
    '3,1'
"""
from __future__ import annotations

from typing import Optional

import jax

from triax.costs import hardware
from triax.costs.workload import Workload
from triax.pipeline import ScheduleKind
from triax.planner.auto import (FIT_MARGIN, AutoChoice, Budget, NoPlanFits, Refused,
                                 kept_plan)
from triax.planner.mixed import MixedPlan, plan_mixed
from triax.sharding.introspect import memory_from_compiled
from triax.sharding.rules import ShardingError
from triax.training.config import RunConfig
from triax.units import human_bytes


def mixed_groups(run: RunConfig) -> tuple:
    """``--plan-gpu``'s groups (``hardware.parse_gpu``), its errors naming this flag."""
    try:
        return hardware.parse_gpu(run.plan_gpu)
    except ValueError as e:
        raise ValueError(str(e).replace("--gpu", "--plan-gpu", 1)) from None


def mixed_budget(groups, device_memory: Optional[str]) -> Budget:
    """Every stage holds the same bytes: the smallest group's memory bounds them all
    (``--device-memory`` instead, when given)."""
    if device_memory is not None:
        from triax.costs.fits import device_capacity
        cap = device_capacity(device_memory)
        return Budget(int(cap[0]), cap[1])
    d = min((d for d, _ in groups), key=lambda d: d.memory)
    return Budget(int(d.memory), f"the smallest memory of the --plan-gpu groups, {d.name}'s")


def _candidate(run: RunConfig, m: MixedPlan, counts) -> RunConfig:
    lay = m.layout
    return run.replace(mesh=lay.mesh_str, strategy=lay.strategy.name,
                       schedule=lay.schedule.value, microbatches=lay.microbatches,
                       stage_layers=",".join(map(str, counts)))


def choose_mixed(run: RunConfig, given: frozenset, cfg=None) -> AutoChoice:
    """The uneven-stage run for ``run.plan_gpu``'s groups, its compiled peak within the
    budget (module doc); raises ``NoPlanFits`` when neither split's compile fits."""
    from triax.training.setup import build_run   # builds steps: imported where it compiles
    kept = kept_plan(run)
    if kept is not None:   # --resume: the split saved with the checkpoint
        budget = mixed_budget(mixed_groups(run), run.device_memory)
        return AutoChoice(kept[0], budget, run.plan_gpu, run.objective, reasons=[kept[1]])
    if run.objective != "throughput":
        raise ValueError(f"--objective {run.objective}: training ranks by throughput")
    cfg = run.model_config() if cfg is None else cfg
    groups = mixed_groups(run)
    n = jax.device_count()
    if sum(c for _, c in groups) != n:
        raise ValueError(f"--plan-gpu {run.plan_gpu}: {sum(c for _, c in groups)} devices, but "
                         f"JAX has {n}; give groups that add up to the devices present "
                         f"(simulated ones stand in: JAX_NUM_CPU_DEVICES)")
    for flag in ("mesh", "stage_layers", "offload"):
        if flag in given:
            raise ValueError(f"--{flag.replace('_', '-')} does not go with --plan-gpu: the "
                             f"groups lay out the stages (pipelined, on the devices)")
    w = Workload.of_run(run, cfg, backend=jax.devices()[0].platform)
    m = plan_mixed(w, groups, run.strategy if "strategy" in given else "fsdp",
                   ScheduleKind.parse(run.schedule) if "schedule" in given
                   else ScheduleKind.ONE_F_ONE_B,
                   run.microbatches if "microbatches" in given and run.microbatches else None)
    budget = mixed_budget(groups, run.device_memory)
    devices = ", ".join(f"{c} × {d.name}" for d, c in groups) + \
        f" (on {n} × {jax.devices()[0].device_kind})"
    choice = AutoChoice(run, budget, devices, run.objective)
    tried = [m.uneven] + ([m.equal] if m.equal != m.uneven else [])
    for counts in tried:
        candidate = _candidate(run, m, counts)
        try:
            mem = memory_from_compiled(build_run(candidate, cfg).compiled.step)
        except (ValueError, ShardingError) as e:
            raise NoPlanFits(f"--plan auto --plan-gpu: {candidate.mesh} with stage layers "
                             f"{candidate.stage_layers} does not build: {e}") from None
        if mem.peak_bytes > budget.usable:
            choice.refused.append(Refused(None, f"stage layers {candidate.stage_layers}: "
                                                f"compiled peak {human_bytes(mem.peak_bytes)} "
                                                f"> {human_bytes(budget.usable)}",
                                          mem.peak_bytes))
            continue
        choice.run, choice.compiled, choice.mixed = candidate, mem, m
        choice.reasons = _reasons(choice, m, counts)
        return choice
    raise NoPlanFits(f"--plan auto --plan-gpu {run.plan_gpu}: nothing fits "
                     f"{budget.describe()}: " + "; ".join(x.why for x in choice.refused)
                     + ". To fit, try: --remat full, a smaller --batch-size, more devices "
                       "per group")


def _reasons(c: AutoChoice, m: MixedPlan, counts) -> list[str]:
    lay, r = m.layout, c.run
    equal = counts == m.equal and m.equal != m.uneven
    out = [f"{r.mesh} {r.strategy}, {r.schedule} M={r.microbatches}, stage layers "
           f"{r.stage_layers}, remat {r.remat} for {c.devices}.",
           f"Budget: {c.budget.describe()}.",
           (f"Why: the groups' speeds split the layers {','.join(map(str, m.uneven))} "
            f"(planner.mixed: {m.uneven_step_s * 1e3:.4g} ms per step modelled against "
            f"{m.equal_step_s * 1e3:.4g} ms with equal stages, the timing modelled, not "
            f"measured)" + (", but that split's compile did not fit, so the equal one runs"
                            if equal else "")
            + f"; its compiled peak is {human_bytes(c.compiled.peak_bytes)} per device on "
              f"every stage (predicted {human_bytes(m.memory.modelled)} before the "
              f"planner's fixed overhead, which the budget pays), within the usable "
              f"{human_bytes(c.budget.usable)} ({FIT_MARGIN:.0%} margin)."),
           "Stages: " + ", ".join(f"{s}: {d.name}" for s, d in enumerate(m.stages))
           + f"; {lay.data} device(s) each."]
    for x in c.refused:
        out.append(f"Refused: {x.why}.")
    return out
