"""One replica's scheduling: its waiting queue, who holds each decode slot, admission by
free KV blocks, preemption.

``Server`` keeps one ``Scheduler`` per replica over that replica's ``Engine`` (the host-side
block tables and buckets over a ``ModelRunner``'s device programs);
``inference.request_router`` puts each request in one replica's queue and moves waiting ones
to an idle replica. Nothing is reserved up front. A waiting request is admitted into a free
decode slot when that slot's row group of the KV pool has the blocks of its prompt (and of
the first token after it: both reserved) beyond those the group's running sequences take in
this step's decode (``next_blocks``; else it would be preempted at once, its prefill
wasted); it takes more blocks as it grows (``KVBlocks.grow``). When a running sequence needs
a block and its group has none left, the running request of that group with the lowest
priority (the largest ``priority``), the newest among equals, is **preempted by
recompute**: its blocks go back and it returns to this replica's queue in its old place
(where its prompt's blocks may stay cached); readmitted, its prompt and every token it
generated so far are prefilled again (its cached blocks, with prefix caching, need no
recompute) and it goes on exactly where it stopped: the same positions, the same seeds, so
greedy and sampled tokens alike are those of a run without pressure.

The replica's queue is served by priority, then arrival. A request that does not fit yet
lets smaller ones behind it in this queue that do fit go first, but only ``max_bypass``
times: then nothing behind it is admitted until it fits (so nothing starves). Every request
in the queue fits the replica's pool when run alone (``can_hold``: the router sees to it).
With prefix caching, the slot whose group holds the longest cached run of the prompt's
first blocks is chosen; those blocks are shared, and only the rest of the prompt is
prefilled.
"""
from __future__ import annotations

import collections
from typing import Sequence

from triax.choices import MAX_BYPASS
from triax.inference.context_length import positions_needed
from triax.inference.engine import Engine
from triax.inference.penalties import reads_prompt
from triax.inference.request import _Live


