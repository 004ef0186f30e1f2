"""Introspection: what crosses devices (HLO collectives), memory per device, placement."""
from triax.sharding.introspect.hlo import (Collective, bytes_over, collectives_from_compiled,
                                           parse_collectives, summarize)
from triax.sharding.introspect.memory import MemoryReport, memory_from_compiled
from triax.sharding.introspect.placement import ParamPlacement, placement_table
from triax.sharding.introspect.step_report import StepReport, analyze, inspect_trainer

__all__ = ["Collective", "MemoryReport", "ParamPlacement", "StepReport", "analyze",
           "bytes_over", "collectives_from_compiled", "inspect_trainer", "memory_from_compiled",
           "parse_collectives", "placement_table", "summarize"]
