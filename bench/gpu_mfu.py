"""Model FLOPs utilisation of one training step on a GPU: a ~1B-parameter Llama (llama3-1b
shapes), bf16 compute over fp32 master weights, AdamW, on every local device; one row per
lever: bf16, fp8 (the block's matmuls in float8, ``models.fp8``) and bf16 with the optimizer
state offloaded to the host (``training.offload``, the update ``costs.offload`` prices lower).

MFU = cfg.flops_per_token(T) × tokens per step ÷ (step time × devices × peak bf16 FLOP/s),
peak from ``triax.training.metrics.PEAK_FLOPS`` (H100/H200: 989 TFLOP/s dense bf16).
Target: ≥ 55% on an H100/H200.

    python bench/gpu_mfu.py                       # llama3-1b, B=8, T=2048, bf16, 10 steps
    python bench/gpu_mfu.py --batch-size 16 --remat dots_no_batch
    python bench/gpu_mfu.py --rows fp8            # one row
    python bench/gpu_mfu.py --smoke               # tiny model on CPU: checks the script runs
"""
from __future__ import annotations

import argparse
import os
import sys
import time


# row -> (precision, offloaded state parts)
ROWS = {"bf16": ("bf16", ()), "fp8": ("fp8", ()), "offload": ("bf16", ("optimizer",))}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-1b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated rows, of {', '.join(ROWS)}")
    p.add_argument("--remat", default="none")
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps, CPU is fine")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.model, args.num_layers, args.batch_size, args.seq_len, args.steps = \
            "tiny", 2, 4, 64, 3
    else:  # overlap collectives/compute where XLA can (harmless on one GPU)
        os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise SystemExit(f"--rows: unknown row {bad[0]!r}; choose from {', '.join(ROWS)}")
    for row in rows:
        measure(args, row, *ROWS[row])
    return 0


def measure(args, row: str, precision: str, offload: tuple) -> None:
    """Compile and time ``row``'s step, print its MFU line."""
    import jax
    import numpy as np
    from triax.costs.offload import cheaper_update
    from triax.costs.workload import Layout, Workload
    from triax.mesh import make_mesh
    from triax.models import config as mc
    from triax.training import metrics as M
    from triax.training.config import RunConfig
    from triax.training.offload import Offload
    from triax.training.step import Trainer

    cfg = mc.get(args.model, args.num_layers)
    n = jax.device_count()
    strategy = args.strategy if n > 1 else "dp"
    run = RunConfig.of(model=args.model, num_layers=args.num_layers, precision=precision,
                       remat=args.remat, batch_size=args.batch_size, seq_len=args.seq_len,
                       strategy=strategy)
    exe = run.exec_config()
    off = Offload(offload, cheaper_update(Workload.of_run(run, cfg),
                                          Layout(data=n, strategy=strategy), offload))
    trainer = Trainer(cfg, make_mesh(data=n), strategy, exe=exe, total_steps=args.steps + 1,
                      offload=off)
    print(f"[{row}] {cfg.name}: {cfg.num_params / 1e6:,.1f}M params, {n} × "
          f"{jax.devices()[0].device_kind}, B={args.batch_size} T={args.seq_len} {precision} "
          f"remat={args.remat} offload={','.join(offload) or 'none'}"
          f"{f' ({off.update})' if offload else ''}")
    state = trainer.init(0)
    t = time.perf_counter()
    step = trainer.lower(args.batch_size, args.seq_len).compile()
    print(f"compile {time.perf_counter() - t:.1f}s")
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), dtype=np.int32)
    batch = trainer.shard_batch({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    state, m = step(state, batch)  # warm-up
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(args.steps):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t) / args.steps
    tokens = args.batch_size * args.seq_len
    flops = cfg.flops_per_token(args.seq_len) * tokens
    dev = jax.devices()[0]
    peak = M.peak_flops_per_device(dev.device_kind) if dev.platform != "cpu" else None
    u = M.mfu(flops, dt, n, peak)
    print(f"[{row}] step {dt * 1e3:.1f} ms, {tokens / dt:,.0f} tokens/s, "
          f"{flops / dt / n / 1e12:.1f} TFLOP/s per device, loss {float(m['loss']):.3f}, "
          f"MFU {M.fmt_mfu(u)} (against the bf16 peak)")


if __name__ == "__main__":
    sys.exit(main())
