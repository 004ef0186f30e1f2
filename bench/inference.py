"""Decode throughput and per-token latency of the serving layouts on simulated devices.

    PYTHONPATH=<dir holding triax> python bench/inference.py --model small --batches 1,8,32 --steps 8

``small`` is run with 16 heads of 48 (8 KV heads) instead of 12 of 64, so that tensor=8
divides the heads; width, depth and MLP are unchanged.

Layouts on 8 devices: tensor=8; 8 replicas; 4 replicas × tensor=2; pipeline decode
(pipe=4 × tensor=2). At batch B the replicas share the B requests (B=1 keeps one busy).
Each figure: after a warm-up step (compile), ``--steps`` decode steps timed in one run;
tokens/s = B·steps / wall, latency = wall / steps (the time each request waits per token).
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
from triax.inference.server import replica_meshes  # noqa: E402
from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--layouts", default=",".join(str(i) for i in range(len(LAYOUTS))),
                    help="indices into the layout list")
    args = ap.parse_args(argv)
    cfg = config.get(args.model, args.num_layers)
    if args.model == "small":  # 12 heads do not split over tensor=8: same width, 16 heads
        cfg = cfg.replace(name="small-16h", num_heads=16, num_kv_heads=8, head_dim=48)
    params = jax.device_get(init_params(abstract_model(cfg), make_mesh(devices=jax.devices()[:1]),
                                        "tp", seed=0))
    batches = [int(b) for b in args.batches.split(",")]
    names = [list(LAYOUTS)[int(i)] for i in args.layouts.split(",")]
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
