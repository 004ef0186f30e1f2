"""The KV cache: its layout and how new keys/values are written into it.

The cache is one pair of arrays per model, ``k_LBSKH`` and ``v_LBSKH`` (layers, batch rows,
cache positions, KV heads, head dim), with logical axes ``CACHE_AXES``. The forward that uses
it is the training forward: pass ``cache=`` to ``Transformer.__call__`` (or to
``models.protocol.run_stack``), and every block's attention writes the keys/values of its ``T`` new tokens at
``positions_BT`` and lets each query see every cache slot at or before its own position. Rows
are independent, so a batch mixes prompts of different lengths (and, in serving, requests at
different steps).

Slots after a row's current position may hold stale values from padding or an earlier
request; the cache's visibility (``models.visibility.Visibility.cache``) hides them, and they
are overwritten before any query can see them (a position is always written in the same call
that first attends to it).

**Paged** (what a serving engine holds): the cache is a pool of fixed-size blocks,
``k_LGNPKH`` / ``v_LGNPKH`` (layers, row groups, blocks per group, positions per block, KV
heads, head dim; logical axes ``PAGED_AXES``), and ``cache["table"]`` (``[L, B, M]``, the
same ``[B, M]`` for every layer) lists each row's blocks: position ``p`` of row ``b`` lives
in block ``table[b, p // P]`` at place ``p % P`` of the pool of ``b``'s group (the rows split
into G contiguous groups, one per data shard or pipeline micro-batch, each with its own
blocks). A table entry past the group's blocks (``N``) is no block: writes there are
dropped. Reading gathers a row's blocks into the ``[B, M·P, K, H]`` view of a slot cache and
attends with the same ``Visibility.cache``, so the math (and every token) is unchanged.
A **mixed** step (:func:`mixed_attention`) runs decode rows and one prompt chunk as one row
of tokens through every dense layer, and splits only attention by their block tables.

**Hook** (:func:`cached_attention`): writing a layer's new keys/values and attending over
its cache is one step that a parallelism may replace while tracing (the runtime's
``cache_attention``, as its ``attention`` replaces attention: ``models.runtime``): context
parallelism keeps the cache split along its positions
(``triax.sharding.context_cache``), which places entries and combines per-slice results its
own way. The model never names a mesh.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from triax.models import Transformer, config
    >>> model = Transformer(config.TINY, nnx.Rngs(0))
    >>> cache = init_cache(config.TINY, batch=2, length=32)
    >>> pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    >>> logits_BTV, aux, cache = model(jnp.zeros((2, 8), jnp.int32), pos, cache=cache)
    >>> cache["k"].shape
    (4, 2, 32, 2, 8)

Paged: row 0's position 3 goes to its block 2 (place 3), row 1's position 17 to its second
block, 3 (place 1); table entry 4 (no block) would be dropped.

    >>> pool = jnp.zeros((4, 1, 4, 16, 2, 8))                        # 1 group of 4 blocks
    >>> table = jnp.broadcast_to(jnp.array([[2, 4], [0, 3]]), (4, 2, 2))
    >>> paged = {"k": pool, "v": pool, "table": table}
    >>> _, _, paged = model(jnp.zeros((2, 1), jnp.int32), jnp.array([[3], [17]]), cache=paged)
    >>> [(int(b), int(p)) for b, p in zip(*jnp.nonzero(paged["k"][0, 0, :, :, 0, 0]))]
    [(2, 3), (3, 1)]
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from triax.models import runtime
from triax.models.attention import attention
from triax.models.visibility import Visibility
from triax.models.axes import constrain
from triax.models.config import ModelConfig

CACHE_AXES = ("layers", "batch", "kv_seq", "act_kv_heads", "act_head_dim")
Cache = dict  # {"k": [L, B, S, K, H], "v": [L, B, S, K, H]}; one layer's: [B, S, K, H]
#               paged: {"k": [L, G, N, P, K, H], "v": ..., "table": [L, B, M]}


def cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, ...]:
    return (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> Cache:
    shape = cache_shape(cfg, batch, length)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def write_rows(cache_BSKH, new_BTKH, start_B):
    """Write each row's ``T`` new entries at its own start position."""
    def one(c_SKH, n_TKH, s):
        return jax.lax.dynamic_update_slice_in_dim(c_SKH, n_TKH.astype(c_SKH.dtype), s, axis=0)
    return jax.vmap(one)(cache_BSKH, new_BTKH, start_B)


