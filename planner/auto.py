"""``--plan auto``: the planner's ranking, proved by compiling, for the devices present.

The planner ranks every layout the flags leave open (``search``) with the speeds of the
devices present (their catalogue entry, or the reference GPU's where the kind is not
catalogued: the speeds only rank, memory decides). The candidates are then AOT-compiled in
turn on abstract inputs (``build_run`` → ``memory_analysis``; nothing is allocated), and the
first whose compiled peak per device fits the budget less ``FIT_MARGIN`` is chosen. Its
``RunConfig`` is what runs (and what the checkpoint saves, so ``--resume`` keeps it).

The budget is ``--device-memory`` when given, else what a device has
(``costs.fits.device_capacity``: the allocator's limit, or on simulated CPU
devices the host's available memory divided among them); the report says which.

    >>> from triax.training.config import RunConfig
    >>> run = RunConfig(model="tiny", num_layers=2, batch_size=8, seq_len=16, plan="auto",
    ...                 device_memory="64MiB")
    >>> choice = choose_train(run, given=frozenset({"model", "num_layers"}))  # doctest: +SKIP
    >>> choice.compiled.peak_bytes <= choice.budget.usable                      # doctest: +SKIP
    True
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import jax

from triax.choices import FP8
from triax.mesh import parse_mesh
from triax.planner.evaluate import PlanResult
from triax.costs.fits import device_capacity
from triax.costs.hardware import Catalog, Cluster, load_catalog
from triax.costs.memory import Assumptions
from triax.costs.offload import offload_reason
from triax.planner.recommend import offload_reasoning
from triax.planner.search import search
from triax.planner.verify import LAYOUT_FIELDS, layout_fields
from triax.costs.workload import Workload
from triax.sharding.introspect import MemoryReport, memory_from_compiled
from triax.sharding.rules import ShardingError
from triax.training.config import RunConfig
from triax.units import human_bytes

if TYPE_CHECKING:   # auto_mixed sets it; imported here only for the annotation
    import triax.planner.mixed

# Headroom kept below the budget: the allocator's fragmentation and the runtime's own
# buffers (collective scratch, the host transfer of a batch) are not in memory_analysis.
FIT_MARGIN = 0.10
# Compiles tried before giving up (each is a whole step's compile).
MAX_COMPILES = 6
# A plan the model puts over the budget is still compiled when it is over by at most this
# fraction (the model's memory is within a few percent of the compile's on the presets:
# bench/planner_verify.py); further over, the compile is not worth its time.
MODEL_SLACK = 0.25
# Whose speeds rank the plans when the devices present are not in the catalogue.
REFERENCE_DEVICE = "h100-80gb"


class NoPlanFits(ValueError):
    """No layout of this workload fits the devices' memory (found before allocating)."""


@dataclass(frozen=True)
class Budget:
    """What one device may use: ``bytes`` (from ``source``), less ``FIT_MARGIN``."""

    bytes: int
    source: str

    @property
    def usable(self) -> int:
        return int(self.bytes * (1.0 - FIT_MARGIN))

    def describe(self) -> str:
        return (f"{human_bytes(self.bytes)} per device ({self.source}), "
                f"{human_bytes(self.usable)} usable after a {FIT_MARGIN:.0%} margin")


def budget_for(device_memory: Optional[str]) -> Budget:
    """The budget of one device: ``--device-memory`` or what the device has."""
    cap = device_capacity(device_memory)
    if cap is None:
        raise ValueError(f"--plan auto: {jax.devices()[0].device_kind} reports no memory "
                         f"limit; give --device-memory, e.g. --device-memory 40GiB")
    return Budget(int(cap[0]), cap[1])


