"""Serving under load: 1,000 requests from several threads into a background-serving server.

Replicas of one device each on the simulated CPU devices; every client thread submits its
share of the requests at once (a burst: all requests are queued within the first moments),
then waits on each request's result. Prompt lengths are uniform up to the cache,
``max_new_tokens`` uniform in 1..``--max-new``; requests that do not fit the cache are
rejected at submit and counted, not timed. Figures, over the served requests:
requests/s = served ÷ (last completion − first submission); latency = completion −
submission per request (p50, p99; queueing included, as a client sees it); time to first
token likewise. Compilation happens in ``warmup`` before the clock starts.

    python bench/serve_load.py                  # writes the "## Serving under load" section
"""
from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from request_stream import requests  # noqa: E402  (bench/ is the script's dir)
from tables import BENCHMARKS_MD, write_section  # noqa: E402

from triax.inference.engine import EngineConfig, InferenceError  # noqa: E402
from triax.inference.server import Server  # noqa: E402
from triax.models import config  # noqa: E402

SECTION = "## Serving under load"



def measure(server: Server, reqs, threads: int) -> dict:
    """Burst ``reqs`` from ``threads`` clients into ``server``; the served Results and
    the number rejected at submit."""
    served, rejected = [], []
    barrier = threading.Barrier(threads + 1)

    def client(k):
        rids, bad = [], 0
        barrier.wait()
        for prompt, m in reqs[k::threads]:
            try:
                rids.append(server.submit(prompt, m))
            except InferenceError:
                bad += 1
        served.extend(server.result(rid) for rid in rids)  # list.extend: atomic
        rejected.append(bad)

    pool = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    with server:
        for t in pool:
            t.start()
        barrier.wait()
        for t in pool:
            t.join()
    return {"served": served, "rejected": sum(rejected)}


def table(r: dict, args, cfg) -> str:
    res = r["served"]
    wall = max(x.done for x in res) - min(x.submitted for x in res)
    lat = np.array([x.done - x.submitted for x in res]) * 1e3
    ttft = np.array([x.ttft_s for x in res]) * 1e3
    tokens = sum(len(x.tokens) for x in res)
    lines = [f"`{cfg.name}` ({cfg.num_layers} layers), {args.replicas} replicas × 1 CPU device, "
             f"{args.max_batch} slots each, cache {args.max_len}, {args.threads} client threads "
             f"bursting {args.requests} requests (prompt 1..{args.max_len} tokens, "
             f"max_new_tokens 1..{args.max_new}); `python bench/serve_load.py`.", "",
             "| served | rejected at submit | requests/s | generated tok/s | latency p50 ms "
             "| latency p99 ms | TTFT p50 ms | TTFT p99 ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {len(res)} | {r['rejected']} | {len(res) / wall:.1f} | {tokens / wall:.0f} | "
             f"{np.percentile(lat, 50):.0f} | {np.percentile(lat, 99):.0f} | "
             f"{np.percentile(ttft, 50):.0f} | {np.percentile(ttft, 99):.0f} |", "",
             "Latency includes the time a request waits in the queue behind the burst. "
             "Measured once on a shared 2-core machine under load from other jobs, so the "
             "absolute figures are pessimistic and noisy; compare rows measured together."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--no-write", action="store_true", help="print, do not touch the docs")
    args = ap.parse_args()
    cfg = config.get(args.model)
    ecfg = EngineConfig(max_batch=args.max_batch, max_len=args.max_len,
                        min_bucket=args.max_len // 2)
    server = Server.from_seed(cfg, replicas=args.replicas, devices=jax.devices()[:args.replicas],
                              ecfg=ecfg)
    server.warmup(range(1, args.max_len + 1))
    t0 = time.perf_counter()
    r = measure(server, requests(args.requests, args.max_len, args.max_new, cfg.vocab_size),
                args.threads)
    assert server.free_slots == server.total_slots, "a slot leaked"
    print(f"load served in {time.perf_counter() - t0:.1f} s")
    body = table(r, args, cfg)
    print(body)
    if not args.no_write:
        write_section(BENCHMARKS_MD, SECTION, body)


if __name__ == "__main__":
    main()
