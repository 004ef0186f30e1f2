"""Predicted (planner) against compiled (XLA, simulated CPU devices) per-device figures.

    JAX_NUM_CPU_DEVICES=8 PYTHONPATH=... python bench/planner_verify.py

Prints a markdown table (docs/planner.md). Plans with 8 devices compile in this process;
others go through ``verify``'s subprocess with their own device count.
"""
import importlib.util
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from triax.models import config  # noqa: E402
from triax.planner.workload import Layout, Schedule, Workload  # noqa: E402
from triax.planner.verify import verify  # noqa: E402

CASES = [
    ("tiny", 2, 16, 32, dict(data=8), "dp"),
    ("tiny", 2, 16, 32, dict(data=8), "zero1"),
    ("tiny", 2, 16, 32, dict(data=8), "fsdp"),
    ("tiny", 2, 16, 32, dict(data=4, tensor=2), "tp"),
    ("tiny", 2, 16, 32, dict(data=4, tensor=2), "fsdp_tp"),
    ("tiny", 4, 16, 32, dict(data=2, tensor=2), "tp"),
    ("small", 2, 32, 128, dict(data=8), "dp"),
    ("small", 2, 16, 64, dict(data=8), "fsdp"),
    ("small", 2, 8, 128, dict(data=2, tensor=4), "tp"),
    ("small", 2, 16, 128, dict(data=2, tensor=4), "fsdp_tp"),
]
MOE = [  # need the MoE layer (triax.models.moe)
    ("tiny-moe", 2, 16, 32, dict(data=2, expert=4), "dp"),
    ("tiny-moe", 2, 16, 32, dict(expert=8), "dp"),
    ("tiny-moe", 2, 16, 32, dict(data=2, expert=2, tensor=2), "tp"),
    ("small-moe", 2, 16, 64, dict(data=2, expert=4), "dp"),
]
PIPELINED = [
    ("tiny", 4, 16, 32, dict(data=2, pipe=4, schedule=Schedule.ONE_F_ONE_B, microbatches=8), "dp"),
    ("tiny", 4, 16, 32, dict(data=2, pipe=4, schedule=Schedule.GPIPE, microbatches=8), "dp"),
    ("tiny", 8, 16, 32, dict(data=2, pipe=4, schedule=Schedule.ONE_F_ONE_B, microbatches=4), "dp"),
]


def mb(x):
    return f"{x / 1e6:.3f}"


def main():
    print("| model (layers) | B×T | plan | state pred/compiled MB | peak pred/compiled MB "
          "(ratio) | comm per axis pred/HLO MB (ratio) |")
    print("|---|---|---|---|---|---|")
    cases = CASES + PIPELINED
    if importlib.util.find_spec("triax.models.moe") is not None:
        cases += MOE
    for name, layers, B, T, sizes, strategy in cases:
        w = Workload.of(config.get(name, num_layers=layers), train=True, dtype="fp32",
                        batch=B, seq=T)
        v = verify(w, Layout(**sizes, strategy=strategy))
        m = v["memory"]
        comm = "; ".join(f"{a} {mb(c['predicted'])}/{mb(c['compiled'])} "
                         f"({c['predicted'] / c['compiled']:.3f})" for a, c in v["comm"].items())
        print(f"| {name} ({layers}) | {B}×{T} | {v['plan']} | {mb(m['predicted_state'])}/"
              f"{mb(m['compiled_state'])} | {mb(m['predicted'])}/{mb(m['compiled'])} "
              f"({m['predicted'] / m['compiled']:.3f}) | {comm} |", flush=True)


if __name__ == "__main__":
    main()
