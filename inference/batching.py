"""One serving iteration of ``Server``: admission by free KV blocks, prefill, decode.

Nothing is reserved up front. A waiting request is admitted into a free decode slot of a
replica when that slot's row group of the KV pool has the blocks of its prompt (and of the
first token after it); it takes more blocks as it grows (``KVBlocks.grow``). When a running
sequence needs a block and its group has none left, the running request of that group with
the lowest priority (the largest ``priority``), the newest among equals, is **preempted by
recompute**: its blocks go back and it returns to the queue in its old place; readmitted,
its prompt and every token it generated so far are prefilled again (its cached blocks, with
prefix caching, need no recompute) and it goes on exactly where it stopped: the same
positions, the same seeds, so greedy and sampled tokens alike are those of a run without
pressure.

The queue is served by priority, then arrival. A request that does not fit yet lets smaller
ones behind it that do fit go first, but only ``max_bypass`` times: then nothing behind it is
admitted until it fits (so nothing starves). With prefix caching, the slot whose group holds
the longest cached run of the prompt's first blocks is chosen; those blocks are shared, and
only the rest of the prompt is prefilled.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from triax.inference.chunked_prefill import ChunkedPrefill
from triax.inference.context_length import positions_needed
from triax.inference.engine import Engine, InferenceError
from triax.inference.logprobs import prompt_entry, row_entry, split_tokens
from triax.inference.penalties import reads_prompt
from triax.inference.request import _Live
from triax.inference.speculative import Round, spec_launch


class Batching(ChunkedPrefill):
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
        """Waiting requests into replica ``r``'s free slots, by priority then arrival, each
        with its prompt's KV blocks (the caller holds the lock)."""
        free = [i for i, s in enumerate(self.slots[r]) if s is None]
        slots, batch, waiting = [], [], []
        for live in sorted(self.queue, key=_Live.rank):
            if not free:
                break
            whole = positions_needed(len(live.result.prompt), live.max_new)
            if eng.kv.need(whole) > eng.kv.blocks:
                continue   # a smaller replica's group could never hold it all: others will
            tokens = live.tokens_to_prefill()
            # the fitting slot whose group caches the longest run of the prompt's blocks
            looked = (self._lookups(eng, free, tokens, live.adapter)
                      if not reads_prompt(live.sampling or eng.sampling) else
                      [(i, ()) for i in free])   # its sampling reads every prompt token
            fits = [(i, shared) for i, shared in looked
                    if eng.kv.can_reserve(i, len(tokens) + 1, shared)]
            if not fits:   # not enough blocks free yet
                waiting.append(live)
                continue
            if any(w.passed >= self.max_bypass for w in waiting):
                break   # one was passed over enough: the rest wait for it
            for w in waiting:   # a later request goes first
                w.passed += 1
            slot, shared = max(fits, key=lambda f: len(f[1]))
            eng.kv.reserve(slot, len(tokens), shared)
            res = live.result
            if not res.preemptions:
                res.cached_tokens = len(shared) * eng.kv.block_size
            if eng.prefix_cache:
                self.stats["prefix_queries"] += len(tokens)
                self.stats["prefix_hits"] += len(shared) * eng.kv.block_size
            self.queue.remove(live)
            free.remove(slot)
            self._admissions += 1
            live.admitted = self._admissions
            self.slots[r][slot] = live
            slots.append(slot)
            batch.append(live)
        return slots, batch

    def _make_room(self, r: int, eng: Engine) -> None:
        """Give every running sequence of replica ``r`` the block its next token needs,
        preempting by recompute where its group has none left (``_preempt``); the oldest
        and most important sequences are served first."""
        with self._lock:
            running = sorted((x for x in self._decoding(r) if x is not None), key=_Live.rank)
            for live in running:
                if live not in self.slots[r]:
                    continue   # preempted for an earlier one
                slot = self.slots[r].index(live)
                positions = int(eng.lengths[slot]) + 1
                while (eng.kv.need(positions) > eng.kv.held[slot]
                       and eng.kv.available(slot) < 1):
                    victim = self._victim(r, eng, slot)
                    self._preempt(r, victim)
                    if victim == slot:
                        break
                if self.slots[r][slot] is live:
                    eng.kv.grow(slot, positions)

    def _victim(self, r: int, eng: Engine, slot: int) -> int:
        """The slot of ``slot``'s row group to preempt: lowest priority, then newest."""
        per = eng.ecfg.max_batch // eng.kv.groups
        g = slot // per
        group = [i for i in range(g * per, (g + 1) * per) if self.slots[r][i] is not None]
        return max(group, key=lambda i: (self.slots[r][i].priority,
                                         self.slots[r][i].admitted))

    def _preempt(self, r: int, slot: int) -> None:
        """Take ``slot``'s blocks back and requeue its request (the caller holds the lock);
        readmitted, it recomputes its prompt and tokens so far and goes on."""
        live = self.slots[r][slot]
        self.slots[r][slot] = None
        self.engines[r].release(slot)
        live.result.preemptions += 1
        self.stats["preemptions"] += 1
        self.queue.append(live)

    @staticmethod
    def _lookups(eng: Engine, free: Sequence[int], prompt: Sequence[int], adapter: int = 0):
        """``(slot, cached blocks)`` for each free slot: one lookup per row group (blocks
        keyed with ``adapter``'s salt: its KV differs from the base's)."""
        per = eng.ecfg.max_batch // eng.kv.groups
        salt = eng.adapter_keys[adapter] if adapter else b""
        found = {g: eng.kv.lookup(g * per, prompt, salt) for g in {i // per for i in free}}
        return [(i, found[i // per]) for i in free]

    def _prefill_all(self) -> int:
        launched = []
        for r, eng in enumerate(self.engines):
            with self._lock:  # take requests, claim their slots and blocks in one step
                slots, batch = self._admit(r, eng)
                running = sum(s is not None for row in self.slots for s in row)
                self.stats["peak_running"] = max(self.stats["peak_running"], running)
            # whole prompts, or this step's chunks of them (inference.chunked_prefill)
            slots, batch, prompts, cached, final = self._prefill_work(r, eng, slots, batch)
            if not batch:
                continue
            try:
                toks = eng.prefill(slots, prompts, [x.seed for x in batch],
                                   [x.sampling or eng.sampling for x in batch], cached=cached,
                                   prompt_lens=[len(x.result.prompt) for x in batch],
                                   **self._adapters_kw([x.adapter for x in batch]))
            except Exception as e:
                self._engine_failed(r, batch, e)
                continue
            launched.append((r, slots, batch, toks, final))
        for r, slots, batch, toks, final in launched:
            try:
                toks, extra = split_tokens(toks)
            except Exception as e:  # an asynchronous device error surfaces here
                self._engine_failed(r, batch, e)
                continue
            now = time.perf_counter()
            for i, (slot, live, tok) in enumerate(zip(slots, batch, toks)):
                if not final[i]:
                    continue   # a chunk before its prompt's last: nothing sampled yet
                res = live.result
                res.replica, res.slot = r, slot
                res.first_token = res.first_token or now   # once, resumed or not
                self.slot_uses[r][slot] += 1
                self.stats["prefill_tokens"] += len(live.tokens_to_prefill())
                if live.sampling is not None and live.sampling.prompt_logprobs \
                        and res.prompt_logprobs is None:   # a resumed request has them
                    res.prompt_logprobs = prompt_entry(extra, i, len(res.prompt))
                self._accept(r, slot, int(tok), now, row_entry(extra, i))
        return len(launched)

    def _decode_all(self) -> int:
        launched = []
        for r, eng in enumerate(self.engines):
            self._make_room(r, eng)
            live = self._decoding(r)  # only this thread fills or frees slots
            active = np.array([s is not None for s in live])
            if not active.any():
                continue
            last = np.array([s.result.tokens[-1] if s else 0 for s in live], np.int32)
            seeds = np.array([s.seed if s else 0 for s in live], np.int32)
            settings = [(s.sampling if s else None) or eng.sampling for s in live]
            try:
                spec = getattr(eng, "speculator", None)   # inference.speculative
                launched.append((r, active, live, spec_launch(spec, live, last, seeds, settings)
                                 if spec is not None and spec.usable(settings, active) else
                                 eng.decode(last, active, seeds, settings)))
            except Exception as e:
                self._engine_failed(r, [s for s in live if s is not None], e)
        for r, active, live, toks in launched:
            try:
                if isinstance(toks, Round):
                    self._accept_round(r, live, self.engines[r].speculator.collect(toks))
                    continue
                toks, extra = split_tokens(toks)
            except Exception as e:
                self._engine_failed(r, [s for s in live if s is not None], e)
                continue
            now = time.perf_counter()
            for slot in np.flatnonzero(active):
                self.stats["decode_tokens"] += 1
                self._accept(r, int(slot), int(toks[slot]), now, row_entry(extra, int(slot)))
        return len(launched)

    def _accept_round(self, r: int, live, got: dict) -> None:
        """A speculative step's tokens, each slot's in order, until its request ends."""
        now = time.perf_counter()
        for slot, (toks, entries) in got.items():
            for tok, entry in zip(toks, entries):
                if self.slots[r][slot] is not live[slot]:
                    break   # finished (stop, length, cancelled) at an earlier token
                self.stats["decode_tokens"] += 1
                self._accept(r, slot, tok, now, entry)

    def _accept(self, r: int, slot: int, tok: int, now: float, logprob=None) -> None:
        """Record a sampled token (and its ``logprob`` entry, for requests that ask); finish
        the request (freeing its slot) on stop or length."""
        live = self.slots[r][slot]
        if live.cancelled:
            self._finish(live, "cancelled", now)
            return
        res = live.result
        sampling = live.sampling or self.engines[r].sampling
        stop = tok in sampling.stop_tokens
        complete = False   # its grammar (structured output) took this token and ends
        if not stop and sampling.constraint is not None:
            sampling.constraint.advance(tok)
            complete = sampling.constraint.finished
        if not stop:
            res.tokens.append(tok)
            if sampling.logprobs:
                res.logprobs.append(logprob)
            self.stats["generated_tokens"] += 1
            if live.on_token is not None:
                try:
                    if sampling.logprobs:   # (the prompt's come with the first token)
                        first = len(res.tokens) == 1 and res.prompt_logprobs is not None
                        live.on_token(tok, now, {**logprob, "prompt": res.prompt_logprobs}
                                      if first else logprob)
                    else:
                        live.on_token(tok, now)
                except Exception:  # a listener that fails (its client gone) ends its request
                    live.cancelled = True
        if stop or complete or len(res.tokens) >= live.max_new:
            self._finish(live, "stop" if stop or complete else "length", now)

