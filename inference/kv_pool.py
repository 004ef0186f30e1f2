"""The paged KV pool of one engine, in one home: its shape, placement and size (a
prompt's keys/values enter it by ``models.decode.write_scratch``).

The pool is ``[L, G, N, P, K, H]`` per k and v (``models.decode.PAGED_AXES``): G row groups
(the decode slots split over the batch mesh axes and, under pipeline decode, into its
micro-batches: each group's rows run on the devices that hold its blocks), N blocks per
group of P positions. The strategy's rules split it as they split a slot cache: KV heads
over ``tensor``, layers over ``pipe``, the groups over ``data``; under context parallelism
each block's P positions are striped over ``context`` (rank r holds places r, r+C, …, so a
position lives on the rank that owns it in the prompt's striped order,
``triax.sharding.context_cache``).

Size: ``--kv-blocks`` (blocks over all groups), or ``--kv-memory`` (bytes of pool per
device: as many whole blocks per group as fit), or by default as many blocks as slots ×
``max_len`` positions need (the memory of a slot-reserved cache). Bytes per block per device
are ``bytes_per_block`` (2 · L/pipe · P/context · K/tensor · H · the dtype's bytes). The
planner counts the same pool on a mesh it only imagines (``planned_pool``: an abstract mesh).

Dtype (``--kv-dtype``, ``kv_dtype``): ``auto`` stores keys/values in the served weights'
dtype; ``int8`` stores them quantized with one float32 scale per block, layer and KV head
(``k_scale`` / ``v_scale``, ``[L, G, N, K]``, placed as the pool without its positions and
head dim; ``models.decode`` quantizes on write and dequantizes on read), so a block costs
2 · L · K · (P · H + 4) bytes before the mesh splits it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from triax.choices import KV_DTYPES, SERVE_DTYPES, check
from triax.inference.errors import InferenceError
from triax.inference.pool_settings import PoolSettings
from triax.mesh.build import AXES, mesh_sizes
from triax.models.config import ModelConfig
from triax.models.decode import CACHE_AXES, PAGED_AXES, cache_shape
from triax.pipeline.pipelined import default_decode_microbatches
from triax.sharding.context_cache import ContextCache, context_cache
from triax.sharding.rules import Strategy

SCALE_DTYPE = jnp.dtype(jnp.float32)   # an int8 pool's per-block, per-head scales


def kv_storage_dtype(dtype: str, kv_dtype: str = "auto") -> str:
    """The pool's stored dtype: ``kv_dtype`` (``--kv-dtype``), ``auto`` following the
    served weights' ``dtype`` (``--dtype``)."""
    check("dtype", dtype, SERVE_DTYPES)
    return dtype if check("kv_dtype", kv_dtype, KV_DTYPES) == "auto" else kv_dtype


def split_context(mesh: Mesh, strategy: Strategy) -> Optional[ContextCache]:
    """The context-split cache layout an engine on ``mesh`` uses, or None: no context axis,
    or pipeline decode (whose stages run whole over ``context``)."""
    if mesh_sizes(mesh)["pipe"] > 1:
        return None
    return context_cache(mesh, strategy.rules, strategy.context_attention)


def decode_microbatches(mesh: Mesh, microbatches: int) -> int:
    """Pipeline decode's micro-batches (``EngineConfig.microbatches``, 0: the default)."""
    return microbatches or default_decode_microbatches(mesh_sizes(mesh)["pipe"])


def row_groups(mesh: Mesh, strategy: Strategy, microbatches: int) -> int:
    """The pool's row groups: one per batch shard, times the pipeline's micro-batches."""
    sizes = mesh_sizes(mesh)
    if sizes["pipe"] > 1:   # the pipeline splits rows over `data` only
        return sizes["data"] * decode_microbatches(mesh, microbatches)
    return math.prod(sizes.get(a, 1) for a in strategy.rules.mesh_axes("batch"))


def scratch_layout(cfg: ModelConfig, mesh: Mesh, strategy: Strategy, batch: int,
                   length: int) -> tuple[tuple[int, ...], NamedSharding]:
    """Shape and placement of a prefill's scratch cache (``[L, b, T, K, H]``, a slot cache
    of the prompt's bucket): the rules', its positions over ``context`` where split."""
    ctx = split_context(mesh, strategy)
    if ctx is None:
        shape = cache_shape(cfg, batch, length)
        spec = strategy.rules.spec(CACHE_AXES, shape, mesh_sizes(mesh), what="KV cache")
    else:
        shape = cache_shape(cfg, batch, ctx.length(length))
        spec = ctx.spec(shape)
    return shape, NamedSharding(mesh, spec)


@dataclass(frozen=True)
class KVPool:
    """One engine's pool: ``groups`` × ``blocks`` blocks of ``block_size`` positions; a
    sequence holds at most ``max_blocks`` (its ``max_len``)."""

    groups: int
    blocks: int          # per group
    block_size: int
    max_blocks: int
    shape: tuple[int, ...]
    sharding: NamedSharding
    dtype: str = "float32"   # what it stores: float32 | bfloat16 | int8 (with scales)

    @property
    def quantized(self) -> bool:
        return self.dtype == "int8"

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """An int8 pool's scales: one per layer, group, block and KV head."""
        return _scale_shape(self.shape)

    @property
    def scale_sharding(self) -> NamedSharding:
        return _scale_sharding(self.sharding)

    @property
    def total_blocks(self) -> int:
        return self.groups * self.blocks

    @property
    def positions(self) -> int:
        """KV positions the whole pool holds (what the planner's KV term counts)."""
        return self.total_blocks * self.block_size

    def arrays(self) -> dict:
        """Each pool array's ``(shape, dtype, sharding)``: k and v (and an int8 pool's
        per-block, per-head scales, ``k_scale`` / ``v_scale``)."""
        out = {n: (self.shape, jnp.dtype(self.dtype), self.sharding) for n in ("k", "v")}
        if self.quantized:
            out.update({f"{n}_scale": (self.scale_shape, SCALE_DTYPE, self.scale_sharding)
                        for n in ("k", "v")})
        return out

    def bytes_per_device(self) -> int:
        """Bytes of pool (k and v) each device holds."""
        return _per_device(self.shape, self.sharding, self.dtype)


