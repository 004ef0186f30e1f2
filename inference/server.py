"""Serving: R replicas, each with its own request queue, continuous batching into free slots.

Each replica is a ``Scheduler`` (``triax.inference.scheduler``: its queue, its slots,
admission by free KV blocks, preemption) over an ``Engine`` (block tables and buckets over a
``ModelRunner``: the weights and jitted programs) on its own sub-mesh with a full copy of
the model. Replicas multiply throughput; they do **not** pool memory. ``submit`` queues a
request on a replica (``triax.inference.request_router``). Every loop iteration
(``triax.inference.batching``) each replica admits and prefills (whole prompts, or chunks
within ``max_step_tokens``: ``triax.inference.chunked_prefill``), then decodes one token;
a sequence that stops frees its slot and blocks at once. ``serving/`` reads only this
class's public limits (``max_len``, ``slots_per_replica``, ``dtype``, adapters).

    >>> import jax
    >>> from triax.models import config
    >>> server = Server.from_seed(config.TINY, replicas=2, mesh_sizes={"tensor": 2},
    ...                           devices=jax.devices()[:4],    # 2 replicas × tensor=2
    ...                           ecfg=EngineConfig(max_batch=2, max_len=32))
    >>> rid = server.submit([72, 105], max_new_tokens=8)
    >>> results = server.run()             # {request id: Result}
    >>> len(results[rid].tokens), results[rid].ttft_s > 0
    (8, True)

``submit`` is thread-safe; ``with server:`` serves in a background thread meanwhile, and
``result(rid)`` waits for one request (``future(rid)`` gives a ``concurrent.futures.Future``):

    >>> with server:
    ...     rid = server.submit([72, 105], max_new_tokens=4)
    ...     server.result(rid, timeout=60).tokens == results[0].tokens[:4]
    True
    >>> server.free_slots == server.total_slots, server.kv_blocks_in_use   # all back
    (True, 0)
"""
from __future__ import annotations

import operator
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable, Optional, Sequence

from triax.inference.adapter_serving import AdapterServing
from triax.inference.batching import Batching
from triax.inference.engine import Engine, EngineConfig, InferenceError
from triax.inference.replicas import replica_meshes
from triax.inference.request_router import route
from triax.inference.request import QueueFullError, Result, _Live, default_seed
from triax.inference.scheduler import Scheduler
from triax.inference.server_limits import ServerLimits
from triax.inference.sampling import SamplingConfig
from triax.models.config import ModelConfig
from triax.sharding.partition import abstract_model, init_params
from triax.choices import MAX_BYPASS, SERVE_STRATEGY


