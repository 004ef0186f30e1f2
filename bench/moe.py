"""MoE expert parallelism: tokens/s and all-to-all bytes per step across EP sizes.

Runs on 8 simulated CPU devices (mesh data=8/EP × expert=EP, strategy dp) and prints a
markdown table: measured step throughput, the all-to-all bytes per device per step read from
the compiled HLO, the closed form of ``triax.sharding.experts.all_to_all_bytes``, and the
planner's prediction for the same model, mesh and batch (``triax.planner``: the all-to-all
payload of ``comm.traffic`` on the ``expert`` axis, and ``evaluate``'s tokens/s on one node
of 8 × h100-80gb, fp32 like the run).

    python bench/moe.py --models tiny-moe,small-moe --ep 1,2,4,8 --layers 2 --steps 5

``--planner-only`` recomputes the prediction columns (instant) and takes the measured ones
from the table already in ``--measured`` (default docs/benchmarks.md), so adding a
prediction does not mean re-running the slow measurement.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.planner import Layout, Workload, cluster, evaluate  # noqa: E402
from triax.units import mib  # noqa: E402
from triax.costs.comm import traffic  # noqa: E402
from triax.sharding.experts import all_to_all_bytes  # noqa: E402
from triax.sharding.introspect import bytes_over, collectives_from_compiled  # noqa: E402
from triax.sharding.rules import get_strategy  # noqa: E402
from triax.training.step import Trainer  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def measure(cfg, ep: int, batch: int, seq: int, steps: int) -> dict:
    mesh = make_mesh(data=jax.device_count() // ep, expert=ep)
    tr = Trainer(cfg, mesh, "dp")
    compiled = tr.lower(batch, seq).compile()
    colls = collectives_from_compiled(compiled, mesh)
    state = tr.init(0)
    data = tr.shard_batch(tr.example_batch(batch, seq))
    state, m = compiled(state, data)          # warm-up
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = compiled(state, data)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / steps
    return {"tokens_per_s": f"{batch * seq / dt:.0f}", "step_ms": f"{1e3 * dt:.1f}",
            "a2a_count": str(sum(c.count for c in colls if c.kind == "all-to-all")),
            "a2a_measured": f"{mib(bytes_over(colls, kind='all-to-all')):.3f}"}


def predict(cfg, ep: int, batch: int, seq: int, gpu: str) -> dict:
    """Closed form (sharding.experts) and planner figures for the same model, mesh, batch."""
    data = jax.device_count() // ep
    closed = all_to_all_bytes(cfg, batch, seq, make_mesh(data=data, expert=ep),
                              get_strategy("dp").rules)
    w = Workload.of(cfg, train=True, dtype="fp32", batch=batch, seq=seq)
    lay = Layout(data=data, expert=ep, strategy="dp")
    expert = traffic(w, lay).get("expert")
    planner_a2a = expert.payload_by_kind.get("all-to-all", 0.0) if expert else 0.0
    return {"closed": closed["bytes_per_step"], "planner": planner_a2a,
            "planner_tps": evaluate(w, lay, cluster(gpu, 8, 1)).tokens_per_s}


def read_measured(path: Path, label: str, mesh: str) -> dict:
    """The measured cells of one row of an existing table (for --planner-only)."""
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == [label, mesh]:
            return dict(zip(("tokens_per_s", "step_ms", "a2a_count", "a2a_measured"),
                            cells[2:6]))
    raise ValueError(f"{path}: no measured row for {label} {mesh}; run without "
                     f"--planner-only to measure it")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-moe,small-moe")
    ap.add_argument("--ep", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gpu", default="h100-80gb", help="planner device kind (8 per node)")
    ap.add_argument("--planner-only", action="store_true",
                    help="recompute only the prediction columns; measured ones from --measured")
    ap.add_argument("--measured", type=Path, default=DOCS,
                    help="markdown holding this table's measured rows (for --planner-only)")
    args = ap.parse_args(argv)
    print("| model | mesh | tokens/s | step ms | all-to-all ops/step | all-to-all MiB/device/step"
          f" (HLO) | closed form MiB | planner all-to-all MiB | planner tokens/s "
          f"(8 × {args.gpu}, fp32) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        cfg = config.get(name, num_layers=args.layers)
        for ep in (int(e) for e in args.ep.split(",")):
            label = f"{name} (L={args.layers})"
            mesh = f"data={jax.device_count() // ep},expert={ep}"
            try:
                r = (read_measured(args.measured, label, mesh) if args.planner_only
                     else measure(cfg, ep, args.batch, args.seq, args.steps))
            except ValueError as e:
                ap.error(str(e))
            p = predict(cfg, ep, args.batch, args.seq, args.gpu)
            print(f"| {label} | {mesh} | {r['tokens_per_s']} | {r['step_ms']} | "
                  f"{r['a2a_count']} | {r['a2a_measured']} | {mib(p['closed']):.3f} | "
                  f"{mib(p['planner']):.3f} | {p['planner_tps']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