def _scale_shape(shape) -> tuple[int, ...]:
    return (*shape[:3], shape[4])


def _scale_sharding(sh: NamedSharding) -> NamedSharding:
    spec = tuple(sh.spec) + (None,) * (6 - len(sh.spec))
    return NamedSharding(sh.mesh, PartitionSpec(*spec[:3], spec[4]))


def _placed(cfg, mesh, strategy, groups, blocks, block_size):
    shape = (cfg.num_layers, groups, blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    ctx = split_context(mesh, strategy)
    spec = strategy.rules.spec(PAGED_AXES, shape, mesh_sizes(mesh), what="KV pool") \
        if ctx is None else ctx.spec(shape, PAGED_AXES)
    return shape, NamedSharding(mesh, spec)


def _per_device(shape, sh, dtype: str) -> int:
    values = math.prod(sh.shard_shape(shape)) * jnp.dtype(dtype).itemsize
    if dtype == "int8":
        scale = _scale_shape(shape)
        values += math.prod(_scale_sharding(sh).shard_shape(scale)) * SCALE_DTYPE.itemsize
    return 2 * values


def bytes_per_block(cfg: ModelConfig, mesh: Mesh, strategy: Strategy, block_size: int,
                    microbatches: int = 0, dtype: str = "float32") -> int:
    """Bytes one block (k and v, and an int8 pool's scales) takes on each device that
    holds a share of it, stored as ``dtype``."""
    G = row_groups(mesh, strategy, microbatches)
    shape, sh = _placed(cfg, mesh, strategy, G, 1, block_size)
    return _per_device(shape, sh, dtype) // sh.shard_shape(shape)[1]   # groups held here


def planned_pool(cfg: ModelConfig, sizes: Mapping[str, int], strategy: Strategy, slots: int,
                 max_len: int, settings: PoolSettings, microbatches: int = 0,
                 dtype: str = "float32") -> KVPool:
    """The pool ``kv_pool`` would build on a mesh of ``sizes`` (axes left out are 1) for
    ``slots`` sequences of ``max_len`` positions, stored as ``dtype``: no devices needed
    (``triax plan``'s KV term)."""
    mesh = AbstractMesh(tuple(int(sizes.get(a, 1)) for a in AXES), AXES)
    return _pool(cfg, mesh, strategy, slots, max_len, settings, microbatches, dtype)


def kv_pool(cfg: ModelConfig, mesh: Mesh, strategy: Strategy, ecfg) -> KVPool:
    """The pool ``ecfg`` (an ``EngineConfig``) asks for on ``mesh``, in its stored dtype
    (``ecfg.cache_dtype``: what ``--kv-memory`` buys); a clear error when its size, block
    size or dtype cannot be."""
    settings = PoolSettings(ecfg.kv_blocks, ecfg.kv_memory, ecfg.block_size)
    return _pool(cfg, mesh, strategy, ecfg.max_batch, ecfg.max_len, settings,
                 ecfg.microbatches, ecfg.cache_dtype)


def _pool(cfg, mesh, strategy, slots, max_len, settings: PoolSettings, microbatches,
          dtype) -> KVPool:
    P, C = settings.block_size, mesh_sizes(mesh)["context"]
    ctx = split_context(mesh, strategy)
    if dtype == "int8" and ctx is not None:
        raise InferenceError(f"--kv-dtype int8 with context={C}: a block's scale would span "
                             f"the context ranks' stripes; use --kv-dtype bfloat16 there")
    if P < 1 or (ctx is not None and P % ctx.size):
        raise InferenceError(f"--kv-block-size {P}: choose a positive multiple of "
                             f"context={C} (a block's positions stripe over context)")
    G = row_groups(mesh, strategy, microbatches)
    if slots % G:
        raise InferenceError(f"{slots} decode slots do not split into the KV pool's "
                             f"{G} row groups (batch shards × micro-batches); choose --slots "
                             f"a multiple of {G}")
    M = -(-max_len // P)
    if settings.kv_blocks:
        if settings.kv_blocks % G:
            raise InferenceError(f"--kv-blocks {settings.kv_blocks} does not split into the "
                                 f"pool's {G} row groups; choose a multiple of {G}")
        total = settings.kv_blocks
    elif settings.kv_memory:
        # A device holds its groups' blocks: n per group cost n × one block of each of them.
        one = _per_device(*_placed(cfg, mesh, strategy, G, 1, P), dtype)
        if settings.kv_memory < one:
            raise InferenceError(
                f"--kv-memory {settings.kv_memory} bytes holds no KV block: one block per row "
                f"group takes {one} bytes per device (--kv-block-size {P}); give at least "
                f"{one} bytes, or a smaller --kv-block-size")
        total = settings.kv_memory // one * G
    else:   # what slot-reserved caches of max_len positions would take
        total = slots * M
    shape, sh = _placed(cfg, mesh, strategy, G, total // G, P)
    return KVPool(G, total // G, P, M, shape, sh, dtype)
