"""Serving: a request queue, R replica engines, continuous batching into free decode slots.

Each replica is an ``Engine`` on its own sub-mesh with a full copy of the model (tensor- or
pipeline-parallel inside). Replicas multiply throughput; they do **not** pool memory: every
replica must hold the whole model and its own KV cache.

Every loop iteration: each replica pulls waiting requests into its free slots and prefills
them; then every replica with live slots decodes one token. All replicas' work is
dispatched before any result is read, so the sub-meshes run concurrently. A sequence that
stops frees its slot at once, and the next iteration fills it.

    >>> from triax.models import config
    >>> server = Server.from_seed(config.TINY, replicas=2, mesh_sizes={"tensor": 2},
    ...                           devices=jax.devices()[:4])    # 2 replicas × tensor=2
    >>> rid = server.submit([72, 105], max_new_tokens=8)
    >>> results = server.run()             # {request id: Result}
    >>> len(results[rid].tokens), results[rid].ttft_s > 0
    (8, True)
"""
from __future__ import annotations

import collections
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import jax
import numpy as np

from triax.inference.engine import Engine, EngineConfig, InferenceError
from triax.inference.sampling import SamplingConfig
from triax.mesh.build import make_mesh
from triax.models.config import ModelConfig
from triax.sharding.partition import abstract_model, init_params


@dataclass
class Result:
    """One request's outcome and timings (seconds, wall clock)."""

    request_id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (a stop token excluded)
    finish_reason: str = ""                          # "stop" or "length"
    replica: int = -1
    slot: int = -1
    submitted: float = 0.0
    first_token: float = 0.0
    done: float = 0.0

    @property
    def ttft_s(self) -> float:
        """Time to first token, from submission."""
        return self.first_token - self.submitted

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of this request's life (submission to last token)."""
        return len(self.tokens) / max(self.done - self.submitted, 1e-9)


@dataclass
class _Live:
    result: Result
    max_new: int
    seed: int


def split_devices(devices: Sequence, replicas: int) -> list[list]:
    """Split ``devices`` into ``replicas`` equal contiguous groups (one per replica)."""
    n = len(devices)
    if replicas < 1 or n % replicas:
        raise InferenceError(f"--replicas {replicas} does not divide the {n} devices; choose a "
                             f"divisor of {n} ({', '.join(str(d) for d in range(1, n + 1) if n % d == 0)})")
    k = n // replicas
    return [list(devices[i * k:(i + 1) * k]) for i in range(replicas)]


def replica_meshes(mesh_sizes: Mapping[str, int], replicas: int, devices=None) -> list:
    """One mesh per replica; ``mesh_sizes`` describes a single replica (missing axes are 1)."""
    devices = list(jax.devices() if devices is None else devices)
    groups = split_devices(devices, replicas)
    per = math.prod(mesh_sizes.values())
    if per > 0 and per != len(groups[0]):  # (a -1 axis fills the replica's devices)
        desc = ",".join(f"{a}={n}" for a, n in mesh_sizes.items()) or "one device"
        raise InferenceError(
            f"--mesh {desc} has {per} device(s) per replica, but {len(devices)} devices split "
            f"into {replicas} replica(s) give {len(groups[0])} each; choose --mesh and "
            f"--replicas whose product is {len(devices)}")
    return [make_mesh(devices=g, **dict(mesh_sizes)) for g in groups]


