"""``triax train``: sharded training runs with checkpoints, resume and metrics.

    triax train                                   # tiny on pydoc text, 8 simulated devices
    triax train --model tiny --mesh data=2,tensor=2,pipe=2 --strategy fsdp_tp \\
        --steps 100 --seed 0 --batch-size 16 --seq-len 128 --log-json run.jsonl \\
        --checkpoint-dir ckpt --checkpoint-every 50
    triax train --config run.toml --steps 300 --resume     # flags override the file
"""
from __future__ import annotations

import argparse
import sys

# Nothing here imports JAX at module level: the device count must be set before it loads.

_FLAGS: list[tuple[str, type, str]] = [
    ("--model", str, "model preset (tiny, small, llama3-1b, …)"),
    ("--num-layers", int, "override the preset's layer count"),
    ("--mesh", str, "axis=size pairs, e.g. data=2,tensor=2,pipe=2 (default: picked from devices)"),
    ("--strategy", str, "dp | fsdp | zero1 | tp | fsdp_tp"),
    ("--steps", int, "optimizer steps to reach (a resumed run continues up to this)"),
    ("--seed", int, "seed for parameters and data order"),
    ("--batch-size", int, "global batch size (sequences per optimizer step)"),
    ("--seq-len", int, "tokens per sequence"),
    ("--lr", float, "peak learning rate (warmup + cosine)"),
    ("--lr-warmup-steps", int, "warmup steps (default 10%% of --steps)"),
    ("--lr-decay-steps", int, "cosine decay steps (default --steps)"),
    ("--weight-decay", float, "AdamW weight decay"),
    ("--clip-norm", float, "gradient clipping (global norm)"),
    ("--precision", str, "fp32 | bf16 (bf16 compute, fp32 master weights)"),
    ("--remat", str, "activation checkpointing policy: none | full | dots | dots_no_batch"),
    ("--grad-accum", int, "gradient-accumulation micro-steps per optimizer step"),
    ("--schedule", str, "pipeline schedule when pipe > 1 (gpipe, 1f1b, interleaved, zb-h1)"),
    ("--microbatches", int, "pipeline micro-batches when pipe > 1 (0: 2 × pipe)"),
    ("--virtual", int, "pipeline chunks per stage (interleaved only)"),
    ("--data", str, "pydoc | markov | path to a .txt or .npy token file"),
    ("--val-fraction", float, "fraction of the data held out for validation"),
    ("--eval-every", int, "validation loss every N steps (0: at the end only)"),
    ("--eval-batches", int, "batches per validation"),
    ("--checkpoint-dir", str, "directory for Orbax checkpoints"),
    ("--checkpoint-every", int, "save every N steps (0: at the end and on SIGTERM/SIGINT)"),
    ("--keep-checkpoints", int, "keep the last N checkpoints"),
    ("--log-json", str, "write one JSON object per optimizer step to FILE"),
    ("--tensorboard", str, "write TensorBoard logs to DIR (needs tensorboardX)"),
]
_SWITCHES = [("--resume", "continue from the latest checkpoint in --checkpoint-dir"),
             ("--no-save", "do not write checkpoints")]


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model on a mesh (checkpoints, resume, metrics)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML or YAML file with the same keys; flags override it")
    for flag, typ, help_ in _FLAGS:
        p.add_argument(flag, type=typ, default=None, help=help_)
    for flag, help_ in _SWITCHES:
        p.add_argument(flag, action="store_true", default=None, help=help_)
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar")
    g = p.add_argument_group("multi-process (default: auto-detect SLURM, Open MPI, Kubernetes)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int)
    g.add_argument("--process-id", type=int)
    p.set_defaults(func=run)


def run_config_from_args(args):
    """RunConfig defaults < ``--config`` file < explicit flags."""
    from triax.training.config import FIELDS, RunConfig, load_config_file
    values = load_config_file(args.config) if args.config else {}
    values.update({k: v for k, v in vars(args).items() if k in FIELDS and v is not None})
    return RunConfig(**values)


def run(args) -> int:
    from triax.mesh import simulate_cpu_devices
    simulate_cpu_devices()  # before JAX starts its backend
    run_cfg = run_config_from_args(args)
    from triax.training import distributed
    how = distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from triax.training.loop import Interrupted, train
    from triax.training.run_summary import format_summary
    main = distributed.is_main_process()
    if main and how != "single process":
        print(f"triax train: multi-process ({how})", file=sys.stderr)
    try:
        result = train(run_cfg, note=lambda m: print(m, file=sys.stderr))
    except Interrupted as e:
        if main:
            print(f"triax train: {e}", file=sys.stderr)
        return 128 + e.signum
    if main:
        print(format_summary(result.summary))
    return 0
