"""The memory and bytes levers on 8 simulated CPU devices: host offload and FP8.

Two tables and a plot, each from one run of this script, into docs/benchmarks.md:

- ``## Host offload``: the FSDP step of ``small`` (2 layers) with nothing, the optimizer
  state (streamed, host-updated) and parameters + optimizer state in ``pinned_host``: the
  compiled step's device and host argument bytes and temporaries (``memory_analysis``, host
  buffers split off by their ``S(5)`` layout), the host-link bytes and time per step that
  ``costs.offload`` prices on PCIe 5, and the CPU step time (CPU: the "host" and the
  "device" are one memory here, so it proves placement and bytes, not speed).
- ``## FP8``: the same step in bf16 and fp8: all-gather bytes over ``data`` from the
  compiled HLO, memory, CPU step time; and 200 steps of ``tiny`` on the project's training
  data (``--data pydoc``) in bf16 and fp8 from the same seed, the loss curves plotted to
  docs/fp8_loss.png and the mean loss of the last 20 steps compared.

    python bench/memory_levers.py                 # both tables and the plot
    python bench/memory_levers.py --steps 20      # a quick look (the plot from 20 steps)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tables import BENCHMARKS_MD, write_section  # noqa: E402  (bench/ is the script's dir)
import jax  # noqa: E402

from triax.costs.offload import HOST_LINK, offload_cost  # noqa: E402
from triax.costs.workload import Layout, Workload  # noqa: E402
from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.models.runtime import ExecConfig  # noqa: E402
from triax.sharding.introspect import (bytes_over, collectives_from_compiled,  # noqa: E402
                                       memory_from_compiled)
from triax.training.config import RunConfig  # noqa: E402
from triax.training.loop import train  # noqa: E402
from triax.training.offload import Offload  # noqa: E402
from triax.training.step import Trainer  # noqa: E402
from triax.units import human_bytes as binary_bytes  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"
PLOT = DOCS / "fp8_loss.png"
# The stated margin: fp8's mean loss over the last 20 of 200 steps within 2% of bf16's.
MARGIN = 0.02
OFFLOADS = (("none", Offload()), ("optimizer (stream)", Offload(("optimizer",), "stream")),
            ("optimizer (host update)", Offload(("optimizer",), "host")),
            ("params + optimizer (stream)", Offload(("optimizer", "params"), "stream")))


def timed(compiled, trainer, batch, reps: int) -> float:
    """Mean seconds of ``reps`` steps after one warm-up (the state donated along)."""
    state = trainer.init(0)
    batch = trainer.shard_batch(batch)
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(reps):
        state, m = compiled(state, batch)
    jax.block_until_ready(m)
    return (time.perf_counter() - t) / reps


def offload_rows(cfg, B, T, reps):
    mesh, rows = make_mesh(data=8), []
    w = Workload.of(cfg, train=True, dtype="fp32", batch=B, seq=T)
    for name, off in OFFLOADS:
        tr = Trainer(cfg, mesh, "fsdp", offload=off)
        c = tr.lower(B, T).compile()
        mem = memory_from_compiled(c)
        cost = offload_cost(w, Layout(data=8, strategy="fsdp"), off.targets, off.update)
        rows.append((name, mem, cost, timed(c, tr, tr.example_batch(B, T), reps)))
        print(f"offload {name}: {mem}", file=sys.stderr)
    return rows


def fp8_rows(cfg, B, T, reps):
    mesh, rows = make_mesh(data=8), []
    for name, exe in (("bf16", ExecConfig("bfloat16")), ("fp8", ExecConfig("bfloat16", fp8=True))):
        tr = Trainer(cfg, mesh, "fsdp", exe=exe)
        c = tr.lower(B, T).compile()
        gathered = bytes_over(collectives_from_compiled(c, mesh), "all-gather", "data")
        rows.append((name, gathered, memory_from_compiled(c),
                     timed(c, tr, tr.example_batch(B, T), reps)))
        print(f"fp8 {name}: all-gather {gathered}", file=sys.stderr)
    return rows


def loss_curves(steps: int) -> dict[str, list[float]]:
    """``tiny`` on the project's data (pydoc), bf16 and fp8, same seed, FSDP on data=8."""
    curves = {}
    for precision in ("bf16", "fp8"):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "log.jsonl")
            run = RunConfig.of(model="tiny", mesh="data=8", strategy="fsdp", precision=precision,
                               steps=steps, batch_size=16, seq_len=128, data="pydoc",
                               eval_batches=0, no_save=True, progress=False, log_json=log)
            train(run, note=lambda *_: None)
            with open(log) as f:
                curves[precision] = [json.loads(line)["loss"] for line in f]
        print(f"{precision}: loss {curves[precision][0]:.3f} -> {curves[precision][-1]:.3f}",
              file=sys.stderr)
    return curves


