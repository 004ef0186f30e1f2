"""Next-token sampling: greedy, temperature, top-k, top-p, seeded per request; each
request's penalties and logit bias (``inference.penalties``) and log-probabilities
(``inference.logprobs``) ride in the same per-row arrays, so none of them recompiles per
request.

Each row draws with its own key, ``fold_in(fold_in(PRNGKey(seed), request_seed), position)``,
so a request's tokens depend only on the request, never on which slot, replica or batch it
shares: results are independent of arrival order.

    >>> cfg = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, seed=1)
    >>> SamplingConfig.greedy_config().greedy
    True
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from triax.inference.logprobs import logprob_rows, with_logprobs
from triax.inference.penalties import (BIAS_WIDTH, LOGIT_BIAS_MAX, adjust_logits, adjusts,
                                       penalty_rows)


class SamplingError(ValueError):
    """Sampling settings that make no sense; the message says which and the valid range."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0          # 0: no top-k filter
    top_p: float = 1.0      # 1.0: no nucleus filter
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    # Per-request controls (vLLM's semantics; ``inference.penalties``): penalties on the
    # tokens seen so far, a bias per token id, and the tokens before a stop token may end it.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # Log-probabilities (``inference.logprobs``): of each sampled token (and the top
    # ``TOP_LOGPROBS``), and of the prompt's own tokens (``echo``).
    logprobs: bool = False
    prompt_logprobs: bool = False
    # A grammar this request's tokens must follow (``penalties.TokenConstraint``: one per
    # request, advanced as its tokens are accepted); not part of the config's identity.
    constraint: Optional[Any] = field(default=None, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b))
                                                     for t, b in self.logit_bias))
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            if not lo <= getattr(self, name) <= hi:
                raise SamplingError(f"{name} must be in [{lo:g}, {hi:g}] (0 disables it), got "
                                    f"{getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise SamplingError(f"repetition_penalty must be > 0 (1 disables it), got "
                                f"{self.repetition_penalty}")
        if self.min_tokens < 0:
            raise SamplingError(f"min_tokens must be >= 0, got {self.min_tokens}")
        bad = [(t, b) for t, b in self.logit_bias if not -100 <= b <= 100]
        if bad:
            raise SamplingError(f"logit_bias values must be in [-100, 100], got {bad[0][1]} "
                                f"for token {bad[0][0]}")
        need = len(self.logit_bias) + (len(self.stop_tokens) if self.min_tokens else 0)
        if len(self.logit_bias) > LOGIT_BIAS_MAX or need > BIAS_WIDTH:
            raise SamplingError(f"logit_bias has {len(self.logit_bias)} entries (with "
                                f"min_tokens, plus {len(self.stop_tokens)} stop tokens): at "
                                f"most {LOGIT_BIAS_MAX} (and {BIAS_WIDTH} with the stop "
                                f"tokens); bias fewer tokens")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy_config(cls, stop_tokens: tuple[int, ...] = ()) -> "SamplingConfig":
        return cls(temperature=0.0, stop_tokens=tuple(stop_tokens))


def _filter_top_k(logits_BV, k: int):
    if k <= 0 or k >= logits_BV.shape[-1]:
        return logits_BV
    kth = jax.lax.top_k(logits_BV, k)[0][:, -1:]
    return jnp.where(logits_BV < kth, -jnp.inf, logits_BV)


