"""One request's record: its ``Result`` (tokens, finish reason, timings), the serving
loop's live state for it, and the error a full queue raises."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from triax.inference.engine import InferenceError
from triax.inference.sampling import SamplingConfig


def default_seed(prompt: Sequence[int]) -> int:
    """A request's seed when it gives none: a hash of its prompt, so sampled text does not
    depend on arrival order."""
    return zlib.crc32(np.asarray(prompt, np.int32).tobytes()) & 0x7FFFFFFF


@dataclass
class Result:
    """One request's outcome and timings (seconds, wall clock)."""

    request_id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (a stop token excluded)
    # With ``SamplingConfig(logprobs=True)``: one ``{"logprob", "top"}`` per token
    # (``inference.logprobs.row_entry``); with ``prompt_logprobs``: the prompt's, from its
    # second token on.
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: Optional[list[dict]] = None
    cached_tokens: int = 0                           # prompt tokens read from cached blocks
    preemptions: int = 0                             # times its blocks were taken back
    finish_reason: str = ""                          # "stop", "length" or "cancelled"
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
    sampling: Optional[SamplingConfig] = None      # None: the engine's
    on_token: Optional[Callable[[int, float], None]] = None
    cancelled: bool = False
    priority: int = 0        # lower runs first and is preempted last (vLLM's convention)
    passed: int = 0          # admissions that went past it while it did not fit
    admitted: int = 0        # when it last entered a slot (the server's admission count)
    adapter: int = 0         # its LoRA adapter's slot in the engines' table (0: none)

    def rank(self) -> tuple[int, int]:
        """Queue order: priority, then arrival (a preempted request keeps its place)."""
        return self.priority, self.result.request_id

    def tokens_to_prefill(self) -> list[int]:
        """Its prompt, and after a preemption every token it generated (recomputed)."""
        return self.result.prompt + self.result.tokens


class QueueFullError(InferenceError):
    """``submit`` while ``max_queue`` requests already wait; retry later."""