def catalogue_device(kind: str, catalog: Optional[Catalog] = None) -> Optional[str]:
    """The catalogue name whose parts all appear in a JAX ``device_kind`` ("NVIDIA H100 80GB
    HBM3" → h100-80gb), the longest such; None when none does (CPU, an unknown part).

    >>> [catalogue_device(k) for k in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
    ...                                "NVIDIA A100-SXM4-40GB", "NVIDIA H200", "cpu")]
    ['h100-80gb', 'h100-pcie', 'a100-40gb', 'h200', None]
    """
    names = (catalog or load_catalog()).devices
    kind = kind.lower()
    hits = [n for n in names if all(part in kind for part in n.split("-"))]
    return max(hits, key=len, default=None)


def present_cluster(catalog: Optional[Catalog] = None) -> tuple[Cluster, str]:
    """The devices present as a planner cluster (memory left unbounded: the budget decides
    fit), and a sentence saying whose speeds rank the plans."""
    catalog = catalog or load_catalog()
    kind = jax.devices()[0].device_kind
    name = catalogue_device(kind, catalog)
    speeds = f"{name}'s catalogue speeds" if name else (
        f"the {REFERENCE_DEVICE}'s speeds (the {kind} is not in the catalogue; speeds only "
        f"rank, memory decides what fits)")
    device = dataclasses.replace(catalog.device(name or REFERENCE_DEVICE),
                                 name=f"this device ({kind})", memory=float("inf"))
    cluster = Catalog(devices={device.name: device}, links=catalog.links).cluster(
        device.name, jax.local_device_count(), jax.process_count())
    return cluster, speeds


# Host offload the search offers when no plan keeps the state on the device: the optimizer
# state (its moments cross the link), then the parameters too.
OFFLOADS = (("optimizer",), ("optimizer", "params"))


@functools.lru_cache(maxsize=16)
def _searched(w: Workload, cluster: Cluster, remats: tuple[str, ...],
              offloads: tuple[tuple[str, ...], ...] = ((),),
              precisions: tuple[str, ...] = ()) -> tuple[PlanResult, ...]:
    # One search per workload and devices: each budget only draws its line through it.
    # The budget is what the allocator gives, so the planner's fixed overhead is paid.
    res = search(w, cluster, Assumptions(overhead_bytes=0), remats=remats, offloads=offloads,
                 precisions=precisions)
    return tuple(res.fitting)


@dataclass
class Refused:
    plan: PlanResult
    why: str
    compiled_peak: Optional[int] = None   # None: not compiled (the build refused it)


@dataclass
class AutoChoice:
    """The chosen run, why, the runner-up and what was refused (the ``--plan auto`` report)."""

    run: RunConfig
    budget: Budget
    devices: str
    objective: str
    plan: Optional[PlanResult] = None           # None: the plan was kept from a checkpoint
    compiled: Optional[MemoryReport] = None
    runner_up: Optional[PlanResult] = None
    refused: list[Refused] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    mixed: Optional["triax.planner.mixed.MixedPlan"] = None   # --plan-gpu's (auto_mixed)

    def to_json(self) -> dict:
        r = self.run
        p = self.plan
        return {"mesh": r.mesh, "strategy": r.strategy,
                "schedule": r.schedule if _pipe(r) > 1 else None,
                "microbatches": r.microbatches if _pipe(r) > 1 else None,
                "virtual": r.virtual if _pipe(r) > 1 else None,
                "remat": r.remat, "loss_chunks": r.loss_chunks, "precision": r.precision,
                "context_attention": r.context_attention if _axis(r, "context") > 1 else None,
                "tp_overlap": r.tp_overlap, "offload": r.offload or None,
                "predicted_host_bytes": int(p.memory.host) if p else None,
                "compiled_host_bytes": self.compiled.host_argument_bytes
                if self.compiled else None,
                "predicted_peak_bytes": int(p.memory.total) if p else
                (int(self.mixed.memory.modelled) if self.mixed else None),
                "predicted_step_s": p.step_time_s if p else None,
                "compiled_peak_bytes": self.compiled.peak_bytes if self.compiled else None,
                "budget_bytes": self.budget.bytes, "usable_bytes": self.budget.usable,
                "margin": FIT_MARGIN, "budget_source": self.budget.source,
                "devices": self.devices, "objective": self.objective,
                "runner_up": _brief(self.runner_up) if self.runner_up else None,
                "refused": [{**(_brief(x.plan) if x.plan else {}),
                             "compiled_peak_bytes": x.compiled_peak, "why": x.why}
                            for x in self.refused],
                "stage_layers": r.stage_layers,
                "mixed": self.mixed.to_json() if self.mixed else None,
                "reasons": self.reasons}

    def describe(self) -> str:
        return "\n".join(["triax --plan auto: " + self.reasons[0], *("  " + s for s in
                                                                   self.reasons[1:])])


