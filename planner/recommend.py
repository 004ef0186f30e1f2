"""The decision procedure: search, apply the rules, and say why in plain sentences.

Rules, in order:
  1. If the weights fit on one device, one device (inference) or data parallelism
     (training throughput) is enough; if not, never a single-device plan.
  2. If they fit within one node with fast links, tensor parallelism within the node.
  3. Otherwise pipeline stages across nodes, tensor parallelism within each node.
  4. Training adds DP or FSDP on top.
  5. Slow intra-node links (PCIe) keep TP at 2 at most when another plan fits.

    >>> from triax.models import config
    >>> from triax.costs import hardware
    >>> from triax.costs.workload import Workload
    >>> w = Workload.of(config.get("llama3-70b"), train=False, batch=8, seq=4096)
    >>> rec = plan(w, hardware.cluster("h100-80gb", 8, 1))
    >>> rec.plans[0].layout.tensor
    8
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from triax.models.loss import chunk_recompute_flops
from triax.pipeline import ScheduleKind
from triax.pipeline.pipelined import default_microbatches, unpipelinable_mesh_reason
from triax.costs.comm import crossing_axes
from triax.planner.evaluate import PlanResult, evaluate
from triax.costs.hardware import Cluster
from triax.costs.activations import logits_bytes, loss_tokens
from triax.models.lora import param_count
from triax.planner.lora_advice import lora_reasoning, lora_would_fit
from triax.costs.memory import ADAM_MOMENTS, Assumptions, min_devices_for_weights
from triax.pipeline.timeline import LABELS
from triax.planner.op_costs import op_costs_for
from triax.costs.pipeline_math import microbatch_constraint
from triax.planner.context_reasoning import context_reasoning
from triax.planner.search import context_reason, search
from triax.costs.workload import FP32, Layout, Workload
from triax.sharding.context import SCHEMES
from triax.training.config import context_fix
from triax.units import decimal_bytes

SLOW_LINK_MAX_TP = 2


@dataclass
class Recommendation:
    """What ``triax.plan`` answers: the plans ranked best first, and why."""

    workload: Workload
    cluster: Cluster
    min_devices: int
    plans: list[PlanResult]
    reasoning: list[str]
    assumptions: Assumptions = Assumptions()
    op_costs: dict = dataclasses.field(default_factory=dict)  # "zb-h1 remat=none" -> OpCosts

    def to_json(self) -> dict:
        """The recommendation as plain JSON values (``triax plan --json``)."""
        w = self.workload
        return {"model": {"name": w.name, "params": w.params, "weight_bytes": int(w.weight_bytes)},
                "cluster": self.cluster.describe(),
                "min_devices_for_weights": self.min_devices,
                "plans": [p.to_json() for p in self.plans],
                "reasoning": self.reasoning,
                "op_costs": {name: c.to_json() for name, c in self.op_costs.items()},
                "assumptions": dataclasses.asdict(self.assumptions)}


def state_bytes(w: Workload) -> float:
    """Bytes of the whole training state (or of the weights, for inference); LoRA: the
    frozen base plus the adapters with their fp32 gradients and moments."""
    if not w.train:
        return w.weight_bytes
    if w.lora is not None:
        return w.weight_bytes + param_count(w.lora, w.cfg) * (FP32 * (2 + ADAM_MOMENTS))
    per_param = FP32 + FP32 + FP32 * ADAM_MOMENTS   # fp32 params (= master), grads, mu, nu
    return w.params * per_param


def _slow_intra(cluster: Cluster) -> bool:
    return cluster.intra.name.startswith("pcie")


def _apply_rules(w: Workload, cluster: Cluster, fitting: list[PlanResult],
                 why: list[str]) -> list[PlanResult]:
    """Stable re-ranking by the rules above (each only when an alternative fits)."""
    ranked = list(fitting)
    if w.cfg is None:
        ranked.sort(key=lambda p: (p.layout.tensor * p.layout.pipe, p.step_time_s))
    node_bytes = cluster.device.memory * cluster.gpus_per_node
    if cluster.nodes > 1 and state_bytes(w) > node_bytes:
        piped = [p for p in ranked if "pipe" in crossing_axes(p.layout, cluster)]
        if piped:
            ranked = piped + [p for p in ranked if p not in piped]
            why.append(f"The {'training state' if w.train else 'weights'} "
                       f"({decimal_bytes(state_bytes(w), None)}) "
                       f"exceed{'s' if w.train else ''} one node "
                       f"({decimal_bytes(node_bytes, '.0f')}), so pipeline stages go across "
                       f"nodes with tensor parallelism inside each node.")
    if w.cfg is not None and w.cfg.moe is not None:
        ep = [p for p in ranked if p.layout.expert > 1]
        if ep:
            ranked = ep + [p for p in ranked if p not in ep]
            why.append(f"{w.cfg.moe.num_experts} experts: expert weights are split over the "
                       f"'expert' axis (tokens travel by all-to-all) rather than cut by "
                       f"tensor parallelism, which would all-reduce every expert's output.")
    if _slow_intra(cluster):
        low = [p for p in ranked if p.layout.tensor <= SLOW_LINK_MAX_TP]
        if low and len(low) < len(ranked):
            ranked = low + [p for p in ranked if p not in low]
            why.append(f"Links inside a node are {cluster.intra.name} "
                       f"({decimal_bytes(cluster.intra.bandwidth, '.0f')}/s): tensor "
                       f"parallelism is kept at {SLOW_LINK_MAX_TP} at most and pipeline stages "
                       f"are preferred.")
    return ranked


def _opening(w: Workload, cluster: Cluster, min_dev: int) -> list[str]:
    dev = cluster.device
    why = [f"{w.name}: {w.params:,} parameters, {decimal_bytes(w.weight_bytes, None)} of "
           f"{w.dtype} weights; one {dev.name} holds {decimal_bytes(dev.memory, '.0f')}."]
    if w.cfg is not None and w.seq > w.cfg.max_seq_len:   # as RunConfig.check_model refuses
        why.append(f"Note: {w.seq:,} tokens is longer than {w.name}'s context (max_seq_len "
                   f"{w.cfg.max_seq_len:,}); the plan sizes the run, but `triax train` refuses "
                   f"it with this model: {context_fix(w.seq, w.cfg.max_seq_len)}.")
    if min_dev == 1:
        why.append("The weights fit on one device" + (
            ", so data parallelism over the others adds throughput." if w.train
            else "; more devices lower latency (TP) or add throughput (DP)."))
    else:
        why.append(f"The weights alone need at least {min_dev} devices, so no single-device "
                   f"plan is considered.")
    if w.train and w.lora is not None:
        why.append(f"LoRA rank {w.lora.rank} on {','.join(w.lora.targets)}: the "
                   f"{w.lora.base_dtype} base is frozen (no gradients, no moments), "
                   f"{param_count(w.lora, w.cfg):,} adapter parameters train; "
                   f"{decimal_bytes(state_bytes(w), None)} of state in all.")
    elif w.train:
        master = "; the fp32 weights are the master copy" if w.mixed else ""
        why.append(f"Training keeps {decimal_bytes(state_bytes(w), None)} of state (weights, fp32 "
                   f"gradients, AdamW moments{master}); DP, ZeRO-1 or FSDP go on top of TP/PP.")
    need = state_bytes(w)
    if min_dev > 1 and need <= dev.memory * cluster.gpus_per_node:
        why.append(f"That fits within one node: tensor parallelism inside the node, over "
                   f"{cluster.intra.name}.")
    if w.cfg is None:
        why.append("Without a model config (--params), activations and TP/PP traffic are not "
                   "modelled, so plans are ranked by the least model parallelism that fits.")
    return why


def plan(w: Workload, cluster: Cluster, top: int = 3, layout: Optional[Layout] = None,
         assume: Optional[Assumptions] = None,
         schemes: tuple[str, ...] = SCHEMES, offload: tuple[str, ...] = ()) -> Recommendation:
    """Search (or evaluate the given ``layout``) and explain the choice; context layouts are
    searched with each of ``schemes``; ``offload``: the state parts every plan keeps in the
    host's memory (``--offload``; the search then offers unpipelined plans only)."""
    min_dev = min_devices_for_weights(w, cluster.device.memory)
    why = _opening(w, cluster, min_dev)
    if layout is not None:
        return _explicit(w, cluster, dataclasses.replace(layout, offload=offload), min_dev,
                         why, assume)
    if cluster.devices < min_dev:
        raise ValueError(f"{w.name} needs at least {min_dev} {cluster.device.name} devices "
                         f"just for its weights ({decimal_bytes(w.weight_bytes)}), but the "
                         f"cluster has {cluster.devices}; use --nodes/--gpus-per-node for "
                         f"≥ {min_dev} devices")
    res = search(w, cluster, assume, schemes=schemes, offloads=(offload,))
    if not res.fitting:
        raise ValueError(_nothing_fits(w, cluster, res)
                         + lora_would_fit(w, cluster, assume, schemes))
    ranked = _apply_rules(w, cluster, res.fitting, why)
    for what, plans in (("Not runnable, so not ranked", res.not_runnable),
                        ("Not searched", res.not_searched)):
        for reason in sorted({r for _, r in plans}):
            these = [lay.describe() for lay, r in plans if r == reason]
            why.append(f"{what} ({len(these)} plan{'s' if len(these) > 1 else ''}, e.g. "
                       f"{these[0]}): {reason}.")
    best = ranked[0]
    why.append(f"Searched {res.considered} plans; {len(res.fitting)} fit. Best: "
               f"{best.layout.describe()}"
               + (f" ({best.workload.run_label}), " if w.train else ", ") +
               f"{best.step_time_s * 1e3:.1f} ms per step, MFU {best.mfu:.0%}, "
               f"{decimal_bytes(best.memory.total)} per device.")
    if best.bubble > 0:
        why.append(f"Its pipeline bubble is {best.bubble:.1%} of the step.")
    why.extend(offload_reasoning(best))
    if any(best.comm_time_by_axis.values()):
        axis = max(best.comm_time_by_axis, key=best.comm_time_by_axis.get)
        why.append(f"Most communication time is on '{axis}' "
                   f"({best.comm_time_by_axis[axis] * 1e3:.2f} ms per step).")
    why.extend(context_reasoning(w, res, best))
    why.extend(loss_chunk_reasoning(res, best))
    why.extend(lora_reasoning(w, cluster, assume, schemes))
    used = _op_costs(w, res.fitting, why)
    return Recommendation(w, cluster, min_dev, ranked[:top], why, assume or Assumptions(), used)


