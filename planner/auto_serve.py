"""``--plan auto`` for serving (``triax generate``, and ``triax serve`` through the same
call): how many replicas, and each replica's ``tensor × pipe`` mesh, for the devices present.

The planner ranks every split (``evaluate`` on the inference workload: one decode step of a
replica's slots over its KV cache) by the objective: ``throughput`` (all replicas' tokens
per second) or ``latency`` (one decode step's time). The candidates are then AOT-compiled in
turn (``Engine(params=None).lower_decode()``: abstract weights and cache, nothing
allocated) and the first whose compiled peak fits the budget less ``auto.FIT_MARGIN`` is
chosen. ``mesh_sizes`` / ``replicas`` the user gives stay fixed.

    >>> list(splits(4, layers=2))     # (one replica's mesh, replicas) over 4 devices
    [({'tensor': 4}, 1), ({'pipe': 2, 'tensor': 2}, 1), ({'tensor': 2}, 2), ({'pipe': 2, 'tensor': 1}, 2), ({'tensor': 1}, 4)]
    >>> c = choose_serving(cfg, longest=8, max_new_tokens=8, slots=8,       # doctest: +SKIP
    ...                    device_memory="1GiB")
    >>> server = build_server(ServeConfig.of(model="tiny", mesh=c.mesh,    # doctest: +SKIP
    ...                                      replicas=c.replicas))
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

import jax

from triax.pipeline import ScheduleKind
from triax.planner.auto import Budget, NoPlanFits, budget_for, present_cluster
from triax.planner.evaluate import PlanResult, evaluate
from triax.costs.memory import Assumptions
from triax.costs.workload import Layout, Workload, divisors
from triax.sharding.context import check_scheme
from triax.sharding.rules import ShardingError, get_strategy
from triax.units import human_bytes
from triax.choices import SERVE_STRATEGY, SLOTS

# The budget is what the allocator gives, so the planner's fixed runtime overhead is paid.
NO_OVERHEAD = Assumptions(overhead_bytes=0)


@dataclass
class ServeChoice:
    mesh_sizes: dict            # one replica's mesh (ServeConfig's mesh: ``mesh``)
    replicas: int
    budget: Budget
    objective: str
    plan: PlanResult            # the planner's figures for one replica
    compiled_peak: int
    runner_up: Optional[tuple[dict, int, PlanResult]] = None
    refused: list = field(default_factory=list)   # (mesh, replicas, why, peak or None)

    @property
    def mesh(self) -> str:
        """``mesh_sizes`` as ``--mesh`` (and ``ServeConfig``'s mesh) writes it."""
        return ",".join(f"{a}={n}" for a, n in self.mesh_sizes.items())

    def label(self, sizes=None, replicas=None) -> str:
        sizes = self.mesh_sizes if sizes is None else sizes
        mesh = ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "one device"
        return f"{replicas or self.replicas} replica(s) of {mesh}"

    def reasons(self) -> list[str]:
        p, b = self.plan, self.budget
        score = (f"{p.tokens_per_s * self.replicas:,.0f} tokens/s modelled over all replicas"
                 if self.objective == "throughput" else
                 f"{p.step_time_s * 1e3:.3g} ms per decode step modelled")
        out = [f"{self.label()}.", f"Budget: {b.describe()}.",
               f"Why: the best by {self.objective} ({score}) whose compiled decode step peaks "
               f"at {human_bytes(self.compiled_peak)} per device (predicted "
               f"{human_bytes(p.memory.total)}), within {human_bytes(b.usable)}."]
        if self.runner_up:
            sizes, r, q = self.runner_up
            out.append(f"Runner-up: {self.label(sizes, r)}, {human_bytes(q.memory.total)} "
                       f"predicted (not compiled).")
        out += [f"Refused: {self.label(s, r)}: {why}." for s, r, why, _ in self.refused]
        return out

    def describe(self) -> str:
        lines = self.reasons()
        return "\n".join(["triax --plan auto: " + lines[0], *("  " + s for s in lines[1:])])

    def to_json(self) -> dict:
        return {"mesh": self.mesh_sizes, "replicas": self.replicas, "strategy": SERVE_STRATEGY,
                "schedule": "forward-only" if self.mesh_sizes.get("pipe", 1) > 1 else None,
                "microbatches": self.mesh_sizes.get("pipe") if self.mesh_sizes.get(
                    "pipe", 1) > 1 else None,
                "predicted_peak_bytes": int(self.plan.memory.total),
                "compiled_peak_bytes": self.compiled_peak, "budget_bytes": self.budget.bytes,
                "usable_bytes": self.budget.usable, "budget_source": self.budget.source,
                "objective": self.objective,
                "refused": [{"plan": self.label(s, r), "why": why, "compiled_peak_bytes": pk}
                            for s, r, why, pk in self.refused]}


def splits(n: int, layers: int, mesh_sizes: Optional[Mapping[str, int]] = None,
           replicas: Optional[int] = None):
    """(one replica's mesh, replicas) over ``n`` devices, keeping what is given."""
    if mesh_sizes:
        r = replicas or n // math.prod(mesh_sizes.values())
        yield dict(mesh_sizes), r
        return
    for r in ([replicas] if replicas else divisors(n)):
        m = n // r
        for p in (d for d in divisors(m) if d <= layers):
            yield ({"pipe": p, "tensor": m // p} if p > 1 else {"tensor": m}), r


def choose_serving(cfg, *, longest: int, max_new_tokens: int, slots: int = SLOTS,
                   objective: str = "throughput", device_memory: Optional[str] = None,
                   mesh_sizes: Optional[Mapping[str, int]] = None,
                   replicas: Optional[int] = None, context_attention: str = "all-gather",
                   budget: Optional[Budget] = None, max_compiles: int = 6,
                   pool: Optional[Mapping] = None) -> ServeChoice:
    """The serving layout for ``cfg`` on the devices present (see the module doc).
    ``pool``: the KV pool's size and the dtypes (``engine_config_for``'s kv_blocks,
    kv_memory, block_size, dtype, kv_dtype);
    the KV term counts each candidate's pool (``inference.kv_pool``)."""
    from triax.inference.engine import Engine      # inference sits below; built here only
    from triax.inference.generate import engine_config_for
    from triax.inference.kv_pool import kv_pool
    from triax.inference.replicas import replica_meshes
    from triax.sharding.introspect import memory_from_compiled
    budget = budget or budget_for(device_memory)
    st = dataclasses.replace(get_strategy(SERVE_STRATEGY),
                             context_attention=check_scheme(context_attention))
    cluster, _ = present_cluster()
    n = jax.device_count()
    ranked = []
    for sizes, r in splits(n, cfg.num_layers, mesh_sizes, replicas):
        ecfg = engine_config_for(cfg, sizes, longest, max_new_tokens, slots, **(pool or {}))
        try:
            kv_pool(cfg, replica_meshes(sizes, r)[0], st, ecfg)   # a pool this layout builds
        except (ValueError, ShardingError):
            continue
        w = Workload.of_engine(cfg, ecfg, backend=jax.devices()[0].platform)
        p = sizes.get("pipe", 1)
        lay = Layout(tensor=sizes.get("tensor", 1), pipe=p, data=sizes.get("data", 1),
                     context=sizes.get("context", 1), strategy=SERVE_STRATEGY,
                     schedule=ScheduleKind.FORWARD_ONLY if p > 1 else None,
                     microbatches=p, context_attention=context_attention)
        try:
            ranked.append((sizes, r, ecfg, evaluate(w, lay, cluster, NO_OVERHEAD)))
        except ShardingError:
            continue
    key = (lambda t: -t[3].tokens_per_s * t[1]) if objective == "throughput" \
        else (lambda t: t[3].step_time_s)
    ranked.sort(key=key)
    fit = [t for t in ranked if t[3].memory.total <= budget.usable]
    refused = []
    for i, (sizes, r, ecfg, p) in enumerate(fit[:max_compiles]):
        try:
            mesh = replica_meshes(sizes, r)[0]
            peak = memory_from_compiled(
                Engine(cfg, None, mesh, st, ecfg).lower_decode().compile()).peak_bytes
        except (ValueError, ShardingError) as e:
            refused.append((sizes, r, f"not buildable: {e}", None))
            continue
        if peak > budget.usable:
            refused.append((sizes, r, f"compiled peak {human_bytes(peak)} > "
                                      f"{human_bytes(budget.usable)}", peak))
            continue
        nxt = next(((s, rr, q) for s, rr, _, q in fit[i + 1:]), None)
        return ServeChoice(sizes, r, budget, objective, p, peak, nxt, refused)
    over = [t for t in ranked if t[3].memory.total > budget.usable]
    needs = [pk for *_, pk in refused if pk] + [t[3].memory.total for t in over]
    need = min(needs) if needs else None
    raise NoPlanFits(
        f"--plan auto: nothing fits: serving {cfg.name} on {n} devices needs at least "
        + (f"{human_bytes(need)} per device" if need else "a layout that builds")
        + f" against {human_bytes(budget.usable)} usable ({budget.describe()}). To fit, "
          f"try: more devices, fewer --slots, a smaller --kv-blocks or --kv-memory, a "
          f"shorter prompt or --max-new-tokens, or fewer --replicas")