def _axis(run: RunConfig, name: str) -> int:
    return parse_mesh(run.mesh).get(name, 1) if run.mesh else 1


def _pipe(run: RunConfig) -> int:
    return _axis(run, "pipe")


def _brief(p: PlanResult) -> dict:
    return {"plan": label(p), "predicted_peak_bytes": int(p.memory.total),
            "predicted_step_s": p.step_time_s}


def label(p: PlanResult) -> str:
    """A plan in words: ``data=4,tensor=2 fsdp_tp, remat none``."""
    return f"{p.layout.describe()}, {p.workload.run_label}"


def matches(p: PlanResult, run: RunConfig, given: frozenset, devices: int) -> bool:
    """Whether plan ``p`` keeps every layout flag the user gave (``given``) as given."""
    lay, w = p.layout, p.workload
    if "mesh" in given and run.mesh:
        want = parse_mesh(run.mesh)
        if -1 in want.values():   # one axis takes the remaining devices
            rest = devices // max(1, -math.prod(want.values()))
            want = {a: (rest if n == -1 else n) for a, n in want.items()}
        if {a: n for a, n in want.items() if n > 1} != {a: n for a, n in lay.sizes.items()
                                                        if n > 1}:
            return False
    piped = lay.pipe > 1
    checks = {"strategy": lay.strategy.name == run.strategy, "remat": w.remat == run.remat,
              "loss_chunks": w.loss_chunks == run.loss_chunks,
              "schedule": not piped or lay.schedule.value == run.schedule,
              "microbatches": not piped or run.microbatches in (0, lay.microbatches),
              "virtual": not piped or lay.virtual == run.virtual,
              "context_attention": lay.context == 1
              or lay.context_attention == run.context_attention,
              "tp_overlap": lay.tp_overlap == run.tp_overlap,
              "offload": lay.offload == run.offload_targets()}
    return all(ok for name, ok in checks.items() if name in given)


