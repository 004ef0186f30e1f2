"""Which replica's queue a request waits in: routing at submission, work stealing at admission.

Each replica's ``Scheduler`` (``inference.scheduler``) owns its queue. ``route`` places a new
request on the replica with the least outstanding work (waiting + running); among equals, the
one whose prefix cache holds the longest run of its prompt's blocks, then the lowest index.
A replica whose pool could never hold the request whole is never chosen (``Server.submit``
refuses one that no replica can hold).

Routing sees only counts, not lengths: one replica may drain while another still has a
backlog. So before each admission ``steal`` lets a replica with free slots and an empty
queue take waiting requests, one per free slot, each from the longest other queue, first in
that queue's order (priority, then arrival) among those it can hold. A preempted request
waiting to resume is taken only when no queue holds a fresh one: its replica may still cache
its blocks, but recomputing it now on an idle replica beats waiting for blocks on one under
pressure. Moved requests keep their ``passed`` count (the age bound only grows).
The caller (``Server``) holds its lock around both.
"""
from __future__ import annotations

from typing import Optional, Sequence

from triax.inference.errors import InferenceError
from triax.inference.request import _Live
from triax.inference.scheduler import Scheduler


def check_servable(engines: Sequence, n_tokens: int, max_new_tokens: int) -> None:
    """Raise replica 0's ``InferenceError`` (``Engine.check_prompt``) unless some replica
    can serve a prompt of ``n_tokens`` and ``max_new_tokens``: then ``route`` finds one."""
    errors = []
    for eng in engines:
        try:
            return eng.check_prompt(n_tokens, max_new_tokens)
        except InferenceError as e:
            errors.append(e)
    raise errors[0]


def route(schedulers: Sequence[Scheduler], live: _Live) -> Optional[int]:
    """The replica whose queue ``live`` joins (None: no replica's pool could hold it)."""
    able = [r for r, sch in enumerate(schedulers) if sch.can_hold(live)]
    if not able:
        return None
    load = {r: len(schedulers[r].queue) + schedulers[r].running for r in able}
    least = [r for r in able if load[r] == min(load.values())]
    if len(least) == 1:
        return least[0]
    # a tie: look up the prompt's cached blocks (only now, for the tied replicas)
    return max(least, key=lambda r: (schedulers[r].cached_blocks(live), -r))


def steal(schedulers: Sequence[Scheduler], r: int) -> int:
    """Move waiting requests into replica ``r``'s queue if it is empty and ``r`` has free
    slots (see module docstring); returns how many moved."""
    thief = schedulers[r]
    if thief.queue:
        return 0
    moved = 0
    for _ in range(len(thief.slots) - thief.running):
        pick = _first_stealable(schedulers, thief)
        if pick is None:
            break
        donor, live = pick
        donor.queue.remove(live)
        thief.queue.append(live)
        moved += 1
    return moved


def _first_stealable(schedulers: Sequence[Scheduler], thief: Scheduler):
    """``(donor, request)``: the first by rank of the longest other queue's requests that
    ``thief`` can hold, fresh ones first (a preempted one only when no queue has a fresh
    one); None if there is none."""
    donors = sorted((s for s in schedulers if s is not thief),
                    key=lambda s: len(s.queue), reverse=True)   # stable: lowest index first
    for preempted in (False, True):
        for donor in donors:
            fits = [x for x in donor.queue if thief.can_hold(x)
                    and bool(x.result.preemptions) == preempted]
            if fits:
                return donor, min(fits, key=_Live.rank)
    return None
