"""The cached forward an engine jits: plain SPMD, or pipelined over ``pipe``.

Both have the signature ``fwd(params, tokens_BT, positions_BT, cache) -> (logits_BTV, cache)``
and the same math (the model's forward with a KV cache, ``triax.models.decode``); only the
placement differs.

Pipeline decode (``pipe > 1``) is ``triax.pipeline``'s executor running the validated
forward-only schedule (``Pipeline.decode``): the same tick loop as training, carrying each
stage's KV cache as per-stage state. Every stage holds its ``L/S`` layers and those layers'
cache; the batch is split over ``data`` and into ``M`` micro-batches; the embedding runs on
the first stage, the head on the last, activations move by ``ppermute``.
"""
from __future__ import annotations

from typing import Callable, Optional

from flax import nnx
from jax.sharding import Mesh

from triax.mesh.build import mesh_sizes
from triax.models import runtime
from triax.models.decode import CacheAttentionFn
from triax.models.runtime import ExecConfig
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.pipeline.schedules import ScheduleKind
from triax.sharding.partition import AbstractModel, activation_sharding
from triax.sharding.rules import ShardingError, Strategy


def plain_forward(am: AbstractModel, mesh: Mesh, strategy: Strategy, exe: ExecConfig,
                  cache_attention: Optional[CacheAttentionFn] = None) -> Callable:
    """One SPMD program; XLA inserts the tensor-parallel collectives. ``cache_attention``
    replaces the model's cached attention (``triax.sharding.context_cache``'s hook)."""
    def fwd(params, tokens_BT, positions_BT, cache):
        with activation_sharding(mesh, strategy), \
                runtime.using(cache_attention=cache_attention):
            logits_BTV, _, cache = nnx.merge(am.graphdef, params)(tokens_BT, positions_BT,
                                                                  exe=exe, cache=cache)
        return logits_BTV, cache
    return fwd


def check_pipeline(am: AbstractModel, mesh: Mesh, batch: int, microbatches: int) -> None:
    """Raise a clear error for a layout the pipelined forward cannot run."""
    sizes = mesh_sizes(mesh)
    S, L = sizes["pipe"], am.cfg.num_layers
    if L % S:
        raise ShardingError(f"pipeline decode needs num_layers={L} divisible by pipe={S}; "
                            f"choose pipe dividing {L}")
    if batch % (microbatches * sizes["data"]):
        raise ShardingError(
            f"pipeline decode splits the batch {batch} into {microbatches} micro-batches, "
            f"each sharded over data={sizes['data']}: choose a batch divisible by "
            f"{microbatches * sizes['data']}")


def pipelined_forward(am: AbstractModel, mesh: Mesh, strategy: Strategy, exe: ExecConfig,
                      microbatches: int) -> Callable:
    """Decode through ``pipe`` stages with the forward-only schedule of ``microbatches``."""
    config = PipelineConfig(ScheduleKind.FORWARD_ONLY.value, microbatches)
    return Pipeline(am.cfg, mesh, strategy, config, exe).decode
