"""What only ``triax plan`` is told (the rest of its flags are ``RunConfig``'s): which
devices, what to size, and how much to show. JAX-free, like every config the parser reads.

    >>> PlanConfig().gpu is None, PlanConfig().gpus_per_node, PlanConfig().nodes
    (True, 8, 1)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from triax.config_fields import spec
from triax.configs import GE1, GT0, check_fields
from triax.pipeline.schedules import ScheduleKind   # JAX-free, as training.config needs


@dataclass(frozen=True)
class PlanConfig:
    gpu: Optional[str] = spec(None, "device kind, e.g. h100-80gb; or mixed generations as "
                                    "KIND:COUNT groups, e.g. h100-80gb:8,a100-80gb:8 (one "
                                    "pipeline stage per group, layers sized by speed; "
                                    "docs/planner.md)",
                              default_help="the devices present: this process's JAX devices, "
                                           "each with the memory the memory check counts")
    gpus_per_node: int = spec(8, "devices per node, with one --gpu kind")
    nodes: int = spec(1, "nodes, with one --gpu kind")
    params: Optional[float] = spec(None, "parameter count for a quick estimate (instead of "
                                         "--model)")
    model_dir: Optional[str] = spec(None, "Hugging Face model directory (its config.json; no "
                                          "weights are read)", metavar="DIR")
    train: bool = spec(False, "plan a training step (the default)")
    inference: bool = spec(False, "plan serving: forward-only, with a KV cache")
    # A plan may be for inference (forward-only) and its micro-batches default to 1, where a
    # run's 0 means 2 × pipe: so these are the plan's own, not RunConfig's.
    schedule: Optional[str] = spec(None, "pipeline schedule for --mesh with pipe > 1",
                                   choices=tuple(k.value for k in ScheduleKind))
    microbatches: Optional[int] = spec(None, "micro-batches for --mesh with pipe > 1")
    speculative_tokens: int = spec(0, "with --inference: speculative decoding's proposals "
                                      "verified per step (0: off)")
    acceptance_rate: float = spec(0.7, "with --speculative-tokens: the chance each proposal "
                                       "is kept")
    draft_model: Optional[str] = spec(None, "with --speculative-tokens: the draft preset whose "
                                            "steps and memory are priced (none: n-gram lookup)")
    top: int = spec(3, "plans to show")
    verify: bool = spec(False, "compile the top plans on simulated CPU devices and compare")
    hardware: Optional[str] = spec(None, "TOML file of extra devices, links and clusters")

    def __post_init__(self):
        check_fields(self, {
            "gpus_per_node": (*GE1, "give the devices per node, e.g. --gpus-per-node 8"),
            "nodes": (*GE1, "give the node count, e.g. --nodes 2"),
            "params": (*GT0, "give a parameter count, e.g. --params 7e9"),
            "microbatches": (*GE1, "give the micro-batches, e.g. --microbatches 8"),
            "top": (*GE1, "give how many plans to show, e.g. --top 3")})
        if self.train and self.inference:
            raise ValueError("give one of --train and --inference")
        if (self.speculative_tokens or self.draft_model) and not self.inference:
            raise ValueError("--speculative-tokens and --draft-model plan serving: add "
                             "--inference")
