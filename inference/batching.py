"""One serving iteration of ``Server``: every replica admits and prefills, then decodes; a
replica whose step has one prompt chunk beside its decode rows runs both as one fused program
in the decode phase (``triax.inference.chunked_prefill``).

Each replica's ``Scheduler`` (``triax.inference.scheduler``) admits requests from its own queue
(an idle replica first takes others' waiting ones: ``triax.inference.request_router``) into its
free slots by free KV blocks and preempts by recompute when a group runs out; its ``Engine``
runs the steps. All replicas' work is dispatched before any result is read, so the sub-meshes
run concurrently. Sampled tokens are accepted here: streamed, checked against stop tokens and
grammars, and a finished request frees its slot.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from triax.inference.chunked_prefill import ChunkedPrefill
from triax.inference.errors import InferenceError
from triax.inference.logprobs import prompt_entry, row_entry, split_tokens
from triax.inference.request import _Live
from triax.inference.request_router import steal
from triax.inference.speculative import Round, spec_launch


class Batching(ChunkedPrefill):
    """The serving loop's steps; ``Server`` holds the state they use."""

    @property
    def slots(self) -> list[list[_Live | None]]:
        """Each replica's decode slots: the request each holds (None: free)."""
        return [sch.slots for sch in self.schedulers]

    @property
    def slot_uses(self) -> list[list[int]]:
        """Each replica's slots: how many requests each has served."""
        return [sch.slot_uses for sch in self.schedulers]

    @property
    def prefilling(self) -> list[dict]:
        """Each replica's prompts still prefilling, by slot (``inference.chunked_prefill``)."""
        return [sch.prefilling for sch in self.schedulers]

    def _idle(self) -> bool:  # caller holds the lock
        return not any(sch.queue or sch.running for sch in self.schedulers)

    def _serve_forever(self) -> None:
        try:
            while True:
                with self._wake:
                    while self._idle() and not self._stopping:
                        self._wake.wait()
                    if self._stopping and (self._idle() or not self._drain):
                        return
                self._step()
        except BaseException as e:  # the callers waiting on futures must hear of it
            self._fail(e, fatal=True)
        finally:
            self._loop.release()

    def _fail(self, exc: BaseException, fatal: bool = False) -> None:
        """Fail every unfinished request with ``exc`` and free its slot."""
        with self._lock:
            if fatal:
                self._error = exc
            for sch in self.schedulers:
                sch.clear()   # its queue and its slots
            futures, self._futures = self._futures, {}
            self._failed.update(dict.fromkeys(futures, exc))
        for fut in futures.values():
            fut.set_exception(exc)

    def _step(self) -> bool:
        """One iteration (prefill free slots, decode live ones); False when idle."""
        self._reap_cancelled()
        with self._lock:
            if self._idle():
                return False
        t0 = time.perf_counter()
        self.mixing = {}
        prefilled = self._prefill_all()
        self._phase_done()
        t1 = time.perf_counter()
        decoded = self._decode_all()
        self._phase_done()
        t2 = time.perf_counter()
        if prefilled:
            self.stats["prefill_s"] += t1 - t0
        if decoded:
            self.stats["decode_s"] += t2 - t1
            self.stats["decode_steps"] += 1
        return True

    def _phase_done(self) -> None:
        for listener in self.phase_listeners:
            listener()

    def _finish(self, live: _Live, reason: str, now: float) -> None:
        """Resolve a request's future with its ``Result`` and free its slot."""
        res = live.result
        res.finish_reason, res.done = reason, now
        with self._lock:
            self.results[res.request_id] = res
            if res.replica >= 0 and self.slots[res.replica][res.slot] is live:
                self.schedulers[res.replica].free(res.slot)   # its KV blocks back
            fut = self._futures.pop(res.request_id, None)
        if fut is not None:
            fut.set_result(res)  # outside the lock: a done-callback may submit again

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
                    self.schedulers[r].free(self.slots[r].index(live))
                self._failed[rid] = err
                fut = self._futures.pop(rid, None)
                if fut is not None:
                    fut.set_exception(err)
        self.engines[r].recover()

    def _prefill_all(self) -> int:
        launched = []
        for r, eng in enumerate(self.engines):
            with self._lock:  # take requests, claim their slots and blocks in one step
                steal(self.schedulers, r)   # idle with an empty queue: others' waiting work
                slots, batch = self.schedulers[r].admit(self.stats)
                running = sum(sch.running for sch in self.schedulers)
                self.stats["peak_running"] = max(self.stats["peak_running"], running)
            # whole prompts, or this step's chunks of them (inference.chunked_prefill)
            work = self._prefill_work(r, eng, slots, batch)
            slots, batch, prompts, cached, final = work
            if not batch or self._fuse(r, eng, work):   # fused: the decode phase runs it
                continue
            try:
                toks = eng.prefill(slots, prompts, [x.seed for x in batch],
                                   [x.sampling or eng.sampling for x in batch], cached=cached,
                                   prompt_lens=[len(x.result.prompt) for x in batch],
                                   padded=True,   # rows past the batch's: read by none
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
                if final[i]:   # (a chunk before its prompt's last: nothing sampled yet)
                    self._accept_first(r, slot, live, int(tok), now, extra, i)
        return len(launched)

    def _accept_first(self, r: int, slot: int, live: _Live, tok: int, now: float, extra,
                      i: int) -> None:
        """A prefilled request's first token (row ``i`` of its step's ``extra``)."""
        res = live.result
        res.replica, res.slot = r, slot
        res.first_token = res.first_token or now   # once, resumed or not
        self.slot_uses[r][slot] += 1
        self.stats["prefill_tokens"] += len(live.tokens_to_prefill())
        if live.sampling is not None and live.sampling.prompt_logprobs \
                and res.prompt_logprobs is None:   # a resumed request has them
            res.prompt_logprobs = prompt_entry(extra, i, len(res.prompt))
        self._accept(r, slot, tok, now, row_entry(extra, i))

    def _decode_all(self) -> int:
        launched = []
        for r, eng in enumerate(self.engines):
            with self._lock:
                self.schedulers[r].make_room(self._decoding(r), self.stats)
            live = self._decoding(r)  # only this thread fills or frees slots
            active = np.array([s is not None for s in live])
            chunk = self.mixing.pop(r, None)   # a fused step's chunk (chunked_prefill)
            if chunk is not None and self.slots[r][chunk.slot] is not chunk.live:
                chunk = None   # preempted by make_room: it is queued again
            if not active.any() and chunk is None:
                continue
            last = np.array([s.result.tokens[-1] if s else 0 for s in live], np.int32)
            seeds = np.array([s.seed if s else 0 for s in live], np.int32)
            settings = [(s.sampling if s else None) or eng.sampling for s in live]
            try:
                spec = getattr(eng, "speculator", None)   # inference.speculative
                if chunk is not None:   # one program: the decode rows and the chunk
                    self.stats["mixed_steps"] += 1
                    out = eng.mixed(last, active, seeds, settings, chunk.slot, chunk.tokens,
                                    chunk.cached, chunk.live.seed, chunk.live.sampling)
                elif spec is not None and spec.usable(settings, active):
                    out = spec_launch(spec, live, last, seeds, settings)
                else:
                    out = eng.decode(last, active, seeds, settings)
                launched.append((r, active, live, out, chunk))
            except Exception as e:
                self._engine_failed(r, [s for s in live if s is not None]
                                    + ([chunk.live] if chunk is not None else []), e)
        for r, active, live, toks, chunk in launched:
            try:
                if isinstance(toks, Round):
                    self._accept_round(r, live, self.engines[r].speculator.collect(toks))
                    continue
                if chunk is not None:
                    toks, first = toks
                    first, first_extra = split_tokens(first)
                toks, extra = split_tokens(toks)
            except Exception as e:
                self._engine_failed(r, [s for s in live if s is not None]
                                    + ([chunk.live] if chunk is not None else []), e)
                continue
            now = time.perf_counter()
            for slot in np.flatnonzero(active):
                self.stats["decode_tokens"] += 1
                self._accept(r, int(slot), int(toks[slot]), now, row_entry(extra, int(slot)))
            if chunk is not None and chunk.final:   # it decodes from the next step on
                self._accept_first(r, chunk.slot, chunk.live, int(first[0]), now,
                                   first_extra, 0)
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

