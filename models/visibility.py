"""Who sees whom in attention, described rather than stored: a query sees a key when the
key's *order* (its index in the causal stream) is at or before the query's and, for packed
documents, both carry the same segment id (padding is segment 0). No ``[B, T, S]`` mask
exists until a kernel asks for one (:meth:`Visibility.mask`, for any block of queries and
keys).

    >>> Visibility.causal(1, 3).mask().astype(int)[0]
    Array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]], dtype=int32)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Visibility:
    """Which keys each query sees: ``k_order <= q_order`` and equal segments (when given)."""

    q_order_BT: jax.Array
    k_order_BS: jax.Array
    q_segment_BT: Optional[jax.Array] = None
    k_segment_BS: Optional[jax.Array] = None
    # Static: both orders are 0..T-1 and there are no segments, so the mask is the lower
    # triangle and a fused kernel may use its own causal mask (``is_causal``). Set only by
    # :meth:`causal`; a Visibility built or sliced any other way must leave it False.
    plain_causal: bool = field(default=False, metadata=dict(static=True))

    @classmethod
    def causal(cls, B: int, T: int) -> "Visibility":
        order_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return cls(order_BT, order_BT, plain_causal=True)

    @classmethod
    def self_attention(cls, order_BT, segment_BT=None) -> "Visibility":
        """Queries and keys are the same tokens (training, prefill without a cache)."""
        return cls(order_BT, order_BT, segment_BT, segment_BT)

    @classmethod
    def cache(cls, positions_BT, length: int) -> "Visibility":
        """Queries at their cache positions against every slot ``0..length-1``."""
        slots_BS = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32),
                                    (positions_BT.shape[0], length))
        return cls(positions_BT, slots_BS)

    def mask(self) -> jax.Array:
        """``bool[B, T, S]``: True where a query may see a key."""
        m = self.k_order_BS[:, None, :] <= self.q_order_BT[:, :, None]
        if self.q_segment_BT is not None:
            m = m & (self.q_segment_BT[:, :, None] == self.k_segment_BS[:, None, :])
        return m

    def keys(self, k_order_BS, k_segment_BS=None) -> "Visibility":
        """The same queries against another block of keys (blockwise and ring attention)."""
        return Visibility(self.q_order_BT, k_order_BS, self.q_segment_BT, k_segment_BS)


def packed_visibility(segment_ids_BT, order_BT=None) -> Optional[Visibility]:
    """Causal attention inside each packed document (``triax.training.packing``), in the
    causal order ``order_BT`` when the tokens are permuted (context parallelism's zigzag
    layout) or else 0…T−1; None (plain causal) when the batch packs and permutes nothing."""
    if order_BT is not None:
        return Visibility.self_attention(order_BT, segment_ids_BT)
    if segment_ids_BT is None:
        return None
    B, T = segment_ids_BT.shape
    return Visibility.self_attention(Visibility.causal(B, T).q_order_BT, segment_ids_BT)
