"""One serving iteration of ``Server``: admission by free KV blocks, prefill, decode.

A waiting request is admitted into a free decode slot of a replica when that slot's row
group of the KV pool can set aside the blocks its prompt plus ``max_tokens`` may fill
(``KVBlocks.reserve``), not a slot cache of ``max_len``: so many short requests run beside a
few long ones, and a sequence never waits for a block once started (nothing is preempted).
Requests are admitted first come, first served: one that does not fit yet waits at the head
of the queue until blocks come back. With prefix caching, the slot whose group holds the
longest cached run of the prompt's first blocks is chosen; those blocks are shared, not
reserved again, and only the rest of the prompt is prefilled.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from triax.inference.context_length import positions_needed
from triax.inference.engine import Engine, InferenceError
from triax.inference.request import _Live


class Batching:
    """The serving loop's steps; ``Server`` holds the state they use."""

    def _reap_cancelled(self) -> None:
        """Free the slots of cancelled requests (only the serving thread frees slots)."""
        now = time.perf_counter()
        for row in self.slots:
            for live in row:
                if live is not None and live.cancelled:
                    self._finish(live, "cancelled", now)

    def _engine_failed(self, r: int, lives: Sequence[_Live], exc: BaseException) -> None:
        """An engine error fails only the requests it touched; the replica serves on (with a
        fresh cache if the failed program consumed its donated one)."""
        err = InferenceError(f"replica {r} failed while serving this request: {exc!r}")
        err.__cause__ = exc
        with self._lock:
            for live in lives:
                rid = live.result.request_id
                live.result.replica = r
                if live in self.slots[r]:
                    slot = self.slots[r].index(live)
                    self.slots[r][slot] = None
                    self.engines[r].release(slot)
                self._failed[rid] = err
                fut = self._futures.pop(rid, None)
                if fut is not None:
                    fut.set_exception(err)
        self.engines[r].recover()

    def _admit(self, r: int, eng: Engine) -> tuple[list[int], list[_Live]]:
        """Waiting requests into replica ``r``'s free slots, each with its KV blocks
        reserved (the caller holds the lock)."""
        free = [i for i, s in enumerate(self.slots[r]) if s is None]
        slots, batch = [], []
        while self.queue and free:
            live = self.queue[0]
            prompt = live.result.prompt
            need = positions_needed(len(prompt), live.max_new)
            # the fitting slot whose group caches the longest run of the prompt's blocks
            fits = [(i, shared) for i, shared in self._lookups(eng, free, prompt)
                    if eng.kv.can_reserve(i, need, shared)]
            if not fits:   # not enough blocks free yet: it waits, first in line
                break
            slot, shared = max(fits, key=lambda f: len(f[1]))
            eng.kv.reserve(slot, need, shared)
            live.result.cached_tokens = len(shared) * eng.kv.block_size
            if eng.prefix_cache:
                self.stats["prefix_queries"] += len(prompt)
                self.stats["prefix_hits"] += live.result.cached_tokens
            self.queue.popleft()
            free.remove(slot)
            self.slots[r][slot] = live
            slots.append(slot)
            batch.append(live)
        return slots, batch

    @staticmethod
    def _lookups(eng: Engine, free: Sequence[int], prompt: Sequence[int]):
        """``(slot, cached blocks)`` for each free slot: one lookup per row group."""
        per = eng.ecfg.max_batch // eng.kv.groups
        found = {g: eng.kv.lookup(g * per, prompt) for g in {i // per for i in free}}
        return [(i, found[i // per]) for i in free]

    def _prefill_all(self) -> int:
        launched = []
        for r, eng in enumerate(self.engines):
            with self._lock:  # take requests, claim their slots and blocks in one step
                slots, batch = self._admit(r, eng)
                running = sum(s is not None for row in self.slots for s in row)
                self.stats["peak_running"] = max(self.stats["peak_running"], running)
            if not batch:
                continue
            try:
                toks = eng.prefill(slots, [np.asarray(x.result.prompt) for x in batch],
                                   [x.seed for x in batch], [x.sampling or eng.sampling
                                                             for x in batch],
                                   cached=[x.result.cached_tokens for x in batch])
            except Exception as e:
                self._engine_failed(r, batch, e)
                continue
            launched.append((r, slots, batch, toks))
        for r, slots, batch, toks in launched:
            try:
                toks = np.asarray(toks)
            except Exception as e:  # an asynchronous device error surfaces here
                self._engine_failed(r, batch, e)
                continue
            now = time.perf_counter()
            for slot, live, tok in zip(slots, batch, toks):
                live.result.replica, live.result.slot, live.result.first_token = r, slot, now
                self.slot_uses[r][slot] += 1
                self.stats["prefill_tokens"] += len(live.result.prompt)
                self._accept(r, slot, int(tok), now)
        return len(launched)

    def _decode_all(self) -> int:
        launched = []
        for r, eng in enumerate(self.engines):
            live = list(self.slots[r])  # only this thread fills or frees slots
            active = np.array([s is not None for s in live])
            if not active.any():
                continue
            last = np.array([s.result.tokens[-1] if s else 0 for s in live], np.int32)
            seeds = np.array([s.seed if s else 0 for s in live], np.int32)
            settings = [(s.sampling if s else None) or eng.sampling for s in live]
            try:
                launched.append((r, active, live, eng.decode(last, active, seeds, settings)))
            except Exception as e:
                self._engine_failed(r, [s for s in live if s is not None], e)
        for r, active, live, toks in launched:
            try:
                toks = np.asarray(toks)
            except Exception as e:
                self._engine_failed(r, [s for s in live if s is not None], e)
                continue
            now = time.perf_counter()
            for slot in np.flatnonzero(active):
                self.stats["decode_tokens"] += 1
                self._accept(r, int(slot), int(toks[slot]), now)
        return len(launched)

    def _accept(self, r: int, slot: int, tok: int, now: float) -> None:
        """Record a sampled token; finish the request (freeing its slot) on stop or length."""
        live = self.slots[r][slot]
        if live.cancelled:
            self._finish(live, "cancelled", now)
            return
        res = live.result
        stop = tok in (live.sampling or self.engines[r].sampling).stop_tokens
        if not stop:
            res.tokens.append(tok)
            self.stats["generated_tokens"] += 1
            if live.on_token is not None:
                try:
                    live.on_token(tok, now)
                except Exception:  # a listener that fails (its client gone) ends its request
                    live.cancelled = True
        if stop or len(res.tokens) >= live.max_new:
            self._finish(live, "stop" if stop else "length", now)

