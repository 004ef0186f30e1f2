"""``triax serve``'s time to ready, a first start against a second with the persistent
compile cache (``--compile-cache DIR``), the second both with ``--warmup auto`` (the default:
replica 1 warms, the rest on first use) and ``--warmup all``: the command in a subprocess on
127.0.0.1 with a free port, timed from its start to its ready line, then stopped with
SIGTERM; its own ``ready in`` figure and its stderr's steps (loading, compiling) are read
back.

    python bench/serve_startup.py      # writes "## Serve start-up (compile cache)"
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time

from tables import BENCHMARKS_MD, write_section

HEADING = "## Serve start-up (compile cache)"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def start(args, cache: str, warmup: str = "auto", timeout: float = 600.0) -> dict:
    """One start: seconds to the ready line (outside and inside), and its stderr's steps."""
    cmd = [sys.executable, "-m", "triax", "serve", "--model", args.model, "--seed", "0",
           "--mesh", args.mesh, "--replicas", str(args.replicas), "--port", "0",
           "--compile-cache", cache, "--warmup", warmup]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "PYTHONUNBUFFERED": "1"}
    err = tempfile.TemporaryFile(mode="w+")
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                            cwd=os.path.dirname(ROOT))
    try:
        deadline = t0 + timeout
        line = ""
        while time.perf_counter() < deadline:
            line = proc.stdout.readline()
            if not line or "ready at" in line:
                break
        wall = time.perf_counter() - t0
        if "ready at" not in line:
            raise RuntimeError(f"triax serve did not get ready: {line!r}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    cpu = _children_cpu() - cpu0   # to ready, plus its brief SIGTERM drain
    err.seek(0)
    log = err.read()
    compiled = sum(float(s) for s in re.findall(r"compiled .* in ([0-9.]+) s", log))
    loading = re.search(r"loading .*: done in ([0-9.]+) s", log)
    return {"wall": wall, "cpu": cpu,
            "ready": float(re.search(r"ready in ([0-9.]+) s", line).group(1)),
            "compiled": compiled, "loading": float(loading.group(1)) if loading else 0.0,
            "programs": len(re.findall(r"compiled ", log))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--mesh", default="tensor=2")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--no-write", action="store_true", help="print, do not touch the docs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        rows = [("off (nothing kept)", start(args, "off")),
                ("first start, empty cache", start(args, cache)),
                ("second start, same cache", start(args, cache)),
                ("second start, same cache, `--warmup all`", start(args, cache, "all"))]
    lines = [f"`triax serve --model {args.model} --mesh {args.mesh} --replicas "
             f"{args.replicas} --port 0 --compile-cache DIR [--warmup all]`, **CPU** (8 "
             f"simulated devices on a shared 2-core machine), started as a subprocess and "
             f"stopped with SIGTERM once ready (process CPU: user + system seconds to its "
             f"exit); `python bench/serve_startup.py`.", "",
             "| --compile-cache | to ready s (outside) | `ready in` s | process CPU s | "
             "loading s | warm-up compiles s (programs) |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['wall']:.1f} | {r['ready']:.1f} | {r['cpu']:.1f} | "
                     f"{r['loading']:.1f} | "
                     f"{r['compiled']:.1f} ({r['programs']}) |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(BENCHMARKS_MD, HEADING, body)


if __name__ == "__main__":
    main()
