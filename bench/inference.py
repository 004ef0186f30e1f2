"""Decode throughput and per-token latency of the serving layouts on simulated devices.

    PYTHONPATH=<dir holding triax> python bench/inference.py --model small --batches 1,8,32 --steps 8

``small`` is run with 16 heads of 48 (8 KV heads) instead of 12 of 64, so that tensor=8
divides the heads; width, depth and MLP are unchanged.

Layouts on 8 devices: tensor=8; 8 replicas; 4 replicas × tensor=2; pipeline decode
(pipe=4 × tensor=2). At batch B the replicas share the B requests (B=1 keeps one busy).
Each figure: after a warm-up step (compile), ``--steps`` decode steps timed in one run;
tokens/s = B·steps / wall, latency = wall / steps (the time each request waits per token).

A second table gives the planner's prediction (``triax.planner.evaluate`` with the layout
given explicitly) for the same model, layouts and batches on one 8-GPU node (default
8 × h100-80gb, NVLink), with the KV cache as long as the measured one. Replicas are
independent copies: the planner evaluates one replica's layout at its share of the batch,
and throughput is that replica's tokens/s times the replicas that have requests.
``--planner-only`` prints just this table (instant; no measurement).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from triax.inference.engine import Engine, EngineConfig  # noqa: E402
from triax.inference.replicas import replica_meshes  # noqa: E402
from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.planner import Layout, ScheduleKind, Workload, cluster, evaluate  # noqa: E402
from triax.sharding.partition import abstract_model, init_params  # noqa: E402

LAYOUTS = {  # name: (one replica's mesh, replicas)
    "tensor=8": ({"tensor": 8}, 1),
    "8 replicas": ({}, 8),
    "4 replicas × tensor=2": ({"tensor": 2}, 4),
    "pipeline (pipe=4 × tensor=2)": ({"pipe": 4, "tensor": 2}, 1),
}


def measure(cfg, params, sizes, replicas, batch, steps, prompt_len):
    used = min(replicas, batch)  # replicas with at least one request
    per = math.ceil(batch / used)
    meshes = replica_meshes(sizes, replicas)[:used]
    ecfg = EngineConfig(max_batch=per, max_len=prompt_len + steps + 2, min_bucket=prompt_len,
                        microbatches=min(sizes.get("pipe", 1), per))
    engines = [Engine(cfg, params, m, "tp", ecfg) for m in meshes]
    prompts = [np.arange(prompt_len) % 256 for _ in range(per)]
    toks = [np.asarray(e.prefill(range(per), prompts, list(range(per)))) for e in engines]
    active = np.ones(per, bool)
    seeds = np.zeros(per, np.int32)

    def step(toks):
        outs = [e.decode(t, active, seeds) for e, t in zip(engines, toks)]  # all dispatched
        return [np.asarray(o) for o in outs]                                 # then gathered
    toks = step(toks)  # warm-up: compiles decode
    t0 = time.perf_counter()
    for _ in range(steps):
        toks = step(toks)
    wall = time.perf_counter() - t0
    return batch * steps / wall, wall / steps * 1e3


def predict(cfg, sizes, replicas, batch, context, node, dtype):
    """The planner's figures for one layout: (tokens/s, ms/token, one device's Memory).

    One replica is planned (``Layout`` of its mesh, strategy tp as the engine uses, the
    pipeline forward-only with the measured micro-batch count) at its share of the batch;
    the busy replicas multiply the throughput, not the latency.
    """
    used = min(replicas, batch)
    per = math.ceil(batch / used)
    pipe = sizes.get("pipe", 1)
    lay = Layout(tensor=sizes.get("tensor", 1), pipe=pipe, strategy="tp",
                 schedule=ScheduleKind.FORWARD_ONLY if pipe > 1 else None,
                 microbatches=min(pipe, per) if pipe > 1 else 1)
    r = evaluate(Workload.of(cfg, train=False, dtype=dtype, batch=per, seq=context), lay, node)
    return r.tokens_per_s * used, r.step_time_s * 1e3, r.memory


def predicted_table(cfg, names, batches, context, node, dtype):
    """Markdown lines of the planner's table (memory at the largest batch)."""
    head = " | ".join(f"B={b} tok/s | B={b} ms/token" for b in batches)
    lines = [f"| layout | {head} | MB/device, B={batches[-1]} (weights + KV + act.) "
             f"| GB/device, B={batches[-1]}, incl. overhead |",
             "|---|" + "---:|" * (2 * len(batches) + 2)]
    for name in names:
        sizes, reps = LAYOUTS[name]
        cells = []
        for b in batches:
            tps, ms, mem = predict(cfg, sizes, reps, b, context, node, dtype)
            cells += [f"{tps:.0f}", f"{ms:.3g}"]
        cells += [f"{mem.modelled / 1e6:.1f}", f"{mem.total / 1e9:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def bench_config(model, num_layers):
    cfg = config.get(model, num_layers)
    if model == "small":  # 12 heads do not split over tensor=8: same width, 16 heads
        cfg = cfg.replace(name="small-16h", num_heads=16, num_kv_heads=8, head_dim=48)
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--layouts", default=",".join(str(i) for i in range(len(LAYOUTS))),
                    help="indices into the layout list")
    ap.add_argument("--planner-only", action="store_true",
                    help="print only the planner's predicted table (no measurement)")
    ap.add_argument("--gpu", default="h100-80gb", help="planner device kind (8 per node)")
    ap.add_argument("--dtype", default="fp32", help="planner dtype (the measurement is fp32)")
    ap.add_argument("--context", type=int, default=None,
                    help="KV-cache length for the planner (default: the measured cache, "
                         "prompt-len + steps + 2)")
    args = ap.parse_args(argv)
    cfg = bench_config(args.model, args.num_layers)
    batches = [int(b) for b in args.batches.split(",")]
    names = [list(LAYOUTS)[int(i)] for i in args.layouts.split(",")]
    context = args.context or args.prompt_len + args.steps + 2
    predicted = predicted_table(cfg, names, batches, context, cluster(args.gpu, 8, 1),
                                args.dtype)
    if not args.planner_only:
        measure_table(cfg, names, batches, args)
        print()
    print(f"Planner prediction, 1 node × 8 {args.gpu}, {args.dtype}, KV cache {context} "
          f"tokens:\n")
    print("\n".join(predicted))


def measure_table(cfg, names, batches, args):
    params = jax.device_get(init_params(abstract_model(cfg), make_mesh(devices=jax.devices()[:1]),
                                        "tp", seed=0))
    print(f"model {cfg.name} ({cfg.num_layers} layers, {cfg.num_params / 1e6:.1f}M params), "
          f"{len(jax.devices())} {jax.devices()[0].platform} devices, {args.steps} decode steps, "
          f"prompt {args.prompt_len} tokens", file=sys.stderr)
    header = "| layout | " + " | ".join(f"B={b} tok/s | B={b} ms/token" for b in batches) + " |"
    print(header)
    print("|" + "---|" * (1 + 2 * len(batches)))
    for name in names:
        sizes, reps = LAYOUTS[name]
        cells = []
        for b in batches:
            tps, ms = measure(cfg, params, sizes, reps, b, args.steps, args.prompt_len)
            cells += [f"{tps:.1f}", f"{ms:.0f}"]
            print(f"  {name} B={b}: {tps:.1f} tok/s, {ms:.0f} ms/token", file=sys.stderr)
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