class Server(Batching, AdapterServing, ServerLimits):
    """Continuous-batching request server over one or more replica engines.

    ``submit`` is thread-safe. Serve either with ``run()`` (blocks until everything queued,
    including requests other threads submit meanwhile, is done) or with ``start()`` /
    ``stop()`` (or ``with server:``), which serve in a background thread while callers wait
    on ``result(rid)`` or ``future(rid)``. One serving loop at a time."""

    def __init__(self, engines: Sequence[Engine], max_queue: Optional[int] = None,
                 max_bypass: int = MAX_BYPASS, max_step_tokens: int = 0,
                 fused_steps: bool = True):
        self.engines = list(engines)
        if max_step_tokens < 0:
            raise InferenceError(f"max_step_tokens={max_step_tokens}: give a step's token "
                                 f"budget, e.g. 512, or 0 to prefill whole prompts")
        # prefill tokens + decode rows a replica step (0: whole prompts; chunked_prefill)
        self.max_step_tokens = max_step_tokens
        self.fused_steps = fused_steps   # a chunk beside decode rows: one program
        self.mixing = {}   # this step's fused chunk of each replica
        self.max_queue = max_queue  # waiting requests at most, all queues (None: unbounded)
        # one per replica, each with its queue and its bypass bound (inference.scheduler)
        self.schedulers = [Scheduler(e, max_bypass) for e in self.engines]
        self.results: dict[int, Result] = {}
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0,
                      "decode_steps": 0, "generated_tokens": 0,
                      # automatic prefix caching: prompt tokens looked up, and found cached
                      "prefix_queries": 0, "prefix_hits": 0,
                      "preemptions": 0,   # sequences whose blocks were taken back
                      "prefill_chunks": 0,   # prefills run by chunked prefill (a chunk each)
                      "mixed_steps": 0,   # fused steps: a chunk and the decode rows at once
                      "peak_running": 0}   # the most requests in decode slots at once
        self._next_id = 0
        # One lock guards the queues, slots, results and futures (other threads read them).
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # a request arrived, or stop()
        self._futures: dict[int, Future] = {}          # unfinished requests
        self._failed: dict[int, BaseException] = {}     # requests the server gave up on
        self._thread: threading.Thread | None = None
        self._loop = threading.Lock()  # held by whichever loop serves (run() or start())
        self._stopping = self._drain = False
        self._error: BaseException | None = None
        # called after each prefill and decode phase: streams its tokens (serving.delivery)
        self.phase_listeners: list[Callable[[], None]] = []

    @classmethod
    def from_params(cls, cfg: ModelConfig, params, meshes: Sequence, strategy=SERVE_STRATEGY,
                    ecfg: EngineConfig = EngineConfig(), sampling=SamplingConfig(), **kw):
        """One replica engine per mesh in ``meshes``, all serving ``params``."""
        return cls([Engine(cfg, params, m, strategy, ecfg, sampling, **kw) for m in meshes])

    @classmethod
    def from_seed(cls, cfg: ModelConfig, replicas: int = 1, mesh_sizes=None, seed: int = 0,
                  strategy=SERVE_STRATEGY, devices=None, **kw):
        """Replicas of a seeded random init (created on the first sub-mesh, copied to the rest)."""
        meshes = replica_meshes(mesh_sizes or {}, replicas, devices)
        params = init_params(abstract_model(cfg), meshes[0], strategy, seed)
        return cls.from_params(cfg, params, meshes, strategy, **kw)

    def warmup(self, prompt_lengths: Sequence[int],
               progress: Optional[Callable[[str], None]] = None,
               replicas: Optional[Iterable[int]] = None, sampled: bool = True) -> None:
        """Compile every replica's programs (``replicas``: those, counted from 0) for these
        prompt lengths before serving; ``progress(line)`` hears each one (``Engine.warmup``),
        named by its replica. ``inference.warm_start`` picks the replicas for ``serve``.
        ``sampled=False``: no request will sample (greedy), so no draw program is needed."""
        if self._loop.locked() or self.free_slots < self.total_slots:
            raise InferenceError("warmup() needs an idle server (no live requests, not "
                                 "serving in the background); call it before start()")
        n = len(self.engines)
        for i in (range(n) if replicas is None else replicas):
            self.engines[i].warmup(prompt_lengths, progress and (
                lambda line, i=i: progress(f"replica {i + 1}/{n}: {line}")),
                self.max_step_tokens if self.fused_steps else 0, sampled)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, seed: int | None = None,
               sampling: Optional[SamplingConfig] = None,
               on_token: Optional[Callable[[int, float], None]] = None,
               priority: int = 0, adapter: Optional[str] = None) -> int:
        """Queue a request and return its id; safe to call from any thread, also while the
        server is serving. A request that cannot be served (empty or over-long prompt,
        ``max_new_tokens`` that does not fit the cache, ids outside the vocabulary) raises
        ``InferenceError`` here and queues nothing; ``max_queue`` requests already waiting
        (all replicas' queues) raise ``QueueFullError``. ``seed`` defaults to a hash of the
        prompt, so sampled text does not depend on arrival order. ``sampling``: this
        request's temperature, top-k, top-p and stop tokens (default: each engine's).
        ``on_token(token, time)`` is called from the serving thread with each generated
        token as it is sampled (streaming); with ``sampling.logprobs`` as ``on_token(token,
        time, entry)``, ``entry`` the token's ``inference.logprobs.row_entry`` (the first also
        holding the prompt's, ``"prompt"``). ``priority``: lower is admitted first and
        preempted last (default 0). ``adapter``: the loaded LoRA adapter it runs with
        (``load_adapter``; None: the base model). It waits in one replica's queue."""
        prompt = self.check_request(prompt, max_new_tokens)
        max_new_tokens = operator.index(max_new_tokens)
        if seed is None:
            seed = default_seed(prompt)
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # a queued request is not cancellable
        with self._wake:
            if self._error is not None:
                raise InferenceError(f"the server stopped on an error ({self._error!r}); "
                                     f"build a new Server") from self._error
            waiting = sum(len(sch.queue) for sch in self.schedulers)
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFullError(f"{waiting} requests already wait (max_queue="
                                     f"{self.max_queue}); retry later")
            slot = self._adapter_slot(adapter)
            rid, self._next_id = self._next_id, self._next_id + 1
            live = _Live(Result(rid, prompt, submitted=time.perf_counter()), max_new_tokens,
                         seed, sampling, on_token, priority=int(priority), adapter=slot)
            self.schedulers[route(self.schedulers, live)].queue.append(live)   # (one holds it)
            self._futures[rid] = fut
            self._wake.notify()
        return rid

    def cancel(self, request_id: int) -> bool:
        """Stop serving a request (its client left, or it timed out): a queued one leaves the
        queue now, a live one frees its slot at the serving loop's next step. Its future
        resolves to the ``Result`` so far, ``finish_reason == "cancelled"``. False when the
        request is already finished."""
        with self._lock:
            if request_id not in self._futures:
                return False
            queued = next(((sch, x) for sch in self.schedulers for x in sch.queue
                           if x.result.request_id == request_id), None)
            if queued is None:
                live = next((x for row in self.slots for x in row
                             if x is not None and x.result.request_id == request_id), None)
                if live is None:
                    return False
                live.cancelled = True
                self._wake.notify()
                return True
            queued[0].queue.remove(queued[1])
        self._finish(queued[1], "cancelled", time.perf_counter())
        return True

    def future(self, request_id: int) -> Future:
        """A ``concurrent.futures.Future`` that resolves to the request's ``Result`` (or
        raises why it could not be served); usable with ``concurrent.futures.wait``."""
        with self._lock:
            if request_id in self._futures:
                return self._futures[request_id]
            done: Future = Future()
            if request_id in self.results:
                done.set_result(self.results[request_id])
            elif request_id in self._failed:
                done.set_exception(self._failed[request_id])
            else:
                raise InferenceError(f"no request with id {request_id}; use an id that "
                                     f"submit() returned")
            return done

    def result(self, request_id: int, timeout: float | None = None) -> Result:
        """Wait (up to ``timeout`` seconds) for the request's ``Result``."""
        return self.future(request_id).result(timeout)

    @property
    def total_slots(self) -> int:
        """Decode slots over all replicas."""
        return sum(len(row) for row in self.slots)

    @property
    def free_slots(self) -> int:
        """Decode slots holding no request now; ``total_slots`` when the server is idle."""
        with self._lock:
            return sum(s is None for row in self.slots for s in row)

    @property
    def kv_positions_in_use(self) -> int:
        """KV cache positions the live requests hold, over all replicas."""
        with self._lock:
            return int(sum(e.lengths[i] for e, row in zip(self.engines, self.slots)
                           for i, s in enumerate(row) if s is not None))

    @property
    def kv_blocks_in_use(self) -> int:
        """KV pool blocks the live requests hold, over all replicas."""
        with self._lock:
            return sum(e.kv.in_use for e in self.engines)

    @property
    def kv_blocks_total(self) -> int:
        """KV pool blocks over all replicas."""
        return sum(e.kv.total for e in self.engines)

    @property
    def running(self) -> int:
        """Requests in a decode slot now."""
        with self._lock:
            return sum(sch.running for sch in self.schedulers)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot, all replicas' queues."""
        return sum(self.queued_per_replica)

    @property
    def queued_per_replica(self) -> list[int]:
        """Requests waiting in each replica's queue."""
        with self._lock:
            return [len(sch.queue) for sch in self.schedulers]

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished (queued or in a slot)."""
        with self._lock:
            return len(self._futures)

    # ---- serving loops -----------------------------------------------------------------------
    def run(self) -> dict[int, Result]:
        """Serve until the queues are empty and every slot is free (requests submitted from
        other threads meanwhile are served too); returns all results so far."""
        if not self._loop.acquire(blocking=False):
            raise InferenceError("run() while another loop serves (start() or run() in "
                                 "another thread); wait on result(rid) instead, or stop() first")
        try:
            while self._step():
                pass
        except BaseException as e:
            self._fail(e, fatal=True)
            raise
        finally:
            self._loop.release()
        return self.results

    @property
    def serving(self) -> bool:
        """Whether a background serving thread (``start()``) is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Server":
        """Serve in a background thread until ``stop()``; returns the server."""
        if not self._loop.acquire(blocking=False):
            raise InferenceError("the server is already serving (start() or run()); call "
                                 "stop() first, or let run() return")
        self._stopping = False
        self._thread = threading.Thread(target=self._serve_forever, name="triax-server",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """End background serving. ``drain``: finish every submitted request first;
        otherwise the unfinished ones fail with ``InferenceError`` and free their slots.
        Re-raises the error that stopped the loop, if one did."""
        if self._thread is not None:
            with self._wake:
                self._stopping, self._drain = True, drain
                self._wake.notify()
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise InferenceError(f"the serving thread did not stop within {timeout} s")
            self._thread = None
        if not drain:
            self._fail(InferenceError("the server stopped before serving this request"))
        if self._error is not None:
            raise self._error

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(drain=exc[0] is None)

    # ---- figures -----------------------------------------------------------------------------
    @property
    def speculative_stats(self) -> dict:
        """Speculative decoding over all replicas (``inference.speculative``): ``rounds``
        (row-steps verified), ``proposed`` and ``accepted`` tokens; zeros without it."""
        got = [e.speculator.stats for e in self.engines
               if getattr(e, "speculator", None) is not None]
        return {k: sum(s[k] for s in got) for k in ("rounds", "proposed", "accepted")}

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second so far."""
        return self.stats["prefill_tokens"] / max(self.stats["prefill_s"], 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second so far."""
        return self.stats["decode_tokens"] / max(self.stats["decode_s"], 1e-9)
