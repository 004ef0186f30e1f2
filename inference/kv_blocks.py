"""The host side of the paged KV cache: which blocks of the pool each decode slot holds.

A replica's pool has ``groups`` row groups of ``blocks`` blocks each (``models.decode``: a
slot's blocks come from its group, the slots split into contiguous groups). A sequence is
admitted with a **reservation** (``reserve``: blocks set aside for the positions it is about
to fill; the serving scheduler reserves its prompt and first decoded position), **takes**
blocks as it grows (``grow``), and gives them all back when it ends (``release``: finished,
cancelled, failed or stopped). ``tables`` is the ``[slots, max_blocks]`` block table the
engine's programs read; an entry equal to ``blocks`` is no block.

With ``prefix_cache`` (``inference.prefix_cache``), a prompt's full blocks are keyed once
written (``register``); a later prompt of the same group that starts with the same tokens
``lookup``s them and its reservation shares them (``reserve(..., shared=)``): a block's
``refs`` count its holders, and one is never given back while any holds it. A block whose
last holder ended stays cached (its key kept) until a free block is needed and none is
left: then the least recently used one is evicted.

    >>> kv = KVBlocks(groups=1, blocks=4, block_size=16, slots=2, max_blocks=2)
    >>> kv.reserve(0, 20)            # 20 positions: 2 blocks set aside
    >>> kv.grow(0, 5); kv.tables[0].tolist(), kv.in_use, kv.available(0)
    ([0, 4], 1, 2)
    >>> kv.release(0); kv.in_use
    0
"""
from __future__ import annotations

import numpy as np

from typing import Sequence

from triax.inference.errors import CacheFullError, InferenceError
from triax.inference.prefix_cache import PrefixCache, block_keys


class KVBlocksError(InferenceError):
    """A block-table call out of order (a double release, a second reservation)."""


