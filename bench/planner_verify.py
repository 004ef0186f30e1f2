"""Predicted (planner) against compiled (XLA, simulated CPU devices) per-device figures.

    JAX_NUM_CPU_DEVICES=8 PYTHONPATH=... python bench/planner_verify.py

Prints the markdown table of docs/benchmarks.md's "Planner: predicted against compiled"
section (sizes in MiB, ``triax.units.mib``). Plans with 8 devices compile in this process;
others go through ``verify``'s subprocess with their own device count. The "fitted" column
says which rows a planner constant was fitted on: none since the pipeline stash is derived
from the executor (``pipeline.buffer_sizes.activation_buffer_bytes``) rather than fitted (the
removed ``PIPELINE_STASH_FACTOR`` was fitted on the tiny 1F1B/GPipe rows); "derived on"
marks the rows a term was derived on (``DERIVED_ON``: what the compiled program holds that
the model missed), "check" the rows added to check those terms on (``CHECKS``). ``--new``
runs only the rows added for issue 12 (zb-h1, interleaved, remat=full, pipe × tensor),
``--checks`` only the check rows, ``--context`` only the context rows (issue 14;
``models.attention_memory``'s one fitted figure came from whole-sequence rows, not these),
``--pipeline-fsdp`` only the rows of FSDP in pipeline stages by stage and by layer (issue 27).
``--auto`` prints the rows for the plans ``--plan auto`` chose (issue 26) at a few budgets:
the chosen plan's predicted peak against its compiled one, and how many candidates the
compile refused.
"""
import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from triax.models import config  # noqa: E402
from triax.pipeline import ScheduleKind  # noqa: E402
from triax.planner.verify import verify  # noqa: E402
from triax.costs.workload import Layout, Workload  # noqa: E402
from triax.units import mib  # noqa: E402

ONE_F_ONE_B, GPIPE = ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE
ZB_H1, INTERLEAVED = ScheduleKind.ZB_H1, ScheduleKind.INTERLEAVED
# (model, layers, batch, seq, layout sizes, strategy[, remat]); FITTED: rows a constant was
# fitted on.
FITTED: set = set()
NEW = [
    ("tiny", 4, 16, 32, dict(data=2, pipe=4, schedule=ZB_H1, microbatches=8), "dp"),
    ("tiny", 8, 16, 32, dict(data=2, pipe=4, schedule=INTERLEAVED, microbatches=8, virtual=2),
     "dp"),
    ("tiny", 4, 16, 32, dict(data=2, pipe=4, schedule=ONE_F_ONE_B, microbatches=8), "dp",
     "full"),
    ("tiny", 2, 16, 32, dict(data=2, pipe=2, tensor=2, schedule=ONE_F_ONE_B, microbatches=4),
     "tp"),
]
# Context parallelism (issue 14): both schemes at a few sequence lengths.
CONTEXT = [
    ("tiny", 2, 4, T, dict(data=2, context=4, context_attention=scheme), "dp")
    for scheme in ("all-gather", "ring") for T in (256, 512, 1024)
] + [
    ("tiny", 2, 4, 512, dict(data=2, context=4), "fsdp"),
    ("tiny", 2, 8, 512, dict(data=4, context=2), "zero1"),
]
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
    # pipelined, through triax.pipeline's executor
    ("tiny", 4, 16, 32, dict(data=2, pipe=4, schedule=ONE_F_ONE_B, microbatches=8), "dp"),
    ("tiny", 4, 16, 32, dict(data=2, pipe=4, schedule=GPIPE, microbatches=8), "dp"),
    ("tiny", 8, 16, 32, dict(data=2, pipe=4, schedule=ONE_F_ONE_B, microbatches=4), "dp"),
    # MoE: experts over `expert`
    ("tiny-moe", 2, 16, 32, dict(data=2, expert=4), "dp"),
    ("tiny-moe", 2, 16, 32, dict(expert=8), "dp"),
    ("tiny-moe", 2, 16, 32, dict(data=2, expert=2, tensor=2), "tp"),
    ("small-moe", 2, 16, 64, dict(data=2, expert=4), "dp"),
] + NEW
# Rows a planner term was derived on: what the compiled program holds there (its buffer
# assignment's live set at the peak) that the model missed — the MoE layer's residuals and
# its expert-weight copies, a pipelined op's layer loop; nothing fitted.
DERIVED_ON = [
    ("tiny", 8, 16, 32, dict(data=2, pipe=4, schedule=ONE_F_ONE_B, microbatches=4), "dp"),
    ("small-moe", 2, 16, 64, dict(data=2, expert=4), "dp"),
    # pipelined FSDP: the stage gathered whole once per step, its gradients accumulated whole
    ("tiny", 4, 16, 32, dict(data=4, pipe=2, schedule=ONE_F_ONE_B, microbatches=4), "fsdp"),
]
# Rows added to check those terms on, nothing derived from them: other layers per stage,
# micro-batch counts and schedules; MoE at another sequence, batch and expert degree.
CHECKS = [
    ("tiny", 12, 16, 32, dict(data=2, pipe=4, schedule=ONE_F_ONE_B, microbatches=4), "dp"),
    ("tiny", 8, 16, 32, dict(data=2, pipe=4, schedule=ONE_F_ONE_B, microbatches=8), "dp"),
    ("tiny", 8, 16, 32, dict(data=2, pipe=4, schedule=ZB_H1, microbatches=8), "dp"),
    ("tiny", 8, 16, 32, dict(data=2, pipe=4, schedule=ONE_F_ONE_B, microbatches=8), "dp",
     "full"),
    ("tiny", 16, 16, 32, dict(data=2, pipe=4, schedule=INTERLEAVED, microbatches=8,
                              virtual=2), "dp"),
    ("tiny", 4, 16, 32, dict(data=2, pipe=2, tensor=2, schedule=ONE_F_ONE_B, microbatches=4),
     "tp"),
    ("small-moe", 2, 16, 128, dict(data=2, expert=4), "dp"),
    ("small-moe", 2, 16, 64, dict(expert=8), "dp"),
    ("small-moe", 2, 16, 64, dict(data=4, expert=2), "dp"),
    ("tiny-moe", 2, 32, 64, dict(data=2, expert=4), "dp"),
    ("tiny-moe", 4, 16, 32, dict(data=4, expert=2), "dp"),
    ("tiny-moe", 2, 16, 32, dict(data=2, expert=4), "dp", "full"),
    ("tiny-moe", 4, 16, 32, dict(data=2, pipe=2, expert=2, schedule=ONE_F_ONE_B,
                                 microbatches=4), "dp"),
    # pipelined FSDP on another model, layer count and schedule
    ("small", 4, 16, 64, dict(data=4, pipe=2, schedule=ONE_F_ONE_B, microbatches=4), "fsdp"),
    ("tiny", 8, 16, 32, dict(data=2, pipe=4, schedule=ZB_H1, microbatches=8), "fsdp"),
]
# FSDP inside pipeline stages, both modes (issue 27): the stage gathered once per step, or
# each layer per op (``--pipeline-fsdp``), on 1F1B and the split backward.
PIPELINE_FSDP = [
    ("small", 8, 16, 16, dict(data=4, pipe=2, schedule=kind, microbatches=4,
                              pipeline_fsdp=mode), "fsdp")
    for kind in (ONE_F_ONE_B, ZB_H1) for mode in ("stage", "layer")
]
CASES += [r for r in DERIVED_ON if r not in CASES] + CHECKS + CONTEXT + PIPELINE_FSDP


