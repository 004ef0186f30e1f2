"""The token loss, written once: a weighted sum of next-token negative log-likelihoods.

The train step divides the sum by the batch's total weight (:func:`cross_entropy`); a pipeline
stage multiplies its micro-batch's sum by ``1 / total weight`` of the whole batch, so the
micro-batches add up to the same mean.

    >>> import jax.numpy as jnp
    >>> logits_BTV = jnp.zeros((1, 2, 4))              # uniform over 4 tokens
    >>> round(float(cross_entropy(logits_BTV, jnp.zeros((1, 2), jnp.int32))), 4)
    1.3863
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def weighted_nll_sum(logits_BTV, targets_BT, weights_BT=None):
    """``Σ weight · -log p(target)`` in fp32 (all weights 1 when ``weights_BT`` is None)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    if weights_BT is None:
        return jnp.sum(nll_BT)
    return jnp.sum(nll_BT * weights_BT.astype(jnp.float32))


def cross_entropy(logits_BTV, targets_BT, weights_BT=None):
    """Mean next-token cross-entropy in fp32 (weights mask padding)."""
    total = weighted_nll_sum(logits_BTV, targets_BT, weights_BT)
    if weights_BT is None:
        return total / targets_BT.size
    return total / jnp.maximum(jnp.sum(weights_BT.astype(jnp.float32)), 1.0)