class KVBlocks:
    """Free lists, per-slot block tables and reservations of one replica's pool."""

    def __init__(self, groups: int, blocks: int, block_size: int, slots: int, max_blocks: int,
                 prefix_cache: bool = False):
        if slots % groups:
            raise KVBlocksError(f"{slots} slots do not split into {groups} row groups")
        self.groups, self.blocks, self.block_size = groups, blocks, block_size
        self.slots, self.max_blocks = slots, max_blocks
        self.tables = np.full((slots, max_blocks), blocks, np.int32)
        self.held = np.zeros(slots, np.int64)       # blocks taken by each slot
        self.reserved = np.zeros(slots, np.int64)   # blocks set aside for it (>= held)
        self._free = [list(range(blocks))[::-1] for _ in range(groups)]   # pop() takes 0 first
        self.refs = np.zeros((groups, blocks), np.int64)   # holders of each block
        self.prefix = [PrefixCache() for _ in range(groups)] if prefix_cache else None
        self.evicted = 0   # cached blocks taken back for new tokens

    def group(self, slot: int) -> int:
        return slot // (self.slots // self.groups)

    def need(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_size)

    def available(self, slot: int) -> int:
        """Blocks of ``slot``'s group neither taken nor reserved (cached unused ones count:
        they are evicted when needed)."""
        g = self.group(slot)
        rows = slice(g * (self.slots // self.groups), (g + 1) * (self.slots // self.groups))
        parked = len(self.prefix[g].unused) if self.prefix else 0
        return len(self._free[g]) + parked - int((self.reserved[rows] - self.held[rows]).sum())

    def lookup(self, slot: int, prompt: Sequence[int], salt: bytes = b"") -> list[int]:
        """The cached blocks of ``slot``'s group that hold ``prompt``'s first full blocks
        (never its last token: its logits are what the prefill samples from); ``salt``:
        what else the blocks' values depend on (a LoRA adapter's load)."""
        if self.prefix is None:
            return []
        keys = block_keys(prompt[:len(prompt) - 1], self.block_size, salt)
        return self.prefix[self.group(slot)].match(keys)

    def register(self, slot: int, prompt: Sequence[int], salt: bytes = b"") -> None:
        """``slot``'s blocks now hold ``prompt``: key its full blocks for later prompts."""
        if self.prefix is not None:
            cache = self.prefix[self.group(slot)]
            for i, key in enumerate(block_keys(prompt, self.block_size, salt)):
                cache.add(key, int(self.tables[slot, i]))

    def _parked(self, slot: int, shared: Sequence[int]) -> int:
        refs = self.refs[self.group(slot)]
        return sum(int(refs[b] == 0) for b in shared)

    def _take(self, g: int) -> int:
        if self._free[g]:
            return self._free[g].pop()
        self.evicted += 1
        return self.prefix[g].evict()   # the least recently used cached block

    def busy(self, slot: int) -> bool:
        return bool(self.reserved[slot] or self.held[slot])

    def can_reserve(self, slot: int, positions: int, shared: Sequence[int] = (),
                    keep: int = 0) -> bool:
        """Whether ``reserve`` would succeed and still leave ``keep`` blocks of the group
        (those the running sequences take next)."""
        new = self.need(positions) - len(shared) + self._parked(slot, shared)
        return not self.busy(slot) and new + keep <= self.available(slot)

    def next_blocks(self, slot: int, positions: int) -> int:
        """Blocks ``slot`` must still take to hold ``positions`` (beyond its reservation)."""
        return max(0, self.need(positions) - max(int(self.reserved[slot]),
                                                 int(self.held[slot])))

    def reserve(self, slot: int, positions: int, shared: Sequence[int] = ()) -> None:
        """Set aside the blocks of ``positions`` for the sequence about to start in ``slot``,
        its first ones the ``shared`` cached blocks (``lookup``), held from now on."""
        if self.busy(slot):
            raise KVBlocksError(f"slot {slot} already holds a sequence; release it first")
        n = self.need(positions)
        if not self.can_reserve(slot, positions, shared):
            raise CacheFullError(f"{n} KV blocks needed for {positions} positions, "
                                 f"{self.available(slot)} free in slot {slot}'s group")
        g = self.group(slot)
        for i, b in enumerate(shared):
            self.prefix[g].reuse(b)
            self.refs[g, b] += 1
            self.tables[slot, i] = b
        self.held[slot] = len(shared)
        self.reserved[slot] = n

    def grow(self, slot: int, positions: int) -> None:
        """Take blocks until ``slot`` holds ``positions`` positions: its reservation's first,
        then free ones (direct engine use); CacheFullError when the pool has none left."""
        n = self.need(positions)
        if n > self.max_blocks:
            raise CacheFullError(f"slot {slot}: {positions} positions exceed the "
                                 f"{self.max_blocks * self.block_size} a sequence may hold")
        extra = self.next_blocks(slot, positions)
        if extra > self.available(slot):
            raise CacheFullError(
                f"the KV pool is out of blocks: slot {slot} needs {extra} more and its group "
                f"has {self.available(slot)} free of {self.blocks}; raise --kv-blocks or "
                f"--kv-memory, or serve fewer or shorter sequences at once")
        g = self.group(slot)
        while self.held[slot] < n:
            b = self._take(g)
            self.refs[g, b] += 1
            self.tables[slot, self.held[slot]] = b
            self.held[slot] += 1
        self.reserved[slot] = max(self.reserved[slot], self.held[slot])

    def shrink(self, slot: int, positions: int) -> None:
        """Give back ``slot``'s blocks past those ``positions`` need (speculative decoding's
        rollback: blocks taken for proposals that were rejected)."""
        g, n = self.group(slot), self.need(positions)
        while self.held[slot] > n:
            self.held[slot] -= 1
            b = int(self.tables[slot, self.held[slot]])
            self.tables[slot, self.held[slot]] = self.blocks
            self.refs[g, b] -= 1
            if not self.refs[g, b]:
                self._free[g].append(b)
        self.reserved[slot] = min(int(self.reserved[slot]), max(n, int(self.held[slot])))

    def release(self, slot: int) -> None:
        """Give back every block ``slot`` holds or reserved (its sequence ended)."""
        if not self.busy(slot):
            raise KVBlocksError(f"slot {slot} holds no KV blocks: released twice?")
        g = self.group(slot)
        for b in self.tables[slot, :int(self.held[slot])][::-1].tolist():
            self.refs[g, b] -= 1
            if self.refs[g, b]:
                continue                   # still shared: another sequence reads it
            if self.prefix is not None and self.prefix[g].keyed(b):
                self.prefix[g].park(b)     # cached until evicted
            else:
                self._free[g].append(b)
        self.tables[slot] = self.blocks
        self.held[slot] = self.reserved[slot] = 0

    def forget_cached(self) -> None:
        """Drop every cached key (the pool's contents were lost): unused cached blocks are
        free again, held ones are no longer shared with later prompts."""
        if self.prefix is not None:
            for g, cache in enumerate(self.prefix):
                self._free[g].extend(cache.unused)
                self.prefix[g] = PrefixCache()

    @property
    def total(self) -> int:
        return self.groups * self.blocks

    @property
    def in_use(self) -> int:
        """Blocks held by live sequences, a shared one once (reservations not yet grown
        into, and cached unused blocks, excluded)."""
        return int((self.refs > 0).sum())

    @property
    def cached(self) -> int:
        """Blocks no sequence holds that keep a cached prefix (evictable)."""
        return sum(len(p.unused) for p in self.prefix) if self.prefix else 0

    @property
    def committed(self) -> int:
        """Blocks taken or reserved."""
        return int(np.maximum(self.reserved, self.held).sum())
