"""The host side of the paged KV cache: which blocks of the pool each decode slot holds.

A replica's pool has ``groups`` row groups of ``blocks`` blocks each (``models.decode``: a
slot's blocks come from its group, the slots split into contiguous groups). A sequence is
admitted with a **reservation** (``reserve``: the blocks its prompt plus ``max_tokens`` may
need, so it never waits for a block mid-stream and nothing is ever preempted), **takes**
blocks as it grows (``grow``), and gives them all back when it ends (``release``: finished,
cancelled, failed or stopped). ``tables`` is the ``[slots, max_blocks]`` block table the
engine's programs read; an entry equal to ``blocks`` is no block.

    >>> kv = KVBlocks(groups=1, blocks=4, block_size=16, slots=2, max_blocks=2)
    >>> kv.reserve(0, 20)            # 20 positions: 2 blocks set aside
    >>> kv.grow(0, 5); kv.tables[0].tolist(), kv.in_use, kv.available(0)
    ([0, 4], 1, 2)
    >>> kv.release(0); kv.in_use
    0
"""
from __future__ import annotations

import numpy as np

from triax.inference.errors import CacheFullError, InferenceError


class KVBlocksError(InferenceError):
    """A block-table call out of order (a double release, a second reservation)."""


class KVBlocks:
    """Free lists, per-slot block tables and reservations of one replica's pool."""

    def __init__(self, groups: int, blocks: int, block_size: int, slots: int, max_blocks: int):
        if slots % groups:
            raise KVBlocksError(f"{slots} slots do not split into {groups} row groups")
        self.groups, self.blocks, self.block_size = groups, blocks, block_size
        self.slots, self.max_blocks = slots, max_blocks
        self.tables = np.full((slots, max_blocks), blocks, np.int32)
        self.held = np.zeros(slots, np.int64)       # blocks taken by each slot
        self.reserved = np.zeros(slots, np.int64)   # blocks set aside for it (>= held)
        self._free = [list(range(blocks))[::-1] for _ in range(groups)]   # pop() takes 0 first

    def group(self, slot: int) -> int:
        return slot // (self.slots // self.groups)

    def need(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_size)

    def available(self, slot: int) -> int:
        """Blocks of ``slot``'s group neither taken nor reserved."""
        g = self.group(slot)
        rows = slice(g * (self.slots // self.groups), (g + 1) * (self.slots // self.groups))
        return len(self._free[g]) - int((self.reserved[rows] - self.held[rows]).sum())

    def busy(self, slot: int) -> bool:
        return bool(self.reserved[slot] or self.held[slot])

    def can_reserve(self, slot: int, positions: int) -> bool:
        return not self.busy(slot) and self.need(positions) <= self.available(slot)

    def reserve(self, slot: int, positions: int) -> None:
        """Set aside the blocks of ``positions`` for the sequence about to start in ``slot``."""
        if self.busy(slot):
            raise KVBlocksError(f"slot {slot} already holds a sequence; release it first")
        n = self.need(positions)
        if n > self.available(slot):
            raise CacheFullError(f"{n} KV blocks needed for {positions} positions, "
                                 f"{self.available(slot)} free in slot {slot}'s group")
        self.reserved[slot] = n

    def grow(self, slot: int, positions: int) -> None:
        """Take blocks until ``slot`` holds ``positions`` positions: its reservation's first,
        then free ones (direct engine use); CacheFullError when the pool has none left."""
        n = self.need(positions)
        if n > self.max_blocks:
            raise CacheFullError(f"slot {slot}: {positions} positions exceed the "
                                 f"{self.max_blocks * self.block_size} a sequence may hold")
        extra = n - max(int(self.reserved[slot]), int(self.held[slot]))
        if extra > self.available(slot):
            raise CacheFullError(
                f"the KV pool is out of blocks: slot {slot} needs {extra} more and its group "
                f"has {self.available(slot)} free of {self.blocks}; raise --kv-blocks or "
                f"--kv-memory, or serve fewer or shorter sequences at once")
        g = self.group(slot)
        while self.held[slot] < n:
            self.tables[slot, self.held[slot]] = self._free[g].pop()
            self.held[slot] += 1
        self.reserved[slot] = max(self.reserved[slot], self.held[slot])

    def release(self, slot: int) -> None:
        """Give back every block ``slot`` holds or reserved (its sequence ended)."""
        if not self.busy(slot):
            raise KVBlocksError(f"slot {slot} holds no KV blocks: released twice?")
        held = int(self.held[slot])
        self._free[self.group(slot)].extend(self.tables[slot, :held][::-1].tolist())
        self.tables[slot] = self.blocks
        self.held[slot] = self.reserved[slot] = 0

    @property
    def total(self) -> int:
        return self.groups * self.blocks

    @property
    def in_use(self) -> int:
        """Blocks taken by live sequences (reservations not yet grown into excluded)."""
        return int(self.held.sum())

    @property
    def committed(self) -> int:
        """Blocks taken or reserved."""
        return int(np.maximum(self.reserved, self.held).sum())
