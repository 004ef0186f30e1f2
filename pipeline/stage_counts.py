"""Uneven pipeline stages: how many layers each stage runs. The one home of the split's
arithmetic (its check, its offsets, the split by speed), which ``RunConfig``, the executor's
``StageLayers`` and the planner's mixed-generation sizing (``planner.mixed``) all ask.

A stage with fewer layers than the longest holds its chunk padded to the longest (SPMD: one
program, one shape for every stage) and skips the padded slots at run time
(the runtime's ``layer_count``, ``models.runtime``), so a short stage really computes less.

    >>> check_counts((5, 3), num_layers=8, stages=2)
    (5, 3)
    >>> offsets((5, 3))
    (0, 5)
    >>> split_by_time(8, (1.0, 3.0))       # the second stage's layers take 3× as long
    (6, 2)
"""
from __future__ import annotations

from typing import Optional, Sequence


class StageCountsError(ValueError):
    """Per-stage layer counts that do not describe the model's layers over its stages."""


def parse_counts(text: str) -> tuple[int, ...]:
    """``"5,3"`` (the ``--stage-layers`` flag) → ``(5, 3)``."""
    try:
        counts = tuple(int(p) for p in str(text).split(","))
    except ValueError:
        raise StageCountsError(f"stage_layers {text!r}: give one layer count per pipeline "
                               f"stage, comma-separated, e.g. 5,3") from None
    return counts


def check_counts(counts: Sequence[int], num_layers: int, stages: int, virtual: int = 1,
                 split_backward: bool = False) -> tuple[int, ...]:
    """``counts`` as a tuple, or a :class:`StageCountsError` naming what is wrong and the fix.

    A split backward (ZB-H1, ZB-V) is refused: its B_in and W ran the padded slots' matmuls
    outside the slot's conditional (measured on tiny, 3 + 1 layers: all 12 of B_in's), so a
    short stage would not be cheaper there."""
    counts = tuple(int(c) for c in counts)
    if split_backward:
        raise StageCountsError(f"stage_layers {counts}: a zero-bubble schedule's split "
                               f"backward runs the padded layers too; use gpipe or 1f1b with "
                               f"uneven stages")
    if virtual != 1:
        raise StageCountsError(f"stage_layers {counts}: uneven stages run one chunk per stage; "
                               f"use virtual=1 (a non-interleaved schedule), or drop "
                               f"stage_layers")
    if len(counts) != stages:
        raise StageCountsError(f"stage_layers {counts}: {len(counts)} count(s) for {stages} "
                               f"pipeline stage(s); give one per stage (the mesh's pipe)")
    if min(counts) < 1:
        raise StageCountsError(f"stage_layers {counts}: every stage needs at least 1 layer")
    if sum(counts) != num_layers:
        raise StageCountsError(f"stage_layers {counts} add up to {sum(counts)}, but the model "
                               f"has {num_layers} layers; make them add up to {num_layers}")
    return counts


def offsets(counts: Sequence[int]) -> tuple[int, ...]:
    """The first layer of each stage."""
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return tuple(out)


def equal_counts(num_layers: int, stages: int) -> tuple[int, ...]:
    """The even split (the first ``L % S`` stages one layer more): what ``StageLayers``'
    padded layout amounts to when it is not given counts, as far as the longest stage goes."""
    q, r = divmod(num_layers, stages)
    return tuple(q + (s < r) for s in range(stages))


def split_by_time(num_layers: int, seconds_per_layer: Sequence[float],
                  cap: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's time ``max_s count_s × t_s`` (each
    stage ≥ 1 layer, at most ``cap[s]``): layer by layer onto the stage that would finish it
    soonest, which is optimal for a max of linear costs. Ties go to the earlier stage."""
    S = len(seconds_per_layer)
    cap = tuple(cap) if cap is not None else (num_layers,) * S
    if num_layers < S or sum(min(c, num_layers) for c in cap) < num_layers or min(cap) < 1:
        raise StageCountsError(f"{num_layers} layers cannot go onto {S} stages holding at most "
                               f"{cap} layers each (and at least 1)")
    counts = [1] * S
    for _ in range(num_layers - S):
        s = min((s for s in range(S) if counts[s] < cap[s]),
                key=lambda s: ((counts[s] + 1) * seconds_per_layer[s], s))
        counts[s] += 1
    return tuple(counts)
