"""Benchmark: triax's train step against a plain-``jit`` reference of the same model with
the same shardings, per layout, on 8 simulated CPU devices.

The reference step is written here with no triax code in it: the model's own ``__call__``
(logits), optax's cross-entropy, ``jax.value_and_grad``, the same optax chain (clip + AdamW
on the same schedule), one ``jax.jit`` whose in/out shardings are the NamedShardings triax's
trainer puts the state and batch on (read once, as data). For the pipelined layouts the
reference is the same model *unpipelined* with the same parameter shardings (layers split
over ``pipe``): XLA then runs the stack's layers where they live, with no schedule.

Timing: rounds of (reference, triax) interleaved, ``--steps`` steps each, every step timed
to completion; a round gives the two medians and their ratio; rounds repeat (up to
``--max-rounds``) until the spread of the ratio over the last three rounds is under 5 %, or
the table says it was not reached. Temporaries are ``memory_analysis().temp_size_in_bytes``;
collective bytes per device per step are read from the compiled HLO
(``sharding.introspect``: loop trip counts and branch frequencies weighted).

    python bench/overhead.py                    # every layout, writes ## Overhead
    python bench/overhead.py --layouts dp,fsdp --no-write
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from tables import write_section  # noqa: E402
from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.pipeline.pipelined import PipelineConfig  # noqa: E402
from triax.sharding.introspect import collectives_from_compiled, memory_from_compiled  # noqa: E402
from triax.training.optim import OptimConfig, make_optimizer  # noqa: E402
from triax.training.step import Trainer  # noqa: E402
from triax.units import mib  # noqa: E402

# (name, mesh sizes, strategy, pipeline fsdp mode or None: not pipelined)
LAYOUTS = (
    ("dp", {"data": 8}, "dp", None),
    ("fsdp", {"data": 8}, "fsdp", None),
    ("zero1", {"data": 8}, "zero1", None),
    ("tp", {"data": 4, "tensor": 2}, "tp", None),
    ("fsdp_tp", {"data": 4, "tensor": 2}, "fsdp_tp", None),
    ("pipe×fsdp, stage", {"data": 4, "pipe": 2}, "fsdp", "stage"),
    ("pipe×fsdp, layer", {"data": 4, "pipe": 2}, "fsdp", "layer"),
    ("pipe×tensor", {"data": 2, "pipe": 2, "tensor": 2}, "tp", "stage"),
)
SPREAD = 0.05


def reference_step(graphdef, tx, state_sh, batch_sh, repl):
    """The plain-jit step: no triax code runs in it (the model is the model)."""
    def loss_fn(params, batch):
        logits, _ = nnx.merge(graphdef, params)(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["targets"]).mean()

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt_state": opt,
                 "step": state["step"] + 1}, loss)
    return jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl),
                   donate_argnums=(0,))


def _collective_mib(compiled, mesh) -> float:
    cols = collectives_from_compiled(compiled, mesh)
    return mib(sum(c.bytes_per_device * (c.count if c.frequency_known else c.at_most or 0)
                   for c in cols))


def _timed(fn, state, batch, steps):
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, out = fn(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return state, statistics.median(times), times


def trace_summary(fn, state, batch, steps: int, top: int = 8):
    """Run ``steps`` steps under ``jax.profiler.trace`` and read the Perfetto trace back:
    ``(state, [(event name, total ms per step)])``, the ``top`` longest in total (host
    dispatch, XLA's thunks and fusions alike)."""
    import glob
    import gzip
    import json
    import tempfile
    from collections import defaultdict
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            state, _, _ = _timed(fn, state, batch, steps)
        (path,) = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    total = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            total[e["name"]] += e["dur"] / 1e3 / steps
    return state, sorted(total.items(), key=lambda kv: -kv[1])[:top]


def one_layout(name, sizes, strategy, mode, cfg, B, T, steps, max_rounds, trace=False):
    mesh = make_mesh(**sizes)
    pipe = PipelineConfig("1f1b", fsdp=mode) if mode else None
    oc = OptimConfig().resolved(1000)
    tr = Trainer(cfg, mesh, strategy, optim=oc, pipeline=pipe)
    batch = tr.shard_batch(tr.example_batch(B, T))
    repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ref = reference_step(tr.abstract.graphdef, make_optimizer(oc), tr.state_shardings,
                         tr.batch_sharding(), repl)
    s_ref, s_tri = tr.init(0), tr.init(0)
    c_ref = ref.lower(tr.abstract_state(), batch).compile()
    c_tri = tr.lower(batch).compile()

    def tri_step(state, batch):
        state, metrics = tr.step(state, batch)
        return state, metrics["loss"]
    s_ref, _, _ = _timed(ref, s_ref, batch, 2)          # warm: compile and first runs
    s_tri, _, _ = _timed(tri_step, s_tri, batch, 2)
    ratios, rounds = [], []
    for _ in range(max_rounds):
        s_ref, m_ref, t_ref = _timed(ref, s_ref, batch, steps)
        s_tri, m_tri, t_tri = _timed(tri_step, s_tri, batch, steps)
        jax.block_until_ready((s_ref, s_tri))
        ratios.append(m_tri / m_ref)
        rounds.append((m_ref, m_tri, t_ref, t_tri))
        last = ratios[-3:]
        if len(last) == 3 and (max(last) - min(last)) / statistics.median(last) < SPREAD:
            break
    last = ratios[-3:]
    spread = (max(last) - min(last)) / statistics.median(last)
    if trace:   # where the time goes, each side, read back from a profiler trace
        for side, fn, st in (("reference", ref, s_ref), ("triax", tri_step, s_tri)):
            _, top = trace_summary(fn, st, batch, 5)
            print(f"{name} {side}: " + "; ".join(f"{n[:60]} {ms:.2f} ms" for n, ms in top),
                  flush=True)
    m_ref, m_tri, t_ref, t_tri = rounds[-1]
    iqr = lambda t: (np.percentile(t, 75) - np.percentile(t, 25)) / np.median(t)  # noqa: E731
    return {"layout": name, "ratio": statistics.median(last), "spread": spread,
            "settled": spread < SPREAD, "rounds": len(ratios),
            "ref_ms": m_ref * 1e3, "tri_ms": m_tri * 1e3,
            "ref_iqr": iqr(t_ref), "tri_iqr": iqr(t_tri),
            "ref_temp": mib(memory_from_compiled(c_ref).temp_bytes),
            "tri_temp": mib(memory_from_compiled(c_tri).temp_bytes),
            "ref_coll": _collective_mib(c_ref, mesh), "tri_coll": _collective_mib(c_tri, mesh)}


def table(rows, args) -> str:
    head = (f"{args.model} ({args.num_layers} layers), B={args.batch_size} × T={args.seq_len}, "
            f"fp32, 8 simulated CPU devices, {args.steps} steps a side per round, rounds "
            f"interleaved (reference, triax, …) until the triax ÷ reference ratio's spread "
            f"over the last three rounds is under 5 % (at most {args.max_rounds} rounds). "
            f"Step times are medians of the last round (spread: interquartile range over "
            f"the median). This machine's 2 cores are shared by five agents: times are "
            f"noisy; temporaries and bytes are exact.\n\n")
    lines = ["| layout | step ms ref / triax (IQR) | triax ÷ ref (spread, rounds) | "
             "temporaries MiB ref / triax | collectives MiB per device ref / triax |",
             "|---|---|---|---|---|"]
    for r in rows:
        settled = "" if r["settled"] else ", **not settled**"
        lines.append(
            f"| {r['layout']} | {r['ref_ms']:.1f} ({r['ref_iqr']:.0%}) / {r['tri_ms']:.1f} "
            f"({r['tri_iqr']:.0%}) | {r['ratio']:.3f} ({r['spread']:.1%}, {r['rounds']}"
            f"{settled}) | {r['ref_temp']:.2f} / {r['tri_temp']:.2f} | "
            f"{r['ref_coll']:.2f} / {r['tri_coll']:.2f} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-rounds", type=int, default=5)
    ap.add_argument("--layouts", default="", help="comma-separated names (default: all)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--trace", action="store_true",
                    help="also read back a jax.profiler trace of 5 steps a side per layout")
    args = ap.parse_args(argv)
    cfg = config.get(args.model, num_layers=args.num_layers)
    pick = [n.strip() for n in args.layouts.split(",") if n.strip()]
    rows = []
    for name, sizes, strategy, mode in LAYOUTS:
        if pick and name not in pick:
            continue
        r = one_layout(name, sizes, strategy, mode, cfg, args.batch_size, args.seq_len,
                       args.steps, args.max_rounds, args.trace)
        print(r, flush=True)
        rows.append(r)
    out = table(rows, args)
    print(out)
    if not args.no_write:
        write_section(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md",
                      "## Overhead: triax against plain jit", out)


if __name__ == "__main__":
    main()
