"""HSDP and --tp-overlap on 8 simulated CPU devices: one table per lever, one run each.

Per row: collective bytes per device per step from the compiled HLO, by mesh axis and
kind; the compiled step's argument bytes and peak (``memory_analysis``); and the CPU step
time (best of ``--reps`` after a warm-up). On CPU the times show the programs run, not the
speed of links that do not exist here: the levers are about which links the bytes take
(HSDP) and whether they wait for the matmul (collective matmul).

    JAX_NUM_CPU_DEVICES=8 python bench/comm_levers.py            # prints both tables
    JAX_NUM_CPU_DEVICES=8 python bench/comm_levers.py --write    # into docs/benchmarks.md
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

from triax.mesh import describe, make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.sharding.introspect import collectives_from_compiled, memory_from_compiled  # noqa: E402
from triax.sharding.rules import get_strategy  # noqa: E402
from triax.training.step_cache import compiled_for  # noqa: E402
from triax.units import human_bytes  # noqa: E402

LAYERS, BATCH, SEQ = 2, 8, 64
HSDP_HEADING = "## HSDP (replica × data)"
OVERLAP_HEADING = "## Collective matmul (--tp-overlap)"
HSDP_ROWS = [("fsdp", dict(data=8)), ("fsdp", dict(replica=2, data=4)),
             ("fsdp", dict(replica=4, data=2)), ("dp", dict(data=8))]
OVERLAP_ROWS = [("tp_sp", dict(data=2, tensor=4), False), ("tp_sp", dict(data=2, tensor=4), True),
                ("fsdp_tp_sp", dict(data=4, tensor=2), False),
                ("fsdp_tp_sp", dict(data=4, tensor=2), True)]


def measure(strategy, sizes: dict, reps: int) -> dict:
    cfg = config.get("tiny", num_layers=LAYERS)
    mesh = make_mesh(**sizes)
    c = compiled_for(dict(model=cfg, mesh=mesh, strategy=strategy), BATCH, SEQ)
    mem = memory_from_compiled(c.step)
    by = {}
    for col in collectives_from_compiled(c.step, mesh):
        key = (col.kind, col.axes)
        by[key] = by.get(key, 0) + col.bytes_per_device * col.count
    state = c.init(seed=0)
    batch = c.trainer.shard_batch(c.trainer.example_batch(BATCH, SEQ))
    best = float("inf")
    for _ in range(reps + 1):          # the first run is a warm-up
        t = time.perf_counter()
        state, metrics = c.step(state, batch)
        jax.block_until_ready(metrics)
        best = min(best, time.perf_counter() - t)
    return {"mesh": describe(mesh), "bytes": by, "args": mem.argument_bytes,
            "peak": mem.peak_bytes, "ms": best * 1e3}


def _sum(by: dict, kinds, axis) -> str:
    """Bytes of ``kinds`` on ops whose groups span ``axis`` (alone, or with others)."""
    n = sum(b for (k, axes), b in by.items() if k in kinds and axis in axes)
    return human_bytes(n) if n else "—"


def hsdp_table(reps: int) -> list[str]:
    rows = ["| plan | all-gather over data | gradient reduction over data | all-reduce over "
            "replica | arguments / device | peak / device | CPU step ms |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, sizes in HSDP_ROWS:
        r = measure(get_strategy(name), sizes, reps)
        rows.append(f"| {r['mesh']} {name} | {_sum(r['bytes'], ('all-gather',), 'data')} | "
                    f"{_sum(r['bytes'], ('reduce-scatter', 'all-reduce'), 'data')} | "
                    f"{_sum(r['bytes'], ('all-reduce',), 'replica')} | "
                    f"{human_bytes(r['args'])} | {human_bytes(r['peak'])} | {r['ms']:.1f} |")
        print(rows[-1], flush=True)
    return rows


def overlap_table(reps: int) -> list[str]:
    rows = ["| plan | all-gather over tensor | all-reduce over tensor | permutes over tensor | "
            "peak / device | CPU step ms |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, sizes, on in OVERLAP_ROWS:
        st = dataclasses.replace(get_strategy(name), tp_overlap=on)
        r = measure(st, sizes, reps)
        label = f"{r['mesh']} {name}" + (" --tp-overlap" if on else "")
        by = {k: v for k, v in r["bytes"].items() if k[1] == ("tensor",)}
        rows.append(f"| {label} | {_sum(by, ('all-gather',), 'tensor')} | "
                    f"{_sum(by, ('all-reduce', 'reduce-scatter'), 'tensor')} | "
                    f"{_sum(by, ('collective-permute',), 'tensor')} | "
                    f"{human_bytes(r['peak'])} | {r['ms']:.1f} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", action="store_true",
                    help=f"write both tables into {BENCHMARKS_MD.name}")
    args = ap.parse_args(argv)
    if len(jax.devices()) < 8:
        sys.exit(f"bench/comm_levers.py needs 8 devices, JAX has {len(jax.devices())}; "
                 f"set JAX_NUM_CPU_DEVICES=8")
    common = (f"tiny, {LAYERS} layers, batch {BATCH}, seq {SEQ}, fp32, train step (forward + "
              f"backward + AdamW) on 8 simulated CPU devices. Bytes per device per step from "
              f"the compiled HLO (`triax.sharding.introspect`; an op over several axes counts "
              f"toward each); memory from `memory_analysis`; **CPU** step time, best of "
              f"{args.reps} (the host's cores shared by all 8 devices: it shows the program "
              f"runs, not link speed). Regenerate with `JAX_NUM_CPU_DEVICES=8 python "
              f"bench/comm_levers.py --write`.")
    hsdp = hsdp_table(args.reps)
    overlap = overlap_table(args.reps)
    if args.write:
        write_section(BENCHMARKS_MD, HSDP_HEADING, common + " HSDP keeps FSDP's gathers and "
                      "reductions inside each replica group (`data`) and sends one all-reduce "
                      "of the gradient shard across groups (`replica`, the inter-node links "
                      "on a cluster); the norm scales and the loss reduce over both at once."
                      "\n\n" + "\n".join(hsdp))
        write_section(BENCHMARKS_MD, OVERLAP_HEADING, common + " Bytes over `tensor` alone. "
                      "With `--tp-overlap` the sequence-parallel gathers and scatters of the "
                      "blocks' projections become rings of permutes, each beside a partial "
                      "matmul; what stays on `tensor` is the head's and the embedding's, the "
                      "norm scales' gradients and the replicated K/V heads' (tiny: 2 KV "
                      "heads).\n\n" + "\n".join(overlap))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
