"""Exhaustive search: every (data, tensor, pipe[, expert][, context]) factorization of the
devices, every strategy, schedule, micro-batch count and context scheme; drop what cannot
split or does not fit; rank the rest by estimated step time.

    >>> from triax.models import config
    >>> from triax.costs import hardware
    >>> from triax.costs.workload import Workload
    >>> w = Workload.of(config.get("llama3-8b"), train=False, batch=8, seq=4096)
    >>> res = search(w, hardware.cluster("h100-80gb", 8, 1))
    >>> res.fitting[0].fits, res.fitting[0].step_time_s <= res.fitting[-1].step_time_s
    (True, True)

(An inference search keeps the example quick: a training search also prices pipelined
layouts, from op costs read off a compiled probe step (``planner.op_costs``) and stash sizes
traced per chunk (``pipeline.buffer_sizes``).)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Optional

from triax.pipeline import ScheduleKind, chunks_per_stage
from triax.pipeline.pipelined import unpipelinable_mesh_reason
from triax.planner.evaluate import PlanResult, evaluate
from triax.choices import FP8
from triax.costs.fp8 import fp8_reason
from triax.costs.hardware import Cluster
from triax.costs.memory import Assumptions
from triax.costs.offload import offload_reason
from triax.costs.pipeline_math import microbatch_constraint
from triax.costs.workload import Layout, Workload, divisors
from triax.sharding.collective_matmul import overlap_reason
from triax.sharding.context import SCHEMES, zigzag_order
from triax.sharding.rules import ShardingError, get_strategy
from triax.training.config import TRAIN_SCHEDULES as TRAINABLE, tp_overlap_reason

# Every schedule a training step can run (``training.config.TRAIN_SCHEDULES``).
TRAIN_SCHEDULES = tuple(ScheduleKind(name) for name in TRAINABLE)


@dataclass
class SearchResult:
    fitting: list[PlanResult] = field(default_factory=list)     # best first
    overflowing: list[PlanResult] = field(default_factory=list)  # smallest total first
    unsplittable: list[tuple[Layout, str]] = field(default_factory=list)
    not_runnable: list[tuple[Layout, str]] = field(default_factory=list)  # executor refuses
    not_searched: list[tuple[Layout, str]] = field(default_factory=list)  # planner's choice
    batch_rejected: int = 0

    @property
    def considered(self) -> int:
        return len(self.fitting) + len(self.overflowing) + len(self.unsplittable)


def _strategies(w: Workload, data: int, tensor: int) -> tuple[str, ...]:
    if not w.train:
        return ("tp",) if tensor > 1 else ("dp",)
    if tensor > 1:   # each with and without sequence parallelism
        return ("tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp") if data > 1 else ("tp", "tp_sp")
    return ("dp", "fsdp", "zero1") if data > 1 else ("dp",)


# More stages (or chunks) than layers: the executor runs it, padding the stack with identity
# layers (``pipeline.stage_layers``), but those stages compute nothing useful.
PADDED = ("more pipeline stages or chunks than layers (the executor would pad the stack "
          "with identity layers: stages that compute nothing useful)")


def _schedules(w: Workload, pipe: int, local_batch: int
               ) -> Iterator[tuple[Optional[ScheduleKind], int, int, Optional[str]]]:
    """(schedule, M, v, why not) for a pipe size: M in S, 2S, 4S, 8S and the local batch when
    they divide it; interleaved with v = 2, and ZB-V (its own 2). ``why not`` is None for
    what the planner evaluates, else why not: the executor refuses it (the generators' own
    check, ``microbatch_constraint``), or a chunk would keep no layer (``PADDED``)."""
    if pipe == 1:
        yield None, 1, 1, None
        return
    counts = sorted({m for m in (pipe, 2 * pipe, 4 * pipe, 8 * pipe, local_batch)
                     if m <= local_batch and local_batch % m == 0} or {local_batch})
    kinds = TRAIN_SCHEDULES if w.train else (ScheduleKind.FORWARD_ONLY,)
    for kind in kinds:
        v = 2 if kind is ScheduleKind.INTERLEAVED else chunks_per_stage(kind)   # ZB-V: 2
        if w.cfg is not None and pipe * v > w.cfg.num_layers:
            yield kind, counts[0], v, PADDED
            continue
        why = {m: microbatch_constraint(kind, pipe, m, v) for m in counts}
        # Counts the search picked itself that this schedule refuses (DualPipeV's M < 2S)
        # are not listed: one refusal only when no count runs.
        for m in [m for m in counts if why[m] is None] or counts[:1]:
            yield kind, m, v, why[m]


def context_reason(w: Workload, context: int, pipe: int = 1) -> Optional[str]:
    """Why the planner does not model ``context`` over this workload (None: it does):
    training a dense model, without pipeline stages, with a sequence the zigzag layout can
    split (``sharding.context.zigzag_order``'s rule)."""
    if context == 1:
        return None
    if w.cfg is None:
        return "context parallelism needs a model (--model), not only --params"
    if not w.train:
        return ("the planner models context parallelism for training only (generate's "
                "attention runs on the whole cache)")
    if w.cfg.moe is not None:
        return "context parallelism with MoE layers is not modelled"
    if pipe > 1:
        return "pipe × context is not modelled (the pipelined stages gather K/V)"
    try:
        zigzag_order(w.seq, context)
    except ShardingError as e:
        return str(e)
    return None


def _contexts(w: Workload, n: int) -> list[int]:
    """Context sizes to try on ``n`` devices: 1, and for training every divisor that splits
    the sequence (``context_reason``)."""
    return [c for c in divisors(n) if context_reason(w, c) is None]


def layouts(w: Workload, cluster: Cluster, refused: Optional[list] = None,
            skipped: Optional[list] = None,
            schemes: tuple[str, ...] = SCHEMES) -> Iterator[Layout]:
    """Every layout of the cluster's devices that the step can run (tensor stays within a
    node; context, where it splits the sequence, only without pipeline stages, with each of
    ``schemes``). What the executor would refuse is not yielded; with ``refused`` given, one
    ``(layout, why)`` per such plan is appended to it (the executor's own reason). Plans with
    a stage or chunk holding no layer (``PADDED``) are not yielded either: ``skipped``."""
    n = cluster.devices
    experts = w.cfg.moe.num_experts if (w.cfg is not None and w.cfg.moe) else 1
    for e in (d for d in divisors(n) if experts % d == 0):
        for t in divisors(n // e):
            if cluster.gpus_per_node % t:
                continue
            for c in _contexts(w, n // (e * t)):
                for p in divisors(n // (e * t * c)) if c == 1 else (1,):
                    d = n // (e * t * p * c)
                    if p > 1 and w.cfg is not None and p > w.cfg.num_layers:
                        if skipped is not None:
                            skipped.append((Layout(d, t, p, e), PADDED))
                        continue
                    for st in _strategies(w, d, t):
                        shards = Layout(d, t, p, e, st).batch_shards
                        if w.batch % shards:      # the batch must split evenly
                            continue
                        if p > 1:
                            why = unpipelinable_mesh_reason(w.cfg, Layout(d, t, p, e).sizes,
                                                            get_strategy(st).rules)
                            if why:
                                if refused is not None:
                                    refused.append((Layout(d, t, p, e, st), why))
                                continue
                        for kind, m, v, why in _schedules(w, p, w.batch // shards):
                            lay = Layout(d, t, p, e, st, kind, m, v)
                            if why is PADDED:
                                if skipped is not None:
                                    skipped.append((lay, why))
                            elif why is not None:
                                if refused is not None:
                                    refused.append((lay, why))
                            else:
                                for scheme in schemes if c > 1 else ("all-gather",):
                                    for hs in hsdp_variants(lay, cluster):
                                        yield from overlap_variants(dataclasses.replace(
                                            hs, context=c, context_attention=scheme))


def overlap_variants(lay: Layout) -> Iterator[Layout]:
    """``lay``, and with ``--tp-overlap`` where the collective matmul runs
    (``sharding.collective_matmul.overlap_reason``: SP over tensor, no context or pipe)."""
    yield lay
    if overlap_reason(lay.sizes, lay.strategy.rules) is None:
        yield dataclasses.replace(lay, tp_overlap=True)


def hsdp_variants(lay: Layout, cluster: Cluster) -> Iterator[Layout]:
    """``lay``, and for a strategy that shards the parameters over ``data`` on several nodes
    its HSDP forms: ``replica`` = r groups (r dividing the node count), ``data`` = d/r
    within each. ``replica`` is the mesh's outermost axis, so ``comm.axis_links`` puts it on
    the inter-node links and a group of ``gpus_per_node`` devices or fewer keeps its
    gathers and reduce-scatters inside a node; only the shard's one all-reduce crosses."""
    yield lay
    if not lay.strategy.fsdp or lay.replica > 1:
        return
    for r in divisors(cluster.nodes):
        if r > 1 and lay.data % r == 0 and lay.data // r > 1:
            yield dataclasses.replace(lay, data=lay.data // r, replica=r)


# The longest slice of a sequence whose loss is computed at once, when the search tries a
# chunked loss (models.loss): at 8,192 tokens, llama3's 128,256-entry fp32 logits are 4.2 GB
# per sequence, against 67 GB for 131,072 tokens.
LOSS_CHUNK_TOKENS = 8192


def long_sequence_loss_chunks(seq: int) -> int:
    """The chunk count the search tries beside 1: the fewest slices of at most
    ``LOSS_CHUNK_TOKENS`` that split ``seq`` evenly (1 for a sequence that short)."""
    return next(n for n in range(1, seq + 1) if seq % n == 0 and seq // n <= LOSS_CHUNK_TOKENS)


def loss_chunks_keep_the_split(w: Workload, lay: Layout) -> bool:
    """Whether each loss slice splits over the devices the sequence does (``seq`` over
    ``context``, ``res_seq`` also over ``tensor`` under SP), so slicing moves no data."""
    if w.loss_chunks == 1:     # the whole sequence: nothing sliced (and the search unchanged)
        return True
    rules = lay.strategy.rules
    return all((w.seq // w.loss_chunks) % rules.split_size(name, lay.sizes) == 0
               for name in ("seq", "res_seq"))


def offload_variants(w: Workload, lay: Layout,
                     offloads: tuple[tuple[str, ...], ...]) -> Iterator[Layout]:
    """``lay`` with each of ``offloads`` (state parts kept on the host; ``()``: none). The
    planner prices offload for an unpipelined full fine-tuning step (``costs.offload``);
    a pipelined layout is not offered it."""
    for targets in offloads:
        if not targets:
            yield lay
        elif offload_reason(w) is None and lay.pipe == 1:
            yield dataclasses.replace(lay, offload=targets)


def precision_variants(w: Workload, precisions: tuple[str, ...]) -> list[str]:
    """``w``'s precision, then each of ``precisions`` the planner prices for it (fp8 only
    where ``costs.fp8.fp8_reason`` is None): the search never lowers a precision on its
    own, the caller opts in (``--plan auto --allow-fp8``)."""
    out = [w.dtype]
    for d in precisions:
        if d not in out and (d != FP8 or fp8_reason(w) is None):
            out.append(d)
    return out


def search(w: Workload, cluster: Cluster, assume: Optional[Assumptions] = None,
           remats: tuple[str, ...] = ("none", "full"),
           schemes: tuple[str, ...] = SCHEMES,
           offloads: tuple[tuple[str, ...], ...] = ((),),
           precisions: tuple[str, ...] = ()) -> SearchResult:
    """Evaluate every layout (training also tries full remat; context layouts each of
    ``schemes``; each with every host offload of ``offloads``, ``offload_variants``; each
    in ``w``'s precision and in those of ``precisions``, ``precision_variants``) and sort
    the outcomes."""
    why = next((offload_reason(w) for t in offloads if t), None)
    if why:
        raise ValueError(f"--offload: {why}")
    res = SearchResult()
    res.batch_rejected = sum(1 for d in divisors(cluster.devices) if w.batch % d)
    chunks = sorted({w.loss_chunks, long_sequence_loss_chunks(w.seq)})
    workloads = [dataclasses.replace(w, remat=r, loss_chunks=c, dtype=d) for d in
                 precision_variants(w, precisions) for r in remats
                 for c in chunks] if w.train and w.cfg is not None else [w]
    for lay in (v for base in layouts(w, cluster, res.not_runnable, res.not_searched, schemes)
                for v in offload_variants(w, base, offloads)):
        for wr in workloads:
            if not loss_chunks_keep_the_split(wr, lay) or \
                    tp_overlap_reason(lay.tp_overlap, wr.dtype):
                continue
            try:
                r = evaluate(wr, lay, cluster, assume)
            except ShardingError as e:
                res.unsplittable.append((lay, str(e)))
                break
            (res.fitting if r.fits else res.overflowing).append(r)
    res.fitting.sort(key=lambda r: (r.step_time_s, r.memory.total))
    res.overflowing.sort(key=lambda r: r.memory.total)
    return res
