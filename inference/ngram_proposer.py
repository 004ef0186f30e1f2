"""Prompt lookup: speculative proposals from the sequence itself, no model.

The last ``n`` tokens of a row (its prompt and what it generated, the newest last) are looked
for earlier in it, for ``n`` from ``max_n`` down to ``min_n``; the longest that occurs is
taken, at its latest occurrence, and the tokens that followed it there are proposed (up to
``k``). Text that repeats its context (code edits, summaries quoting the prompt, lists)
proposes long correct runs; text that does not proposes nothing, and the step is a plain
decode step's cost plus the ``k`` extra positions verified.

    >>> propose([1, 2, 3, 4, 9, 1, 2, 3], k=3)      # "1 2 3" seen before, then 4 9 1
    [4, 9, 1]
    >>> propose([5, 6, 7], k=3)
    []
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

NGRAM_MAX, NGRAM_MIN = 4, 1   # the longest and shortest suffix looked up


def propose(tokens: Sequence[int], k: int, max_n: int = NGRAM_MAX,
            min_n: int = NGRAM_MIN) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` (of ``min_n`` to ``max_n`` tokens) that occurs earlier; [] when none does."""
    arr = np.asarray(tokens, np.int64)
    T = len(arr)
    for n in range(min(max_n, T - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:T - 1], n)   # starts < T - n
        hits = np.flatnonzero((windows == arr[T - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer:
    """Prompt-lookup proposals for a batch of rows (host-side, no device work)."""

    host_side = True

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lookup needs 1 <= min_n <= max_n, got min_n={min_n}, "
                             f"max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, contexts: Sequence[Sequence[int]], k: int) -> np.ndarray:
        """``[rows, k]`` proposals and, separately, how many of each row's are real:
        returns ``(drafts, counts)``."""
        drafts = np.zeros((len(contexts), k), np.int32)
        counts = np.zeros(len(contexts), np.int32)
        for i, ctx in enumerate(contexts):
            got = propose(ctx, k, self.max_n, self.min_n) if ctx is not None else []
            drafts[i, :len(got)] = got
            counts[i] = len(got)
        return drafts, counts
