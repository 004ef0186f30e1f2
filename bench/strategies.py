"""Benchmark: every sharding strategy on 8 simulated CPU devices vs one device.

For each strategy it measures, in one run:
  * step time relative to the single-device step on the same global batch;
  * collective bytes per device per step (from the compiled HLO) against the analytic
    ideal of bench/ideal.py;
  * per-device memory (``memory_analysis()``) against the bytes the placement implies;
and writes the table under ``## Strategies`` in docs/benchmarks.md (other sections kept).

    python bench/strategies.py                      # small, 12 layers, B=8, T=128
    python bench/strategies.py --model tiny --num-layers 2 --no-time --no-write
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

from ideal import ideal_collectives, ideal_state_bytes, qkv_three_buffer_bytes  # noqa: E402
from tables import write_section  # noqa: E402
from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.sharding.introspect import (collectives_from_compiled,  # noqa: E402
                                       memory_from_compiled, summarize)
from triax.training.config import RunConfig  # noqa: E402
from triax.training.setup import build_run  # noqa: E402
from triax.training.step import Trainer  # noqa: E402
from triax.units import mib  # noqa: E402

CASES = (("dp", {"data": 8}), ("fsdp", {"data": 8}), ("zero1", {"data": 8}),
         ("tp", {"tensor": 8}), ("fsdp_tp", {"data": 2, "tensor": 4}))
SECTION = "## Strategies"


@dataclass
class Result:
    strategy: str
    mesh: str
    seconds: float | None
    measured: dict            # (kind, axes) -> {"count", "bytes"}
    ideal: dict               # (kind, axes) -> bytes
    memory: dict              # MemoryReport.to_json()
    state_ideal: dict
    ratio_time: float | None = None

    def to_json(self) -> dict:
        d = dict(vars(self))
        d["measured"] = [[k, list(a), v["count"], v["bytes"]]
                         for (k, a), v in self.measured.items()]
        d["ideal"] = [[k, list(a), v] for (k, a), v in self.ideal.items()]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Result":
        d = dict(d)
        d["measured"] = {(k, tuple(a)): {"count": c, "bytes": b} for k, a, c, b in d["measured"]}
        d["ideal"] = {(k, tuple(a)): b for k, a, b in d["ideal"]}
        return cls(**d)

    @property
    def comm(self) -> int:
        return sum(v["bytes"] for v in self.measured.values())

    @property
    def comm_ideal(self) -> int:
        return sum(self.ideal.values())


class Stepper:
    """A compiled step with its own state and batch, timed one step at a time."""

    def __init__(self, trainer, B: int, T: int, compiled=None):
        self.compiled = compiled if compiled is not None else trainer.lower(B, T).compile()
        self.state = trainer.init(0)
        self.batch = trainer.shard_batch(trainer.example_batch(B, T))
        self.times: list[float] = []
        self.step(record=False)  # warm-up

    def step(self, record: bool = True) -> None:
        t0 = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        if record:
            self.times.append(time.perf_counter() - t0)


def time_against(single: Stepper, compiled, trainer, args) -> tuple[float, float]:
    """Alternate single-device and sharded steps; best of each (other processes on a shared
    machine only ever add time, and alternating exposes both to the same load)."""
    case = Stepper(trainer, args.batch_size, args.seq_len, compiled)
    first = len(single.times)
    for _ in range(args.steps):
        single.step()
        case.step()
    del case.state
    return min(case.times), min(single.times[first:])


def run_case(cfg, strategy: str, mesh_kw: dict, args, single: Stepper | None) -> Result:
    mesh_text = ",".join(f"{a}={s}" for a, s in mesh_kw.items())
    run = build_run(RunConfig.of(model=cfg.name, num_layers=cfg.num_layers, mesh=mesh_text,
                                 strategy=strategy, batch_size=args.batch_size,
                                 seq_len=args.seq_len), cfg)
    mesh, trainer, compiled = run.mesh, run.trainer, run.compiled.step
    measured = summarize(collectives_from_compiled(compiled, mesh))
    secs = ratio = None
    if single is not None:
        secs, ref = time_against(single, compiled, trainer, args)
        ratio = secs / ref
    return Result(strategy, mesh_text, secs, measured,
                  ideal_collectives(trainer, args.batch_size, args.seq_len),
                  memory_from_compiled(compiled).to_json(),
                  ideal_state_bytes(trainer, args.batch_size, args.seq_len), ratio)


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if b else ("1.000" if not a else "inf")


def summary_table(results: list[Result], single: float | None) -> list[str]:
    head = ("| strategy | mesh | step s | × 1-device | comm MiB/dev | ideal MiB | ratio "
            "| state MiB/dev | ideal MiB | ratio | temp MiB | peak MiB |")
    lines = [head, "|" + "---|" * 12]
    if single is not None:
        lines.append(f"| single device | 1 | {single:.3f} | 1.00 | 0 | 0 | – | – | – | – "
                     f"| – | – |")
    for r in results:
        t = "–" if r.seconds is None else f"{r.seconds:.3f}"
        x = "–" if r.ratio_time is None else f"{r.ratio_time:.2f}"
        m, s = r.memory, r.state_ideal["total"]
        arg = m["argument_bytes"]
        lines.append(
            f"| {r.strategy} | {r.mesh} | {t} | {x} | {mib(r.comm):.2f} "
            f"| {mib(r.comm_ideal):.2f} | {_ratio(r.comm, r.comm_ideal)} "
            f"| {mib(arg):.2f} | {mib(s):.2f} | {_ratio(arg, s)} "
            f"| {mib(m['temp_bytes']):.2f} | {mib(m['peak_bytes']):.2f} |")
    return lines


def breakdown_table(results: list[Result]) -> list[str]:
    lines = ["| strategy | kind | axes | ops/step | measured MiB | ideal MiB |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for key in sorted(set(r.measured) | set(r.ideal)):
            kind, axes = key
            got = r.measured.get(key, {"count": 0, "bytes": 0})
            lines.append(f"| {r.strategy} | {kind} | {','.join(axes)} | {got['count']} "
                         f"| {mib(got['bytes']):.3f} | {mib(r.ideal.get(key, 0)):.3f} |")
    return lines


def render(results, single, cfg, args) -> str:
    cmd = "python bench/strategies.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (
            ("model", args.model), ("num_layers", cfg.num_layers),
            ("batch_size", args.batch_size), ("seq_len", args.seq_len), ("steps", args.steps)))
    out = [SECTION, "", "Regenerate with:", "", "```", cmd, "```", "",
           f"Model `{args.model}` with {cfg.num_layers} layers ({cfg.num_params / 1e6:.1f}M "
           f"parameters, fp32), global batch {args.batch_size} × {args.seq_len} tokens, "
           f"8 simulated CPU devices (`JAX_NUM_CPU_DEVICES=8`). Step time: best of "
           f"{args.steps} steps after a warm-up step, each ended by `block_until_ready`, "
           f"alternating with steps of the single-device program (`dp` on a 1-device mesh, "
           f"same global batch); \"× 1-device\" divides by the best single-device step of "
           f"that same stretch (the single-device row shows the best over the run). comm: collective bytes per device per step from the "
           f"compiled HLO (`triax.sharding.introspect`); state: `memory_analysis()` argument "
           f"bytes per device; temp and peak are reported, not targeted.", ""]
    out += summary_table(results, single)
    out += ["", "Per (kind, mesh axes), measured against the ideal:", ""]
    out += breakdown_table(results)
    out += ["", notes(results, cfg, args), ""]
    return "\n".join(out)


NOTES = """
How the ideals are derived (details in [sharding.md](sharding.md#communication-ideals)):
weights replicated over `data` all-reduce their gradients (P bytes for dp); weights split over
`data` (fsdp) are all-gathered in the forward and again in the backward and their gradients
reduce-scattered (3P); weights split only in the optimizer (zero1) reduce-scatter their gradients
and all-gather the updated values (2P). Over `tensor`, Megatron costs four all-reduces of b·T·D
floats per block (two forward, two backward), one for the vocab-parallel embedding, one plus
three of b·T floats for the vocab-parallel logits, plus, when `tensor` > kv_heads, an
all-reduce of 2·b·T·H and an all-gather of 2·b·T·K·H floats per block for the replicated KV
heads. Memory ideal ("state"): the step's arguments as the placement implies them — parameters
under the strategy's rules, AdamW's two moments under its optimizer rules, the step counters and
this device's share of the int32 token batch. Activations, gradients and gathered weights are
temporaries; temp and peak are shown but have no target.

Reading the ratios:

* **dp, tp** match the ideal to within the scalar reductions (loss, gradient norm); tp includes
  the KV-replication terms (16 query and 4 KV heads on `tensor=8`).
* **fsdp < 1**: XLA beats the textbook ZeRO-3 schedule on the two parameters outside the layer
  loop. The output head is gathered once and kept for the backward; the embedding table is
  never gathered: the lookup all-gathers the token ids and moves the looked-up rows with two
  all-to-alls of b·T·D/8 floats. **zero1 < 1** for the same reason on the embedding gradient.
* **fsdp and zero1 show no reduce-scatter**: XLA:CPU has no pass that forms one, so the gradient
  reduction stays an all-reduce followed by a local slice. The payload convention counts both as
  the full buffer, so the ratio does not show it, but a ring all-reduce moves about twice the
  bytes of a reduce-scatter. (XLA's GPU pipeline runs ReduceScatterCreator and
  AllReduceReassociate; the CPU pipeline runs neither.)
* **fsdp_tp > 1.05**, two causes, both in the `tensor` rows of the breakdown:
  1. Attention backward when `tensor` divides kv_heads (4 KV heads on `tensor=4`): the input
     gradients through q, k and v are three partial sums over `tensor`. XLA:CPU all-reduces them
     as three buffers (its all-reduce combiner puts them in one tuple op; it has no
     all-reduce-reassociate pass to add them first), +2 · b·T·D floats per block. tp on
     `tensor=8` does not pay it: there K/V weights are replicated and only q's share is partial.
     QKV_LINE
     Removing it is a model change (one fused q|k|v projection per KV group, as the SwiGLU
     gate|up is fused), which would conflict with KV replication when `tensor` > kv_heads; left
     as a follow-up.
  2. Vocab-parallel embedding with the table also split over `data`: XLA re-splits the table
     (the collective-permute) and assembles the looked-up rows with an all-gather plus an
     all-reduce over 2-rank `tensor` sub-groups, 2 · b·T·D floats instead of one all-reduce.
* **Step time**: the 8 simulated devices share this host's 2 cores (with other jobs running,
  hence alternating steps and best-of-N), so "× 1-device" is a sanity check of partitioning
  overhead on a CPU, not a scaling forecast. It can come out below 1: the eight per-device
  programs run on their own threads and keep both cores busy, which the single-device program
  does not always do.
* **State memory 1.000 everywhere**: the placement accounts for every argument byte, i.e. nothing
  is silently replicated (zero1 holds whole parameters but 1/8 of the AdamW moments).
"""


def notes(results, cfg, args) -> str:
    text = NOTES.strip()
    extra = []
    for r in results:
        sizes = {a: int(s) for a, s in (kv.split("=") for kv in r.mesh.split(","))}
        q = qkv_three_buffer_bytes(cfg, sizes, args.batch_size, args.seq_len)
        if q:
            extra.append(f"{r.strategy}: measured / (ideal + that term) = "
                         f"{_ratio(r.comm, r.comm_ideal + q)}")
    line = ("Counted as three buffers in the ideal: " + "; ".join(extra) + ".") if extra else ""
    text = text.replace("QKV_LINE", line)
    preset = config.get(args.model)
    if cfg.num_layers < preset.num_layers:
        text += (f"\n\nLayers: {cfg.num_layers} instead of {preset.num_layers}. dp keeps a full "
                 f"copy of parameters and AdamW state on each of the 8 simulated devices, all in "
                 f"this host's RAM (8 × {preset.num_params * 12 / 2**30:.1f} GiB of arguments "
                 f"for the full model, before temporaries), more than the shared 23 GB machine "
                 f"had free; the per-layer terms scale linearly with the layer count.")
    return text


def measure_all(cfg, args) -> tuple[list[Result], float | None]:
    wanted = args.strategies.split(",")
    single = None
    if not args.no_time:
        single = Stepper(Trainer(cfg, make_mesh(devices=jax.devices()[:1]), "dp"),
                         args.batch_size, args.seq_len)
    results = []
    for strategy, mesh_kw in CASES:
        if strategy in wanted:
            r = run_case(cfg, strategy, mesh_kw, args, single)
            results.append(r)
            print(f"{strategy:8s} {r.seconds} s/step (x{r.ratio_time}), comm ratio "
                  f"{_ratio(r.comm, r.comm_ideal)}", flush=True)
    return results, (min(single.times) if single else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--strategies", default=",".join(s for s, _ in CASES))
    p.add_argument("--no-time", action="store_true", help="compile-time figures only")
    p.add_argument("--no-write", action="store_true", help="print, do not touch the docs")
    p.add_argument("--save-json", help="also save the raw measurements here")
    p.add_argument("--from-json", help="re-render a saved run instead of measuring")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" /
                                        "benchmarks.md"))
    args = p.parse_args(argv)
    cfg = config.get(args.model, args.num_layers)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results, single = [Result.from_json(r) for r in saved["results"]], saved["single"]
    else:
        if len(jax.devices()) != 8:
            raise SystemExit(f"bench/strategies.py needs 8 devices, JAX sees "
                             f"{len(jax.devices())}; unset JAX_NUM_CPU_DEVICES or set it to 8")
        results, single = measure_all(cfg, args)
        if args.save_json:
            Path(args.save_json).write_text(json.dumps(
                {"single": single, "results": [r.to_json() for r in results]}, indent=1))
    text = render(results, single, cfg, args)
    print(text)
    if not args.no_write:
        write_section(args.out, SECTION, text)
        print(f"wrote {SECTION!r} into {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