def choose_train(run: RunConfig, given: frozenset, cfg=None,
                 budget: Optional[Budget] = None,
                 cluster: Optional[tuple[Cluster, str]] = None) -> AutoChoice:
    """The training run ``--plan auto`` runs: the flags in ``given`` stay as given, the
    search fills in the other layout fields (``verify.LAYOUT_FIELDS``); see the module doc.
    ``cluster``: the devices to rank for and whose speeds (default ``present_cluster()``:
    this process's devices, one node per process); its device count must be JAX's."""
    if run.objective != "throughput":
        raise ValueError(f"--objective {run.objective}: training ranks by throughput (tokens "
                         f"per second); --objective latency is for generate and serve")
    if run.plan_gpu:
        raise ValueError("--plan-gpu: mixed generations are laid out by "
                         "planner.auto_mixed.choose_mixed, not choose_train")
    cfg = run.model_config() if cfg is None else cfg
    budget = budget or budget_for(run.device_memory)
    n = jax.device_count()
    devices = f"{n} × {jax.devices()[0].device_kind}"
    kept = kept_plan(run)
    if kept is not None:
        saved, why = kept
        return AutoChoice(saved, budget, devices, run.objective, reasons=[why])
    cluster, speeds = cluster or present_cluster()
    if cluster.devices != n:
        raise ValueError(f"--plan auto: the cluster has {cluster.devices} devices, JAX {n}")
    w = Workload.of_run(run, cfg, backend=jax.devices()[0].platform)
    remats = (run.remat,) if "remat" in given else ("none", "full")
    kept_off = ((run.offload_targets(),) if "offload" in given else ((),))
    # fp8 lowers the precision: a candidate only when the user opts in (--allow-fp8)
    precisions = (FP8,) if run.allow_fp8 else ()
    ranked = [p for p in _searched(w, cluster, remats, kept_off, precisions)
              if matches(p, run, given, n)]
    if not ranked:
        fixed = ", ".join(f"--{f.replace('_', '-')} {getattr(run, f)}"
                          for f in LAYOUT_FIELDS if f in given)
        raise NoPlanFits(f"--plan auto: no layout of {cfg.name} on {devices} keeps the flags "
                         f"you fixed ({fixed or 'none'}) and splits the batch of "
                         f"{run.batch_size}; drop a fixed flag or change --batch-size")
    choice = AutoChoice(run, budget, devices, run.objective)
    over = _prove(choice, ranked, cfg, speeds)
    # Offload costs host-link time every step: offered only when no plan keeps the state on
    # the device (by compile), and only when --offload was not given.
    if choice.plan is None and "offload" not in given and offload_reason(w) is None:
        offloaded = [p for p in _searched(w, cluster, remats, OFFLOADS, precisions)
                     if matches(p, run, given, n)]
        over += _prove(choice, offloaded, cfg, speeds,
                       f"no plan of the {len(ranked)} that keep the state on the device fits "
                       f"the budget (by its compile, or within {MODEL_SLACK:.0%} by the "
                       f"model), so host offload was searched; ")
    if choice.plan is not None:
        return choice
    raise NoPlanFits(_nothing_fits(cfg.name, devices, budget, choice.refused, over, given, run))


def _prove(choice: AutoChoice, ranked: list, cfg, speeds: str, why: str = "") -> list:
    """Compile ``ranked``'s candidates in turn until one's peak fits ``choice.budget``: the
    model's fits first (its ranking), then the rest smallest first (the compile has the last
    word, so a plan the model overrates is still tried). Sets the choice on ``choice``;
    returns the plans over the model's budget (for the nothing-fits message)."""
    from triax.training.setup import build_run   # builds steps: imported where it compiles
    budget, run = choice.budget, choice.run
    fit = [p for p in ranked if p.memory.total <= budget.usable]
    over = sorted((p for p in ranked if p.memory.total > budget.usable),
                  key=lambda p: p.memory.total)
    near = [p for p in over if p.memory.total <= budget.usable * (1 + MODEL_SLACK)]
    for p in (fit + near)[:MAX_COMPILES]:
        candidate = run.replace(**layout_fields(p.workload, p.layout))
        try:
            mem = memory_from_compiled(build_run(candidate, cfg).compiled.step)
        except (ValueError, ShardingError) as e:
            choice.refused.append(Refused(p, f"not buildable: {e}"))
            continue
        if mem.peak_bytes > budget.usable:
            choice.refused.append(Refused(p, f"compiled peak {human_bytes(mem.peak_bytes)} > "
                                             f"{human_bytes(budget.usable)}", mem.peak_bytes))
            continue
        choice.run, choice.plan, choice.compiled = candidate, p, mem
        choice.runner_up = _runner_up(p, fit)
        choice.reasons = _reasons(choice, speeds, len(ranked), len(fit), p in fit, why)
        return over
    return over


def _runner_up(p: PlanResult, fit: list) -> Optional[PlanResult]:
    """The next plan by the ranking that is laid out differently (not only another remat or
    loss-chunk count of the chosen layout, when there is one)."""
    after = fit[fit.index(p) + 1:] if p in fit else []
    return next((q for q in after if q.layout != p.layout), after[0] if after else None)


