"""Which replicas compile their programs before a server is ready (``triax serve --warmup``).

A warm-up runs every prompt and decode bucket once per replica so that served timings
exclude compiling. With the persistent compile cache warm (a second start), nothing is
compiled, yet each program still costs its trace, its lowering to StableHLO and the cache's
retrieval and deserialisation (measured on ``tiny``: ≈0.19 CPU s a program, half of it the
lowering), and every replica pays it again: its programs name other devices, so JAX traces,
lowers and looks each up anew. ``auto`` therefore warms the first replica of each layout
and, when each of its programs came from the persistent cache (a warm start), leaves that
layout's other replicas to their first use, which then costs that retrieval, not a compile;
on a cold cache (or none) every replica is warmed, so serving never stalls on a compile.
``all``: every replica before ready; ``first``: each layout's first only, whatever the
cache holds.

    >>> from triax.inference.warm_start import lazy_rest
    >>> lazy_rest("auto", hits=8, misses=0), lazy_rest("auto", hits=0, misses=8)
    (True, False)
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import jax

from triax.choices import WARMUP, check

HIT, MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def lazy_rest(policy: str, hits: int, misses: int) -> bool:
    """Whether the replicas after the first compile on first use, given how the first's
    programs were found in the persistent cache (``hits``, ``misses``; neither: no cache)."""
    check("warmup", policy, WARMUP)
    return policy == "first" or (policy == "auto" and hits > 0 and misses == 0)


@contextmanager
def cache_lookups():
    """Count the persistent compile cache's hits and misses in the block: ``{HIT: n, MISS: m}``."""
    seen = {HIT: 0, MISS: 0}

    def heard(event: str, **_):
        if event in seen:
            seen[event] += 1

    jax.monitoring.register_event_listener(heard)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_listener(heard)


def warm_replicas(server, prompt_lengths: Sequence[int], policy: str = "auto",
                  progress: Optional[Callable[[str], None]] = None) -> list[int]:
    """Warm the first replica of each layout in ``server``, then that layout's others unless
    ``policy`` leaves them to their first use (module docstring); the replicas warmed,
    counted from 0. A layout's cache hits say nothing of another's programs, so the first
    replica of every distinct layout is warmed."""
    check("warmup", policy, WARMUP)
    layouts: dict = {}
    for i, eng in enumerate(server.engines):
        layouts.setdefault(tuple(eng.mesh.shape.items()), []).append(i)
    warmed = []
    for first, *rest in layouts.values():
        with cache_lookups() as seen:
            server.warmup(prompt_lengths, progress, replicas=[first])
        warmed.append(first)
        if rest and lazy_rest(policy, seen[HIT], seen[MISS]):
            if progress is not None:
                why = ("--warmup first" if policy == "first" else
                       f"replica {first + 1}'s {seen[HIT]} compiles came from the compile "
                       f"cache")
                progress(f"replica(s) {', '.join(str(i + 1) for i in rest)}: each program "
                         f"on its first use ({why})")
        elif rest:
            server.warmup(prompt_lengths, progress, replicas=rest)
            warmed += rest
    return sorted(warmed)