def offload_reasoning(p: PlanResult) -> list[str]:
    """What a plan's host offload moves and costs (``costs.offload``; nothing without)."""
    c = p.offload
    if c is None:
        return []
    return [f"Offloaded to the host ({', '.join(c.targets)}, update {c.update}): "
            f"{decimal_bytes(c.host_bytes, None)} per device in host memory; "
            f"{decimal_bytes(c.link_bytes, None)} per device cross the host link each step, "
            f"{c.link_s * 1e3:.3g} ms" + (f", and the host update takes {c.host_s * 1e3:.3g} ms"
                                          if c.host_s else "")
            + ", added to the step unhidden."]


def loss_chunk_reasoning(res, best: PlanResult) -> list[str]:
    """Why the best plan computes its loss in slices of the sequence (nothing when not)."""
    w, lay = best.workload, best.layout
    if w.loss_chunks == 1:
        return []
    whole, tokens = logits_bytes(w, lay, chunks=1), loss_tokens(w, lay, chunks=1)
    extra = chunk_recompute_flops(w.cfg.embed_dim, w.cfg.vocab_size, w.loss_chunks)
    s = (f"Loss in {w.loss_chunks} chunks: the fp32 logits, log-probabilities and their "
         f"gradient of a device's {tokens:,.0f} tokens (vocab {w.cfg.vocab_size:,}) would "
         f"take {decimal_bytes(whole)} at once, {decimal_bytes(logits_bytes(w, lay))} in slices "
         f"of {tokens / w.loss_chunks:,.0f}; the backward reruns the head's forward for it "
         f"(+{extra / w.cfg.flops_per_token(w.seq):.1%} compute)")
    same = [p for p in res.fitting + res.overflowing if p.layout == lay
            and p.workload == dataclasses.replace(w, loss_chunks=1)]
    if same:
        s += ("; without it this plan " + (f"takes {same[0].step_time_s * 1e3:.1f} ms"
                                           if same[0].fits else f"{same[0].overflow}"))
    return [s + "."]


