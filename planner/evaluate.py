"""One plan, evaluated: memory, communication, compute, step time, MFU, fit.

    >>> from triax.models import config
    >>> from triax.costs import hardware
    >>> from triax.costs.workload import Layout, Workload
    >>> w = Workload.of(config.get("llama3-8b"), train=True, batch=8, seq=4096, remat="full")
    >>> p = evaluate(w, Layout(data=8, strategy="fsdp"), hardware.cluster("h100-80gb", 8, 1))
    >>> p.fits, round(p.memory.total / 1e9)
    (True, 29)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from triax.models.loss import chunk_recompute_flops
from triax.costs import comm
from triax.costs.fp8 import compute_factor, priced
from triax.costs.hardware import Cluster
from triax.costs.memory import Assumptions, Memory, estimate
from triax.costs.offload import OffloadCost, host_link, planned_cost
from triax.costs.speculative import draft_workload, expected_tokens
from triax.planner.op_costs import measured_bubble, work_factor
from triax.costs.workload import Layout, Workload, ceil_div
from triax.units import decimal_bytes


@dataclass(frozen=True)
class PlanResult:
    workload: Workload
    layout: Layout
    memory: Memory
    traffic: dict
    comm_time_by_axis: dict
    compute_time_s: float
    comm_time_s: float
    bubble: float
    step_time_s: float
    mfu: float
    tokens_per_s: float
    fits: bool
    device_memory: float
    offload: Optional[OffloadCost] = None   # host offload's price (``lay.offload``)

    @property
    def overflow(self) -> str:
        """Which term overflows and by how much (empty when it fits)."""
        if self.fits:
            return ""
        m, cap = self.memory, self.device_memory
        terms = {k: v for k, v in m.as_dict().items() if k not in ("total", "host")}
        big = max(terms, key=terms.get)
        return (f"needs {decimal_bytes(m.total)} per device but a device has "
                f"{decimal_bytes(cap)} (over by {decimal_bytes(m.total - cap)}; largest term: "
                f"{big} {decimal_bytes(terms[big])})")

    def to_json(self) -> dict:
        lay = self.layout
        return {"mesh": lay.mesh_str, "strategy": lay.strategy.name,
                "schedule": lay.schedule.value if lay.pipe > 1 and lay.schedule else None,
                "microbatches": lay.microbatches if lay.pipe > 1 else None,
                "virtual": lay.virtual if lay.pipe > 1 else None,
                "context_attention": lay.context_attention if lay.context > 1 else None,
                "remat": self.workload.remat, "loss_chunks": self.workload.loss_chunks,
                "devices": lay.devices,
                "memory_per_device": self.memory.as_dict(),
                "comm_bytes_per_device": {a: int(t.wire) for a, t in self.traffic.items()},
                "comm_payload_bytes_per_device": {a: int(t.payload)
                                                  for a, t in self.traffic.items()},
                "comm_time_s": self.comm_time_s, "compute_time_s": self.compute_time_s,
                "bubble": self.bubble, "step_time_s": self.step_time_s, "mfu": self.mfu,
                "tokens_per_s": self.tokens_per_s, "fits": self.fits,
                "overflow": self.overflow or None,
                "offload": None if self.offload is None else {
                    "targets": list(self.offload.targets), "update": self.offload.update,
                    "host_bytes_per_device": int(self.offload.host_bytes),
                    "link_bytes_per_device": int(self.offload.link_bytes),
                    "link_s": self.offload.link_s, "host_update_s": self.offload.host_s}}


def step_flops(w: Workload) -> float:
    """Model FLOPs of one step: training is B·T tokens at 6·N_active + attention each;
    inference is one decode step, B tokens at a third of that."""
    per_token = w.cfg.flops_per_token(w.seq) if w.cfg is not None else 6.0 * w.params
    return w.batch * w.seq * per_token if w.train else w.batch * per_token / 3.0


def _busy_seconds(w: Workload, lay: Layout, mem: Memory, cluster: Cluster,
                  assume: Assumptions) -> tuple[float, float, float]:
    """(compute seconds, bubble, busy seconds incl. bubble) on the busiest device."""
    flops = step_flops(w)
    peak = cluster.device.peak_flops(w.dtype)
    uneven = 1.0
    if w.cfg is not None and lay.pipe > 1:   # the largest stage sets the pace
        longest = max(lay.stage_layers) if lay.stage_layers else ceil_div(w.cfg.num_layers,
                                                                          lay.pipe)
        uneven = longest * lay.pipe / w.cfg.num_layers
    compute = flops / lay.devices * uneven / (peak * assume.compute_efficiency)
    if priced(w):   # the block's projections at the float8 rate (costs.fp8)
        compute *= compute_factor(w, cluster.device, flops)
    if w.train:
        compute *= 4 / 3 if w.remat == "full" else 1.0      # full remat reruns the forward
        if w.cfg is not None:   # a chunked loss reruns the head's forward (models.loss)
            compute *= 1.0 + chunk_recompute_flops(w.cfg.embed_dim, w.cfg.vocab_size,
                                                   w.loss_chunks) / w.cfg.flops_per_token(w.seq)
        if lay.pipe > 1:     # what the executor's ops cost beyond F + B (ZB-H1's W today)
            compute *= work_factor(lay.schedule, w.remat)
        bubble = measured_bubble(lay.schedule, lay.pipe, lay.microbatches, lay.virtual,
                                 w.remat)
        return compute, bubble, compute / (1.0 - bubble)
    # Decode: each micro-batch's pass on a stage reads the stage's weights and KV cache.
    # Speculative decoding (costs.speculative): the pass verifies k + 1 positions per row
    # (k + 1 times the FLOPs, the same bytes read), after the draft's k steps.
    drafted = 0.0
    if w.draft is not None and w.spec_k:
        dw = draft_workload(w)
        dmem = estimate(dw, lay, assume)
        drafted = w.spec_k * _busy_seconds(dw, lay, dmem, cluster, assume)[2]
        mem = replace(mem, params=mem.params - dmem.params, kv_cache=mem.kv_cache - dmem.kv_cache)
    compute *= w.spec_k + 1
    M = max(lay.microbatches, 1)
    read = (mem.params + mem.kv_cache) / cluster.device.hbm_bandwidth
    per_mb = max(compute / M, read)
    ticks = M + lay.pipe - 1
    return compute, 1.0 - M / ticks, ticks * per_mb + drafted


def attention_seconds(w: Workload, lay: Layout, cluster: Cluster,
                      assume: Assumptions) -> float:
    """Seconds of the step's attention on one device (``ModelConfig.flops_per_token``'s
    attention term at the same efficiency as the rest): what the ring's permutes hide under."""
    if w.cfg is None or not w.train:
        return 0.0
    per_token = w.cfg.flops_per_token(w.seq) - 6.0 * w.cfg.active_params()
    return (w.batch * w.seq * per_token / lay.devices
            / (cluster.device.peak_flops(w.dtype) * assume.compute_efficiency))


