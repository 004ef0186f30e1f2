"""MoE expert parallelism: tokens/s and all-to-all bytes per step across EP sizes.

Runs on 8 simulated CPU devices (mesh data=8/EP × expert=EP, strategy dp) and prints a
markdown table: measured step throughput, the all-to-all bytes per device per step read from
the compiled HLO, and the closed-form prediction of ``triax.sharding.experts.all_to_all_bytes``.

    python bench/moe.py --models tiny-moe,small-moe --ep 1,2,4,8 --layers 2 --steps 5
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.sharding.experts import all_to_all_bytes  # noqa: E402
from triax.sharding.introspect import bytes_over, collectives_from_compiled  # noqa: E402
from triax.training.step import Trainer  # noqa: E402


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
    pred = all_to_all_bytes(cfg, batch, seq, mesh, tr.strategy.rules)
    return {"tokens_per_s": batch * seq / dt, "step_ms": 1e3 * dt,
            "a2a_measured": bytes_over(colls, kind="all-to-all"),
            "a2a_count": sum(c.count for c in colls if c.kind == "all-to-all"),
            "a2a_predicted": pred["bytes_per_step"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-moe,small-moe")
    ap.add_argument("--ep", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"| model | mesh | tokens/s | step ms | all-to-all ops/step | all-to-all MiB/device/step"
          f" (HLO) | predicted MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        cfg = config.get(name, num_layers=args.layers)
        for ep in (int(e) for e in args.ep.split(",")):
            r = measure(cfg, ep, args.batch, args.seq, args.steps)
            print(f"| {name} (L={args.layers}) | data={jax.device_count() // ep},expert={ep} | "
                  f"{r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {r['a2a_count']} | "
                  f"{r['a2a_measured'] / 2**20:.3f} | {r['a2a_predicted'] / 2**20:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
