"""What is planned (``Workload``) and how it is laid out (``Layout``): frozen and hashable.

A pipelined layout names its schedule with ``triax.pipeline.ScheduleKind`` (the names
``triax schedule --kind`` and ``--schedule`` take: "gpipe", "1f1b", "zb-h1", …); an
unpipelined one has none.

    >>> from triax.models import config
    >>> w = Workload.of(config.get("small"), train=True, dtype="bf16", batch=32, seq=1024)
    >>> Layout(data=4, tensor=2).mesh_str
    'data=4,tensor=2'
    >>> Layout(data=2, pipe=4, schedule=ScheduleKind.parse("1f1b"), microbatches=8).describe()
    'data=2,pipe=4 dp, 1f1b M=8'
    >>> Layout(data=8, context=4, context_attention="ring").describe()
    'data=8,context=4 dp, ring'
    >>> Layout(data=8, strategy="fsdp", offload=("optimizer",)).describe()
    'data=8 fsdp, offload optimizer'
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from triax import choices
from triax.choices import KV_DTYPES, KV_PRECISION, PRECISION_BYTES, PRECISIONS
from triax.costs.speculative import check_speculative
from triax.inference.pool_settings import PoolSettings
from triax.mesh.build import AXES
from triax.models.attention import resolve
from triax.models.config import ModelConfig
from triax.models.quantize import served_config
from triax.models.loss import check_loss_chunks
from triax.pipeline.schedules import ScheduleKind
from triax.sharding.rules import Strategy, get_strategy

if TYPE_CHECKING:   # above this layer: taken as they come, never imported
    import triax.inference.engine
    import triax.training.config

DTYPE_BYTES = PRECISION_BYTES   # the precisions' bytes, from their home (choices)
FP32 = PRECISION_BYTES["fp32"]   # master weights, gradients, Adam moments and logits
ADAM_MOMENTS = 2        # AdamW's mu and nu per trained parameter, fp32


@dataclass(frozen=True)
class Workload:
    """A model (or only a parameter count), a job kind, precision, batch and sequence."""

    cfg: Optional[ModelConfig]     # None: quick estimate from a parameter count
    params: int
    train: bool
    dtype: str = "bf16"            # fp32 | bf16 | fp16 (bf16/fp16 train = mixed precision)
    batch: int = 1
    seq: int = 2048
    remat: str = "none"            # none | full | dots | dots_no_batch (choices.REMAT_POLICIES)
    loss_chunks: int = 1           # the loss over this many slices of the sequence (models.loss)
    attention: str = "auto"        # the step's --attention (models.attention.resolve)
    backend: str = "gpu"           # where it runs, which picks `auto`'s kernel: the planner
    #                                plans GPUs; --verify's CPU compile predicts for "cpu"
    # Inference: the serving engine's paged KV pool of `batch` slots of `seq` positions, sized
    # as --kv-blocks / --kv-memory (bytes per device) / --kv-block-size size it (0, 0: slots ×
    # seq's); the KV term is that pool's bytes per device (inference.kv_pool.planned_pool).
    kv_blocks: int = 0
    kv_memory: int = 0
    kv_block_size: int = choices.KV_BLOCK_SIZE
    kv_dtype: str = "auto"         # what the pool stores (--kv-dtype; auto: `dtype`'s)
    # Speculative decoding (costs.speculative): k proposals verified per decode step, each
    # kept with probability `acceptance`, by a `draft` model (None: n-gram lookup, no weights).
    spec_k: int = 0
    acceptance: float = 0.0
    draft: Optional[ModelConfig] = None

    @classmethod
    def of(cls, cfg: Optional[ModelConfig], params: Optional[int] = None, **kw) -> "Workload":
        """The workload of model ``cfg`` (or of ``params`` parameters); ``kw`` sets the rest."""
        if cfg is None and not params:
            raise ValueError("give a model (--model NAME) or a parameter count (--params N)")
        if kw.get("dtype", "bf16") not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {kw['dtype']!r}; choose one of "
                             f"{', '.join(DTYPE_BYTES)}")
        for k in ("batch", "seq"):
            if k in kw and kw[k] < 1:
                raise ValueError(f"--{'batch-size' if k == 'batch' else 'seq-len'} must be ≥ 1")
        choices.check("kv_dtype", kw.get("kv_dtype", "auto"), KV_DTYPES)
        resolve(kw.get("attention", "auto"))   # an unknown --attention names the choices
        check_loss_chunks(kw.get("loss_chunks", 1), kw.get("seq", 2048))
        check_speculative(kw.get("spec_k", 0), kw.get("acceptance", 0.0))
        return cls(cfg, int(params or cfg.num_params), **kw)

    @classmethod
    def of_run(cls, run: "triax.training.config.RunConfig", cfg: Optional[ModelConfig] = None,
               *, train: bool = True, params: Optional[int] = None,
               backend: str = "gpu",
               pool: Optional["triax.inference.pool_settings.PoolSettings"] = None
               ) -> "Workload":
        """The one mapping from a run's settings (a ``training.config.RunConfig``) to what
        is planned: its model (``cfg``; default ``run.model_config()``, none when only
        ``params`` is given), precision, batch, sequence, remat, loss chunks, attention and
        (to serve it, ``train=False``) the KV ``pool`` (serving's flags, not the run's;
        default: slots × sequence); ``backend`` as ``Workload.backend``."""
        if cfg is None and not params:
            cfg = run.model_config()
        pool = pool or PoolSettings()
        c = run.compute
        return cls.of(cfg, params, train=train, dtype=c.precision, batch=run.dataset.batch_size,
                      seq=run.dataset.seq_len, remat=c.remat, loss_chunks=c.loss_chunks,
                      attention=c.attention, backend=backend, kv_blocks=pool.kv_blocks,
                      kv_memory=pool.kv_memory, kv_block_size=pool.block_size,
                      kv_dtype=pool.kv_dtype)

    @classmethod
    def of_engine(cls, cfg: ModelConfig, ecfg: "triax.inference.engine.EngineConfig",
                  backend: str = "gpu") -> "Workload":
        """The one mapping from a serving engine's settings (an
        ``inference.engine.EngineConfig``) to what is planned: ``max_batch`` slots of
        ``max_len`` positions, its KV pool, the weights in the served ``dtype`` and the pool
        in its ``kv_dtype`` (what the engine holds); the model as served (``--quantize``:
        ``models.quantize.served_config``, its int8 leaves priced as stored)."""
        return cls.of(served_config(cfg, ecfg.quantize), train=False,
                      dtype=KV_PRECISION[ecfg.dtype], batch=ecfg.max_batch, seq=ecfg.max_len,
                      backend=backend, kv_blocks=ecfg.kv_blocks, kv_memory=ecfg.kv_memory,
                      kv_block_size=ecfg.block_size, kv_dtype=ecfg.kv_dtype)

    @property
    def run_label(self) -> str:
        """How it runs, for the plan's sentences: ``remat full`` (``, loss in 16 chunks``)
        (``, fp8``: float8 projections, which the search may choose)."""
        return f"remat {self.remat}" + (f", loss in {self.loss_chunks} chunks"
                                        if self.loss_chunks > 1 else "") \
            + (", fp8" if self.dtype == choices.FP8 else "")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_storage(self) -> str:
        """The KV pool's stored dtype (a NumPy name): ``kv_dtype``, or ``dtype``'s."""
        return PRECISIONS[self.dtype] if self.kv_dtype == "auto" else self.kv_dtype

    @property
    def mixed(self) -> bool:
        """Training in bf16/fp16 keeps fp32 master weights (mixed precision)."""
        return self.train and self.dtype != "fp32"

    @property
    def name(self) -> str:
        return self.cfg.name if self.cfg is not None else f"{self.params / 1e9:g}B-params"

    @property
    def lora(self):
        """The model's LoRA adapters (``models.config.LoraConfig``), None without."""
        return None if self.cfg is None else self.cfg.lora

    @property
    def weight_bytes(self) -> int:
        """The weights' bytes: in the workload's dtype, a LoRA base in its own."""
        if self.lora is not None and self.train:
            return self.params * choices.BASE_DTYPE_BYTES[self.lora.base_dtype]
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class Layout:
    """A mesh factorization plus strategy and (for pipe > 1) a schedule."""

    data: int = 1
    tensor: int = 1
    pipe: int = 1
    expert: int = 1
    strategy: Strategy = "dp"   # given by name or resolved; held resolved (.name prints it)
    schedule: Optional[ScheduleKind] = None     # None: not pipelined (pipe == 1)
    microbatches: int = 1
    virtual: int = 1
    context: int = 1    # last: callers build layouts positionally
    context_attention: str = "all-gather"   # the scheme over `context` (sharding.context)
    pipeline_fsdp: str = "stage"   # FSDP in pipeline stages (choices.PIPELINE_FSDP_MODES)
    stage_layers: Optional[tuple[int, ...]] = None   # uneven stages (pipeline.stage_counts)
    replica: int = 1    # HSDP: replica groups, each holding one FSDP-sharded copy
    tp_overlap: bool = False   # SP's gathers/scatters as collective matmuls (permute rings)
    offload: tuple[str, ...] = ()   # state parts in the host's memory (training.offload)

    def __post_init__(self):
        object.__setattr__(self, "strategy", get_strategy(self.strategy))
        object.__setattr__(self, "offload", choices.parse_offload(",".join(self.offload)))
        # the mesh sizes, read once (no field: not compared, hashed or replaced): the search
        # asks ``sizes`` of each candidate many times
        object.__setattr__(self, "_sizes", tuple((a, getattr(self, a)) for a in AXES))

    @property
    def devices(self) -> int:
        return self.replica * self.data * self.tensor * self.pipe * self.expert * self.context

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    @property
    def mesh_str(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.sizes.items() if s > 1) or "data=1"

    @property
    def batch_shards(self) -> int:
        """Ways the global batch is split: the mesh axes the strategy maps ``batch`` to
        (``data``; with the MoE rules also ``expert``)."""
        axes = self.strategy.rules.mesh_axes("batch")
        return math.prod(self.sizes.get(a, 1) for a in axes)

    def unsharded_over_data(self) -> "Layout":
        """The same layout with the parameters not split over ``data`` (what a gather
        yields): the memory model's per-block working set and the traffic model's gathers."""
        # ZeRO-1 splits only the optimizer over data: its parameters are already dp's.
        name = self.strategy.name
        return dataclasses.replace(self, data=1,
                                   strategy={**choices.FSDP_BASE, "zero1": "dp"}.get(name, name))

    def describe(self) -> str:
        sched = "" if self.pipe == 1 or self.schedule is None else (
            f", {self.schedule.value} M={self.microbatches}"
            + (f" v={self.virtual}" if self.virtual > 1 else ""))
        ctx = f", {self.context_attention}" if self.context > 1 else ""
        by_layer = ", FSDP by layer" if self.pipe > 1 and self.pipeline_fsdp == "layer" else ""
        uneven = "" if self.stage_layers is None else \
            f", stage layers {','.join(map(str, self.stage_layers))}"
        overlap = ", tp-overlap" if self.tp_overlap else ""
        off = f", offload {','.join(self.offload)}" if self.offload else ""
        return (f"{self.mesh_str} {self.strategy.name}{sched}{ctx}{by_layer}{uneven}{overlap}"
                f"{off}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def prod(xs) -> int:
    return math.prod(xs)
