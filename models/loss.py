"""The token loss, written once: a weighted sum of next-token negative log-likelihoods.

The train step divides the sum by the batch's total weight (:func:`cross_entropy`); a pipeline
stage multiplies its micro-batch's sum by ``1 / total weight`` of the whole batch, so the
micro-batches add up to the same mean.

    >>> import jax.numpy as jnp
    >>> logits_BTV = jnp.zeros((1, 2, 4))              # uniform over 4 tokens
    >>> round(float(cross_entropy(logits_BTV, jnp.zeros((1, 2), jnp.int32))), 4)
    1.3863

At long sequences the fp32 logits dominate a step's memory (llama3-8b at 131,072 tokens:
67 GB for one sequence, three times over with log-probabilities and their gradient).
:func:`head_nll_sum` runs the head and the loss over ``chunks`` slices of the sequence, one
at a time, and recomputes a slice's logits in the backward, so only one slice's logits are
ever alive; the price is the head's forward once more (:func:`chunk_recompute_flops`).

    >>> head = lambda x_BTD: jnp.zeros(x_BTD.shape[:2] + (4,))
    >>> x_BTD, t_BT = jnp.ones((1, 8, 3)), jnp.zeros((1, 8), jnp.int32)
    >>> bool(jnp.allclose(head_nll_sum(head, x_BTD, t_BT, chunks=4),
    ...                   weighted_nll_sum(head(x_BTD), t_BT)))
    True
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


def loss_denominator(targets_BT, weights_BT=None):
    """What the summed loss is divided by: the tokens, or their total weight (at least 1)."""
    if weights_BT is None:
        return jnp.float32(targets_BT.size)
    return jnp.maximum(jnp.sum(weights_BT.astype(jnp.float32)), 1.0)


def cross_entropy(logits_BTV, targets_BT, weights_BT=None):
    """Mean next-token cross-entropy in fp32 (weights mask padding)."""
    return (weighted_nll_sum(logits_BTV, targets_BT, weights_BT)
            / loss_denominator(targets_BT, weights_BT))


def check_loss_chunks(chunks: int, seq_len: int) -> None:
    """A clear error for a chunk count that does not split the sequence."""
    if chunks < 1 or seq_len % chunks:
        raise ValueError(f"--loss-chunks {chunks}: must be ≥ 1 and divide the sequence length "
                         f"{seq_len}; choose a divisor of {seq_len} (1 computes the whole "
                         f"sequence's logits at once)")


def head_nll_sum(head, x_BTD, targets_BT, weights_BT=None, chunks: int = 1):
    """``weighted_nll_sum(head(x_BTD), targets_BT, weights_BT)``, with the logits of only
    ``T / chunks`` positions of each sequence alive at once (``chunks`` = 1: all at once).

    Chunk ``j`` holds positions ``j, j + chunks, j + 2·chunks, …``: strided, not contiguous,
    so the sequence's sharding (over ``context``, and ``tensor`` under sequence
    parallelism) stays on the major axis of the split and every device keeps its own
    positions; the loss of a token does not depend on its neighbours. Each chunk is
    rematerialised, so the backward keeps only the chunk's hidden states."""
    if chunks == 1:
        return weighted_nll_sum(head(x_BTD), targets_BT, weights_BT)
    B, T = targets_BT.shape
    check_loss_chunks(chunks, T)

    def split(a):   # [B, T, ...] -> [chunks, B, T / chunks, ...]
        a = a.reshape((B, T // chunks, chunks) + a.shape[2:])
        return jnp.moveaxis(a, 2, 0)

    @jax.checkpoint
    def one(total, xs):
        x, t, w = xs
        return total + weighted_nll_sum(head(x), t, w), None
    pieces = (split(x_BTD), split(targets_BT), None if weights_BT is None else split(weights_BT))
    return jax.lax.scan(one, jnp.zeros((), jnp.float32), pieces)[0]


def chunk_recompute_flops(embed_dim: int, vocab_size: int, chunks: int) -> float:
    """FLOPs per token that ``chunks`` > 1 adds to a train step: the head's matmul once more
    in the backward (the rematerialised chunk's logits)."""
    return 0.0 if chunks == 1 else 2.0 * embed_dim * vocab_size
