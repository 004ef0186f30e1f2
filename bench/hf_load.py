"""Importing a Hugging Face checkpoint: time against a plain numpy read, and host memory.

Writes a ``small``-sized model (random init, exported with ``triax.hf.export``) once, then for
each layout runs, in a fresh process: a numpy ``memmap`` read of the same safetensors files
(page cache warm for both), and ``triax.hf.load`` onto that layout. Reports import time ÷
memmap time, and peak anonymous RSS growth ÷ the largest tensor, sampled every 2 ms (the
memory-mapped file pages are page cache, not counted). On CPU the simulated devices *are*
host memory, so the loaded parameters themselves count; the "staging" column is the peak
above what the loaded parameters finally hold, i.e. what the reader kept on the side.

    python bench/hf_load.py                     # writes the "## HF import" section
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tables import BENCHMARKS_MD, write_section  # noqa: E402  (bench/ is the script's dir)
LAYOUTS = {"1 device, tp": ({}, "tp"), "data=2,tensor=4, fsdp_tp": ({"data": 2, "tensor": 4},
                                                                      "fsdp_tp")}

WORKER = """
import json, os, sys, threading, time
import numpy as np
import jax
from triax.hf import load
from triax.hf.files import Checkpoint
from triax.mesh import make_mesh
d, sizes, strategy = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
def anon():  # anonymous resident memory: excludes the memory-mapped safetensors pages
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak_anon = [0]
def sample(stop):
    while not stop.is_set():
        peak_anon[0] = max(peak_anon[0], anon())
        time.sleep(0.002)
files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
for f in files:  # warm the page cache for both readers
    np.asarray(np.memmap(os.path.join(d, f), np.uint8, mode="r")).sum()
t0 = time.perf_counter()
total = 0
for f in files:
    total += np.array(np.memmap(os.path.join(d, f), np.uint8, mode="r")).nbytes
t_np = time.perf_counter() - t0
largest = max(int(np.prod(s)) * 4 for s, _ in Checkpoint(d).headers.values())
mesh = make_mesh(**sizes) if sizes else make_mesh(devices=jax.devices()[:1])
jax.block_until_ready(jax.numpy.zeros(1))
base = anon()
stop = threading.Event()
sampler = threading.Thread(target=sample, args=(stop,))
sampler.start()
cfg, params, report = load(d, mesh, strategy)
stop.set()
sampler.join()
final = anon()
print("RESULT " + json.dumps({"t_import": report.seconds, "t_np": t_np, "bytes": total,
      "largest": largest, "peak_delta": max(peak_anon[0], final) - base,
      "final_delta": final - base, "read": report.bytes_read}))
"""


def make_checkpoint(directory: str) -> None:
    import jax

    from triax.hf.export import export
    from triax.mesh import make_mesh
    from triax.models import config
    from triax.sharding.partition import abstract_model, init_params
    cfg = config.SMALL
    params = init_params(abstract_model(cfg), make_mesh(tensor=8), "tp")
    export(params, cfg, directory, max_shard_size="200MB")
    del params
    jax.clear_caches()


def run_layout(directory: str, sizes: dict, strategy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, directory, json.dumps(sizes), strategy],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))


def table(rows: dict, nbytes: int, largest: int) -> str:
    mb = 2**20
    lines = [f"`small` ({nbytes / mb:.0f} MiB of float32 safetensors, largest tensor "
             f"{largest / mb:.1f} MiB), CPU, `python bench/hf_load.py`. Import time includes "
             f"compiling the per-parameter placement programs.", "",
             "| layout | import s | memmap read s | import ÷ memmap | bytes read ÷ file bytes "
             "| peak anon RSS growth ÷ largest tensor | staging ÷ largest tensor |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        staging = max(0, r["peak_delta"] - r["final_delta"])
        lines.append(f"| {name} | {r['t_import']:.2f} | {r['t_np']:.2f} | "
                     f"{r['t_import'] / r['t_np']:.1f} | {r['read'] / r['bytes']:.2f} | "
                     f"{r['peak_delta'] / largest:.1f} | {staging / largest:.1f} |")
    lines += ["", f"On CPU the loaded parameters live in host memory, so the peak includes "
              f"the model itself ({nbytes / largest:.0f} × the largest tensor); the staging "
              f"column is the host memory the reader held beyond them (anonymous memory, "
              f"sampled every 2 ms; the memory-mapped safetensors pages are page cache and "
              f"not counted)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="reuse (or write) the checkpoint here (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch the docs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = args.dir or os.path.join(tmp, "small")
        if not os.path.exists(os.path.join(d, "config.json")):
            make_checkpoint(d)
        rows = {name: run_layout(d, sizes, st) for name, (sizes, st) in LAYOUTS.items()}
    first = next(iter(rows.values()))
    body = table(rows, first["bytes"], first["largest"])
    print(body)
    if not args.no_write:
        write_section(BENCHMARKS_MD, "## HF import", body)


if __name__ == "__main__":
    main()
