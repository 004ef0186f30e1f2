"""``triax.auto_trainer``: a user's model, where the planner has no formulas, laid out by
compiling (``Trainer.for_model`` with the mesh and strategy chosen).

Every strategy × ``data × tensor`` mesh over the devices present (the model's own rules
added to each preset, as ``Trainer`` does) is AOT-compiled on abstract inputs
(``Trainer.lower(example_batch)``: nothing allocated) and scored from the compiled program:
its per-device peak (``memory_analysis``) against the budget less ``auto.FIT_MARGIN``, and
its modelled step time, the HLO's FLOPs at the device's peak plus each mesh axis's
collective bytes (``sharding.introspect``'s HLO parser) over that axis's link in the
hardware catalogue (``costs.comm.axis_links``). The fastest that fits is chosen. Results
are cached by (model, mesh, strategy, batch shapes), so a second call compiles nothing.

Pipelined layouts are not searched here: a pipeline needs the model's stage protocol and a
schedule (give ``pipeline=PipelineConfig(...)`` with a mesh of your choice).

    >>> [f"{m['data']}x{m['tensor']} {s}" for m, s in candidates(4)]
    ['4x1 dp', '4x1 fsdp', '4x1 zero1', '2x2 tp', '2x2 fsdp_tp', '1x4 tp']
    >>> trainer = auto_trainer(make_model, loss_fn, example_batch=batch,       # doctest: +SKIP
    ...                        device_memory="2GiB")
    >>> print(trainer.auto.describe())                                          # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from triax.mesh import make_mesh
from triax.planner.auto import Budget, NoPlanFits, budget_for, present_cluster
from triax.costs.comm import axis_links
from triax.costs.workload import Layout, divisors
from triax.sharding.introspect import bytes_over, collectives_from_compiled, memory_from_compiled
from triax.sharding.rules import ShardingError
from triax.training.step import Trainer
from triax.training.user_model import UserModel
from triax.units import human_bytes

# What a compile found, per (model, mesh sizes, strategy, batch shapes, trainer keywords).
_COMPILED: dict = {}
COUNTS = {"compiles": 0}   # how many compiles this process ran (a second call adds none)


@dataclass(frozen=True)
class Scored:
    """One candidate's compiled figures (``peak`` None: it could not be built)."""

    mesh: tuple[tuple[str, int], ...]
    strategy: str
    peak: Optional[int] = None
    flops: float = 0.0
    comm_bytes: tuple[tuple[str, int], ...] = ()
    step_s: float = float("inf")
    why: str = ""

    def label(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.mesh if n > 1) + f" {self.strategy}"

    def to_json(self) -> dict:
        return {"mesh": dict(self.mesh), "strategy": self.strategy, "compiled_peak_bytes":
                self.peak, "flops": self.flops, "comm_bytes": dict(self.comm_bytes),
                "modelled_step_s": self.step_s, "why": self.why or None}


@dataclass
class ModelChoice:
    """The chosen layout, why, the runner-up and what was refused."""

    chosen: Scored
    budget: Budget
    devices: str
    runner_up: Optional[Scored] = None
    refused: list[Scored] = field(default_factory=list)
    speeds: str = ""

    def reasons(self) -> list[str]:
        c, b = self.chosen, self.budget
        out = [f"{c.label()} on {self.devices}.", f"Budget: {b.describe()}.",
               f"Why: the fastest compiled candidate that fits: {c.step_s * 1e3:.3g} ms per "
               f"step modelled ({c.flops:.3g} FLOPs and collective bytes "
               f"{dict(c.comm_bytes) or 'none'} priced with {self.speeds}), compiled peak "
               f"{human_bytes(c.peak)} per device within {human_bytes(b.usable)}."]
        if self.runner_up:
            r = self.runner_up
            out.append(f"Runner-up: {r.label()}, {r.step_s * 1e3:.3g} ms modelled, "
                       f"{human_bytes(r.peak)} compiled.")
        out += [f"Refused: {r.label()}: {r.why}." for r in self.refused]
        return out

    def describe(self) -> str:
        lines = self.reasons()
        return "\n".join(["triax plan auto: " + lines[0], *("  " + s for s in lines[1:])])

    def to_json(self) -> dict:
        return {**self.chosen.to_json(), "budget_bytes": self.budget.bytes,
                "usable_bytes": self.budget.usable, "budget_source": self.budget.source,
                "devices": self.devices,
                "runner_up": self.runner_up.to_json() if self.runner_up else None,
                "refused": [r.to_json() for r in self.refused]}


def candidates(n: int) -> list[tuple[dict, str]]:
    """(mesh sizes, strategy) for ``n`` devices: every data × tensor split, with the
    strategies that use its axes (data alone: dp, fsdp, zero1; with tensor: tp, fsdp_tp)."""
    out = []
    for tensor in divisors(n):
        data = n // tensor
        names = ("dp", "fsdp", "zero1") if tensor == 1 else (
            ("tp", "fsdp_tp") if data > 1 else ("tp",))
        out += [({"data": data, "tensor": tensor}, s) for s in names if data > 1 or s != "zero1"]
    return out


