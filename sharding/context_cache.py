"""The KV cache split over the ``context`` mesh axis: prefill and decode under context
parallelism (the inference side of ``triax.sharding.context``).

**Layout (striped).** With C context ranks, cache position ``p`` lives on rank ``p % C`` at
local slot ``p // C``: rank r holds positions r, r+C, r+2C, … (:func:`striped_order`). Each
device keeps S/C of the cache's S positions, whatever the prompt's length, and a prompt of T
tokens (T a multiple of C) is split the same way, so every rank computes exactly the
positions it stores: the prefill writes its K/V into the cache with no communication. The
prompt is permuted once at the input (the tokens in the striped order, rotary positions
and ``Visibility`` carrying each token's position), as the training step's zigzag layout
is; striped chunks also balance the causal work (every rank's tokens spread over the whole
prompt: striped attention, Brandon et al. 2023).

**Prefill** (the new tokens fill the whole cache, the scratch cache of the prompt's length):
the queries, keys and values of the prompt stay split along the sequence; attention across
the split is the training hook's (``context_attention``: all-gather or ring), and each rank
writes its own K/V block into its cache slice.

**Decode** (fewer new tokens than cache positions): the new token's query, key and value are
whole on every context rank (one token does not split). The rank that owns its position
writes its K/V; every rank attends to its own S/C cache positions (``accumulate``), and the
C partial results are gathered over ``context`` and combined with the online-softmax
``merge``. What crosses ``context`` per layer is one query row's partial, ``[B, T, N, H]`` and
two ``[B, N, T]`` statistics from each rank, never the cache.

    >>> striped_order(8, 2).tolist()
    [0, 2, 4, 6, 1, 3, 5, 7]
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from triax.mesh.build import mesh_sizes
from triax.models.online_softmax import accumulate, combine, empty_partial, finish
from triax.models.visibility import Visibility
from triax.models.axes import constrain, using_constraint
from triax.models.decode import CACHE_AXES, CacheAttentionFn
from triax.sharding.context import (check_scheme, context_attention, context_axis, context_size,
                                    split_batch_axes)
from triax.sharding.rules import Rules, ShardingError

_SEQ = CACHE_AXES.index("kv_seq")   # the cache's positions dimension


def striped_order(T: int, C: int) -> np.ndarray:
    """Position held at each index of the striped layout of ``T`` positions over ``C``
    ranks: rank r's block (indices ``r·T/C …``) holds positions r, r+C, r+2C, …"""
    if T % C:
        raise ShardingError(f"{T} cache positions over context={C}: the striped layout needs "
                            f"a multiple of {C} (ContextCache.length rounds up)")
    return np.arange(T).reshape(T // C, C).T.reshape(T)


@dataclass(frozen=True)
class ContextCache:
    """The KV cache of a mesh with a context axis: its placement, the prompt's token order,
    the cached-attention hook and the prompt's write into decode slots."""

    mesh: Mesh
    rules: Rules
    scheme: str
    axis: str
    size: int
    rows: tuple[str, ...]   # batch mesh axes (size > 1): manual in the shard_maps too

    def length(self, n: int) -> int:
        """``n`` cache positions (or prompt tokens) rounded up to a multiple of C: the padded
        positions are never attended to (a query sees positions at or before its own)."""
        return -(-n // self.size) * self.size

    def order(self, T: int) -> np.ndarray:
        """The position of each of a ``T``-token prompt's tokens, in the order they enter."""
        return striped_order(T, self.size)

    def spec(self, shape) -> P:
        """``[L, B, S, K, H]``: the strategy's cache spec with S split over the context axis."""
        base = self.rules.spec(CACHE_AXES, shape, mesh_sizes(self.mesh), what="KV cache")
        parts = list(base) + [None] * (len(shape) - len(base))
        if parts[_SEQ] is not None:
            raise ShardingError(f"the rules map the cache's 'kv_seq' to {parts[_SEQ]!r}; under "
                                f"context parallelism the cache's positions go on "
                                f"{self.axis!r}: leave 'kv_seq' unmapped")
        if shape[_SEQ] % self.size:
            raise ShardingError(f"KV cache of {shape[_SEQ]} positions over {self.axis}="
                                f"{self.size}: round the length up with ContextCache.length")
        parts[_SEQ] = self.axis
        return P(*parts)

    def _specs(self):
        rows = self.rows or None
        return P(rows), P(rows, self.axis)   # whole over context, split along the sequence

    def _auto_constraint(self):
        """Inside a shard_map manual over context and the batch axes: the model's logical
        constraints resolved by the rules, with the manual axes left out."""
        manual = {self.axis, *self.rows}
        # As size 1 the manual axes drop out of every spec (the arrays here are their blocks).
        sizes = {a: 1 if a in manual else n for a, n in mesh_sizes(self.mesh).items()}

        def fn(x, logical_axes):
            spec = self.rules.spec(logical_axes, x.shape, sizes, what="activation")
            return jax.lax.with_sharding_constraint(
                x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))
        return fn

    def _write(self, cache, k_BTKH, v_BTKH, positions_BT):
        """Inside the shard_map: each new token whose position this rank owns goes to its
        local slot ``p // C``; the others are dropped (their owner writes them)."""
        rank = jax.lax.axis_index(self.axis)
        S = cache["k"].shape[1]
        slot_BT = jnp.where(positions_BT % self.size == rank, positions_BT // self.size, S)
        row_BT = jnp.broadcast_to(jnp.arange(slot_BT.shape[0])[:, None], slot_BT.shape)
        return {n: cache[n].at[row_BT, slot_BT].set(x.astype(cache[n].dtype), mode="drop")
                for n, x in (("k", k_BTKH), ("v", v_BTKH))}

    def attention_hook(self) -> CacheAttentionFn:
        """The ``models.decode.using_cache_attention`` hook for this layout."""
        attend = context_attention(self.mesh, self.rules, self.scheme)
        whole, split = self._specs()
        names = {self.axis, *self.rows}
        C, axis = self.size, self.axis

        def write_split(cache, k_BTKH, v_BTKH, positions_BT):   # the prompt: split as stored
            with using_constraint(None):
                return self._write(cache, k_BTKH, v_BTKH, positions_BT)

        def decode_local(q_BTNH, k_BTKH, v_BTKH, cache, positions_BT):
            # The automatic axes (tensor) keep the strategy's layout in here: unconstrained,
            # XLA split the cache's KV heads its own way and regathered the cache every layer.
            with using_constraint(self._auto_constraint()):
                cache = {n: constrain(c, CACHE_AXES[1:])
                         for n, c in self._write(cache, k_BTKH, v_BTKH, positions_BT).items()}
                B, S = cache["k"].shape[:2]
                rank = jax.lax.axis_index(axis)
                order_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) * C + rank, (B, S))
                part = accumulate(empty_partial(q_BTNH), q_BTNH,
                                  cache["k"].astype(q_BTNH.dtype),
                                  cache["v"].astype(q_BTNH.dtype),
                                  Visibility(positions_BT, order_BS))
                # Gathering the C partials and folding them with ``merge`` would do: but a
                # gather over a manual axis makes XLA replicate the automatic ones first
                # (the heads regathered over tensor); pmax and psum keep them split.
                whole_part = combine(part, functools.partial(jax.lax.pmax, axis_name=axis),
                                     functools.partial(jax.lax.psum, axis_name=axis))
                return finish(whole_part, q_BTNH.dtype), cache

        def hook(q_BTNH, k_BTKH, v_BTKH, cache, positions_BT, implementation: str):
            cache_specs = jax.tree.map(lambda _: split, cache)
            T = k_BTKH.shape[1]
            if T == cache["k"].shape[1]:
                if T % C:
                    raise ShardingError(f"a prompt of {T} tokens over {axis}={C}: pad it to "
                                        f"a multiple of {C} (ContextCache.length)")
                # The new tokens fill the cache: a prompt into its scratch cache. Attention is
                # self-attention over the prompt, split, through the context hook.
                cache = jax.shard_map(write_split, mesh=self.mesh, axis_names=names,
                                      in_specs=(cache_specs, split, split, split),
                                      out_specs=cache_specs)(cache, k_BTKH, v_BTKH,
                                                             positions_BT)
                vis = Visibility.self_attention(positions_BT)
                return attend(q_BTNH, k_BTKH, v_BTKH, vis, implementation), cache
            # Decode: each rank attends to its slice of the cache; the partials combine.
            return jax.shard_map(decode_local, mesh=self.mesh, axis_names=names,
                                 in_specs=(whole, whole, whole, cache_specs, whole),
                                 out_specs=(whole, cache_specs))(
                q_BTNH, k_BTKH, v_BTKH, cache, positions_BT)
        return hook

    def write_prompt(self, cache, scratch, slots_b):
        """``cache`` with the prompt's ``scratch`` cache ``[L, b, T, K, H]`` in decode slots
        ``slots_b`` (slots ``>= B`` dropped). Both are striped, so rank r's T/C prompt
        positions go to the first T/C local slots of its own S/C: seen as ``[L, B, C, S/C,
        K, H]``, the copy runs along the context-split dimension, with no communication."""
        C = self.size

        def write(c_LBSKH, s_LbTKH):
            L, B, S = c_LBSKH.shape[:3]
            c = c_LBSKH.reshape(L, B, C, S // C, *c_LBSKH.shape[3:])
            s = s_LbTKH.reshape(*s_LbTKH.shape[:2], C, -1, *s_LbTKH.shape[3:])
            c = c.at[:, slots_b, :, :s.shape[3]].set(s.astype(c.dtype), mode="drop")
            return c.reshape(c_LBSKH.shape)
        return {n: write(cache[n], scratch[n]) for n in cache}


def context_cache(mesh: Mesh, rules: Rules, scheme: str = "all-gather"
                  ) -> Optional[ContextCache]:
    """The context-split KV cache of ``mesh`` (None without a context axis)."""
    check_scheme(scheme)
    axis = context_axis(mesh, rules)
    if axis is None:
        return None
    return ContextCache(mesh, rules, scheme, axis, context_size(mesh, rules),
                        split_batch_axes(mesh, rules))