def _op_costs(w: Workload, plans: list[PlanResult], why: list[str]) -> dict:
    """The op costs the pipelined training plans' bubbles were weighed with, said once per
    schedule (measured on the compiled executor, or the unit costs and why not)."""
    keys = sorted({(p.layout.schedule.value, p.workload.remat) for p in plans
                   if w.train and p.layout.pipe > 1 and p.layout.schedule is not None})
    used = {f"{name} remat={remat}": op_costs_for(ScheduleKind(name), remat)
            for name, remat in keys}
    if not used:
        return used
    # One line for them all: the figures per schedule set, their sources once each.
    by_costs: dict[str, list[str]] = {}
    for key, c in used.items():
        by_costs.setdefault(", ".join(f"{LABELS[k]}={v:.3g}" for k, v in c.costs), []).append(key)
    unmeasured = sorted({c.source for c in used.values() if not c.measured})
    source = "; ".join(unmeasured) or ("measured from the compiled executor: matmul FLOPs "
                                       "per layer of each schedule's tick-switch branches")
    why.append("Pipeline bubbles weigh each op by its cost: " + "; ".join(
        f"{figures} ({', '.join(keys)})" for figures, keys in by_costs.items())
        + f" ({source}).")
    return used


def _nothing_fits(w: Workload, cluster: Cluster, res) -> str:
    if res.batch_rejected and not res.overflowing and not res.fitting:
        return (f"batch size {w.batch} does not divide over any data-parallel size of "
                f"{cluster.devices} devices; choose a batch divisible by the data axis")
    smallest = res.overflowing[0] if res.overflowing else None
    hint = f" (the smallest plan, {smallest.layout.describe()}, {smallest.overflow})" \
        if smallest else ""
    return (f"no plan for {w.name} fits on {cluster.describe()}{hint}; add devices, "
            f"shorten --seq-len or lower --batch-size")