# (model, layers, batch, seq, budget MiB per device): --plan auto on the 8 devices.
AUTO = [("tiny", 2, 16, 32, mb) for mb in (64, 3, 2, 1.5)] + [
    ("small", 2, 16, 64, mb) for mb in (1024, 200)]


def auto_rows():
    from triax.planner import auto
    from triax.training.config import RunConfig
    print("| model (layers) | B×T | budget MiB (usable) | chosen plan | peak pred/compiled MiB "
          "(ratio) | refused by the compile |")
    print("|---|---|---|---|---|---|")
    for name, layers, B, T, mb in AUTO:
        run = RunConfig.of(model=name, num_layers=layers, batch_size=B, seq_len=T, plan="auto")
        budget = auto.Budget(int(mb * (1 << 20)), "bench")
        try:
            c = auto.choose_train(run, frozenset({"model", "num_layers", "batch_size",
                                                  "seq_len", "plan"}), budget=budget)
        except auto.NoPlanFits as e:
            print(f"| {name} ({layers}) | {B}×{T} | {mb:g} ({mib(budget.usable):.3f}) | "
                  f"nothing fits: {str(e)[:80]}… | | |", flush=True)
            continue
        pred, got = c.plan.memory.total, c.compiled.peak_bytes
        print(f"| {name} ({layers}) | {B}×{T} | {mb:g} ({mib(budget.usable):.3f}) | "
              f"{auto.label(c.plan)} | {cell(pred, got)} ({pred / got:.3f}) | "
              f"{len(c.refused)} |", flush=True)


def cell(pred: float, got: float) -> str:
    return f"{mib(pred):.3f}/{mib(got):.3f}"


def main():
    if "--auto" in sys.argv:
        return auto_rows()
    print("| model (layers) | B×T | plan | fitted | state pred/compiled MiB | peak "
          "pred/compiled MiB (ratio) | comm per axis pred/HLO MiB (ratio) |")
    print("|---|---|---|---|---|---|---|")
    rows = (NEW if "--new" in sys.argv else CHECKS if "--checks" in sys.argv
            else CONTEXT if "--context" in sys.argv
            else PIPELINE_FSDP if "--pipeline-fsdp" in sys.argv else CASES)
    for row in rows:
        name, layers, B, T, sizes, strategy, *remat = row
        cfg = config.get(name, num_layers=layers)
        w = Workload.of(cfg.replace(max_seq_len=max(cfg.max_seq_len, T)), train=True,
                        dtype="fp32", batch=B, seq=T, remat=remat[0] if remat else "none")
        sched = sizes.get("schedule")
        fitted = "yes" if not remat and (name, layers, sched and sched.value,
                                         sizes.get("microbatches")) in FITTED else "no"
        fitted += ", derived on" if row in DERIVED_ON else ", check" if row in CHECKS else ""
        v = verify(w, Layout(**sizes, strategy=strategy))
        m = v["memory"]
        comm = "; ".join(f"{a} {cell(c['predicted'], c['compiled'])} "
                         f"({c['predicted'] / c['compiled']:.3f})" for a, c in v["comm"].items())
        print(f"| {name} ({layers}) | {B}×{T} | {v['plan']} | {fitted} | "
              f"{cell(m['predicted_state'], m['compiled_state'])} | "
              f"{cell(m['predicted'], m['compiled'])} ({m['predicted'] / m['compiled']:.3f}) | "
              f"{comm} |", flush=True)


if __name__ == "__main__":
    main()
