"""Per-device memory, term by term: parameters, gradients, optimizer, activations, KV cache.

Parameter-shaped terms are exact: they walk the model's real parameter tree, placed as the
step places it (:mod:`.param_layout`); the activations are :mod:`.activations`'.

    >>> from triax.models import config
    >>> from triax.costs.workload import Layout, Workload
    >>> w = Workload.of(config.get("tiny"), train=True, dtype="fp32", batch=8, seq=16)
    >>> m = estimate(w, Layout(data=8))
    >>> m.params == config.get("tiny").num_params * 4
    True
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

from triax.costs.activations import activation_bytes
from triax.inference.errors import InferenceError
from triax.inference.kv_pool import planned_pool   # the pool's one home (no engine needed)
from triax.inference.pool_settings import PoolSettings
from triax.costs.param_layout import (block_elements, layout_rules, leaf_elements,
                                        local_base_bytes, local_param_elements,
                                        local_served_bytes, param_leaves)
from triax.costs.offload import planned_cost
from triax.costs.speculative import draft_workload
from triax.costs.workload import ADAM_MOMENTS, FP32, Layout, Workload, ceil_div
from triax.pipeline.stage_layers import StageLayers, stack_kept_whole
from triax.sharding.rules import ShardingError
from triax.units import decimal_bytes


@dataclass(frozen=True)
class Assumptions:
    """Stated constants of the model (reported with every plan)."""

    overhead_bytes: float = 2e9        # CUDA/NCCL context, allocator slack, per device
    overhead_frac: float = 0.05        # fragmentation, as a fraction of the modelled terms
    compute_efficiency: float = 0.45   # achieved / peak FLOP/s for the matmuls
    comm_efficiency: float = 0.8       # achieved / nominal link bandwidth
    data_overlap: float = 0.5          # DP/FSDP traffic hidden under this share of compute

    def describe(self) -> str:
        return (f"compute at {self.compute_efficiency:.0%} of peak, links at "
                f"{self.comm_efficiency:.0%} of nominal, DP/FSDP traffic overlapping "
                f"{self.data_overlap:.0%} of compute, TP/PP/EP traffic exposed, overhead "
                f"{decimal_bytes(self.overhead_bytes, 'g')} + {self.overhead_frac:.0%} per device")


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by term. ``total`` includes ``overhead``."""

    params: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float
    overhead: float
    block_weights: float = 0.0  # one block's weights made ready for compute (see estimate)
    host: float = 0.0   # host-offloaded state (``costs.offload``): in the host's memory, not here

    @property
    def modelled(self) -> float:
        """Everything on the device but the overhead: what XLA's memory_analysis sees."""
        return (self.params + self.grads + self.optimizer + self.activations + self.kv_cache
                + self.block_weights)

    @property
    def total(self) -> float:
        return self.modelled + self.overhead

    def as_dict(self) -> dict:
        return {**{k: int(v) for k, v in asdict(self).items()}, "total": int(self.total)}


def kv_cache_bytes(w: Workload, lay: Layout) -> float:
    """The serving engine's paged KV pool (k and v) per device on the layout, from the pool's
    one home (``inference.kv_pool.planned_pool``): ``w.batch`` slots of ``w.seq`` positions,
    sized by ``w.kv_blocks`` / ``w.kv_memory``, stored as ``w.kv_storage``. A pool the layout
    cannot split (its row groups, a block over ``context``) is a ``ShardingError``."""
    if w.cfg is None or w.train:
        return 0.0
    settings = PoolSettings(w.kv_blocks, w.kv_memory, w.kv_block_size)
    try:
        pool = planned_pool(w.cfg, lay.sizes, lay.strategy, w.batch, w.seq,
                            settings, lay.microbatches if lay.pipe > 1 else 0, w.kv_storage)
    except InferenceError as e:
        raise ShardingError(f"the KV pool on {lay.mesh_str}: {e}") from None
    return float(pool.bytes_per_device())


