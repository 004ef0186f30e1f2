"""Per-request logit controls, vLLM's semantics, applied on device inside the jitted step:
a grammar's allowed tokens (``TokenConstraint``: structured output), ``logit_bias`` (and
``min_tokens``, which bans a row's stop tokens until it has generated that many), then ``repetition_penalty`` on every token seen (prompt and output: a positive
logit divided by it, a negative one multiplied), ``frequency_penalty`` times each token's
count in the output and ``presence_penalty`` once per token in the output, both subtracted.

Each control is a per-row array (``penalty_rows``), present only when some row of the step
uses it: a step compiles once per combination of controls in use, never per request. The
tokens a row has seen come from the engine's ``TokenHistory`` (prompt and fed-back tokens,
padded to the engine's ``max_len``: one shape).

    >>> import numpy as np
    >>> from triax.inference.sampling import SamplingConfig
    >>> rows = penalty_rows([SamplingConfig(logit_bias=((3, 5.0),)), SamplingConfig()],
    ...                     np.zeros(2))
    >>> rows["bias_ids"].shape, int(rows["bias_ids"][0, 0]), float(rows["bias"][0, 0])
    ((2, 320), 3, 5.0)
"""
from __future__ import annotations

from typing import Optional, Protocol

import jax.numpy as jnp
import numpy as np

LOGIT_BIAS_MAX = 300      # OpenAI's limit on logit_bias entries
BIAS_WIDTH = 320          # bias entries per row in a step: logit_bias plus min_tokens' bans
PAD_ID = 2 ** 30          # an id beyond any vocabulary: its scatter is dropped


class TokenConstraint(Protocol):
    """A request's grammar state on the host: the tokens it allows next, as a bitmask of
    ``⌈vocab / 32⌉`` int32 words (bit ``t % 32`` of word ``t // 32``: token t), advanced by
    each accepted token; ``finished`` once it can take no more."""

    def bitmask(self) -> np.ndarray: ...

    def advance(self, token: int) -> None: ...

    @property
    def finished(self) -> bool: ...


def _penalized(c) -> bool:
    return c.presence_penalty != 0 or c.frequency_penalty != 0 or c.repetition_penalty != 1


def reads_prompt(c) -> bool:
    """Whether ``c``'s sampling reads every prompt token on device (penalties, echo's
    logprobs): such a request's prefill never starts from cached prefix blocks."""
    return _penalized(c) or c.prompt_logprobs


def penalty_rows(configs, generated) -> dict:
    """The per-row arrays of the controls any row of ``configs`` uses (none: ``{}``);
    ``generated[i]``: tokens row i generated so far (``min_tokens``)."""
    out = {}
    masks = [c.constraint.bitmask() if c.constraint is not None else None for c in configs]
    if any(m is not None for m in masks):   # unconstrained rows: every bit set
        words = max(len(m) for m in masks if m is not None)
        out["allowed"] = np.stack([np.full(words, -1, np.int32) if m is None else
                                   np.asarray(m, np.int32) for m in masks])
    if any(_penalized(c) for c in configs):
        out["presence"] = np.array([c.presence_penalty for c in configs], np.float32)
        out["frequency"] = np.array([c.frequency_penalty for c in configs], np.float32)
        out["repetition"] = np.array([c.repetition_penalty for c in configs], np.float32)
    banned = [c.stop_tokens if g < c.min_tokens else () for c, g in zip(configs, generated)]
    if any(c.logit_bias for c in configs) or any(banned):
        ids = np.full((len(configs), BIAS_WIDTH), PAD_ID, np.int32)
        bias = np.zeros((len(configs), BIAS_WIDTH), np.float32)
        for i, (c, ban) in enumerate(zip(configs, banned)):
            entries = list(c.logit_bias) + [(t, -np.inf) for t in ban]
            if entries:
                ids[i, :len(entries)], bias[i, :len(entries)] = zip(*entries)
        out["bias_ids"], out["bias"] = ids, bias
    return out


def adjusts(rows: dict) -> bool:
    """Whether ``adjust_logits`` changes anything for ``rows`` (a grammar, bias or penalties)."""
    return any(k in rows for k in ("allowed", "bias_ids", "presence"))