def write_layer(layer_cache: Cache, k_BTKH, v_BTKH, positions_BT) -> Cache:
    """One layer's cache with the new keys/values written; a row's new tokens sit at
    consecutive positions starting at ``positions_BT[:, 0]``."""
    start_B = positions_BT[:, 0]
    return {"k": constrain(write_rows(layer_cache["k"], k_BTKH, start_B), CACHE_AXES[1:]),
            "v": constrain(write_rows(layer_cache["v"], v_BTKH, start_B), CACHE_AXES[1:])}


PAGED_AXES = ("layers", "batch", "kv_blocks", "kv_seq", "act_kv_heads", "act_head_dim")


def is_paged(cache: Cache) -> bool:
    return "table" in cache


def pages(table_BM, positions_BT, block_size: int):
    """``(block_BT, place_BT)``: the block (from each row's table) and the place in it of
    every position."""
    index_BT = jnp.clip(positions_BT // block_size, 0, table_BM.shape[1] - 1)
    return jnp.take_along_axis(table_BM, index_BT, axis=1), positions_BT % block_size


def paged_write_read(layer_cache: Cache, k_BTKH, v_BTKH, block_BT, place_BT):
    """``(pool, k_BSKH, v_BSKH)``: the layer's pool ``{"k", "v"}: [G, N, P', K, H]`` with the
    new entries written at ``(block, place)`` of each row's group (``block >= N``: dropped),
    and every row's blocks read back through its table as ``S = M·P'`` positions in table
    order. P' is the positions of a block held here (all P, or a context rank's share).
    A quantized pool (``k_scale`` / ``v_scale``: int8 with a scale per block and KV head)
    is written through ``quantized_write`` and read dequantized, in float32."""
    table_BM = layer_cache["table"]
    G, B = layer_cache["k"].shape[0], table_BM.shape[0]
    quantized = "k_scale" in layer_cache

    def grouped(x):
        return x.reshape(G, B // G, *x.shape[1:])

    def one(pool_NPKH, scale_NK, new_bTKH, block_bT, place_bT, table_bM):
        if quantized:
            pool_NPKH, scale_NK = quantized_write(pool_NPKH, scale_NK, new_bTKH, block_bT,
                                                  place_bT)
        else:
            pool_NPKH = pool_NPKH.at[block_bT, place_bT].set(
                new_bTKH.astype(pool_NPKH.dtype), mode="drop")
        # Entries past the group's blocks are not read: clip, not fill (a NaN would poison
        # the masked weights' sum); the positions they stand for are hidden anyway.
        view_bMPKH = jnp.take(pool_NPKH, table_bM, axis=0, mode="clip")
        if quantized:
            view_bMPKH = dequantize(view_bMPKH, jnp.take(scale_NK, table_bM, axis=0,
                                                         mode="clip"))
        return pool_NPKH, scale_NK, view_bMPKH.reshape(view_bMPKH.shape[0], -1,
                                                       *view_bMPKH.shape[3:])

    out = {}
    for n, new in (("k", k_BTKH), ("v", v_BTKH)):
        scale = layer_cache[f"{n}_scale"] if quantized else jnp.zeros((G,), jnp.float32)
        pool, scale, view = jax.vmap(one)(layer_cache[n], scale, grouped(new),
                                          grouped(block_BT), grouped(place_BT),
                                          grouped(table_BM))
        # Both keep the strategy's layout: left free, XLA split the gathered view its own
        # way (KV heads replicated over tensor) and regathered it every layer.
        out[n] = constrain(pool, PAGED_AXES[1:])
        if quantized:
            out[f"{n}_scale"] = constrain(scale, SCALE_AXES[1:])
        out[f"{n}_view"] = constrain(view.reshape(B, *view.shape[2:]), CACHE_AXES[1:])
    return ({n: x for n, x in out.items() if not n.endswith("_view")}, out["k_view"],
            out["v_view"])


# ---- int8 pools: a float32 scale per block and KV head -------------------------------------
INT8_MAX = 127.0
SCALE_AXES = ("layers", "batch", "kv_blocks", "act_kv_heads")   # a pool's, less P and H


def dequantize(q_NPKH, scale_NK):
    """Int8 values times their block's per-head scale, in float32 (any leading dims)."""
    return q_NPKH.astype(jnp.float32) * scale_NK[..., None, :, None]


def quantize(x_NPKH, scale_NK):
    safe = jnp.where(scale_NK > 0, scale_NK, 1.0)[..., None, :, None]
    return jnp.clip(jnp.round(x_NPKH.astype(jnp.float32) / safe), -INT8_MAX,
                    INT8_MAX).astype(jnp.int8)


def quantized_write(pool_NPKH, scale_NK, new_bTKH, block_bT, place_bT):
    """An int8 pool of one group with new entries written at ``(block, place)``: each
    touched block's scale grows to cover them (a block entered at place 0 starts afresh:
    its old scale was a finished sequence's) and its entries are requantized to it."""
    N = pool_NPKH.shape[0]
    fresh_N = jnp.zeros(N, bool).at[block_bT].max(place_bT == 0, mode="drop")
    base_NK = jnp.where(fresh_N[:, None], 0.0, scale_NK)
    amax_bTK = jnp.max(jnp.abs(new_bTKH.astype(jnp.float32)), axis=-1) / INT8_MAX
    new_NK = base_NK.at[block_bT].max(amax_bTK, mode="drop")
    # Requantize only the blocks written (a whole-pool pass would read it all every step).
    old_bTPKH = dequantize(jnp.take(pool_NPKH, block_bT, axis=0, mode="clip"),
                           jnp.take(base_NK, block_bT, axis=0, mode="clip"))
    new_bTK = jnp.take(new_NK, block_bT, axis=0, mode="clip")
    pool_NPKH = pool_NPKH.at[block_bT].set(quantize(old_bTPKH, new_bTK), mode="drop")
    pool_NPKH = pool_NPKH.at[block_bT, place_bT].set(
        quantize(new_bTKH[..., None, :, :], new_bTK)[..., 0, :, :], mode="drop")
    return pool_NPKH, new_NK


def write_scratch(pool: Cache, scratch: Cache, table_bM, group_b,
                  stripes: int = 1, lengths_b=None) -> Cache:
    """The pool ``{"k", "v"}: [L, G, N, P, K, H]`` with each prefill row's scratch cache
    ``[L, b, T, K, H]`` written through its block table: position ``t`` to block
    ``table[t // P]``, place ``t % P``, of the row's group (a padding row's group ``>= G`` and
    table entries past the blocks are dropped).

    ``stripes`` C > 1: the scratch and every block are striped (context parallelism,
    ``triax.sharding.context_cache``): seen as ``[L, b, C, T/C, K, H]``, stripe c's j-th
    position ``j·C + c`` goes to table entry ``j // (P/C)``, place ``j % (P/C)`` of the
    block's stripe ``[..., C, P/C, ...]``; neither depends on c, so a pool split over the
    stripes is written with no communication.

    An int8 pool (``k_scale`` in it) takes each block's scale from the row's first
    ``lengths_b`` positions (padding would only coarsen it), unstriped."""
    C = stripes
    if "k_scale" in pool:
        return {**pool, **{n: x for k in ("k", "v") for n, x in zip(
            (k, f"{k}_scale"), _write_scratch_int8(pool[k], pool[f"{k}_scale"], scratch[k],
                                                   table_bM, group_b, lengths_b))}}

    def write(p_LGNPKH, s_LbTKH):
        L, G, N, Pb = p_LGNPKH.shape[:4]
        b, T = s_LbTKH.shape[1:3]
        p = p_LGNPKH.reshape(L, G, N, C, Pb // C, *p_LGNPKH.shape[4:])
        s = s_LbTKH.reshape(L, b, C, T // C, *s_LbTKH.shape[3:])
        j = jnp.arange(T // C)
        block_bJ = jnp.take(table_bM, j // (Pb // C), axis=1)
        group_bJ = jnp.broadcast_to(group_b[:, None], block_bJ.shape)
        place_bJ = jnp.broadcast_to((j % (Pb // C)).astype(jnp.int32), block_bJ.shape)
        # The indexed dimensions lead the update (numpy's rule): [b, J, L, C, K, H].
        p = p.at[:, group_bJ, block_bJ, :, place_bJ].set(
            s.transpose(1, 3, 0, 2, 4, 5).astype(p.dtype), mode="drop")
        return p.reshape(p_LGNPKH.shape)
    return {**pool, **{n: write(pool[n], scratch[n]) for n in ("k", "v")}}


def _write_scratch_int8(p_LGNPKH, scale_LGNK, s_LbTKH, table_bM, group_b, lengths_b):
    L, G, N, P = p_LGNPKH.shape[:4]
    b, T = s_LbTKH.shape[1:3]
    J = -(-T // P)   # the prompt's blocks (the bucket padded to whole blocks)
    s = jnp.pad(s_LbTKH.astype(jnp.float32), ((0, 0), (0, 0), (0, J * P - T), (0, 0), (0, 0)))
    if lengths_b is not None:
        s = jnp.where((jnp.arange(J * P)[None, :] < lengths_b[:, None])[None, :, :, None, None],
                      s, 0.0)
    s_LbJPKH = s.reshape(L, b, J, P, *s.shape[3:])
    scale_LbJK = jnp.max(jnp.abs(s_LbJPKH), axis=(3, 5)) / INT8_MAX
    q_LbJPKH = quantize(s_LbJPKH, scale_LbJK)
    block_bJ = jnp.take(table_bM, jnp.arange(J), axis=1, mode="fill", fill_value=N)
    group_bJ = jnp.broadcast_to(group_b[:, None], block_bJ.shape)
    # Adjacent indices stay in place (numpy's rule): the updates are [L, b, J, ...].
    p = p_LGNPKH.at[:, group_bJ, block_bJ].set(q_LbJPKH, mode="drop")
    scale = scale_LGNK.at[:, group_bJ, block_bJ].set(scale_LbJK, mode="drop")
    return p, scale


def read_prefix(pool: Cache, scratch: Cache, table_bM, group_b, start_b) -> Cache:
    """``scratch`` (``[L, b, S, K, H]``) with each row's first ``start_b`` positions read from
    the pool through its block table (dequantized from an int8 pool): a prompt whose first
    blocks are cached (``inference.prefix_cache``) attends to them and computes the rest.
    The rest of the scratch stays zero. Unstriped (no context split)."""
    G = pool["k"].shape[1]
    S = scratch["k"].shape[2]
    g_b = jnp.clip(group_b, 0, G - 1)   # padding rows: any group, all masked below
    keep_bS = jnp.arange(S)[None, :] < start_b[:, None]
    block_bM = jnp.clip(table_bM, 0, pool["k"].shape[2] - 1)   # no block: masked below
    out = {}
    for n in ("k", "v"):
        view = pool[n][:, g_b[:, None], block_bM]   # adjacent indices stay: [L, b, M, P, K, H]
        if f"{n}_scale" in pool:
            view = dequantize(view, pool[f"{n}_scale"][:, g_b[:, None], block_bM])
        L, b, M, P = view.shape[:4]
        view = view.reshape(L, b, M * P, *view.shape[4:])
        view = view[:, :, :S] if M * P >= S else jnp.pad(
            view, ((0, 0), (0, 0), (0, S - M * P), (0, 0), (0, 0)))
        out[n] = jnp.where(keep_bS[None, :, :, None, None], view.astype(scratch[n].dtype),
                           scratch[n])
    return out


def _paged_attention(q_BTNH, k_BTKH, v_BTKH, layer_cache, positions_BT, implementation,
                     end_B=None):
    """``end_B``: each row's first position not to write (its padding: no block, dropped)."""
    block_BT, place_BT = pages(layer_cache["table"], positions_BT, layer_cache["k"].shape[2])
    if end_B is not None:
        block_BT = jnp.where(positions_BT < end_B[:, None], block_BT, layer_cache["k"].shape[1])
    pool, k_BSKH, v_BSKH = paged_write_read(layer_cache, k_BTKH, v_BTKH, block_BT, place_BT)
    vis = Visibility.cache(positions_BT, k_BSKH.shape[1])
    o_BTNH = attention(q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), vis,
                       implementation)
    return o_BTNH, {**pool, "table": layer_cache["table"]}


MIXED_KEYS = ("chunk_table", "chunk_end")   # a mixed step's chunk row, beside "table"


def mixed_attention(q_1XNH, k_1XKH, v_1XKH, layer_cache, positions_1X, implementation):
    """A mixed step's attention (``layer_cache`` has ``chunk_table`` ``[1, M]`` and
    ``chunk_end`` ``[1]``): its one row of ``X = B + C`` tokens is ``B`` decode rows' single
    tokens (their tables: ``table`` ``[B, M]``) then one prompt chunk's ``C`` (positions from
    ``end`` on are padding: never written). Every dense layer ran once over all ``X``; only
    attention splits, each part through its own block table: the decode rows write and
    attend, then the chunk does (its blocks are its own: the two never share a written one)."""
    B = layer_cache["table"].shape[0]
    pool = {n: x for n, x in layer_cache.items() if n not in MIXED_KEYS}
    o_B1NH, pool = _paged_attention(*(x[0, :B, None] for x in (q_1XNH, k_1XKH, v_1XKH)),
                                    pool, positions_1X[0, :B, None], implementation)
    o_1CNH, pool = _paged_attention(q_1XNH[:, B:], k_1XKH[:, B:], v_1XKH[:, B:],
                                    {**pool, "table": layer_cache["chunk_table"]},
                                    positions_1X[:, B:], implementation,
                                    layer_cache["chunk_end"])
    o_1XNH = jnp.concatenate([o_B1NH[:, 0][None], o_1CNH], axis=1)
    return o_1XNH, {**pool, **{n: layer_cache[n] for n in ("table", *MIXED_KEYS)}}


# (q_BTNH, k_BTKH, v_BTKH, layer_cache, positions_BT, implementation) -> (o_BTNH, layer_cache)
CacheAttentionFn = Callable[..., tuple[jax.Array, Cache]]


def cached_attention(q_BTNH, k_BTKH, v_BTKH, layer_cache: Cache, positions_BT,
                     implementation: str = "reference"):
    """``(o_BTNH, layer_cache)``: the ``T`` new keys/values written at ``positions_BT``, then
    the queries attend over every cache slot at or before their position (through the
    block table of a paged cache); or whatever the runtime's ``cache_attention`` does with the
    same arguments (``models.runtime``)."""
    hook = runtime.current().cache_attention
    if hook is not None:
        return hook(q_BTNH, k_BTKH, v_BTKH, layer_cache, positions_BT, implementation)
    if "chunk_table" in layer_cache:   # a mixed prefill + decode step (inference.model_runner)
        return mixed_attention(q_BTNH, k_BTKH, v_BTKH, layer_cache, positions_BT,
                               implementation)
    if is_paged(layer_cache):
        return _paged_attention(q_BTNH, k_BTKH, v_BTKH, layer_cache, positions_BT,
                                implementation)
    layer_cache = write_layer(layer_cache, k_BTKH, v_BTKH, positions_BT)
    k_BSKH, v_BSKH = (layer_cache[n].astype(q_BTNH.dtype) for n in ("k", "v"))
    vis = Visibility.cache(positions_BT, k_BSKH.shape[1])
    return attention(q_BTNH, k_BSKH, v_BSKH, vis, implementation), layer_cache