def _explicit(w, cluster, layout, min_dev, why, assume) -> Recommendation:
    if layout.devices != cluster.devices:
        raise ValueError(f"--mesh {layout.mesh_str} uses {layout.devices} devices but the "
                         f"cluster has {cluster.devices}; axes must multiply to "
                         f"{cluster.devices}")
    shards = layout.batch_shards
    if w.batch % shards:
        axes = "×".join(a for a in layout.strategy.rules.mesh_axes("batch")
                        if layout.sizes.get(a, 1) > 1) or "data"
        raise ValueError(f"batch size {w.batch} does not divide over {axes}={shards}; "
                         f"choose a batch size divisible by {shards}")
    why_not = context_reason(w, layout.context, layout.pipe)
    if why_not:
        raise ValueError(f"--mesh {layout.mesh_str}: {why_not}; plan without the context "
                         f"axis, or measure the mesh with `triax inspect --mesh "
                         f"{layout.mesh_str}`")
    if layout.pipe > 1:
        layout = _pipeline_defaults(w, layout)
    r = evaluate(w, layout, cluster, assume)
    why.append(f"Evaluated the given plan {layout.describe()}: "
               + ("it fits." if r.fits else f"it does not fit: {r.overflow}."))
    why.extend(offload_reasoning(r))
    used = _op_costs(w, [r], why)
    return Recommendation(w, cluster, min_dev, [r], why, assume or Assumptions(), used)


def _pipeline_defaults(w: Workload, layout: Layout) -> Layout:
    """pipe > 1: 1F1B (forward-only for inference) and the pipeline's default micro-batch
    count (capped at the local batch) unless given; check M."""
    reason = w.cfg is not None and unpipelinable_mesh_reason(
        w.cfg, layout.sizes, layout.strategy.rules)
    if reason:
        raise ValueError(f"--mesh {layout.mesh_str} --strategy {layout.strategy.name}: {reason}")
    local = max(w.batch // layout.batch_shards, 1)
    if layout.schedule is None:
        kind = ScheduleKind.ONE_F_ONE_B if w.train else ScheduleKind.FORWARD_ONLY
        layout = dataclasses.replace(layout, schedule=kind)
    if layout.microbatches <= 1:
        layout = dataclasses.replace(
            layout, microbatches=min(default_microbatches(layout.pipe), local))
    if local % layout.microbatches:
        raise ValueError(f"--microbatches {layout.microbatches} does not divide the "
                         f"{local} sequences each data replica runs; choose a divisor of {local}")
    chunks = layout.pipe * layout.virtual
    if w.cfg is not None and chunks > w.cfg.num_layers:
        raise ValueError(f"pipe={layout.pipe} × virtual={layout.virtual} = {chunks} stage "
                         f"chunks but {w.cfg.name} has {w.cfg.num_layers} layers; use fewer "
                         f"stages or chunks")
    why_not = microbatch_constraint(layout.schedule, layout.pipe, layout.microbatches,
                                    layout.virtual)
    if why_not:
        raise ValueError(f"--schedule {layout.schedule.value}: {why_not}")
    return layout
