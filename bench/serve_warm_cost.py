"""Where a warm program's start-up time goes: ``triax serve``'s engines built in this process
(the serve command's flags) over a persistent compile cache, each replica's warm-up timed
program by program in CPU seconds, with JAX's compile events summed (``jax.monitoring``:
tracing, lowering to StableHLO, cache retrieval, backend compile; their seconds are wall).
Run it twice with the same ``--compile-cache``: the second run is a warm start.

    python bench/serve_warm_cost.py --compile-cache /tmp/cc   # prints; writes no docs
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import time


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-cache", required=True)
    ap.add_argument("--warmup", default="all", help="--warmup of the timed warm-up; the "
                    "replicas it leaves are then warmed too, as their first use")
    ap.add_argument("serve_flags", nargs="*", default=["--model", "tiny", "--seed", "0",
                                                       "--mesh", "tensor=2", "--replicas", "4"])
    args = ap.parse_args()
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    from triax.cli.common import start_devices
    from triax.cli.main import build_parser
    from triax.cli import serve_cmd
    from triax.cli.serving_flags import choose_layout, serve_config
    ns = build_parser().parse_args(["serve", *args.serve_flags, "--compile-cache",
                                    args.compile_cache])
    config = serve_config(ns, **serve_cmd.DEFAULTS)
    start_devices()
    serve_cmd.use_compile_cache(config.http.compile_cache_dir())
    import jax
    from triax.inference.generate import build_server
    from triax.inference.warm_start import warm_replicas
    events = collections.defaultdict(lambda: [0, 0.0])

    def heard(name, secs=0.0, **_):
        events[name][0] += 1
        events[name][1] += secs
    jax.monitoring.register_event_duration_secs_listener(heard)
    jax.monitoring.register_event_listener(heard)
    longest = config.engine.max_len or 1 << 30
    config, _ = choose_layout(config, longest, max_new_tokens=0)
    server = build_server(config, longest=longest, max_new_tokens=0)
    events.clear()
    last = [cpu()]

    def line(text):
        now = cpu()
        print(f"{text}  [{now - last[0]:.2f} CPU s]", flush=True)
        last[0] = now
    c0, w0 = cpu(), time.perf_counter()
    warmed = warm_replicas(server, [1], args.warmup, line)
    print(f"warm-up (--warmup {args.warmup}): {cpu() - c0:.2f} CPU s, "
          f"{time.perf_counter() - w0:.2f} s wall")
    rest = [i for i in range(len(server.engines)) if i not in warmed]
    if rest:
        c0, w0 = cpu(), time.perf_counter()
        server.warmup([1], line, replicas=rest)
        print(f"first use of replicas {[i + 1 for i in rest]}: {cpu() - c0:.2f} CPU s, "
              f"{time.perf_counter() - w0:.2f} s wall")
    for name, (n, secs) in sorted(events.items()):
        print(f"  {name}: {n} events, {secs:.2f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