# ---- the whole picture ---------------------------------------------------------------------
def estimate(w: Workload, lay: Layout, assume: Optional[Assumptions] = None) -> Memory:
    """Per-device memory for the workload on the layout (raises ShardingError if the
    strategy's rules cannot split the model over the mesh); a layout with host offload
    (``lay.offload``) has its offloaded state moved to ``host`` (``costs.offload``)."""
    assume = assume or Assumptions()
    p_local = local_param_elements(w, lay)
    if w.train and w.lora is not None:
        # LoRA: the frozen base in its dtype, no gradient or moments of it; the adapters train
        # as full fine-tuning would (fp32, their gradients, AdamW moments).
        ad = local_param_elements(w, lay, part="adapters")
        ad_o = local_param_elements(w, lay, optimizer=True, part="adapters")
        params = local_base_bytes(w, lay) + ad * FP32
        grads = 2 * ad_o * FP32            # the accumulated and one fresh gradient, bounded
        optimizer = ad_o * FP32 * ADAM_MOMENTS + 16
    elif w.train:
        o_local = local_param_elements(w, lay, optimizer=True)
        # triax trains fp32 parameters; under mixed precision they *are* the fp32 master
        # weights and each block is cast to bf16/fp16 as it runs (block_weights below).
        # Gradients are fp32 and follow the optimizer's sharding (ZeRO-1 shards them), plus
        # one block's gradient before its reduction (a pipeline's B: its chunk's). AdamW: mu
        # and nu in fp32.
        params = p_local * FP32
        # Pipelined FSDP accumulates the stage's gradients whole over ``data`` in the tick
        # loop and reduce-scatters them once per step (``pipeline.fsdp.FSDP.reduce``).
        acc = _stage_elements(w, lay) if pipelined_fsdp(w, lay) else o_local
        grads = acc * FP32 + _fresh_grad_elements(w, lay) * FP32
        optimizer = o_local * FP32 * ADAM_MOMENTS + 16     # + step counters
    else:   # served: each leaf as the engine places it (int8 projections under --quantize)
        params = p_local * w.dtype_bytes if w.cfg is None else local_served_bytes(w, lay)
        grads, optimizer = 0.0, 0.0
    acts = activation_bytes(w, lay)
    kv = kv_cache_bytes(w, lay)
    if not w.train and w.draft is not None:   # the draft's weights and pool beside these
        d = estimate(draft_workload(w), lay, assume)
        params, kv = params + d.params, kv + d.kv_cache
    block = _block_weights(w, lay, p_local) + _stage_copy_elements(w, lay) * (
        FP32 if w.train else w.dtype_bytes)
    mem = Memory(params, grads, optimizer, acts, kv, 0.0, block)
    if lay.offload:
        mem = device_memory(mem, w, lay)
    return replace(mem, overhead=assume.overhead_bytes + assume.overhead_frac * mem.modelled)


def device_memory(mem: Memory, w: Workload, lay: Layout) -> Memory:
    """``mem`` (the terms of ``w`` on ``lay``) with the state ``lay.offload`` names moved off
    the device (``training.offload``): ``host`` is the offloaded state's bytes
    (``costs.offload``'s ``host_bytes``)."""
    targets = lay.offload
    return replace(mem, params=0.0 if "params" in targets else mem.params,
                   optimizer=0.0 if "optimizer" in targets else mem.optimizer,
                   host=planned_cost(w, lay).host_bytes if targets else 0.0)


def _block_weights(w: Workload, lay: Layout, p_local: int) -> float:
    """FSDP: one block's weights gathered over ``data`` (a pipelined stage: all its weights);
    mixed precision: one block's compute-dtype copy of the local fp32 weights."""
    if not w.train or w.cfg is None:
        return 0.0
    if pipelined_fsdp(w, lay):   # the stage's weights, gathered once per step (pipeline.fsdp)
        return _stage_elements(w, lay) * FP32
    if pipelined_fsdp(w, lay, "layer"):   # one block's fp32 weights, gathered as it runs
        return _block_grad_elements(w, lay) * FP32 + (
            _block_grad_elements(w, lay) * w.dtype_bytes if w.mixed else 0)
    if lay.strategy.fsdp and lay.data > 1:
        return _block_grad_elements(w, lay) * w.dtype_bytes
    if w.mixed:
        return p_local / w.cfg.num_layers * w.dtype_bytes
    return 0.0


