"""``triax inspect``: compile the train step on abstract inputs and report placement,
communication and memory, without allocating the model.

Its flags are ``RunConfig``'s, every field that shapes the step (the model, its LoRA
adapters, the layout, the pipeline, precision and remat, the batch), and a ``--config``
file as ``train`` reads it; the run is built by ``triax.training.setup.build_run``, exactly
as ``triax train`` would build it.
"""
from __future__ import annotations

import argparse

from triax.cli.common import start_devices
from triax.cli.flags import add_json
from triax.cli.run_flags import FIELDS as RUN_FIELDS
from triax.cli.run_flags import add_run_flags, run_values
from triax.training.config import RunConfig, RunConfigWarning, load_config_file
from triax.configs import warn_inert
from triax.training.inert import inert_flags

# The run's fields that do not change the compiled step: how long it runs, what it reads,
# where it writes and reports, how a layout is searched.
NOT_THE_STEP = {"steps", "seed", "lr_warmup_steps", "lr_decay_steps", "data", "tokenizer",
                "val_fraction", "eval_every", "eval_batches", "checkpoint_dir",
                "checkpoint_every", "keep_checkpoints", "resume", "no_save", "resume_from",
                "on_nonfinite", "log_json", "tensorboard", "progress", "plan", "objective"}
FIELDS = tuple(f for f in RUN_FIELDS if f not in NOT_THE_STEP)
# inspect's own defaults: a small batch, all devices on `data`.
DEFAULTS = {"mesh": "data=-1", "batch_size": 8, "seq_len": 64}


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="what lives where, what crosses devices, memory per device",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML or YAML run file (train's); flags override it")
    add_run_flags(p, FIELDS, DEFAULTS)
    add_json(p, "machine-readable report")
    p.set_defaults(func=run)


def run(args) -> int:
    start_devices()
    # Loaded only now: these modules start JAX, which must see the simulated device count.
    from triax.sharding.introspect import inspect_trainer
    from triax.training.setup import build_run

    values = {**(load_config_file(args.config) if args.config else {}), **run_values(args)}
    run_cfg = RunConfig.of(**{**DEFAULTS, **values})
    warn_inert(inert_flags(run_cfg, values), RunConfigWarning)
    built = build_run(run_cfg)
    data = run_cfg.dataset
    report = inspect_trainer(built.trainer, data.batch_size, data.seq_len)
    print(report.dumps() if args.json else report.to_text())
    return 0
