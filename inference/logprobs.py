"""Log-probabilities under the model, computed on device inside the jitted step: of each
sampled token and the ``TOP_LOGPROBS`` likeliest (a request trims to its own count), and
of a prompt's own tokens (``echo``). They are the model's own distribution, the log-softmax
of its raw fp32 logits, before any temperature, filter, penalty or bias (vLLM's default),
so an evaluation harness scores continuations as the model does.

Rows ask with ``SamplingConfig(logprobs=True)`` / ``prompt_logprobs=True``; a step computes
them only when one of its rows asks (``logprob_rows``'s keys: one more compile per bucket,
never one per request).

    >>> import jax.numpy as jnp
    >>> out = with_logprobs(jnp.log(jnp.array([[0.5, 0.25, 0.25]])), jnp.array([1]),
    ...                     {"logprobs": None})
    >>> round(float(jnp.exp(out["logprob"][0])), 3), out["top_ids"][0, :2].tolist()
    (0.25, [0, 1])
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TOP_LOGPROBS = 20   # OpenAI's most top_logprobs; every asking row gets these, trimmed later


def logprob_rows(configs, prefill: bool = False) -> dict:
    """The flags of the rows that ask for log-probabilities (none ask: ``{}``)."""
    out = {}
    if any(c.logprobs for c in configs):
        out["logprobs"] = np.array([c.logprobs for c in configs], bool)
    if prefill and any(c.prompt_logprobs for c in configs):
        out["prompt_logprobs"] = np.array([c.prompt_logprobs for c in configs], bool)
    return out


def _top(lp_XV):
    k = min(TOP_LOGPROBS, lp_XV.shape[-1])
    top_lp, top_ids = jax.lax.top_k(lp_XV, k)
    return top_ids.astype(jnp.int32), top_lp


def with_logprobs(raw_BV, tok_B, rows: dict):
    """``tok_B`` alone, or (``rows["logprobs"]``) a dict: ``token``, its ``logprob`` and the
    ``top_ids`` / ``top_logprobs`` of each row, from the raw logits ``raw_BV``."""
    if "logprobs" not in rows:
        return tok_B
    lp_BV = jax.nn.log_softmax(raw_BV.astype(jnp.float32), axis=-1)
    top_ids, top_lp = _top(lp_BV)
    return {"token": tok_B, "top_ids": top_ids, "top_logprobs": top_lp,
            "logprob": jnp.take_along_axis(lp_BV, tok_B[:, None], axis=-1)[:, 0]}


def prompt_logprobs(logits_bTV, tokens_bT) -> dict:
    """Each prompt position's next token's log-probability (``prompt_logprob[:, t]`` is
    token t+1's, given tokens ..t) and the top ones there, from logits in token order."""
    lp_bTV = jax.nn.log_softmax(logits_bTV[:, :-1].astype(jnp.float32), axis=-1)
    top_ids, top_lp = _top(lp_bTV)
    return {"prompt_logprob": jnp.take_along_axis(lp_bTV, tokens_bT[:, 1:, None], axis=-1)[..., 0],
            "prompt_top_ids": top_ids, "prompt_top_logprobs": top_lp}


def scatter_rows(out, slots_B, n: int):
    """A step's outputs (an array or a dict of them, one row each) scattered to ``n`` slots
    (rows whose slot is ``n`` or more are padding: dropped)."""
    return jax.tree.map(lambda x: jnp.zeros((n, *x.shape[1:]), x.dtype).at[slots_B].set(
        x, mode="drop"), out)


def split_tokens(out) -> tuple[np.ndarray, dict | None]:
    """A step's fetched outputs as (tokens, the rest or None)."""
    if isinstance(out, dict):
        return np.asarray(out["token"]), {k: np.asarray(v) for k, v in out.items()}
    return np.asarray(out), None


def row_entry(extra: dict | None, i: int) -> dict | None:
    """Row ``i``'s sampled-token log-probabilities: ``logprob`` and ``top`` as
    ``[(token id, logprob), ...]`` likeliest first (None: the step computed none)."""
    if extra is None or "logprob" not in extra:
        return None
    return {"logprob": float(extra["logprob"][i]),
            "top": list(zip(extra["top_ids"][i].tolist(), extra["top_logprobs"][i].tolist()))}


def prompt_entry(extra: dict | None, i: int, n_tokens: int) -> list | None:
    """Row ``i``'s prompt log-probabilities: one entry per prompt token after the first, as
    ``row_entry``'s (None: not computed)."""
    if extra is None or "prompt_logprob" not in extra:
        return None
    lp, ids, top = (extra[k][i] for k in ("prompt_logprob", "prompt_top_ids",
                                          "prompt_top_logprobs"))
    return [{"logprob": float(lp[t]), "top": list(zip(ids[t].tolist(), top[t].tolist()))}
            for t in range(n_tokens - 1)]
