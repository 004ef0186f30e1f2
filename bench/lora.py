"""LoRA against full fine-tuning: per-device memory of an abstract llama3-8b compile on 1, 2
and 8 devices (full FT, LoRA over an fp32, a bf16 and an int8 base), the planner's
figures beside it, and CPU step time, full against LoRA, on ``small``.

The compiles are abstract (``Trainer.lower(...).compile()``: nothing is allocated) but CPU
compiles of llama3-8b are slow, so the model is compiled with ``--layers`` layers (default
1, embedding and head whole) and the planner is asked for the same model, beside its figure
for all 32 layers. Memory: ``memory_analysis()``'s argument bytes less the batch (the train
state) and its peak, per device; the planner's ``params + optimizer`` (the state) for the same
layout. LoRA over an fp32 base is compiled on 1 device only (the run stays within ~3 min).

    python bench/lora.py --layers 1 --seq 64 --steps 5
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.models.config import LoraConfig  # noqa: E402
from triax.planner import Layout, Workload  # noqa: E402
from triax.costs.memory import estimate  # noqa: E402
from triax.sharding.introspect import memory_from_compiled  # noqa: E402
from triax.training.step import Trainer  # noqa: E402

RANK = 16
VARIANTS = {"full FT": None,
            "LoRA, fp32 base": LoraConfig(RANK, 32.0),
            "LoRA, bf16 base": LoraConfig(RANK, 32.0, base_dtype="bfloat16"),
            "LoRA, int8 base": LoraConfig(RANK, 32.0, base_dtype="int8")}
LAYOUTS = {1: ("dp", {}), 2: ("fsdp", {"data": 2}), 8: ("fsdp", {"data": 8})}
GIB = 2 ** 30


def compiled_memory(cfg, n: int, batch: int, seq: int) -> dict:
    strategy, sizes = LAYOUTS[n]
    tr = Trainer(cfg, make_mesh(**sizes, devices=jax.devices()[:n]), strategy)
    mem = memory_from_compiled(tr.lower(batch, seq).compile())
    return {"state": mem.argument_bytes - 2 * 4 * batch * seq // max(1, sizes.get("data", 1)),
            "peak": mem.peak_bytes}


def planned_state(cfg, n: int, batch: int, seq: int) -> float:
    strategy, sizes = LAYOUTS[n]
    m = estimate(Workload.of(cfg, train=True, dtype="fp32", batch=batch, seq=seq),
                 Layout(**sizes, strategy=strategy))
    return m.params + m.optimizer   # the state the step takes as arguments (verify's too)


def memory_table(layers: int, batch: int, seq: int) -> list[str]:
    rows = ["| devices | run | compiled state/dev ({L} layer) | planner state/dev ({L} layer) "
            "| compiled peak/dev ({L} layer) | planner state/dev (32 layers) |".format(L=layers),
            "|---|---|---|---|---|---|"]
    for n in LAYOUTS:
        for name, lo in VARIANTS.items():
            if name == "LoRA, fp32 base" and n > 1:
                continue
            full = config.LLAMA3_8B.replace(lora=lo)
            cut = full.replace(num_layers=layers)
            got = compiled_memory(cut, n, batch, seq)
            rows.append(f"| {n} | {name} | {got['state'] / GIB:.2f} GiB | "
                        f"{planned_state(cut, n, batch, seq) / GIB:.2f} GiB | "
                        f"{got['peak'] / GIB:.2f} GiB | "
                        f"{planned_state(full, n, batch, seq) / GIB:.1f} GiB |")
            print(rows[-1], flush=True)
    return rows


def step_time(lo, steps: int, batch: int, seq: int) -> float:
    tr = Trainer(config.SMALL.replace(num_layers=2, lora=lo), make_mesh(data=8), "dp")
    compiled = tr.lower(batch, seq).compile()
    state = tr.init(0)
    data = tr.shard_batch(tr.example_batch(batch, seq))
    state, m = compiled(state, data)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = compiled(state, data)
    jax.block_until_ready(m)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    t0 = time.perf_counter()
    print("\n".join(memory_table(a.layers, a.batch, a.seq)))
    print("\n| small (2 layers), data=8 dp | step time (CPU) |\n|---|---|")
    for name, lo in (("full FT", None), (f"LoRA rank {RANK}", LoraConfig(RANK, 32.0))):
        print(f"| {name} | {step_time(lo, a.steps, a.batch, a.seq) * 1e3:.0f} ms |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
