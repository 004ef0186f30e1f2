"""The KV pool's size as the engine and the planner take it: whole numbers, resolved from the
flags' section (``config_fields.KVPool``: ``--kv-blocks`` / ``--kv-memory`` /
``--kv-block-size``, checked there, in one place). No JAX.

    >>> PoolSettings.of_flags(kv_memory="1MiB")
    PoolSettings(kv_blocks=0, kv_memory=1048576, block_size=16, kv_dtype='auto')
    >>> PoolSettings.of_flags(kv_blocks=8, kv_memory="1MiB")
    Traceback (most recent call last):
    ...
    ValueError: give one of --kv-blocks and --kv-memory (both size the pool)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from triax.choices import KV_BLOCK_SIZE
from triax.config_fields import KVPool


@dataclass(frozen=True)
class PoolSettings:
    """Blocks over all row groups, or bytes of pool per device (both 0: slots × max_len's),
    positions per block, and what a position stores (``--kv-dtype``); the names
    ``EngineConfig`` takes."""

    kv_blocks: int = 0
    kv_memory: int = 0
    block_size: int = KV_BLOCK_SIZE
    kv_dtype: str = "auto"

    @classmethod
    def of(cls, pool: KVPool) -> "PoolSettings":
        """The flags' section (already checked) resolved to whole numbers."""
        return cls(pool.kv_blocks or 0, pool.memory_bytes(), pool.kv_block_size, pool.kv_dtype)

    @classmethod
    def of_flags(cls, kv_blocks: Optional[int] = None, kv_memory: Optional[str] = None,
                 kv_block_size: int = KV_BLOCK_SIZE, kv_dtype: str = "auto") -> "PoolSettings":
        """The flags' values (None: not given; ``kv_memory`` a size such as ``2GiB``),
        refused as the flags are, naming the flag and a fix."""
        return cls.of(KVPool(kv_blocks, kv_memory, kv_block_size, kv_dtype))
