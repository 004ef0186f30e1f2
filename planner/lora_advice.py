"""When LoRA makes a model fit where full fine-tuning does not: the planner's advice.

A full fine-tuning plan that fits nowhere is told whether adapters over a frozen bf16 base
would (``SUGGESTED``), and a LoRA plan says whether full fine-tuning would have fitted on the
same cluster, each from the planner's own search of the other workload.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from triax.models.config import LoraConfig
from triax.planner.evaluate import PlanResult
from triax.costs.hardware import Cluster
from triax.costs.memory import min_devices_for_weights
from triax.planner.search import search
from triax.costs.workload import Workload
from triax.units import decimal_bytes

# The adapters the advice suggests: rank 16 (alpha 32) on all seven projections, bf16 base.
SUGGESTED = LoraConfig(rank=16, alpha=32.0, base_dtype="bfloat16")


def with_lora(w: Workload, lora: Optional[LoraConfig]) -> Workload:
    """The same workload with other adapters (None: full fine-tuning)."""
    return dataclasses.replace(w, cfg=w.cfg.replace(lora=lora))


def best_fit(w: Workload, cluster: Cluster, assume=None, schemes=None) -> Optional[PlanResult]:
    """The fastest plan of ``w`` that fits on ``cluster``, None when none does."""
    if cluster.devices < min_devices_for_weights(w, cluster.device.memory):
        return None
    try:
        res = search(w, cluster, assume, **({} if schemes is None else {"schemes": schemes}))
    except ValueError:
        return None
    return min(res.fitting, key=lambda r: r.step_time_s) if res.fitting else None


def flags(lora: LoraConfig) -> str:
    return f"--lora-rank {lora.rank} --base-dtype {lora.base_dtype}"


def lora_would_fit(w: Workload, cluster: Cluster, assume=None, schemes=None) -> str:
    """For "nothing fits" under full fine-tuning: whether ``SUGGESTED`` adapters would."""
    if not w.train or w.cfg is None or w.lora is not None:
        return ""
    best = best_fit(with_lora(w, SUGGESTED), cluster, assume, schemes)
    if best is None:
        return ""
    return (f"; LoRA would fit: {flags(SUGGESTED)} trains on {best.layout.describe()} with "
            f"{decimal_bytes(best.memory.total)} per device")


def lora_reasoning(w: Workload, cluster: Cluster, assume=None, schemes=None) -> list[str]:
    """A LoRA plan's sentence on full fine-tuning on the same cluster."""
    if not w.train or w.cfg is None or w.lora is None:
        return []
    full = best_fit(with_lora(w, None), cluster, assume, schemes)
    if full is None:
        return [f"Full fine-tuning of {w.name} fits on no plan of {cluster.describe()}: "
                f"LoRA ({flags(w.lora)}) makes it fit."]
    return [f"Full fine-tuning would fit too ({full.layout.describe()}, "
            f"{decimal_bytes(full.memory.total)} per device)."]
