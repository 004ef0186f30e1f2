"""``--schedule/--microbatches/--virtual`` for ``triax train`` and ``triax inspect``.

    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_pipeline_args(p)
    >>> p.parse_args(["--schedule", "zb-h1"]).schedule
    'zb-h1'
"""
from __future__ import annotations

import argparse
from typing import Optional

from triax.pipeline.schedules import ScheduleKind


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline (used when the mesh has pipe > 1)")
    g.add_argument("--schedule", default="1f1b", choices=[k.value for k in ScheduleKind
                                                          if k is not ScheduleKind.FORWARD_ONLY],
                   help="pipeline schedule")
    g.add_argument("--microbatches", type=int, default=0,
                   help="micro-batches per step (0: 2 x pipe)")
    g.add_argument("--virtual", type=int, default=1,
                   help="chunks per stage (interleaved only)")


def pipeline_config_from_args(args, mesh) -> Optional["PipelineConfig"]:  # noqa: F821
    """A ``PipelineConfig`` when ``mesh`` has pipe > 1, else None (the plain step).

    The schedule is built here once so a bad combination fails before any compile, with
    the schedule's own message (e.g. interleaved needs M divisible by S).
    """
    from triax.mesh.build import mesh_sizes
    from triax.pipeline.runner import PipelineConfig
    stages = mesh_sizes(mesh).get("pipe", 1)
    if stages < 2:
        return None
    cfg = PipelineConfig(args.schedule, args.microbatches, args.virtual)
    cfg.build(stages)
    return cfg
