"""Speculative decoding in the planner's decode model (``inference.speculative``): a step
verifies ``k`` proposals per row in one pass over ``k + 1`` positions, and a draft model (if
any) runs ``k`` steps of its own before it; with each proposal kept with probability ``α``
(independently), a row emits ``(1 − α^(k+1)) / (1 − α)`` tokens per step (Leviathan et al.
2023). The draft's weights and KV pool sit beside the target's on each device.

    >>> round(expected_tokens(4, 0.8), 3), expected_tokens(4, 0.0), expected_tokens(3, 1.0)
    (3.362, 1.0, 4.0)
"""
from __future__ import annotations

import dataclasses


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a row emits per verify step: ``k`` proposals, each kept with probability
    ``acceptance`` until the first rejection, plus the target's own token."""
    if k == 0:
        return 1.0
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def check_speculative(k: int, acceptance: float) -> None:
    """A clear error for settings the model cannot price."""
    if k < 0:
        raise ValueError(f"--speculative-tokens {k}: give 0 (off) or more")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--acceptance-rate {acceptance}: give a probability in [0, 1]")


def draft_workload(w):
    """The draft's own decode workload: the target's slots, sequences, dtype and pool
    settings over the draft's model (``w.draft``), speculating nothing itself."""
    return dataclasses.replace(w, cfg=w.draft, params=w.draft.num_params, spec_k=0,
                               acceptance=0.0, draft=None)
