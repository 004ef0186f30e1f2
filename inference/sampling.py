"""Next-token sampling: greedy, temperature, top-k, top-p, seeded per request.

Each row draws with its own key, ``fold_in(fold_in(PRNGKey(seed), request_seed), position)``,
so a request's tokens depend only on the request, never on which slot, replica or batch it
shares: results are independent of arrival order.

    >>> cfg = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, seed=1)
    >>> SamplingConfig.greedy_config().greedy
    True
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


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

    def __post_init__(self):
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


def sample(logits_BV, cfg: SamplingConfig, request_seeds_B, positions_B):
    """Pick one token per row (traced inside the jitted prefill/decode)."""
    logits_BV = logits_BV.astype(jnp.float32)
    if cfg.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = _filter_top_p(_filter_top_k(logits_BV / cfg.temperature, cfg.top_k), cfg.top_p)
    keys = row_keys(cfg.seed, request_seeds_B, positions_B)
    return jax.vmap(jax.random.categorical)(keys, logits_BV).astype(jnp.int32)
