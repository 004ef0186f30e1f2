"""``triax inspect``: compile the train step on abstract inputs and report placement,
communication and memory, without allocating the model.

Its flags are ``RunConfig``'s (the subset that shapes the step) and the run is built by
``triax.training.setup.build_run``, exactly as ``triax train`` would build it.
"""
from __future__ import annotations

import argparse

from triax.cli.flags import add_json
from triax.cli.common import start_devices
from triax.cli.run_flags import add_run_flags, run_values
from triax.training.config import RunConfig

# The run fields that change the compiled step, and inspect's own defaults for some of them
# (a small batch, all devices on `data`).
FIELDS = ("model", "num_layers", "max_seq_len", "mesh", "strategy", "context_attention", "batch_size",
          "seq_len", "precision", "remat", "attention", "loss_chunks", "schedule", "microbatches",
          "virtual")
DEFAULTS = {"mesh": "data=-1", "batch_size": 8, "seq_len": 64}


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="what lives where, what crosses devices, memory per device",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(p, FIELDS, DEFAULTS)
    add_json(p, "machine-readable report")
    p.set_defaults(func=run)


def run(args) -> int:
    start_devices()
    # Loaded only now: these modules start JAX, which must see the simulated device count.
    from triax.sharding.introspect import inspect_trainer
    from triax.training.setup import build_run

    run_cfg = RunConfig(**{**DEFAULTS, **run_values(args)})
    built = build_run(run_cfg)
    report = inspect_trainer(built.trainer, run_cfg.batch_size, run_cfg.seq_len)
    print(report.dumps() if args.json else report.to_text())
    return 0
