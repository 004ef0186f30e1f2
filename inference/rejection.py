"""Speculative decoding's acceptance rules, traced inside the verify program: which of a
row's proposed tokens the target keeps, and the token it emits after them.

A row fed its last token and ``n`` proposals ``d_1..d_n`` at positions ``L..L+n`` has the
target's logits at each; position ``i``'s (``p_i``, after the row's temperature, top-k and
top-p: ``sampling.filtered_logits``) is the distribution of the token at ``L+1+i``. Every
draw uses the key of the position it fills (``sampling.row_keys``), as plain decoding does.

**Coupled** (``coupled_accept``; proposals with no distribution of their own: n-gram
lookup): the target draws ``x_i`` from ``p_i`` with position ``L+1+i``'s key, exactly the
token plain decoding would draw there; ``d_{i+1}`` is kept iff it equals ``x_i``. This is the
rejection rule for a point-mass proposal (kept with probability ``p_i(d)``, else a draw from
``p_i`` without ``d``), so every token is the one plain decoding gives, greedy or sampled.

**Rejection** (``rejection_accept``; a draft model that drew ``d_i`` from ``q_i``): keep
``d_i`` with probability ``min(1, p(d)/q(d))`` (a uniform from the key folded with
``ACCEPT``); at the first rejection draw from ``norm(max(0, p - q))`` (key folded with
``RESIDUAL``); after ``n`` kept, the bonus token is drawn from ``p_n`` with the position's own
key. Each emitted token is then distributed as the target's (Leviathan et al. 2023); greedy
rows (point masses) keep ``d`` iff it is the argmax, so they emit plain decoding's tokens.

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[5, 7, 9]]); d = jnp.array([[5, 8]])
    >>> [a.tolist() for a in coupled_accept(x, d, jnp.array([2]))]  # keeps 5, not 8: then 7
    [[1], [[5, 7, 0]]]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from triax.inference.sampling import filtered_logits, row_keys, sample_rows

ACCEPT, RESIDUAL = 1, 2   # fold_in tags: the acceptance uniform, the residual draw


def leading(ok_BK, n_B):
    """How many of each row's first flags are all true, at most ``n_B``."""
    K = ok_BK.shape[1]
    ok = ok_BK & (jnp.arange(K)[None] < n_B[:, None])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def emitted(drafts_BK, a_B, last_B):
    """``[B, K+1]``: the ``a`` kept proposals, then the row's last token; 0 after it."""
    B, K = drafts_BK.shape
    i = jnp.arange(K + 1)[None]
    d = jnp.pad(drafts_BK, ((0, 0), (0, 1)))
    return jnp.where(i < a_B[:, None], d, jnp.where(i == a_B[:, None], last_B[:, None], 0))


def coupled_accept(x_BT, drafts_BK, n_B):
    """``(a_B, tokens_BT)`` for point-mass proposals: ``x_BT`` the target's own draws at
    each position; proposal ``i+1`` kept while it equals ``x_i``."""
    a_B = leading(x_BT[:, :-1] == drafts_BK, n_B)
    return a_B, emitted(drafts_BK, a_B, jnp.take_along_axis(x_BT, a_B[:, None], 1)[:, 0])


def _flat(x_BT):
    return x_BT.reshape(-1, *x_BT.shape[2:])


def per_position(rows: dict, T: int) -> dict:
    """A step's per-row sampling arrays repeated for each of ``T`` positions."""
    return {k: jnp.repeat(jnp.asarray(v), T, axis=0) for k, v in rows.items()}


def target_draws(logits_BTV, seed, seeds_B, base_B, rows):
    """Plain decoding's draw at every position (``base_B + 1 + i``'s key; ``seed``: the
    global seed, ``rows``: each row's settings, ``sampling.row_settings``)."""
    B, T = logits_BTV.shape[:2]
    pos = (base_B[:, None] + 1 + jnp.arange(T)[None]).reshape(-1)
    return sample_rows(_flat(logits_BTV).astype(jnp.float32), seed, jnp.repeat(seeds_B, T),
                       pos, per_position(rows, T)).reshape(B, T)


def probabilities(logits_XV, rows):
    """Each row's sampling distribution: the softmax of its filtered logits, or for a
    greedy row the point mass on its argmax."""
    logits_XV = logits_XV.astype(jnp.float32)
    hot = jax.nn.one_hot(jnp.argmax(logits_XV, axis=-1), logits_XV.shape[-1])
    soft = jax.nn.softmax(filtered_logits(logits_XV, rows), axis=-1)
    return jnp.where((rows["temperature"] > 0)[:, None], soft, hot)


def rejection_accept(logits_BTV, drafts_BK, q_BKV, n_B, seed, seeds_B, base_B, rows):
    """``(a_B, tokens_BT)`` for proposals drawn from ``q_BKV`` (each row's draft
    distribution at each position), by the rejection rule (module docstring)."""
    B, T, V = logits_BTV.shape
    K = T - 1
    p_BKV = probabilities(_flat(logits_BTV[:, :K]), per_position(rows, K)).reshape(B, K, V)
    pd = jnp.take_along_axis(p_BKV, drafts_BK[..., None], -1)[..., 0]
    qd = jnp.take_along_axis(q_BKV, drafts_BK[..., None], -1)[..., 0]
    pos_BK = base_B[:, None] + 1 + jnp.arange(K)[None]
    keys = row_keys(seed, jnp.repeat(seeds_B, K), pos_BK.reshape(-1))
    u_BK = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT)))(
        keys).reshape(B, K)
    a_B = leading(u_BK * qd < pd, n_B)
    resid_BKV = jnp.maximum(p_BKV - q_BKV, 0.0)
    resid_BKV = jnp.where(resid_BKV.sum(-1, keepdims=True) > 0, resid_BKV, p_BKV)
    fix_BK = jax.vmap(lambda k, r: jax.random.categorical(jax.random.fold_in(k, RESIDUAL),
                                                          jnp.log(r)))(
        keys, resid_BKV.reshape(B * K, V)).reshape(B, K).astype(jnp.int32)
    bonus_BT = target_draws(logits_BTV, seed, seeds_B, base_B, rows)
    def at(x):   # each row's entry at its accepted count
        return jnp.take_along_axis(x, jnp.minimum(a_B, x.shape[1] - 1)[:, None], 1)[:, 0]
    last_B = jnp.where(a_B < n_B, at(fix_BK), at(bonus_BT))
    return a_B, emitted(drafts_BK, a_B, last_B)
