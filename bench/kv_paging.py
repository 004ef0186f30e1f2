"""Paged KV cache: concurrent sequences at equal KV memory, paged ÷ slot-reserved.

One CPU device, one replica. Both servers hold the same KV memory (asserted: the engine's
pool bytes per device): ``--reserved-slots`` × ``--max-len`` positions. *Slot-reserved*:
that many decode slots, each able to hold ``max_len`` positions, as a cache reserved per
slot is (a pool of exactly slots × max_len's blocks admits by slot only). *Paged*:
``--paged-slots`` decode slots over the same pool, a request admitted when its prompt plus
``max_tokens`` fit the free blocks. The mixed workload: ``--long`` requests of prompt and
``max_tokens`` ``--max-len``/2 each, and ``--short`` ones of prompt 8..24, max_tokens 8..16
(seeded), all queued at once, greedy. Figures, from the server's own counters: the peak
number of sequences in decode slots at once, and the mean over decode steps (decoded tokens
÷ decode steps); wall time of the whole workload (compilation excluded, ``warmup``).
Both runs' tokens are checked equal.

    python bench/kv_paging.py           # writes the "## Paged KV cache" section
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tables import BENCHMARKS_MD, write_section  # noqa: E402

from triax.inference.engine import EngineConfig  # noqa: E402
from triax.inference.server import Server  # noqa: E402
from triax.models import config  # noqa: E402
from triax.sharding.partition import abstract_model, init_params  # noqa: E402
from triax.mesh import make_mesh  # noqa: E402

SECTION = "## Paged KV cache"


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(0)
    half = args.max_len // 2
    jobs = [(rng.integers(0, vocab, half).tolist(), half) for _ in range(args.long)]
    jobs += [(rng.integers(0, vocab, int(rng.integers(8, 25))).tolist(),
              int(rng.integers(8, 17))) for _ in range(args.short)]
    order = rng.permutation(len(jobs))   # the long ones arrive among the short
    return [jobs[i] for i in order]


def serve(cfg, params, mesh, ecfg: EngineConfig, jobs) -> dict:
    server = Server.from_params(cfg, params, [mesh], "tp", ecfg)
    server.warmup(sorted({len(p) for p, _ in jobs}))
    t0 = time.perf_counter()
    ids = [server.submit(p, k) for p, k in jobs]
    results = server.run()
    wall = time.perf_counter() - t0
    st, eng = server.stats, server.engines[0]
    assert server.kv_blocks_in_use == 0 and eng.kv.committed == 0, "a KV block leaked"
    return {"tokens": [results[i].tokens for i in ids], "peak": st["peak_running"],
            "mean": st["decode_tokens"] / max(st["decode_steps"], 1), "wall": wall,
            "generated": st["generated_tokens"], "bytes": eng.pool.bytes_per_device(),
            "blocks": eng.kv.total, "block_size": eng.kv.block_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--reserved-slots", type=int, default=8)
    ap.add_argument("--paged-slots", default="16,32,64", help="comma-separated: one row each")
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--short", type=int, default=58)
    ap.add_argument("--no-write", action="store_true", help="print, do not touch the docs")
    args = ap.parse_args()
    cfg = config.get(args.model)
    mesh = make_mesh(devices=jax.devices()[:1])
    params = init_params(abstract_model(cfg), mesh, "tp", 0)
    jobs = workload(args, cfg.vocab_size)
    base = EngineConfig(max_batch=args.reserved_slots, max_len=args.max_len, min_bucket=16)
    reserved = serve(cfg, params, mesh, base, jobs)
    rows = [("slot-reserved", args.reserved_slots, reserved)]
    for slots in map(int, args.paged_slots.split(",")):
        paged = serve(cfg, params, mesh, EngineConfig(
            max_batch=slots, max_len=args.max_len, min_bucket=16,
            kv_blocks=reserved["blocks"]), jobs)
        assert paged["bytes"] == reserved["bytes"], "not equal KV memory"
        assert paged["tokens"] == reserved["tokens"], "the runs' tokens differ"
        rows.append(("paged", slots, paged))
    lines = [f"`{cfg.name}` ({cfg.num_layers} layers), 1 CPU device; KV memory "
             f"{reserved['bytes'] / 2 ** 20:.2f} MiB in both ({reserved['blocks']} blocks × "
             f"{reserved['block_size']} positions = {args.reserved_slots} slots × "
             f"{args.max_len}); {len(jobs)} greedy requests queued at once: {args.long} of "
             f"prompt {args.max_len // 2} + {args.max_len // 2} tokens, {args.short} of prompt "
             f"8..24 + 8..16 tokens; `python bench/kv_paging.py`.", "",
             "| cache | decode slots | peak concurrent sequences | ÷ slot-reserved | mean "
             "concurrent (per decode step) | ÷ slot-reserved | wall s | generated tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {slots} | {r['peak']} | {r['peak'] / reserved['peak']:.1f}× | "
              f"{r['mean']:.1f} | {r['mean'] / reserved['mean']:.1f}× | {r['wall']:.2f} | "
              f"{r['generated'] / r['wall']:.0f} |" for name, slots, r in rows]
    lines += ["", "Goal: ≥ 2× concurrent sequences at equal KV memory. Every run's tokens are "
              "equal. The mean counts every decode step, the tail where only the long requests "
              "are left included. A decode step runs only the live rows (a power-of-two bucket "
              "of them per row group) and a prefill a power-of-two batch of the admitted "
              "prompts, so slots the traffic does not fill cost little; the 64-slot run still "
              "pays for prefill batches and decode buckets larger than 8 slots'. Wall times "
              "are from a shared 2-core machine: compare rows of this table only."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(BENCHMARKS_MD, SECTION, body)


if __name__ == "__main__":
    main()