class Server:
    """Continuous-batching request server over one or more replica engines."""

    def __init__(self, engines: Sequence[Engine]):
        self.engines = list(engines)
        self.queue: collections.deque[_Live] = collections.deque()
        self.slots: list[list[_Live | None]] = [[None] * e.ecfg.max_batch for e in self.engines]
        self.slot_uses = [[0] * e.ecfg.max_batch for e in self.engines]
        self.results: dict[int, Result] = {}
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0,
                      "decode_steps": 0}
        self._next_id = 0

    @classmethod
    def from_params(cls, cfg: ModelConfig, params, meshes: Sequence, strategy="tp",
                    ecfg: EngineConfig = EngineConfig(), sampling=SamplingConfig(), **kw):
        """One replica engine per mesh in ``meshes``, all serving ``params``."""
        return cls([Engine(cfg, params, m, strategy, ecfg, sampling, **kw) for m in meshes])

    @classmethod
    def from_seed(cls, cfg: ModelConfig, replicas: int = 1, mesh_sizes=None, seed: int = 0,
                  strategy="tp", devices=None, **kw):
        """Replicas of a seeded random init (created on the first sub-mesh, copied to the rest)."""
        meshes = replica_meshes(mesh_sizes or {}, replicas, devices)
        params = init_params(abstract_model(cfg), meshes[0], strategy, seed)
        return cls.from_params(cfg, params, meshes, strategy, **kw)

    def warmup(self, prompt_lengths: Sequence[int]) -> None:
        """Compile every replica's programs for these prompt lengths before serving."""
        if any(s is not None for row in self.slots for s in row):
            raise InferenceError("warmup() needs an idle server (no live requests)")
        for eng in self.engines:
            eng.warmup(prompt_lengths)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, seed: int | None = None) -> int:
        """Queue a request; returns its id. ``seed`` defaults to a hash of the prompt, so
        sampled text does not depend on arrival order."""
        prompt = [int(t) for t in prompt]
        self.engines[0].check_prompt(len(prompt), max_new_tokens)
        if seed is None:
            seed = zlib.crc32(np.asarray(prompt, np.int32).tobytes()) & 0x7FFFFFFF
        rid = self._next_id
        self._next_id += 1
        res = Result(rid, prompt, submitted=time.perf_counter())
        self.queue.append(_Live(res, max_new_tokens, seed))
        return rid

    def run(self) -> dict[int, Result]:
        """Serve until the queue is empty and every slot is free; returns all results."""
        while self.queue or any(s is not None for row in self.slots for s in row):
            t0 = time.perf_counter()
            prefilled = self._prefill_all()
            t1 = time.perf_counter()
            decoded = self._decode_all()
            t2 = time.perf_counter()
            if prefilled:
                self.stats["prefill_s"] += t1 - t0
            if decoded:
                self.stats["decode_s"] += t2 - t1
                self.stats["decode_steps"] += 1
        return self.results

    # ---- one iteration -----------------------------------------------------------------------
    def _prefill_all(self) -> int:
        launched = []
        for r, eng in enumerate(self.engines):
            free = [i for i, s in enumerate(self.slots[r]) if s is None]
            batch = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
            if not batch:
                continue
            slots = free[:len(batch)]
            toks = eng.prefill(slots, [np.asarray(x.result.prompt) for x in batch],
                               [x.seed for x in batch])
            launched.append((r, slots, batch, toks))
        for r, slots, batch, toks in launched:
            now = time.perf_counter()
            for slot, live, tok in zip(slots, batch, np.asarray(toks)):
                live.result.replica, live.result.slot, live.result.first_token = r, slot, now
                self.slots[r][slot] = live
                self.slot_uses[r][slot] += 1
                self.stats["prefill_tokens"] += len(live.result.prompt)
                self._accept(r, slot, int(tok), now)
        return len(launched)

    def _decode_all(self) -> int:
        launched = []
        for r, eng in enumerate(self.engines):
            live = self.slots[r]
            active = np.array([s is not None for s in live])
            if not active.any():
                continue
            last = np.array([s.result.tokens[-1] if s else 0 for s in live], np.int32)
            seeds = np.array([s.seed if s else 0 for s in live], np.int32)
            launched.append((r, active, eng.decode(last, active, seeds)))
        for r, active, toks in launched:
            now = time.perf_counter()
            for slot, tok in zip(np.flatnonzero(active), np.asarray(toks)[active]):
                self.stats["decode_tokens"] += 1
                self._accept(r, int(slot), int(tok), now)
        return len(launched)

    def _accept(self, r: int, slot: int, tok: int, now: float) -> None:
        """Record a sampled token; finish the request (freeing its slot) on stop or length."""
        live = self.slots[r][slot]
        res = live.result
        stop = tok in self.engines[r].sampling.stop_tokens
        if not stop:
            res.tokens.append(tok)
        if stop or len(res.tokens) >= live.max_new:
            res.finish_reason = "stop" if stop else "length"
            res.done = now
            self.results[res.request_id] = res
            self.slots[r][slot] = None

    # ---- figures -----------------------------------------------------------------------------
    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second so far."""
        return self.stats["prefill_tokens"] / max(self.stats["prefill_s"], 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second so far."""
        return self.stats["decode_tokens"] / max(self.stats["decode_s"], 1e-9)
