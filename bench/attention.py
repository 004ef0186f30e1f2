"""Attention implementations: forward+backward time and compiled temporaries of one attention
call (tiny's heads: N=8 query, K=2 KV heads, head dim 8; causal; fp32) on the local backend.

This is the measurement behind ``triax.models.attention.AUTO`` on CPU; the table goes into
docs/benchmarks.md (section "Attention implementations").

    python bench/attention.py                        # B×T = 16×128, 8×512, 2×2048
    python bench/attention.py --shapes 1x4096 --reps 3 --no-write
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from tables import BENCHMARKS_MD, write_section  # (bench/ is the script's dir)

from triax.models import attention as A
from triax.models import visibility as V
from triax.units import human_bytes

HEADING = "## Attention implementations"
N, K, H = 8, 2, 8


def measure(name: str, B: int, T: int, reps: int) -> tuple[float, int]:
    """(best forward+backward ms of ``reps``, compiled temporaries in bytes)."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, N, H))
    k, v = jax.random.normal(kk, (B, T, K, H)), jax.random.normal(kv, (B, T, K, H))
    vis = V.Visibility.causal(B, T)
    fn = A.IMPLEMENTATIONS[name]
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, vis) ** 2), argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    jax.block_until_ready(compiled(q, k, v))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        best = min(best, time.perf_counter() - t)
    return best * 1e3, compiled.memory_analysis().temp_size_in_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x128,8x512,2x2048", help="B×T pairs, e.g. 16x128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    names = list(A.IMPLEMENTATIONS)
    rows = ["| B × T | " + " | ".join(f"{n} ms | {n} temporaries" for n in names) + " |",
            "|---|" + "---:|---:|" * len(names)]
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        cells = []
        for n in names:
            ms, temp = measure(n, B, T, args.reps)
            cells += [f"{ms:.1f}", human_bytes(temp)]
        rows.append(f"| {B} × {T} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    body = "\n".join([
        HEADING, "",
        f"One attention call, forward+backward, best of {args.reps} "
        f"(`python bench/attention.py`; backend {jax.default_backend()}, "
        f"{jax.devices()[0].device_kind}; N={N}, K={K}, H={H}, causal, fp32; blockwise with "
        f"its default block of {A.BLOCK_SIZE} keys). `auto` on this backend: "
        f"`{A.resolve('auto')}`.", "", *rows])
    if not args.no_write:
        write_section(BENCHMARKS_MD, HEADING, body)
    print(body)
    return 0


if __name__ == "__main__":
    main()