def _filter_top_p(logits_BV, p: float):
    """Keep the smallest set of tokens whose probability reaches ``p`` (always the best one)."""
    if p >= 1.0:
        return logits_BV
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_BV, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep = before < p
    cutoff = jnp.min(jnp.where(keep, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_BV < cutoff, -jnp.inf, logits_BV)


def row_keys(seed: int, request_seeds_B, positions_B):
    """One PRNG key per row from the global seed, the request's seed and the position."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(base, r), p))(
        request_seeds_B, positions_B)


def filtered_logits(logits_BV, rows):
    """Each row's logits as it samples them: over its temperature, its top-k and top-p
    filters applied (the tokens filtered out at -inf); greedy rows (temperature 0) are
    unscaled. ``categorical`` over these is the row's draw; their softmax is its
    distribution (what speculative decoding's rejection rule compares)."""
    t_B, k_B, p_B = rows["temperature"], rows["top_k"], rows["top_p"]
    V = logits_BV.shape[-1]
    x_BV = logits_BV / jnp.where(t_B > 0, t_B, 1.0)[:, None]
    sorted_BV = jnp.sort(x_BV, axis=-1)[:, ::-1]
    k_eff = jnp.where((k_B <= 0) | (k_B >= V), V, k_B)
    kth = jnp.take_along_axis(sorted_BV, (k_eff - 1)[:, None], axis=-1)
    x_BV = jnp.where(x_BV < kth, -jnp.inf, x_BV)
    sorted_BV = jnp.where(jnp.arange(V)[None] < k_eff[:, None], sorted_BV, -jnp.inf)
    probs = jax.nn.softmax(sorted_BV, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(before < p_B[:, None], sorted_BV, jnp.inf), axis=-1,
                     keepdims=True)
    return jnp.where((p_B < 1.0)[:, None] & (x_BV < cutoff), -jnp.inf, x_BV)


def sample_rows(logits_BV, seed, request_seeds_B, positions_B, rows):
    """Each row with its own temperature, top-k and top-p (a request's own settings); a row
    whose temperature is 0 takes the argmax. Same filters as the static path, per row.
    ``seed``: the global seed (an int, or a traced scalar: the same keys)."""
    t_B = rows["temperature"]
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def drawn(_):
        x_BV = filtered_logits(logits_BV, rows)
        keys = row_keys(seed, request_seeds_B, positions_B)
        tok = jax.vmap(jax.random.categorical)(keys, x_BV).astype(jnp.int32)
        return jnp.where(t_B > 0, tok, greedy_B)

    # All rows greedy (the common case): skip the sort.
    return jax.lax.cond(jnp.any(t_B > 0), drawn, lambda _: greedy_B, None)


def sample(logits_BV, cfg: SamplingConfig, request_seeds_B, positions_B, rows=None):
    """Pick one token per row (traced inside the jitted prefill/decode). ``rows``: per-row
    ``temperature`` / ``top_k`` / ``top_p`` arrays (``row_settings``) in place of ``cfg``'s."""
    logits_BV = logits_BV.astype(jnp.float32)
    if rows is not None:
        return sample_rows(logits_BV, cfg.seed, request_seeds_B, positions_B, rows)
    if cfg.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = _filter_top_p(_filter_top_k(logits_BV / cfg.temperature, cfg.top_k), cfg.top_p)
    keys = row_keys(cfg.seed, request_seeds_B, positions_B)
    return jax.vmap(jax.random.categorical)(keys, logits_BV).astype(jnp.int32)


def row_settings(configs, generated=None, prefill: bool = False) -> dict:
    """Per-row sampling arrays for ``sample(rows=...)`` from one ``SamplingConfig`` per row;
    with penalties, bias or logprobs in any row, their arrays too (``generated``: each row's
    tokens generated so far, for ``min_tokens``; default none; ``prefill``: the prompt's
    log-probabilities too, for rows that ask)."""
    configs = list(configs)
    rows = {"temperature": np.array([c.temperature for c in configs], np.float32),
            "top_k": np.array([c.top_k for c in configs], np.int32),
            "top_p": np.array([c.top_p for c in configs], np.float32)}
    gen = np.zeros(len(configs), np.int64) if generated is None else np.asarray(generated)
    return {**rows, **penalty_rows(configs, gen), **logprob_rows(configs, prefill)}


# What a draw reads of a row's settings (its penalties and bias are in the logits already).
DRAW_KEYS = ("temperature", "top_k", "top_p", "logprobs")


def draws(rows: dict) -> bool:
    """Whether any row of a step samples (temperature > 0), on the host: only then does the
    engine run the draw program (``draw``) on the step's logits."""
    return bool(np.any(np.asarray(rows["temperature"]) > 0))


def draw_rows(rows: dict) -> dict:
    """``rows``' arrays a draw reads (``DRAW_KEYS``): penalties and bias make no draw of
    their own."""
    return {k: rows[k] for k in DRAW_KEYS if k in rows}


def step_tokens(logits_BV, rows, seen=None):
    """A jitted step's tokens: penalties and bias on the logits (rows that ask; ``seen =
    (history_BL, length_B, prompt_len_B)``, the tokens each row has seen), then each row's
    argmax (with ``rows["logprobs"]``, a dict of it and its log-probabilities under the
    model: ``inference.logprobs``); and ``(logits, adjusted)``, what ``draw`` reads when a
    row samples (``adjusted``: None where no row adjusts, the raw logits serve).

    The draw is a program of its own, launched only for steps where a row samples, so a
    step carries no sort, softmax or random hashing: each prefill (batch × length bucket),
    decode and mixed program compiles without them, and one draw per row count serves them
    all."""
    raw_BV = logits_BV.astype(jnp.float32)
    adj_BV = adjust_logits(raw_BV, rows, seen)
    greedy_B = jnp.argmax(adj_BV, axis=-1).astype(jnp.int32)
    return with_logprobs(raw_BV, greedy_B, rows), (logits_BV, adj_BV if adjusts(rows) else None)


def draw(logits, seed, request_seeds_B, positions_B, rows):
    """Each row's own draw (``sample_rows``: its temperature, top-k, top-p and key) from a
    step's ``(logits, adjusted)`` (``step_tokens``); greedy rows take the argmax, as in the
    step. ``seed``: the engine's global seed (traced). The same tokens (and logprobs) as
    ``sample_step`` on the same logits."""
    logits_BV, adj_BV = logits
    raw_BV = logits_BV.astype(jnp.float32)
    tok_B = sample_rows(raw_BV if adj_BV is None else adj_BV, seed, request_seeds_B,
                        positions_B, rows)
    return with_logprobs(raw_BV, tok_B, rows)


def sample_step(logits_BV, seed, request_seeds_B, positions_B, rows, seen=None):
    """``step_tokens`` and ``draw`` in one trace: penalties and bias, then each row's own
    draw. ``rows``: ``row_settings``' arrays; ``seed``: the global seed, traced. Both are
    inputs, not constants, so one program serves every mix of settings and any engine seed.
    (The engine runs the two halves as two programs; tokens are the same.)"""
    return draw(step_tokens(logits_BV, rows, seen)[1], seed, request_seeds_B, positions_B,
                draw_rows(rows))