class Scheduler:
    """Replica queue, slot table and admission over ``engine`` (see module docstring). The
    caller (``Server``) holds its lock around every use of the queue and the slots."""

    def __init__(self, engine: Engine, max_bypass: int = MAX_BYPASS):
        self.engine = engine
        B = engine.ecfg.max_batch
        self.queue: collections.deque[_Live] = collections.deque()   # waiting, arrival order
        self.max_bypass = max_bypass   # later requests one that does not fit lets go first
        self.slots: list[_Live | None] = [None] * B   # the request in each decode slot
        self.slot_uses = [0] * B                      # requests each slot has served
        self.prefilling: dict = {}    # slot -> a prompt still prefilling (chunked_prefill)
        self._admissions = 0          # orders the slots' requests: newest preempted first

    def free(self, slot: int) -> None:
        """``slot``'s request left (finished, failed, preempted): its KV blocks go back."""
        self.slots[slot] = None
        self.engine.release(slot)

    def clear(self) -> None:
        """Drop every waiting request and free every slot (the server failed them)."""
        self.queue.clear()
        for slot, live in enumerate(self.slots):
            if live is not None:
                self.free(slot)

    @property
    def running(self) -> int:
        """Requests in this replica's slots."""
        return sum(s is not None for s in self.slots)

    def can_hold(self, live: _Live) -> bool:
        """Whether a row group's whole pool holds ``live`` at its longest (else it could
        never run here, and would wait in this queue forever)."""
        kv = self.engine.kv
        return kv.need(positions_needed(len(live.result.prompt), live.max_new)) <= kv.blocks

    def cached_blocks(self, live: _Live) -> int:
        """The longest run of ``live``'s prompt blocks a row group of this replica caches
        (0 without prefix caching, or where its sampling reads every prompt token)."""
        eng = self.engine
        if not eng.prefix_cache or reads_prompt(live.sampling or eng.sampling):
            return 0
        every = range(eng.ecfg.max_batch)
        return max(len(shared) for _, shared in
                   self.lookups(every, live.tokens_to_prefill(), live.adapter))

    def admit(self, stats: dict) -> tuple[list[int], list[_Live]]:
        """Waiting requests from this replica's queue into its free slots, by priority then
        arrival, each with its prompt's KV blocks; ``(slots, requests)`` admitted."""
        eng = self.engine
        free = [i for i, s in enumerate(self.slots) if s is None]
        keep = self.next_blocks()
        slots, batch, waiting = [], [], []
        for live in sorted(self.queue, key=_Live.rank):
            if not free:
                break
            whole = positions_needed(len(live.result.prompt), live.max_new)
            tokens = live.tokens_to_prefill()
            first = min(len(tokens) + 1, whole)   # its prompt and its first decode's position
            # the fitting slot whose group caches the longest run of the prompt's blocks
            looked = (self.lookups(free, tokens, live.adapter)
                      if not reads_prompt(live.sampling or eng.sampling) else
                      [(i, ()) for i in free])   # its sampling reads every prompt token
            fits = [(i, shared) for i, shared in looked
                    if eng.kv.can_reserve(i, first, shared, keep[eng.kv.group(i)])]
            if not fits:   # not enough blocks free yet
                waiting.append(live)
                continue
            if any(w.passed >= self.max_bypass for w in waiting):
                break   # one was passed over enough: the rest wait for it
            for w in waiting:   # a later request goes first
                w.passed += 1
            slot, shared = max(fits, key=lambda f: len(f[1]))
            eng.kv.reserve(slot, first, shared)
            res = live.result
            if not res.preemptions:
                res.cached_tokens = len(shared) * eng.kv.block_size
            if eng.prefix_cache:
                stats["prefix_queries"] += len(tokens)
                stats["prefix_hits"] += len(shared) * eng.kv.block_size
            self.queue.remove(live)
            free.remove(slot)
            self._admissions += 1
            live.admitted = self._admissions
            self.slots[slot] = live
            slots.append(slot)
            batch.append(live)
        return slots, batch

    def next_blocks(self) -> list[int]:
        """Per row group, the blocks its decoding sequences take in this step's decode
        (``make_room``, after admission): admission leaves them, or the request it admits
        would be preempted at once, its prefill wasted."""
        kv, out = self.engine.kv, [0] * self.engine.kv.groups
        for slot, live in enumerate(self.slots):
            pending = self.prefilling.get(slot)
            if live is not None and (pending is None or pending.live is not live):
                out[kv.group(slot)] += kv.next_blocks(slot, int(self.engine.lengths[slot]) + 1)
        return out

    def make_room(self, decoding: Sequence, stats: dict) -> None:
        """Give every running sequence (``decoding``: the slots' requests, None where not
        decoding) the block its next token needs, preempting by recompute where its group
        has none left (``preempt``); the oldest and most important are served first."""
        eng = self.engine
        for live in sorted((x for x in decoding if x is not None), key=_Live.rank):
            if live not in self.slots:
                continue   # preempted for an earlier one
            slot = self.slots.index(live)
            positions = int(eng.lengths[slot]) + 1
            while eng.kv.next_blocks(slot, positions) > eng.kv.available(slot):
                victim = self.victim(slot)
                self.preempt(victim, stats)
                if victim == slot:
                    break
            if self.slots[slot] is live:
                eng.kv.grow(slot, positions)

    def victim(self, slot: int) -> int:
        """The slot of ``slot``'s row group to preempt: lowest priority, then newest."""
        per = self.engine.ecfg.max_batch // self.engine.kv.groups
        g = slot // per
        group = [i for i in range(g * per, (g + 1) * per) if self.slots[i] is not None]
        return max(group, key=lambda i: (self.slots[i].priority, self.slots[i].admitted))

    def preempt(self, slot: int, stats: dict) -> None:
        """Take ``slot``'s blocks back and requeue its request in this replica's queue (its
        cached blocks are here); readmitted, it recomputes its prompt and tokens so far and
        goes on."""
        live = self.slots[slot]
        self.free(slot)
        live.result.preemptions += 1
        stats["preemptions"] += 1
        self.queue.append(live)

    def lookups(self, free: Sequence[int], prompt: Sequence[int], adapter: int = 0):
        """``(slot, cached blocks)`` for each free slot: one lookup per row group (blocks
        keyed with ``adapter``'s salt: its KV differs from the base's)."""
        eng = self.engine
        per = eng.ecfg.max_batch // eng.kv.groups
        salt = eng.adapter_keys[adapter] if adapter else b""
        found = {g: eng.kv.lookup(g * per, prompt, salt) for g in {i // per for i in free}}
        return [(i, found[i // per]) for i in free]
