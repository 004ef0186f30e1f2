"""How the model runs while it is traced: one frozen :class:`Runtime`, in one ContextVar.

The model's code is written once and runs anywhere; what changes from run to run (compute
dtype and remat, the sharding layer's activation constraint and attention kernels, the MoE
expert runner, a pipeline stage's per-layer parameter gather and slot count, the running
layer, LoRA's dropout seeds, each row's adapter slot, the collective-matmul projections) is a
field of the one ``Runtime``. The callers that know (the
sharding layer, a pipeline stage, the engine, ``run_stack``) layer fields over the current
runtime with :func:`using`; the model's code reads them through thin accessors
(``axes.constrain``, ``attention.attention``, ``decode.cached_attention``,
``protocol.current_exec``, ``protocol.current_layer``, ...).

Why a ContextVar rather than an argument: the readers sit deep inside the layers (every
``constrain``) and inside models triax does not own (a user's NNX model follows
``protocol.PipelineModel``, whose ``block(block, x, batch)`` has no room for it). Passing it
down would put plumbing into every layer's and every user's signature; one variable keeps the
model's code free of it, and one frozen value keeps every field restored together on exit.
Nothing here names a mesh: the hooks the sharding layer installs do.

    >>> rt = current()
    >>> rt.constraint is None and rt.layer is None
    True
    >>> with using(layer=3, moe_inference=True):
    ...     with using(layer=4):                      # layers over the outer, keeps the rest
    ...         inner = current()
    ...     outer = current()
    >>> inner.layer, inner.moe_inference, outer.layer, current().layer
    (4, True, 3, None)
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import jax.numpy as jnp



@dataclass(frozen=True)
class ExecConfig:
    """How to run (not what to run): compute dtype and activation checkpointing."""

    compute_dtype: str = "float32"  # "bfloat16": bf16 compute over fp32 master parameters
    remat: str = "none"             # see triax.models.transformer.REMAT_POLICIES
    attention: str = "auto"         # see triax.models.attention.resolve
    loss_chunks: int = 1            # the loss over this many slices of the sequence (models.loss)
    fp8: bool = False               # the block's projections in float8 (models.fp8)

    @property
    def dtype(self):
        """``compute_dtype`` as a NumPy dtype."""
        return jnp.dtype(self.compute_dtype)


@dataclass(frozen=True)
class Runtime:
    """Everything that steers the model while it is traced; each default runs it as written,
    on whole arrays."""

    exe: ExecConfig = ExecConfig()        # protocol.current_exec: dtype, remat, kernel, chunks
    # The hooks are typed as plain callables: their aliases live in the modules that call
    # them (models.axes.Constraint, attention.AttentionFn, decode.CacheAttentionFn,
    # moe.MoERunner), which import this one.
    # (x, logical_axes) -> x: resolves the logical activation axes (models.axes.constrain)
    constraint: Optional[Callable] = None
    # replaces every models.attention.attention call (context parallelism's kernel)
    attention: Optional[Callable] = None
    # replaces every models.decode.cached_attention call (the context-split cache)
    cache_attention: Optional[Callable] = None
    moe_runner: Optional[Callable] = None   # how MoE token work runs (models.moe; None: here)
    moe_inference: bool = False       # every MoE layer routes dropless (models.moe.capacity)
    # run_stack reads each layer's parameters through this (a pipeline stage's FSDP gather by
    # layer); its result is never kept for the backward, which calls it again
    layer_params: Optional[Callable] = None
    # int32 scalar (may be traced): run_stack runs the first ``layer_count`` layers and skips
    # the rest under a lax.cond (uneven pipeline stages); None: every layer, no conditional
    layer_count: Optional[Any] = None
    layer: Optional[Any] = None       # inside run_stack's scan: the running layer's index
    # (seeds_BT, layer) while a block runs a training step with LoRA dropout (models.lora)
    lora_dropout: Optional[tuple] = None
    # int32 [B] while a serving step runs a LoRA table (models.lora_table): each row's
    # adapter slot (0: none); None: no row has an adapter
    adapter_rows: Optional[Any] = None
    # replace models.projection's column-parallel projections of the residual stream and
    # its row-parallel projections back onto it (collective matmul; None: plain einsums)
    gather_matmul: Optional[Callable] = None
    matmul_scatter: Optional[Callable] = None


_CURRENT: contextvars.ContextVar[Runtime] = contextvars.ContextVar("triax_runtime",
                                                                  default=Runtime())


def current() -> Runtime:
    """The runtime in effect (``Runtime()`` outside of any :func:`using`)."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(**fields) -> Iterator[Runtime]:
    """While active, the current runtime with ``fields`` replaced (an unknown name is a
    ``TypeError``); on exit the outer runtime is back, whatever the block set inside."""
    token = _CURRENT.set(dataclasses.replace(_CURRENT.get(), **fields))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
