"""End-of-run summary: how the model was split over the mesh and where the time went.

    >>> print(format_summary(result.summary))
"""
from __future__ import annotations

import jax
import numpy as np

from triax.mesh import describe, mesh_sizes
from triax.training import metrics as M


def _per_device_bytes(tree) -> int:
    """Bytes one device holds for ``tree`` (from each array's shard shape)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * x.dtype.itemsize
    return total


def _total_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def summary(loop, result, start: int) -> dict:
    run, tr, times = loop.rc, loop.trainer, loop.times
    state = result.state
    steps_timed = max(len(result.losses) - 1, 0)  # the first executed step is warm-up
    mean_step = times["steps_s"] / steps_timed if steps_timed else times["first_step_s"]
    tokens = run.batch_size * run.seq_len
    out = {
        "model": tr.cfg.name, "params": tr.cfg.num_params, "mesh": describe(tr.mesh),
        "mesh_sizes": mesh_sizes(tr.mesh), "strategy": tr.strategy.name,
        "devices": jax.device_count(), "processes": jax.process_count(),
        "steps": run.steps, "steps_this_run": len(result.losses),
        "final_loss": result.losses[-1] if result.losses else None,
        "val_loss": result.val_losses.get(run.steps),
        "unigram_loss": loop.corpus.info.get("unigram_loss"),
        "optimal_loss": loop.corpus.info.get("optimal_loss"),
        "param_bytes_per_device": _per_device_bytes(state["params"]),
        "param_bytes_total": _total_bytes(state["params"]),
        "opt_bytes_per_device": _per_device_bytes(state["opt_state"]),
        "opt_bytes_total": _total_bytes(state["opt_state"]),
        "mean_step_s": mean_step, "tokens_per_s": tokens / mean_step if mean_step else None,
        "mfu": M.mfu(loop.flops_per_step, mean_step, jax.device_count(), loop.peak),
        "time": {k: round(v, 3) for k, v in times.items()},
        "pipeline": _pipeline(tr), "collectives": _collectives(loop.compiled),
    }
    return out


def _pipeline(trainer):
    p = getattr(trainer, "pipeline", None)
    if p is None:
        return None
    s = p.schedule
    return {"schedule": s.kind.value, "stages": s.stages, "microbatches": s.microbatches,
            "virtual": s.virtual}


def _collectives(compiled) -> list[dict]:
    """Per (kind, mesh axes): ops and bytes per device per step, from the compiled HLO."""
    from triax.sharding.introspect.hlo import collectives_from_compiled, summarize
    if not compiled.is_step_compiled:
        return []
    totals = summarize(collectives_from_compiled(compiled.step, compiled.trainer.mesh))
    return [{"kind": k, "axes": list(axes), **v} for (k, axes), v in sorted(totals.items())]


def _mb(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def format_summary(s: dict) -> str:
    """Readable multi-line summary for the terminal."""
    t = s["time"]
    total = sum(t.values())
    lines = [
        "── how it was split " + "─" * 40,
        f"  {s['model']} ({s['params'] / 1e6:.2f}M params) on {s['mesh']} "
        f"({s['devices']} devices, {s['processes']} process(es)), strategy {s['strategy']}",
        f"  parameters: {_mb(s['param_bytes_per_device'])} per device of "
        f"{_mb(s['param_bytes_total'])} total "
        f"({s['param_bytes_total'] / max(s['param_bytes_per_device'], 1):.1f}× split)",
        f"  optimizer:  {_mb(s['opt_bytes_per_device'])} per device of "
        f"{_mb(s['opt_bytes_total'])} total "
        f"({s['opt_bytes_total'] / max(s['opt_bytes_per_device'], 1):.1f}× split)",
    ]
    if s.get("pipeline"):
        p = s["pipeline"]
        lines.append(f"  pipeline:   {p['schedule']} over {p['stages']} stages, "
                     f"{p['microbatches']} micro-batches" +
                     (f", {p['virtual']} chunks per stage" if p["virtual"] > 1 else ""))
    for c in s.get("collectives", []):
        axes = "×".join(c["axes"]) or "-"
        lines.append(f"  {c['kind']:18s} over {axes:18s} {c['count']:5d} per step, "
                     f"{_mb(c['bytes'])} per device")
    lines.append("── where time went " + "─" * 40)
    labels = {"setup_s": "setup (data, init/restore)", "compile_s": "compile (excluded)",
              "first_step_s": "first step (warm-up, excluded)", "steps_s": "training steps",
              "eval_s": "evaluation", "ckpt_s": "checkpoint saves (blocking part)"}
    for k, label in labels.items():
        v = t.get(k, 0.0)
        lines.append(f"  {label:34s} {v:8.2f}s  {v / total if total else 0:6.1%}")
    tps = s["tokens_per_s"]
    lines.append(f"  mean step {s['mean_step_s'] * 1e3:.1f} ms, "
                 f"{tps:,.0f} tokens/s, MFU {M.fmt_mfu(s['mfu'])}" if tps else "")
    lines.append("── result " + "─" * 49)
    res = f"  loss {s['final_loss']:.4f}" if s["final_loss"] is not None else "  no steps run"
    if s["val_loss"] is not None:
        res += f", validation loss {s['val_loss']:.4f}"
    if s["unigram_loss"] is not None:
        res += f" (unigram baseline {s['unigram_loss']:.4f}"
        res += f", optimal {s['optimal_loss']:.4f})" if s["optimal_loss"] else ")"
    lines.append(res)
    return "\n".join(lines)
