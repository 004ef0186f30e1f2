"""Pipeline parallelism: schedules as data, a validator, and one shard_map executor."""
from triax.pipeline.generators import build, chunks_per_stage
from triax.pipeline.schedules import (DEFAULT_COSTS, Op, OpKind, Schedule, ScheduleError,
                                      ScheduleKind, closed_form_bubble)
from triax.pipeline.validate import validate

__all__ = ["DEFAULT_COSTS", "Op", "OpKind", "Schedule", "ScheduleError", "ScheduleKind", "build",
           "chunks_per_stage", "closed_form_bubble", "validate"]
