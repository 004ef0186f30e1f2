"""What is planned (``Workload``) and how it is laid out (``Layout``): frozen and hashable.

    >>> from triax.models import config
    >>> w = Workload.of(config.get("small"), train=True, dtype="bf16", batch=32, seq=1024)
    >>> Layout(data=4, tensor=2).mesh_str
    'data=4,tensor=2'
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional

from triax.mesh.build import AXES
from triax.models.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class Schedule(enum.Enum):
    """Pipeline schedules (names as in ``triax schedule --kind``); NONE when pipe == 1."""

    NONE = "none"
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    FORWARD_ONLY = "forward-only"


@dataclass(frozen=True)
class Workload:
    """A model (or only a parameter count), a job kind, precision, batch and sequence."""

    cfg: Optional[ModelConfig]     # None: quick estimate from a parameter count
    params: int
    train: bool
    dtype: str = "bf16"            # fp32 | bf16 | fp16 (bf16/fp16 train = mixed precision)
    batch: int = 1
    seq: int = 2048
    remat: str = "none"            # none | full | dots (see models.transformer)

    @classmethod
    def of(cls, cfg: Optional[ModelConfig], params: Optional[int] = None, **kw) -> "Workload":
        if cfg is None and not params:
            raise ValueError("give a model (--model NAME) or a parameter count (--params N)")
        if kw.get("dtype", "bf16") not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {kw['dtype']!r}; choose one of "
                             f"{', '.join(DTYPE_BYTES)}")
        for k in ("batch", "seq"):
            if k in kw and kw[k] < 1:
                raise ValueError(f"--{'batch-size' if k == 'batch' else 'seq-len'} must be ≥ 1")
        return cls(cfg, int(params or cfg.num_params), **kw)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def mixed(self) -> bool:
        """Training in bf16/fp16 keeps fp32 master weights (mixed precision)."""
        return self.train and self.dtype != "fp32"

    @property
    def name(self) -> str:
        return self.cfg.name if self.cfg is not None else f"{self.params / 1e9:g}B-params"

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class Layout:
    """A mesh factorization plus strategy and (for pipe > 1) a schedule."""

    data: int = 1
    tensor: int = 1
    pipe: int = 1
    expert: int = 1
    strategy: str = "dp"
    schedule: Schedule = Schedule.NONE
    microbatches: int = 1
    virtual: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipe * self.expert

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def mesh_str(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.sizes.items() if s > 1) or "data=1"

    @property
    def batch_shards(self) -> int:
        """Ways the global batch is split: the mesh axes the strategy maps ``batch`` to
        (``data``; with the MoE rules also ``expert``)."""
        from triax.sharding.rules import get_strategy
        axes = get_strategy(self.strategy).rules.mesh_axes("batch")
        return math.prod(self.sizes.get(a, 1) for a in axes)

    def describe(self) -> str:
        sched = "" if self.pipe == 1 else (
            f", {self.schedule.value} M={self.microbatches}"
            + (f" v={self.virtual}" if self.virtual > 1 else ""))
        return f"{self.mesh_str} {self.strategy}{sched}"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def prod(xs) -> int:
    return math.prod(xs)