def _shapes(batch) -> tuple:
    return tuple(sorted((k, tuple(jnp.shape(v)), str(jnp.result_type(v)))
                        for k, v in batch.items()))


def _score(trainer_for, model, sizes: dict, strategy: str, batch, kw_key, cluster) -> Scored:
    mesh_key = tuple(sizes.items())
    key = (model, mesh_key, strategy, _shapes(batch), kw_key)
    if key in _COMPILED:
        return _COMPILED[key]
    rows = len(next(iter(batch.values())))
    if rows % sizes["data"]:
        out = Scored(mesh_key, strategy, why=f"the batch of {rows} does not split over "
                                             f"data={sizes['data']}")
    else:
        try:
            trainer = trainer_for(make_mesh(**sizes), strategy)
            compiled = trainer.lower(batch).compile()
            COUNTS["compiles"] += 1
        except (ShardingError, ValueError) as e:
            out = Scored(mesh_key, strategy, why=f"cannot split: {e}")
        else:
            out = _figures(compiled, trainer.mesh, mesh_key, strategy, cluster)
    _COMPILED[key] = out
    return out


def _figures(compiled, mesh, mesh_key, strategy, cluster) -> Scored:
    mem = memory_from_compiled(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float((cost or {}).get("flops", 0.0))
    cols = collectives_from_compiled(compiled, mesh)
    comm = {a: bytes_over(cols, axis=a, unknown="at_most")
            for a in sorted({a for c in cols for a in c.axes})}
    links = axis_links(Layout(**dict(mesh_key)), cluster)
    step = flops / cluster.device.peak_flops("fp32") + sum(
        b / links[a].bandwidth + links[a].latency for a, b in comm.items() if b)
    return Scored(mesh_key, strategy, mem.peak_bytes, flops, tuple(comm.items()), step)


def auto_trainer(make_model: Callable, loss_fn: Optional[Callable], *,
                 example_batch, device_memory: Optional[str] = None,
                 rules: Optional[dict] = None, default: Optional[str] = None, **kw) -> Trainer:
    """``Trainer.for_model``'s Trainer on the mesh and strategy chosen here: every candidate
    compiled on ``example_batch``'s shapes (arrays or ShapeDtypeStructs), the fastest whose
    compiled peak fits ``device_memory`` (e.g. ``"2GiB"``; default what a device has) built;
    its report is ``trainer.auto``. ``kw``: the constructor's (no ``pipeline``)."""
    if kw.get("pipeline") is not None:
        raise ValueError("auto_trainer chooses the mesh and strategy of an unpipelined step: "
                         "give a pipeline with a mesh of your choice to Trainer.for_model")
    model = UserModel.of(make_model, loss_fn, rules, default)
    choice = choose_for_model(model, lambda m, s: Trainer(model, m, s, **kw), example_batch,
                              device_memory, kw_key=tuple(sorted(kw.items())))
    trainer = Trainer(model, make_mesh(**dict(choice.chosen.mesh)), choice.chosen.strategy, **kw)
    trainer.auto = choice
    return trainer


def choose_for_model(model, trainer_for, example_batch, device_memory: Optional[str] = None,
                     budget: Optional[Budget] = None, kw_key=()) -> ModelChoice:
    """Compile every candidate of ``candidates(devices)`` for a ``UserModel`` (``model``,
    the cache key; ``trainer_for(mesh, strategy)`` builds its Trainer) and choose."""
    budget = budget or budget_for(device_memory)
    cluster, speeds = present_cluster()
    n = jax.device_count()
    devices = f"{n} × {jax.devices()[0].device_kind}"
    scored = [_score(trainer_for, model, sizes, s, example_batch, kw_key, cluster)
              for sizes, s in candidates(n)]
    fits = sorted((x for x in scored if x.peak is not None and x.peak <= budget.usable),
                  key=lambda x: (x.step_s, x.peak))
    refused = [x if x.peak is None else
               Scored(x.mesh, x.strategy, x.peak, x.flops, x.comm_bytes, x.step_s,
                      f"compiled peak {human_bytes(x.peak)} > {human_bytes(budget.usable)}")
               for x in scored if x.peak is None or x.peak > budget.usable]
    if not fits:
        built = [x for x in scored if x.peak is not None]
        if not built:
            raise NoPlanFits("plan='auto': no layout of the model builds on "
                             f"{devices}: " + "; ".join(f"{x.label()}: {x.why}" for x in scored))
        small = min(built, key=lambda x: x.peak)
        raise NoPlanFits(
            f"plan='auto': nothing fits: the smallest layout, {small.label()}, needs "
            f"{human_bytes(small.peak)} per device (compiled) against "
            f"{human_bytes(budget.usable)} usable ({budget.describe()}). To fit, try: more "
            f"devices (about {-(-small.peak // budget.usable)}× this memory in all); a "
            f"smaller example batch or shorter inputs; LoRA (only adapters train); "
            f"rematerialising the blocks (nnx.remat)")
    return ModelChoice(fits[0], budget, devices, fits[1] if len(fits) > 1 else None,
                       refused, speeds)
