"""The planner: will a model fit, on how many devices, split how, at what cost.

    >>> from triax.models import config
    >>> from triax.planner import Workload, cluster, plan
    >>> rec = plan(Workload.of(config.get("llama3-70b"), train=False, batch=8, seq=4096),
    ...            cluster("h100-80gb", gpus_per_node=8, nodes=1))
    >>> rec.plans[0].layout.mesh_str
    'tensor=8'

See docs/planner.md for the formulas and assumptions.
"""
from triax.pipeline import ScheduleKind   # a pipelined Layout's schedule
from triax.planner.recommend import Recommendation, plan
from triax.planner.evaluate import PlanResult, evaluate
from triax.costs.hardware import Catalog, Cluster, Device, Link, cluster, load_catalog
from triax.costs.memory import Assumptions, Memory, estimate, min_devices_for_weights
from triax.planner.search import search
from triax.costs.workload import Layout, Workload

__all__ = ["Assumptions", "Catalog", "Cluster", "Device", "Layout", "Link", "Memory",
           "PlanResult", "Recommendation", "ScheduleKind", "Workload", "cluster", "estimate",
           "evaluate", "load_catalog", "min_devices_for_weights", "plan", "search"]