def pipelined_fsdp(w: Workload, lay: Layout, mode: str = "stage") -> bool:
    """A pipelined step under FSDP whose stages hold the weights as ``mode`` says
    (``lay.pipeline_fsdp``): ``stage``, the executor gathers the whole stage over ``data``
    once per step, outside the tick loop; ``layer``, one block at a time per op."""
    return lay.pipe > 1 and w.cfg is not None and lay.strategy.fsdp \
        and lay.data > 1 and lay.pipeline_fsdp == mode


def _stage_elements(w: Workload, lay: Layout) -> int:
    """A pipeline stage's own parameters whole over ``data`` (what pipelined FSDP gathers and
    accumulates): the pre/post-stack and its ``v`` chunks of ``per_chunk`` blocks, even where
    the stack is stored whole on every stage (an uneven layer count)."""
    rules = layout_rules(w, lay.unsharded_over_data())
    elems = leaf_elements(w.cfg, rules, lay.sizes)
    pieces = sum(elems[i] for i, (p, _, _) in enumerate(param_leaves(w.cfg))
                 if not p.startswith("blocks/"))
    return pieces + lay.virtual * _per_chunk(w, lay) * _block_grad_elements(w, lay)


def _stage_copy_elements(w: Workload, lay: Layout) -> int:
    """The stage's chunks copied out of a stack kept whole on every pipe rank
    (``stage_layers.stack_kept_whole``: an uneven layer count), in its local placement;
    an even split's stage, and uneven stages' (stored stage by stage), is a view of its own
    ``layers → pipe`` shard instead."""
    if lay.pipe == 1 or w.cfg is None or not stack_kept_whole(
            w.cfg.num_layers, lay.pipe, lay.stage_layers):
        return 0
    block = block_elements(w.cfg, layout_rules(w, lay), lay.sizes)
    return lay.virtual * _per_chunk(w, lay) * block


def _per_chunk(w: Workload, lay: Layout) -> int:
    """Blocks in one of a stage's chunks (the executor's ``StageLayers``, padding included)."""
    return StageLayers(w.cfg.num_layers, lay.pipe, lay.virtual,
                       counts=lay.stage_layers).per_chunk


def _block_grad_elements(w: Workload, lay: Layout) -> int:
    """One block's parameters, whole over ``data``: its gradient before the reduction (the
    backward's working set) and, under FSDP, its gathered weights."""
    if w.cfg is None:
        return 0
    return block_elements(w.cfg, layout_rules(w, lay.unsharded_over_data()), lay.sizes)


def _fresh_grad_elements(w: Workload, lay: Layout) -> int:
    """The gradient a backward produces before adding it up: one block's (the layer scan's
    iteration), or with a pipeline B's whole chunk's (its layer loop emits the chunk's
    stacked gradients, which the executor then adds into the stage's accumulator)."""
    blocks = 1
    if lay.pipe > 1 and w.cfg is not None:
        blocks = _per_chunk(w, lay)
        # uneven stages: B's layer slot is a conditional, whose gradient XLA returns in a
        # buffer of its own before the loop stacks it (pipeline.buffer_sizes' ``slot``)
        if StageLayers(w.cfg.num_layers, lay.pipe, lay.virtual,
                       counts=lay.stage_layers).slot_counts is not None:
            blocks += 1
    if pipelined_fsdp(w, lay, "layer"):   # each block's reduce-scattered as it is made
        return _block_grad_elements(w, lay) + blocks * ceil_div(
            _block_grad_elements(w, lay), lay.data)
    return blocks * _block_grad_elements(w, lay)


def min_devices_for_weights(w: Workload, device_memory: float) -> int:
    """Devices of this kind needed just to hold the weights (in the workload's dtype)."""
    return max(1, ceil_div(int(w.weight_bytes), int(device_memory)))