# The share of a training step's matmuls that ``--tp-overlap``'s rings run beside: the
# forward's and the input gradients' (each ring step's partial matmul), not the weight
# gradients' third, which ``sharding.collective_matmul`` computes after its ring.
RING_HIDES = 2 / 3


def tp_ring_seconds(traffic: dict, links: dict, lay: Layout, assume: Assumptions) -> float:
    """Seconds of ``--tp-overlap``'s permute rings on ``tensor``: each permute runs beside
    a partial matmul of the chunk at hand, so they hide under ``RING_HIDES`` of the step's
    matmuls (its compute less attention) and only what exceeds that is exposed."""
    t = traffic.get("tensor")
    if not lay.tp_overlap or t is None:
        return 0.0
    return comm.kind_seconds(t, links["tensor"], assume.comm_efficiency,
                             ("collective-permute",))


def evaluate(w: Workload, lay: Layout, cluster: Cluster,
             assume: Optional[Assumptions] = None) -> PlanResult:
    """Evaluate ``lay`` for ``w`` on ``cluster`` (raises ShardingError if it cannot split)."""
    assume = assume or Assumptions()
    mem = estimate(w, lay, assume)
    traffic = comm.traffic(w, lay)
    seconds = comm.comm_seconds(traffic, comm.axis_links(lay, cluster), assume.comm_efficiency)
    compute, bubble, busy = _busy_seconds(w, lay, mem, cluster, assume)
    # TP/PP/EP collectives sit on the critical path; DP/FSDP traffic overlaps part of the
    # compute (bucketed gradient reduction, prefetched gathers), and so do the gradient
    # all-reduces over `replica` (HSDP) and `context`. The ring's K/V permutes overlap the attention they feed
    # (each hop's block is computed while the next arrives); the all-gather scheme's
    # gathers and reduce-scatters are exposed.
    links = comm.axis_links(lay, cluster)
    ctx = traffic.get("context")
    ctx_grads = ctx_ring = 0.0
    if ctx is not None:
        ctx_grads = comm.kind_seconds(ctx, links["context"], assume.comm_efficiency,
                                      ("all-reduce",))
        ctx_ring = comm.kind_seconds(ctx, links["context"], assume.comm_efficiency,
                                     ("collective-permute",))
    overlapped = seconds.get("data", 0.0) + seconds.get("replica", 0.0) + ctx_grads
    tp_ring = tp_ring_seconds(traffic, links, lay, assume)
    exposed = sum(t for a, t in seconds.items() if a not in ("data", "replica")) \
        - ctx_grads - ctx_ring - tp_ring \
        + max(0.0, overlapped - assume.data_overlap * compute) \
        + max(0.0, ctx_ring - attention_seconds(w, lay, cluster, assume)) \
        + max(0.0, tp_ring - RING_HIDES * (compute - attention_seconds(w, lay, cluster, assume)))
    # Host offload's transfers (and a host update) are not overlapped with the step.
    off = planned_cost(w, lay, host_link(cluster.device)) if lay.offload else None
    step = busy + exposed + (off.seconds if off else 0.0)
    peak = cluster.device.peak_flops(w.dtype)
    mfu = step_flops(w) / (step * lay.devices * peak)
    tokens = w.batch * (w.seq if w.train else expected_tokens(w.spec_k, w.acceptance))
    return PlanResult(w, lay, mem, traffic, seconds, compute, sum(seconds.values()), bubble,
                      step, mfu, tokens / step, mem.total <= cluster.device.memory,
                      cluster.device.memory, off)
