"""The serving engine's dtypes and prefix cache, in-process (one CPU device, one replica).

*Dtypes*: the same requests served with ``--dtype float32`` and ``bfloat16`` (and
``--kv-dtype int8`` over bf16 weights): KV positions one GiB of pool holds (from the pool's
bytes per device, ``inference.kv_pool``, checked against the allocated arrays), decode tokens
per second (the server's own counters, compilation excluded), and greedy token agreement
with fp32.

*Prefix cache*: ``--requests`` requests that share a ``--system``-token system prompt, each
with its own 16-token question and 16 generated tokens, all queued at once; the first is
served alone (its blocks cached), then the rest. With and without the cache: TTFT p50/p99
and generated tokens per second over the whole workload, tokens checked equal.

    python bench/serve_engine.py        # writes "## Serving dtypes" and "## Prefix cache"
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
from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.sharding.partition import abstract_model, init_params  # noqa: E402

GIB = 1 << 30


def serve(cfg, params, mesh, ecfg: EngineConfig, jobs, first_alone=False) -> dict:
    server = Server.from_params(cfg, params, [mesh], "tp", ecfg)
    server.warmup(sorted({len(p) for p, _ in jobs}))
    t0 = time.perf_counter()
    ids = []
    if first_alone:
        ids.append(server.submit(*jobs[0]))
        server.run()
    ids += [server.submit(p, k) for p, k in jobs[len(ids):]]
    results = server.run()
    wall = time.perf_counter() - t0
    eng, st = server.engines[0], server.stats
    placed = sum(a.addressable_shards[0].data.nbytes for a in eng.cache.values())
    assert placed == eng.pool.bytes_per_device(), "the pool's bytes are not what it holds"
    ttft = np.array([results[i].ttft_s for i in ids]) * 1e3
    return {"tokens": [results[i].tokens for i in ids], "wall": wall,
            "decode": server.decode_tokens_per_s, "generated": st["generated_tokens"],
            "positions_per_gib": GIB * eng.kv.total * eng.kv.block_size / placed,
            "ttft50": np.percentile(ttft, 50), "ttft99": np.percentile(ttft, 99),
            "hits": st["prefix_hits"], "queries": st["prefix_queries"]}


def dtypes(args, mesh) -> str:
    cfg = config.get(args.dtype_model)
    params = init_params(abstract_model(cfg), mesh, "tp", 0)
    rng = np.random.default_rng(0)
    jobs = [(rng.integers(0, cfg.vocab_size, int(rng.integers(8, 33))).tolist(), args.new)
            for _ in range(args.dtype_requests)]
    rows = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")):
        ecfg = EngineConfig(max_batch=args.slots, max_len=128, min_bucket=32, dtype=dtype,
                            kv_dtype=kv)
        rows[dtype, kv] = serve(cfg, params, mesh, ecfg, jobs)
    ref = np.array(rows["float32", "auto"]["tokens"])
    lines = [f"`{cfg.name}` ({cfg.num_layers} layers), 1 CPU device, {args.slots} slots; "
             f"{len(jobs)} greedy requests (prompt 8..32, {args.new} new tokens) queued at "
             f"once; `python bench/serve_engine.py`.", "",
             "| --dtype | --kv-dtype | KV positions per GiB | ÷ fp32 | decode tok/s | ÷ fp32 "
             "| greedy tokens equal to fp32 |", "|---|---|---:|---:|---:|---:|---:|"]
    base = rows["float32", "auto"]
    for (dtype, kv), r in rows.items():
        agree = (np.array(r["tokens"]) == ref).mean()
        lines.append(f"| {dtype} | {kv} | {r['positions_per_gib']:,.0f} | "
                     f"{r['positions_per_gib'] / base['positions_per_gib']:.2f}× | "
                     f"{r['decode']:.0f} | {r['decode'] / base['decode']:.2f}× | "
                     f"{agree:.1%} |")
    lines += ["", "Positions per GiB are exact (the pool's bytes per device, k and v, int8's "
              "per-block scales included). Decode tok/s is from one run on a shared 2-core "
              "CPU while other jobs ran (CPU figures rank only): a decode step of `small` "
              "reads its weights and KV pool, so halving (bf16) and quartering (int8 KV) "
              "those bytes shows even here; the greedy agreement is that of a random-init "
              "model whose logits are nearly flat (docs/serving.md, \"Dtypes\"), and a "
              "flipped token changes every later one of its request."]
    return "\n".join(lines)


def prefix(args, mesh) -> str:
    cfg = config.TINY.replace(max_seq_len=2048)
    params = init_params(abstract_model(cfg), mesh, "tp", 0)
    rng = np.random.default_rng(1)
    system = rng.integers(0, cfg.vocab_size, args.system).tolist()
    jobs = [(system + rng.integers(0, cfg.vocab_size, 16).tolist(), 16)
            for _ in range(args.requests)]
    max_len = 16 * -(-(args.system + 32) // 16)
    rows = {}
    for on in (False, True):
        ecfg = EngineConfig(max_batch=args.slots, max_len=max_len, min_bucket=16,
                            prefix_cache=on)
        rows[on] = serve(cfg, params, mesh, ecfg, jobs, first_alone=True)
    assert rows[True]["tokens"] == rows[False]["tokens"], "the cache changed a token"
    lines = [f"`{cfg.name}` ({cfg.num_layers} layers), 1 CPU device, {args.slots} slots; "
             f"{args.requests} greedy requests sharing a {args.system}-token system prompt, "
             f"each + 16 tokens of its own, 16 generated; the first served alone (its blocks "
             f"cached), then the rest queued at once; `python bench/serve_engine.py`.", "",
             "| prefix cache | prompt tokens from cache | TTFT p50 ms | TTFT p99 ms | "
             "generated tok/s | ÷ off |", "|---|---:|---:|---:|---:|---:|"]
    for on, r in rows.items():
        hit = f"{r['hits'] / r['queries']:.0%}" if on else "—"
        lines.append(f"| {'on' if on else 'off'} | {hit} | {r['ttft50']:.0f} | "
                     f"{r['ttft99']:.0f} | {r['generated'] / r['wall']:.0f} | "
                     f"{r['generated'] / r['wall'] / (rows[False]['generated'] / rows[False]['wall']):.1f}× |")
    lines += ["", "Goal: ≥ 2× throughput with the cache. Both runs' tokens are equal. The "
              "rates cover the whole workload (prefill and decode, compilation excluded, "
              "`warmup`); a hit prompt still compiles a prefill of its own scratch length "
              "on first use, which the first batch after the cached request pays."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype-model", default="small")
    ap.add_argument("--dtype-requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--only", choices=("dtypes", "prefix"))
    ap.add_argument("--no-write", action="store_true", help="print, do not touch the docs")
    args = ap.parse_args()
    mesh = make_mesh(devices=jax.devices()[:1])
    for name, heading, fn in (("dtypes", "## Serving dtypes", dtypes),
                              ("prefix", "## Prefix cache", prefix)):
        if args.only in (None, name):
            body = fn(args, mesh)
            print(heading, "\n", body, flush=True)
            if not args.no_write:
                write_section(BENCHMARKS_MD, heading, body)


if __name__ == "__main__":
    main()
