"""``triax inspect``: compile the train step on abstract inputs and report placement,
communication and memory, without allocating the model."""
from __future__ import annotations

import argparse

from triax.cli.common import (add_mesh_args, add_model_args, mesh_from_args, model_from_args,
                              start_devices)


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="what lives where, what crosses devices, memory per device",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    add_mesh_args(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    _add_pipeline_args(p)
    p.set_defaults(func=run)


def _add_pipeline_args(p) -> None:
    try:
        from triax.pipeline.cli_args import add_pipeline_args
    except ImportError:
        return
    add_pipeline_args(p)


def run(args) -> int:
    start_devices()
    from triax.sharding.introspect import inspect_trainer
    from triax.training.step import Trainer

    cfg, mesh = model_from_args(args), mesh_from_args(args)
    trainer = Trainer(cfg, mesh, args.strategy, **_pipeline_kwargs(args, mesh))
    report = inspect_trainer(trainer, args.batch_size, args.seq_len)
    print(report.dumps() if args.json else report.to_text())
    return 0


def _pipeline_kwargs(args, mesh) -> dict:
    try:
        from triax.pipeline.cli_args import pipeline_config_from_args
    except ImportError:
        return {}
    cfg = pipeline_config_from_args(args, mesh)
    return {} if cfg is None else {"pipeline": cfg}
