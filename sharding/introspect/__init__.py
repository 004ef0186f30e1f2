"""Introspection: what crosses devices (HLO collectives), what each pipeline op costs
(per-branch FLOPs and bytes), memory per device, placement."""
from triax.sharding.introspect.branch_costs import (OP_SCOPE, branch_costs, op_branch_costs,
                                                    op_costs, op_matmuls)
from triax.sharding.introspect.hlo import (Collective, bytes_over, collectives_from_compiled,
                                           parse_collectives, summarize)
from triax.sharding.introspect.memory import MemoryReport, memory_from_compiled
from triax.sharding.introspect.placement import ParamPlacement, placement_table
from triax.sharding.introspect.step_report import StepReport, analyze, inspect_trainer

__all__ = ["OP_SCOPE", "Collective", "MemoryReport", "ParamPlacement", "StepReport", "analyze",
           "branch_costs", "bytes_over", "collectives_from_compiled", "inspect_trainer",
           "memory_from_compiled", "op_branch_costs", "op_costs", "op_matmuls",
           "parse_collectives",
           "placement_table", "summarize"]
