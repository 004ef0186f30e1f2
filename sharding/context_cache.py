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

**Paged pool** (what decode reads, ``models.decode``'s paged cache): every block's P
positions are striped inside it, place ``o`` at index ``(o % C)·P/C + o // C``, so split
over ``context`` rank r holds places r, r+C, … of every block: position p still lives on
rank ``p % C`` (P a multiple of C). The prompt's striped scratch enters the pool with no
communication (``models.decode.write_scratch`` with ``stripes=C``).

**Decode** (a paged cache): the new token's query, key and value are whole on every context
rank (one token does not split). The rank that owns its position writes its K/V into its
share of the block; every rank reads its share of the row's blocks through the block table
and attends to those positions (``accumulate``), and the C partial results are combined with
the online-softmax statistics. What crosses ``context`` per layer is one query row's
partial, ``[B, T, N, H]`` and two ``[B, N, T]`` statistics from each rank, never the cache.

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
from triax.models import runtime
from triax.models.online_softmax import accumulate, combine, empty_partial, finish
from triax.models.visibility import Visibility
from triax.models.decode import (CACHE_AXES, CacheAttentionFn, is_paged, pages,
                                 paged_write_read)
from triax.sharding.context import (check_scheme, context_attention, context_axis, context_size,
                                    split_batch_axes)
from triax.sharding.rules import Rules, ShardingError



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

    def spec(self, shape, axes=CACHE_AXES) -> P:
        """The strategy's spec of a cache with logical ``axes`` (``[L, B, S, K, H]``, or the
        paged pool's ``[L, G, N, P, K, H]``) with its positions (``kv_seq``) split over the
        context axis."""
        seq = axes.index("kv_seq")
        base = self.rules.spec(axes, shape, mesh_sizes(self.mesh), what="KV cache")
        parts = list(base) + [None] * (len(shape) - len(base))
        if parts[seq] is not None:
            raise ShardingError(f"the rules map the cache's 'kv_seq' to {parts[seq]!r}; under "
                                f"context parallelism the cache's positions go on "
                                f"{self.axis!r}: leave 'kv_seq' unmapped")
        if shape[seq] % self.size:
            raise ShardingError(f"KV cache of {shape[seq]} positions over {self.axis}="
                                f"{self.size}: round the length up with ContextCache.length")
        parts[seq] = self.axis
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

    def _write(self, cache, k_BTKH, v_BTKH, positions_BT):   # the prompt's scratch
        """Inside the shard_map: each new token whose position this rank owns goes to its
        local slot ``p // C``; the others are dropped (their owner writes them)."""
        rank = jax.lax.axis_index(self.axis)
        S = cache["k"].shape[1]
        slot_BT = jnp.where(positions_BT % self.size == rank, positions_BT // self.size, S)
        row_BT = jnp.broadcast_to(jnp.arange(slot_BT.shape[0])[:, None], slot_BT.shape)
        return {n: cache[n].at[row_BT, slot_BT].set(x.astype(cache[n].dtype), mode="drop")
                for n, x in (("k", k_BTKH), ("v", v_BTKH))}

    def attention_hook(self) -> CacheAttentionFn:
        """The runtime's ``cache_attention`` hook for this layout (``models.runtime``)."""
        attend = context_attention(self.mesh, self.rules, self.scheme)
        whole, split = self._specs()
        names = {self.axis, *self.rows}
        C, axis = self.size, self.axis

        def write_split(cache, k_BTKH, v_BTKH, positions_BT):   # the prompt: split as stored
            with runtime.using(constraint=None):
                return self._write(cache, k_BTKH, v_BTKH, positions_BT)

        def decode_local(q_BTNH, k_BTKH, v_BTKH, cache, positions_BT):
            # The automatic axes (tensor) keep the strategy's layout in here: unconstrained,
            # XLA split the cache's KV heads its own way and regathered the cache every layer.
            with runtime.using(constraint=self._auto_constraint()):
                rank = jax.lax.axis_index(axis)
                N, share = cache["k"].shape[1:3]   # blocks, the places of a block held here
                P = share * C
                block_BT, place_BT = pages(cache["table"], positions_BT, P)
                mine_BT = positions_BT % C == rank   # the owner writes; the others drop it
                pool, k_BSKH, v_BSKH = paged_write_read(
                    cache, k_BTKH, v_BTKH, jnp.where(mine_BT, block_BT, N), place_BT // C)
                B, M = cache["table"].shape
                # Table entry j, local place i: position j·P + i·C + rank.
                order_S = (jnp.arange(M, dtype=jnp.int32)[:, None] * P
                           + jnp.arange(share, dtype=jnp.int32)[None, :] * C + rank)
                part = accumulate(empty_partial(q_BTNH), q_BTNH,
                                  k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype),
                                  Visibility(positions_BT,
                                             jnp.broadcast_to(order_S.reshape(-1),
                                                              (B, M * share))))
                # Gathering the C partials and folding them with ``merge`` would do: but a
                # gather over a manual axis makes XLA replicate the automatic ones first
                # (the heads regathered over tensor); pmax and psum keep them split.
                whole_part = combine(part, functools.partial(jax.lax.pmax, axis_name=axis),
                                     functools.partial(jax.lax.psum, axis_name=axis))
                return finish(whole_part, q_BTNH.dtype), pool

        def hook(q_BTNH, k_BTKH, v_BTKH, cache, positions_BT, implementation: str):
            T = k_BTKH.shape[1]
            if is_paged(cache):
                # Decode: each rank attends to its share of the row's blocks; the partials
                # combine.
                rows = self.rows or None
                pool_spec = P(rows, None, axis)
                specs = {"k": pool_spec, "v": pool_spec, "table": P(rows)}
                o, pool = jax.shard_map(decode_local, mesh=self.mesh, axis_names=names,
                                        in_specs=(whole, whole, whole, specs, whole),
                                        out_specs=(whole, {"k": pool_spec, "v": pool_spec}))(
                    q_BTNH, k_BTKH, v_BTKH, cache, positions_BT)
                return o, {**pool, "table": cache["table"]}
            cache_specs = jax.tree.map(lambda _: split, cache)
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
            raise ShardingError(f"{T} new tokens into a cache of {cache['k'].shape[1]} "
                                f"positions over {axis}={C}: decode reads the paged pool "
                                f"(a cache with a block table, models.decode); a slot cache "
                                f"takes only a whole prompt")
        return hook


def context_cache(mesh: Mesh, rules: Rules, scheme: str = "all-gather"
                  ) -> Optional[ContextCache]:
    """The context-split KV cache of ``mesh`` (None without a context axis)."""
    check_scheme(scheme)
    axis = context_axis(mesh, rules)
    if axis is None:
        return None
    return ContextCache(mesh, rules, scheme, axis, context_size(mesh, rules),
                        split_batch_axes(mesh, rules))
