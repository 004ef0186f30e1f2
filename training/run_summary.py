"""End-of-run summary: how the model was split over the mesh and where the time went.

``summary`` reads a plain ``RunStats`` (what the loop measured), the run's ``Compiled`` step
and its final state; ``format_summary`` prints it.

    >>> from triax.training.config import RunConfig
    >>> from triax.training.setup import build_run
    >>> run = build_run(RunConfig.of(num_layers=1, mesh="data=8", strategy="dp", batch_size=8,
    ...                              seq_len=16))
    >>> stats = RunStats(steps=2, losses=[5.6, 5.5], tokens_per_step=128, flops_per_step=1e9,
    ...                  times={"first_step_s": 0.2, "steps_s": 0.1})
    >>> s = summary(stats, run.compiled, run.compiled.init(seed=0))
    >>> s["strategy"], s["pipeline"], s["mean_step_s"]
    ('dp', None, 0.1)
    >>> print(format_summary(s).splitlines()[2])  # doctest: +ELLIPSIS
      parameters: ... KiB per device of ... KiB total (... split)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import jax

from triax.mesh import describe, mesh_sizes
from triax.pipeline.buffers import shape_bytes, tree_bytes
from triax.sharding.introspect.hlo import collectives_from_compiled, summarize
from triax.training import metrics
from triax.training.step_cache import Compiled
from triax.units import human_bytes


@dataclass
class RunStats:
    """What the loop measured, for the summary."""

    steps: int                                   # the run's target step
    losses: list = field(default_factory=list)   # this run's part, one per optimizer step
    val_loss: Optional[float] = None             # at the target step
    tokens_per_step: int = 0
    flops_per_step: float = 0.0
    peak_flops: Optional[float] = None           # per device; None on CPU / unknown chips
    corpus_info: dict = field(default_factory=dict)
    times: dict = field(default_factory=dict)    # setup_s, compile_s, first_step_s, steps_s, …


def _per_device_bytes(tree) -> int:
    """Bytes one device holds for ``tree`` (from each array's shard shape)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += shape_bytes(shard, x.dtype)
    return total


def _total_bytes(tree) -> int:
    return tree_bytes(tree)


def summary(stats: RunStats, compiled: Compiled, state) -> dict:
    tr, times = compiled.trainer, stats.times
    steps_timed = max(len(stats.losses) - 1, 0)  # the first executed step is warm-up
    mean_step = times.get("steps_s", 0.0) / steps_timed if steps_timed else \
        times.get("first_step_s", 0.0)
    return {
        "model": tr.cfg.name, "params": tr.cfg.num_params, "mesh": describe(tr.mesh),
        "mesh_sizes": mesh_sizes(tr.mesh), "strategy": tr.strategy.name,
        "devices": jax.device_count(), "processes": jax.process_count(),
        "steps": stats.steps, "steps_this_run": len(stats.losses),
        "final_loss": stats.losses[-1] if stats.losses else None,
        "val_loss": stats.val_loss,
        "unigram_loss": stats.corpus_info.get("unigram_loss"),
        "optimal_loss": stats.corpus_info.get("optimal_loss"),
        "param_bytes_per_device": _per_device_bytes(state["params"]),
        "param_bytes_total": _total_bytes(state["params"]),
        "opt_bytes_per_device": _per_device_bytes(state["opt_state"]),
        "opt_bytes_total": _total_bytes(state["opt_state"]),
        "mean_step_s": mean_step,
        "tokens_per_s": stats.tokens_per_step / mean_step if mean_step else None,
        "mfu": metrics.mfu(stats.flops_per_step, mean_step, jax.device_count(),
                           stats.peak_flops),
        "time": {k: round(v, 3) for k, v in times.items()},
        "pipeline": _pipeline(tr), "collectives": _collectives(compiled),
    }


def _pipeline(trainer):
    if trainer.pipeline is None:
        return None
    s, counts = trainer.pipeline.schedule, trainer.pipeline.layout.counts
    return {"schedule": s.kind.value, "stages": s.stages, "microbatches": s.microbatches,
            "virtual": s.virtual, **({} if counts is None else {"stage_layers": list(counts)})}


def _collectives(compiled: Compiled) -> list[dict]:
    """Per (kind, mesh axes): ops and bytes per device per step, from the compiled HLO."""
    if not compiled.is_step_compiled:
        return []
    totals = summarize(collectives_from_compiled(compiled.step, compiled.trainer.mesh))
    return [{"kind": k, "axes": list(axes), **v} for (k, axes), v in sorted(totals.items())]


def format_summary(s: dict) -> str:
    """Readable multi-line summary for the terminal."""
    t = s["time"]
    total = sum(t.values())
    lines = [
        "── how it was split " + "─" * 40,
        f"  {s['model']} ({s['params'] / 1e6:.2f}M params) on {s['mesh']} "
        f"({s['devices']} devices, {s['processes']} process(es)), strategy {s['strategy']}",
        f"  parameters: {human_bytes(s['param_bytes_per_device'])} per device of "
        f"{human_bytes(s['param_bytes_total'])} total "
        f"({s['param_bytes_total'] / max(s['param_bytes_per_device'], 1):.1f}× split)",
        f"  optimizer:  {human_bytes(s['opt_bytes_per_device'])} per device of "
        f"{human_bytes(s['opt_bytes_total'])} total "
        f"({s['opt_bytes_total'] / max(s['opt_bytes_per_device'], 1):.1f}× split)",
    ]
    if s.get("pipeline"):
        p = s["pipeline"]
        lines.append(f"  pipeline:   {p['schedule']} over {p['stages']} stages, "
                     f"{p['microbatches']} micro-batches" +
                     (f", {p['virtual']} chunks per stage" if p["virtual"] > 1 else "") +
                     (f", layers per stage {','.join(map(str, p['stage_layers']))}"
                      if p.get("stage_layers") else ""))
    for c in s.get("collectives", []):
        axes = "×".join(c["axes"]) or "-"
        lines.append(f"  {c['kind']:18s} over {axes:18s} {c['count']:5d} per step, "
                     f"{human_bytes(c['bytes'])} per device")
    lines.append("── where time went " + "─" * 40)
    labels = {"setup_s": "setup (data, init/restore)", "compile_s": "compile (excluded)",
              "first_step_s": "first step (warm-up, excluded)", "steps_s": "training steps",
              "eval_s": "evaluation", "ckpt_s": "checkpoint saves (blocking part)"}
    for k, label in labels.items():
        v = t.get(k, 0.0)
        lines.append(f"  {label:34s} {v:8.2f}s  {v / total if total else 0:6.1%}")
    tps = s["tokens_per_s"]
    lines.append(f"  mean step {s['mean_step_s'] * 1e3:.1f} ms, "
                 f"{tps:,.0f} tokens/s, MFU {metrics.fmt_mfu(s['mfu'])}" if tps else "")
    lines.append("── result " + "─" * 49)
    res = f"  loss {s['final_loss']:.4f}" if s["final_loss"] is not None else "  no steps run"
    if s["val_loss"] is not None:
        res += f", validation loss {s['val_loss']:.4f}"
    if s["unigram_loss"] is not None:
        res += f" (unigram baseline {s['unigram_loss']:.4f}"
        res += f", optimal {s['optimal_loss']:.4f})" if s["optimal_loss"] else ")"
    lines.append(res)
    return "\n".join(lines)
