"""The KV pool's size as the flags give it (``--kv-blocks`` / ``--kv-memory`` /
``--kv-block-size``), checked in one place: ``RunConfig``, ``triax serve`` / ``generate``
(with or without ``--plan auto``) and ``triax plan`` all make one. No JAX.

    >>> PoolSettings.of_flags(kv_memory="1MiB")
    PoolSettings(kv_blocks=0, kv_memory=1048576, block_size=16)
    >>> PoolSettings.of_flags(kv_blocks=8, kv_memory="1MiB")
    Traceback (most recent call last):
    ...
    ValueError: give one of --kv-blocks and --kv-memory (both size the pool)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from triax.choices import KV_BLOCK_SIZE
from triax.units import parse_bytes


@dataclass(frozen=True)
class PoolSettings:
    """Blocks over all row groups, or bytes of pool per device (both 0: slots × max_len's),
    and positions per block; the names ``EngineConfig`` and ``build_server`` take."""

    kv_blocks: int = 0
    kv_memory: int = 0
    block_size: int = KV_BLOCK_SIZE

    @classmethod
    def of_flags(cls, kv_blocks: Optional[int] = None, kv_memory: Optional[str] = None,
                 kv_block_size: int = KV_BLOCK_SIZE) -> "PoolSettings":
        """The flags' values (None: not given; ``kv_memory`` a size such as ``2GiB``),
        refused naming the flag and a fix."""
        if kv_blocks is not None and kv_memory is not None:
            raise ValueError("give one of --kv-blocks and --kv-memory (both size the pool)")
        if kv_blocks is not None and kv_blocks < 1:
            raise ValueError(f"--kv-blocks {kv_blocks}: must be ≥ 1; give the pool's blocks, "
                             f"e.g. --kv-blocks 512, or leave it out")
        if kv_block_size < 1:
            raise ValueError(f"--kv-block-size {kv_block_size}: must be ≥ 1; give positions "
                             f"per block, e.g. --kv-block-size 16")
        return cls(kv_blocks or 0, _memory(kv_memory), kv_block_size)


def _memory(kv_memory: Optional[str]) -> int:
    if kv_memory is None:
        return 0
    try:
        n = parse_bytes(kv_memory)
    except ValueError as e:
        raise ValueError(f"--kv-memory: {e}") from None
    if n <= 0:
        raise ValueError(f"--kv-memory {kv_memory}: must be > 0, e.g. --kv-memory 2GiB")
    return n