def _reasons(c: AutoChoice, speeds: str, searched: int, fit: int, predicted: bool,
             why: str = "") -> list[str]:
    p, b = c.plan, c.budget
    out = [f"{label(p)} on {c.devices}.",
           f"Budget: {b.describe()}.",
           f"Why: {why}of {searched} plans the flags leave open, {fit} fit by the planner's model; "
           + (f"this is the fastest of them by {c.objective} ({p.step_time_s * 1e3:.3g} ms per "
              f"step modelled with {speeds})" if predicted else
              "none compiled within the budget, and this one, over by the model, does")
           + f", and its compiled peak is {human_bytes(c.compiled.peak_bytes)} per device "
             f"(predicted {human_bytes(p.memory.total)}), within the usable "
             f"{human_bytes(b.usable)}."]
    out.extend(offload_reasoning(p))
    if c.runner_up is not None:
        q = c.runner_up
        out.append(f"Runner-up: {label(q)}, {q.step_time_s * 1e3:.3g} ms per step modelled, "
                   f"{human_bytes(q.memory.total)} predicted (not compiled).")
    for x in c.refused:
        out.append(f"Refused: {label(x.plan)}: {x.why}.")
    return out


def _nothing_fits(name: str, devices: str, b: Budget, refused: list, over: list,
                  given: frozenset, run: RunConfig) -> str:
    needs = [(x.compiled_peak, "compiled", x.plan) for x in refused if x.compiled_peak]
    needs += [(int(p.memory.total), "predicted", p) for p in over
              if all(p is not x.plan for x in refused)]
    if not needs:
        whys = "; ".join(f"{label(x.plan)}: {x.why}" for x in refused)
        return f"--plan auto: no candidate layout of {name} on {devices} builds ({whys})"
    need, how, p = min(needs, key=lambda t: t[0])
    fixes = [f"more devices (about {-(-need // b.usable)}× this memory in all)",
             f"a shorter --seq-len (now {run.seq_len})",
             "LoRA (only the adapters train: the optimizer state shrinks to theirs)"]
    if p.workload.remat != "full":   # never the setting the smallest plan already has
        fixes.append("--remat full" + (" (you fixed --remat " + run.remat + ")"
                                        if "remat" in given else ""))
    fixes.append(f"a smaller --batch-size (now {run.batch_size})")
    tried = "; ".join(f"{label(x.plan)}: {x.why}" for x in refused)
    return (f"--plan auto: nothing fits: the smallest plan of {name} on {devices}, {label(p)}, "
            f"needs {human_bytes(need)} per device ({how}) against {human_bytes(b.usable)} "
            f"usable ({b.describe()}). To fit, try: " + "; ".join(fixes) + "."
            + (f" Compiled and refused: {tried}." if tried else ""))


def kept_plan(run: RunConfig) -> Optional[tuple[RunConfig, str]]:
    """On ``--resume`` into a checkpoint: the run with the layout saved there (the plan is
    kept, not searched again), and a sentence saying so; None when there is none."""
    import os
    if not (run.resume or run.resume_from is not None) or not run.checkpoint_dir \
            or not os.path.isdir(run.checkpoint_dir):
        return None
    from triax.checkpoint.checkpointer import Checkpointer   # Orbax: only when resuming
    with Checkpointer.existing(run.checkpoint_dir) as ckpt:
        step = run.resume_from if run.resume_from is not None else ckpt.latest_step()
        if step is None:
            return None
        saved = ckpt.read_meta(step).get("run") or {}
    fields = {f: saved[f] for f in (*LAYOUT_FIELDS, "stage_layers") if f in saved}
    kept = run.replace(**fields)
    return kept, (f"kept the plan saved with checkpoint step {step} in {run.checkpoint_dir}: "
                  f"--mesh {kept.mesh} --strategy {kept.strategy} --remat {kept.remat}"
                  + (f" --schedule {kept.schedule} --microbatches {kept.microbatches}"
                     if _pipe(kept) > 1 else "")
                  + (f" --loss-chunks {kept.loss_chunks}" if kept.loss_chunks > 1 else ""))