def adjust_logits(logits_BV, rows: dict, seen=None):
    """The logits after each row's bias and penalties (those ``rows`` carries). ``seen``:
    ``(tokens_BL, length_B, prompt_len_B)``, each row's first ``length`` tokens of which
    the first ``prompt_len`` are its prompt; default ``rows``' ``history``, ``seen_len``
    and ``prompt_len`` (decode steps)."""
    B, V = logits_BV.shape
    row_B1 = jnp.arange(B)[:, None]
    if "allowed" in rows:   # the bitmask's bits, token by token (tokens past it: banned)
        bits_BW32 = (rows["allowed"][:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None]) & 1
        allowed_BV = bits_BW32.reshape(B, -1)[:, :V] > 0
        allowed_BV = jnp.pad(allowed_BV, ((0, 0), (0, V - allowed_BV.shape[1])))
        logits_BV = jnp.where(allowed_BV, logits_BV, -jnp.inf)
    if "bias_ids" in rows:
        logits_BV = logits_BV.at[row_B1, rows["bias_ids"]].add(rows["bias"], mode="drop")
    if "presence" not in rows:
        return logits_BV
    tokens_BL, len_B, prompt_B = seen if seen is not None else (
        rows["history"], rows["seen_len"], rows["prompt_len"])
    pos_1L = jnp.arange(tokens_BL.shape[1])[None]
    valid_BL = pos_1L < len_B[:, None]
    output_BL = valid_BL & (pos_1L >= prompt_B[:, None])
    seen_BV = jnp.zeros((B, V), bool).at[row_B1, jnp.where(valid_BL, tokens_BL, PAD_ID)].set(
        True, mode="drop")
    counts_BV = jnp.zeros((B, V), jnp.float32).at[
        row_B1, jnp.where(output_BL, tokens_BL, PAD_ID)].add(1.0, mode="drop")
    rep_B1 = rows["repetition"][:, None]
    logits_BV = jnp.where(seen_BV, jnp.where(logits_BV > 0, logits_BV / rep_B1,
                                             logits_BV * rep_B1), logits_BV)
    return (logits_BV - rows["frequency"][:, None] * counts_BV
            - rows["presence"][:, None] * (counts_BV > 0))


class TokenHistory:
    """The tokens each decode slot has seen (its prompt, then each token fed back), on the
    host, for the penalties: ``seen_rows`` hands a step's rows their history."""

    def __init__(self, slots: int, max_len: int):
        self.tokens = np.zeros((slots, max_len), np.int32)
        self.length = np.zeros(slots, np.int64)
        self.prompt_len = np.zeros(slots, np.int64)

    def start(self, slot: int, prompt, prompt_len: Optional[int] = None) -> None:
        """``slot`` begins with ``prompt`` seen, its first ``prompt_len`` (default: all) the
        request's prompt (a resumed request's rest it generated before)."""
        n = len(prompt)
        self.tokens[slot, :n] = prompt
        self.length[slot] = n
        self.prompt_len[slot] = n if prompt_len is None else prompt_len

    def feed(self, slots, tokens) -> None:
        """Each slot in ``slots`` was fed ``tokens[slot]`` (a generated token)."""
        slots = np.asarray(slots, np.int64)
        fits = slots[self.length[slots] < self.tokens.shape[1]]
        self.tokens[fits, self.length[fits]] = np.asarray(tokens)[fits]
        self.length[slots] += 1

    def generated(self, slots, real) -> np.ndarray:
        """Tokens each of a decode step's rows has generated (``real``: not padding)."""
        return np.where(real, self.length[slots] - self.prompt_len[slots], 0)

    def seen_rows(self, rows: dict, slots, real) -> dict:
        """A decode step's ``rows`` with their histories when a row is penalized."""
        if "presence" in rows:
            rows = {**rows,
                    "history": np.where(real[:, None], self.tokens[slots], 0).astype(np.int32),
                    "seen_len": np.where(real, self.length[slots], 0).astype(np.int32),
                    "prompt_len": np.where(real, self.prompt_len[slots], 0).astype(np.int32)}
        return rows
