"""The run's flags that do nothing in the combination given, named so a user learns it
(``--lora-alpha`` with no LoRA, ``--schedule`` on a mesh without ``pipe``, ``--objective``
without ``--plan auto``). Only flags the user gave are named, never defaults; and a flag
whose effect depends on a layout not chosen yet (``--plan auto`` picks the mesh) is left
alone. Settings that cannot work are errors in ``RunConfig`` instead. JAX-free.

    >>> from triax.training.config import RunConfig
    >>> for line in inert_flags(RunConfig(mesh="data=8"), {"mesh", "schedule", "lora_alpha"}):
    ...     print(line)
    --schedule has no effect: the mesh data=8 has no pipe axis (add pipe=N to --mesh)
    --lora-alpha has no effect without LoRA (give --lora-rank R)
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from triax.training.config import RunConfig

LORA = ("lora_alpha", "lora_targets")
PIPELINE = ("schedule", "microbatches", "virtual", "pipeline_fsdp")


def pipe_size(mesh: str):
    """``--mesh``'s pipe size (1 when left out; None for ``-1``, not known before the
    devices are)."""
    m = re.search(r"(?:^|,)\s*pipe\s*=\s*(-?\d+)", mesh)
    size = int(m.group(1)) if m else 1
    return None if size < 0 else size


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def inert_flags(run: "RunConfig", given: Iterable[str]) -> list[str]:
    """A sentence per flag in ``given`` (field names) that has no effect on ``run``."""
    given = set(given)
    out = []
    pipe = pipe_size(run.mesh)
    if "mesh" in given and pipe == 1:   # a mesh --plan auto or the devices choose may pipe
        out += [f"{_flag(f)} has no effect: the mesh {run.mesh} has no pipe axis (add "
                f"pipe=N to --mesh)" for f in PIPELINE if f in given]
    if run.lora_rank == 0:
        out += [f"{_flag(f)} has no effect without LoRA (give --lora-rank R)"
                for f in LORA if f in given]
    if run.plan != "auto" and "objective" in given:
        out.append("--objective has no effect without --plan auto (it ranks the search)")
    if run.plan != "auto" and "plan_gpu" in given:
        out.append("--plan-gpu has no effect without --plan auto (triax plan --gpu "
                   "KIND:N,KIND:N proposes a split for --plan flags)")
    if run.plan != "auto" and "allow_fp8" in given:
        out.append("--allow-fp8 has no effect without --plan auto (give --precision fp8 to "
                   "train in float8)")
    return out
