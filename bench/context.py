"""Context parallelism on 8 simulated CPU devices: per sequence length, one device against
the sequence split over ``context=8`` by each scheme (all-gather, ring). Per row: step time
(best of ``--reps``) and its ratio to one device, or "does not fit" where the compiled
step's peak (``memory_analysis``) exceeds the stated per-device budget (such a row is not
run); compiled temporaries; bytes over ``context`` from the HLO; and the planner's
prediction beside each (``triax.planner``: peak and context bytes, predicted for the CPU's
attention kernel).

    JAX_NUM_CPU_DEVICES=8 python bench/context.py                      # 2k, 8k, 32k; prints
    JAX_NUM_CPU_DEVICES=8 python bench/context.py --write              # into benchmarks.md
    JAX_NUM_CPU_DEVICES=8 python bench/context.py --seqs 2048 --reps 1     # a quick check

Times are wall-clock on the host's CPU cores shared by the 8 simulated devices: run it on a
quiet machine. Every device of a row lives in the same host memory, so a fitting row holds
up to 8 × the budget.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from tables import BENCHMARKS_MD, write_section  # noqa: E402  (bench/ is the script's dir)

from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.costs.comm import traffic  # noqa: E402
from triax.costs.memory import estimate  # noqa: E402
from triax.costs.workload import Layout, Workload  # noqa: E402
from triax.sharding.context import SCHEMES  # noqa: E402
from triax.sharding.introspect import bytes_over, collectives_from_compiled, \
    memory_from_compiled  # noqa: E402
from triax.sharding.rules import get_strategy  # noqa: E402
from triax.training.step_cache import compiled_for  # noqa: E402
from triax.units import human_bytes  # noqa: E402

HEADING = "## Context parallelism"
LAYERS, BATCH, CONTEXT = 2, 1, 8


def measure(cfg, T: int, context: int, scheme: str, budget: int, reps: int) -> dict:
    """Compile one step (abstract inputs) and, when its peak fits ``budget``, time it."""
    devices = jax.devices()[:context]
    mesh = make_mesh(context=context, devices=devices)
    strategy = dataclasses.replace(get_strategy("dp"), context_attention=scheme)
    c = compiled_for(dict(model=cfg, mesh=mesh, strategy=strategy), BATCH, T)
    step = c.step
    mem = memory_from_compiled(step)
    cols = collectives_from_compiled(step, mesh)
    w = Workload.of(cfg, train=True, dtype="fp32", batch=BATCH, seq=T, backend="cpu")
    lay = Layout(context=context, context_attention=scheme)
    predicted = traffic(w, lay).get("context")
    row = {"peak": mem.peak_bytes, "temp": mem.temp_bytes,
           "predicted_peak": estimate(w, lay).modelled,
           "context_bytes": bytes_over(cols, axis="context") if context > 1 else 0,
           "predicted_context": predicted.payload if predicted else 0.0, "ms": None}
    if mem.peak_bytes > budget:
        return row
    state = c.init(seed=0)
    batch = c.trainer.shard_batch(c.trainer.example_batch(BATCH, T))
    best = float("inf")
    for _ in range(reps + 1):          # the first run is a warm-up
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        best = min(best, time.perf_counter() - t)
    row["ms"] = best * 1e3
    del state
    return row


def table(seqs, budget: int, reps: int) -> list[str]:
    rows = ["| seq | plan | step ms | ÷ one device | peak compiled / planner | temporaries | "
            "context bytes HLO / planner |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for T in seqs:
        cfg = config.get("tiny", num_layers=LAYERS)
        cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, T))
        single = None
        for context, scheme in [(1, "all-gather")] + [(CONTEXT, s) for s in SCHEMES]:
            r = measure(cfg, T, context, scheme, budget, reps)
            plan = "one device" if context == 1 else f"context={context} {scheme}"
            if context == 1:
                single = r["ms"]
            if r["ms"] is None:
                ms = ratio = "does not fit"
            else:
                ms = f"{r['ms']:.1f}"
                ratio = "1.00" if context == 1 else (
                    f"{r['ms'] / single:.2f}" if single else "(one device does not fit)")
            ctx = "—" if context == 1 else (
                f"{human_bytes(r['context_bytes'])} / {human_bytes(r['predicted_context'])}")
            rows.append(f"| {T:,} | {plan} | {ms} | {ratio} | {human_bytes(r['peak'])} / "
                        f"{human_bytes(r['predicted_peak'])} | {human_bytes(r['temp'])} | "
                        f"{ctx} |")
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="2048,8192,32768", help="sequence lengths")
    ap.add_argument("--budget-mib", type=int, default=1024,
                    help="per-device memory budget: a step whose compiled peak exceeds it "
                    "does not fit and is not run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", action="store_true", help=f"write the table into "
                    f"{BENCHMARKS_MD.name} ({HEADING[3:]!r})")
    args = ap.parse_args(argv)
    if len(jax.devices()) < CONTEXT:
        sys.exit(f"bench/context.py needs {CONTEXT} devices, JAX has {len(jax.devices())}; "
                 f"set JAX_NUM_CPU_DEVICES={CONTEXT}")
    budget = args.budget_mib * 2**20
    rows = table([int(s) for s in args.seqs.split(",")], budget, args.reps)
    if args.write:
        intro = (f"Regenerate with `JAX_NUM_CPU_DEVICES=8 python bench/context.py --write` "
                 f"(quiet machine). tiny, {LAYERS} layers, batch {BATCH}, fp32, the CPU's "
                 f"attention kernel (reference), train step (forward + backward + AdamW); "
                 f"one device against the sequence split over context={CONTEXT}. A row "
                 f"whose compiled peak (`memory_analysis`) exceeds {args.budget_mib} MiB "
                 f"per device does not fit and is not run. \"planner\": `triax.planner`'s "
                 f"predicted peak (`estimate(...).modelled`) and context payload "
                 f"(`traffic(...)`), formulas in [planner.md](planner.md). The ring is "
                 f"`sharding.ring`'s flash-style custom VJP.")
        write_section(BENCHMARKS_MD, HEADING, intro + "\n\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