def plot(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("tiny on pydoc, FSDP data=8: bf16 vs fp8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def render_offload(rows, cfg_name, layers, B, T, reps, cmd) -> str:
    lines = [f"`{cfg_name}` with {layers} layers, FSDP on data=8, global batch {B} × {T}, "
             f"fp32, one compile per row; step time is the mean of {reps} steps **on CPU** "
             f"(host and device share one memory there: it shows the transfers' overhead, "
             f"not a GPU's). Link bytes and time per step and device are `costs.offload`'s "
             f"on {HOST_LINK} (both directions, not overlapped). Regenerate: `{cmd}`", "",
             "| offload | device args | host args | temporaries | link bytes/step "
             "(planned) | link time (planned) | CPU step (ms) |", "|---|---|---|---|---|---|---|"]
    for name, mem, cost, step in rows:
        lines.append(f"| {name} | {binary_bytes(mem.argument_bytes)} | "
                     f"{binary_bytes(mem.host_argument_bytes)} | {binary_bytes(mem.temp_bytes)} "
                     f"| {binary_bytes(cost.link_bytes)} | {cost.seconds * 1e6:.0f} µs | "
                     f"{step * 1e3:.1f} |")
    return "\n".join(lines + ["", OFFLOAD_READING])


OFFLOAD_READING = """Reading it: the device's argument bytes drop by exactly the offloaded state's
(AdamW's two moments are two thirds of an fp32 step's state). The temporaries do not change
on CPU: its compiler keeps no separate device copy of a streamed buffer (host and device are
one memory); on a GPU the streamed moments are live on the device during the update, which the
host update avoids. The planner prices the stream cheaper on PCIe 5 (`costs.offload`), so
`--offload optimizer` streams."""


def render_fp8(rows, curves, cfg_name, layers, B, T, reps, cmd) -> str:
    base = rows[0][1]
    lines = [f"`{cfg_name}` with {layers} layers, FSDP on data=8, global batch {B} × {T}; "
             f"all-gather bytes per device per step over `data` from the compiled HLO; step "
             f"time the mean of {reps} steps **on CPU** (XLA's CPU backend computes float8 "
             f"in wider types: this proves numerics and bytes, not speed). Regenerate: "
             f"`{cmd}`", "",
             "| precision | all-gather over data | vs bf16 | device args | temporaries | "
             "CPU step (ms) |", "|---|---|---|---|---|---|"]
    for name, gathered, mem, step in rows:
        lines.append(f"| {name} | {binary_bytes(gathered)} | {gathered / base:.2f} | "
                     f"{binary_bytes(mem.argument_bytes)} | {binary_bytes(mem.temp_bytes)} | "
                     f"{step * 1e3:.1f} |")
    if curves:
        tail = {k: sum(v[-20:]) / len(v[-20:]) for k, v in curves.items()}
        rel = tail["fp8"] / tail["bf16"] - 1
        verdict = "within" if abs(rel) <= MARGIN else "OUTSIDE"
        n = len(curves["bf16"])
        lines += ["", f"Loss over {n} steps of `tiny` on the project's data (pydoc), batch "
                  f"16 × 128, FSDP data=8, seed 0: mean of the last 20 steps bf16 "
                  f"{tail['bf16']:.4f}, fp8 {tail['fp8']:.4f} ({rel:+.2%}: {verdict} the "
                  f"stated ±{MARGIN:.0%} margin).", "", f"![fp8 vs bf16 loss]({PLOT.name})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="loss-curve steps (0: no curve)")
    p.add_argument("--out", default=str(BENCHMARKS_MD))
    args = p.parse_args(argv)
    cfg = config.get(args.model, args.num_layers)
    shape = (args.batch_size, args.seq_len, args.reps)
    cmd = ("python bench/memory_levers.py " + " ".join(argv if argv is not None
                                                else sys.argv[1:])).strip()
    off = offload_rows(cfg, *shape)
    table = render_offload(off, args.model, args.num_layers, *shape, cmd)
    print(table)
    write_section(args.out, "## Host offload", table)
    curves = loss_curves(args.steps) if args.steps else {}
    if curves:
        plot(curves, PLOT)
    table = render_fp8(fp8_rows(cfg, *shape), curves, args.model, args.num_layers, *shape, cmd)
    print(table)
    write_section(args.out, "## FP8", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
