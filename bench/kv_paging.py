"""Paged KV cache: concurrent sequences at equal KV memory, paged ÷ slot-reserved.

One CPU device, one replica. Both servers hold the same KV memory (asserted: the engine's
pool bytes per device): ``--reserved-slots`` × ``--max-len`` positions. *Slot-reserved*:
that many decode slots, each able to hold ``max_len`` positions, as a cache reserved per
slot is (a pool of exactly slots × max_len's blocks admits by slot only). *Paged*:
``--paged-slots`` decode slots over the same pool; the scheduler reserves nothing up front
(a request is admitted when its prompt and first decoded position fit the free blocks, it
takes blocks as it grows, and a group out of blocks preempts by recompute). The mixed
workload: ``--long`` requests of prompt and ``max_tokens`` ``--max-len``/2 each, and
``--short`` ones of prompt 8..24, max_tokens 8..16 (seeded), all queued at once, greedy.

Figures, from the server's counters and a phase listener (one record per serving step):
the peak number of sequences in decode slots at once; the mean over every decode step
(decoded tokens ÷ decode steps); the mean over the decode steps of the steps whose
admission left requests queued (the phase where the cache, blocks or slots, is what limits
concurrency); the ceiling of the all-steps mean (decoded tokens ÷ the decode steps the
longest request needs whatever the cache: once only it is left, no cache runs more); the
preemptions; wall time of the whole workload (compilation excluded: ``warmup`` of every
length a prefill may have, a preempted request's recompute included). Both
runs' tokens are checked equal. ``--trace`` prints every step's (decoded, queued).

    python bench/kv_paging.py --paged-slots 32,64   # writes the "## Paged KV cache" section
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


class StepTrace:
    """A phase listener: per serving step, the requests still queued after its admission
    and the tokens its decode produced (``Server`` calls it after each phase, twice a step)."""

    def __init__(self, server: Server):
        self.server, self.calls, self.steps = server, 0, []
        self.tokens = server.stats["decode_tokens"]
        server.phase_listeners.append(self)

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % 2:   # after the prefill phase: whom admission left waiting
            self.queued = self.server.queued
            return
        decoded, self.tokens = self.server.stats["decode_tokens"] - self.tokens, \
            self.server.stats["decode_tokens"]
        if decoded:
            self.steps.append((decoded, self.queued))


def serve(cfg, params, mesh, ecfg: EngineConfig, jobs) -> dict:
    server = Server.from_params(cfg, params, [mesh], "tp", ecfg)
    # every length a prefill may have: a request preempted after g tokens recomputes n + g
    server.warmup(sorted({n for p, k in jobs for n in range(len(p), len(p) + k)}))
    trace = StepTrace(server)
    t0 = time.perf_counter()
    ids = [server.submit(p, k) for p, k in jobs]
    results = server.run()
    wall = time.perf_counter() - t0
    st, eng = server.stats, server.engines[0]
    assert server.kv_blocks_in_use == 0 and eng.kv.committed == 0, "a KV block leaked"
    assert len(trace.steps) == st["decode_steps"], "the trace missed a decode step"
    waiting = [n for n, q in trace.steps if q]
    return {"tokens": [results[i].tokens for i in ids], "peak": st["peak_running"],
            "mean": st["decode_tokens"] / max(st["decode_steps"], 1),
            "steps": st["decode_steps"], "decoded": st["decode_tokens"],
            "waiting": sum(waiting) / max(len(waiting), 1), "waiting_steps": len(waiting),
            "preemptions": st["preemptions"], "trace": trace.steps, "wall": wall,
            "generated": st["generated_tokens"], "bytes": eng.pool.bytes_per_device(),
            "blocks": eng.kv.total, "block_size": eng.kv.block_size}


def table(args, cfg, jobs, rows) -> str:
    """The section's text: the setup, one row per cache, what the columns mean."""
    base = rows[0][2]
    floor = max(k for _, k in jobs) - 1   # the longest request's decode steps, at the least
    ceiling = max(r["decoded"] for _, _, r in rows[1:]) / floor
    lines = [f"`{cfg.name}` ({cfg.num_layers} layers), 1 CPU device; KV memory "
             f"{base['bytes'] / 2 ** 20:.2f} MiB in both ({base['blocks']} blocks × "
             f"{base['block_size']} positions = {args.reserved_slots} slots × "
             f"{args.max_len}); {len(jobs)} greedy requests queued at once: {args.long} of "
             f"prompt {args.max_len // 2} + {args.max_len // 2} tokens, {args.short} of prompt "
             f"8..24 + 8..16 tokens; `python bench/kv_paging.py --paged-slots "
             f"{args.paged_slots}` (the scheduler that reserves nothing up front and "
             f"preempts by recompute).", "",
             "| cache | decode slots | peak concurrent sequences | ÷ slot-reserved | mean "
             "concurrent, all decode steps | ÷ slot-reserved | decode steps | mean concurrent "
             "while requests wait (steps) | ÷ slot-reserved | preemptions | wall s | "
             "generated tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {slots} | {r['peak']} | {r['peak'] / base['peak']:.1f}× | "
              f"{r['mean']:.1f} | {r['mean'] / base['mean']:.1f}× | {r['steps']} | "
              f"{r['waiting']:.1f} ({r['waiting_steps']}) | "
              f"{r['waiting'] / base['waiting']:.1f}× | {r['preemptions']} | {r['wall']:.2f} | "
              f"{r['generated'] / r['wall']:.0f} |" for name, slots, r in rows]
    lines += ["", f"Goal: ≥ 2× concurrent sequences at equal KV memory. Every run's tokens "
              f"are equal. *All decode steps*: decoded tokens ÷ decode steps, the tail where "
              f"only the long requests are left included. *While requests wait*: the same "
              f"over the decode steps of the serving steps whose admission left requests "
              f"queued (how many in parentheses), the phase where the cache (blocks, or "
              f"slots) is what limits concurrency; once the queue is empty every cache holds "
              f"all that is left. The all-steps goal cannot be met on this workload: a long "
              f"request's {floor + 1} tokens take {floor} decode steps after its prefill "
              f"whatever the cache, so no cache's all-steps mean exceeds decoded tokens ÷ "
              f"{floor} = {ceiling:.1f}, {ceiling / base['mean']:.2f}× the slot-reserved "
              f"mean. The paged runs take {' and '.join(str(r['steps']) for *_, r in rows[1:])} "
              f"decode steps against that floor, the slot-reserved one {base['steps']}: its "
              f"slots full as long as requests wait, it starts the long requests that arrive "
              f"late only when slots free up. Admission leaves the "
              f"blocks the running sequences take in the same step, so no request is admitted "
              f"only to be preempted at once; the preemptions left are sequences outgrowing a "
              f"pool filled at the start. A decode step runs only the live rows (a "
              f"power-of-two bucket of them per row group) and a prefill a power-of-two batch "
              f"of the admitted prompts, so slots the traffic does not fill cost little. Wall "
              f"times are from a shared 2-core machine: compare rows of this table only."]
    return "\n".join(lines)


def run_length(steps) -> str:
    """``decoded/queued ×n`` runs of a trace, to read the phases at a glance."""
    out, prev, n = [], None, 0
    for step in steps + [None]:
        if step == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev[0]}/{prev[1]}" + (f" ×{n}" if n > 1 else ""))
        prev, n = step, 1
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--reserved-slots", type=int, default=8)
    ap.add_argument("--paged-slots", default="32,64", help="comma-separated: one row each")
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--short", type=int, default=58)
    ap.add_argument("--trace", action="store_true",
                    help="print each run's decode steps: decoded/queued-after-admission")
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
    if args.trace:
        for name, slots, r in rows:
            print(f"{name} {slots} slots, decoded/queued per decode step: "
                  f"{run_length(r['trace'])}\n")
    body = table(args, cfg, jobs, rows)
    print(body)
    if not args.no_write:
        write_section(BENCHMARKS_MD, SECTION, body)

if __name__ == "__main__":
    main()
