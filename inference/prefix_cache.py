"""Automatic prefix caching's host side: which full KV blocks hold which tokens.

A full block is keyed by a hash of its tokens and of every token before it (a chain: block
i's key hashes block i-1's key with its own tokens), so two prompts share a block only when
they agree on everything up to its end. A block whose last holder ended stays here, cached,
in least-recently-used order, until the pool needs a free block and evicts the oldest
(``inference.kv_blocks``). One ``PrefixCache`` per row group: a block lives in one group's
pool, so only that group's slots can share it.

    >>> keys = block_keys([1, 2, 3, 4, 5], block_size=2)   # two full blocks; 5 is left over
    >>> len(keys), keys[0] != block_keys([9, 2, 3, 4], 2)[0]
    (2, True)
    >>> cache = PrefixCache()
    >>> cache.add(keys[0], 7); cache.add(keys[1], 3)
    >>> cache.match(keys + [b"x"])          # the chain's blocks, up to the first miss
    [7, 3]
    >>> cache.park(7); cache.evict()        # unused and oldest: its key is forgotten
    7
    >>> cache.match(keys)                   # block 0's key is gone: nothing matches
    []
"""
from __future__ import annotations

import collections
import hashlib
from typing import Optional, Sequence

import numpy as np


def block_keys(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained key of every full block of ``tokens`` (``salt``: the chain's start, what
    else the blocks depend on: a LoRA adapter's load; none for the base)."""
    out, parent = [], salt
    data = np.asarray(tokens, np.int64).tobytes()   # one conversion; slices of bytes below
    step = block_size * 8
    for i in range(len(data) // step):
        parent = hashlib.blake2b(parent + data[i * step:(i + 1) * step],
                                 digest_size=16).digest()
        out.append(parent)
    return out


class PrefixCache:
    """One row group's keyed blocks and, among them, the unused ones in LRU order."""

    def __init__(self):
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.unused: collections.OrderedDict[int, None] = collections.OrderedDict()

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest cached run of ``keys`` from the first."""
        out = []
        for k in keys:
            b = self.block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def add(self, key: bytes, block: int) -> None:
        """``block`` now holds ``key``'s tokens (a key already cached keeps its block)."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key], self.key_of[block] = block, key

    def keyed(self, block: int) -> bool:
        return block in self.key_of

    def park(self, block: int) -> None:
        """``block``'s last holder ended: it stays cached, the newest unused one."""
        self.unused[block] = None

    def reuse(self, block: int) -> None:
        """A parked block is shared again: not evictable while held."""
        self.unused.pop(block, None)

    def evict(self) -> Optional[int]:
        """The oldest unused block, its key forgotten (None: none is parked)."""
        if not self.unused:
            return None
        block, _ = self.unused.popitem(last=False)
        del self.block_of[self.key_of.pop(block)]
        return block
