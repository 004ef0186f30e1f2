"""Attention: one entry point, masks described rather than stored, and the online-softmax
pieces that blockwise and ring attention are built from.

**Who sees whom** (:class:`Visibility`): a query sees a key when the key's *order* (its
index in the causal stream) is at or before the query's, and, for packed documents, both
carry the same segment id (padding is segment 0). Self-attention uses one order and one
segment array for both sides; decode against a KV cache uses the queries' cache positions
and the slot indices. No ``[B, T, S]`` mask exists until an implementation asks for one
(:meth:`Visibility.mask`, for any block of queries and keys).

**Online softmax** (:func:`empty_partial`, :func:`accumulate`, :func:`finish`; partials over
disjoint keys combine by :func:`merge`, or across devices by :func:`combine`): attention
over keys seen one block at a time, carrying an unnormalised output with the running max
and sum of every query row, so a kernel never holds more than one block's scores. Blockwise
attention scans these over key blocks; ring attention (context parallelism) applies them to
the K/V blocks passed around the ring.

**Hook**: context parallelism replaces the whole function while a step is traced
(:func:`using_attention`, installed by the sharding layer), as ``models.axes.constrain`` does
for activation shardings: the model never names a mesh.

    >>> import jax.numpy as jnp
    >>> q = k = v = jnp.ones((1, 4, 2, 8))
    >>> attention(q, k, v, Visibility.causal(1, 4)).shape
    (1, 4, 2, 8)
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from triax import choices
from triax.models.axes import constrain

# Masked scores: the most negative finite float, so a row never meets inf - inf.
_MASKED = float(jnp.finfo(jnp.float32).min)


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


def repeat_kv(x_BSKH, num_heads: int):
    """KV heads repeated to the query heads (query head ``n`` reads KV head ``n // G``), local
    on every tensor rank whether KV heads are sharded or replicated."""
    G = num_heads // x_BSKH.shape[2]
    x_BSNH = jnp.repeat(x_BSKH, G, axis=2)
    return constrain(x_BSNH, ("batch", "kv_seq", "act_heads", "act_head_dim"))


def _scores(q_BTNH, k_BSNH, visible_BTS):
    scale = 1.0 / math.sqrt(q_BTNH.shape[-1])
    s_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH).astype(jnp.float32) * scale
    return jnp.where(visible_BTS[:, None, :, :], s_BNTS, _MASKED)


def reference(q_BTNH, k_BSKH, v_BSKH, vis: Visibility):
    """Scores materialised for every query and key: the plain einsum definition."""
    N = q_BTNH.shape[2]
    k_BSNH, v_BSNH = repeat_kv(k_BSKH, N), repeat_kv(v_BSKH, N)
    p_BNTS = jax.nn.softmax(_scores(q_BTNH, k_BSNH, vis.mask()), axis=-1).astype(v_BSNH.dtype)
    return jnp.einsum("BNTS,BSNH->BTNH", p_BNTS, v_BSNH)


class Partial(NamedTuple):
    """Attention over the keys seen so far: unnormalised output, running row max and sum."""

    o_BTNH: jax.Array   # float32, sum over seen keys of exp(s - m) v
    m_BNT: jax.Array    # running max of visible scores (_MASKED while none is visible)
    l_BNT: jax.Array    # running sum of exp(s - m) over visible keys


def empty_partial(q_BTNH) -> Partial:
    """The partial of queries ``q_BTNH`` that have seen no key yet. Built ``_like`` q, so
    inside a ``shard_map`` it varies over the same manual axes (a scan carry must)."""
    B, T, N, H = q_BTNH.shape
    return Partial(jnp.zeros_like(q_BTNH, jnp.float32),
                   jnp.full_like(q_BTNH, _MASKED, jnp.float32, shape=(B, N, T)),
                   jnp.zeros_like(q_BTNH, jnp.float32, shape=(B, N, T)))


def accumulate(part: Partial, q_BTNH, k_BSKH, v_BSKH, vis: Visibility) -> Partial:
    """Fold one block of keys/values (``vis`` names their order/segments) into ``part``."""
    N = q_BTNH.shape[2]
    k_BSNH, v_BSNH = repeat_kv(k_BSKH, N), repeat_kv(v_BSKH, N)
    visible_BTS = vis.mask()
    s_BNTS = _scores(q_BTNH, k_BSNH, visible_BTS)
    m_BNT = jnp.maximum(part.m_BNT, s_BNTS.max(axis=-1))
    # Masked entries add nothing, also while a row has seen no visible key yet (m = _MASKED).
    p_BNTS = jnp.where(visible_BTS[:, None], jnp.exp(s_BNTS - m_BNT[..., None]), 0.0)
    correction_BNT = jnp.exp(part.m_BNT - m_BNT)
    l_BNT = part.l_BNT * correction_BNT + p_BNTS.sum(axis=-1)
    pv_BTNH = jnp.einsum("BNTS,BSNH->BTNH", p_BNTS.astype(v_BSNH.dtype), v_BSNH)
    o_BTNH = part.o_BTNH * correction_BNT.transpose(0, 2, 1)[..., None] + pv_BTNH
    return Partial(o_BTNH, m_BNT, l_BNT)


def combine(parts: Partial, reduce_max: Callable, reduce_sum: Callable) -> Partial:
    """Partials over disjoint key sets combined into one over their union; the sets lie
    along whatever ``reduce_max``/``reduce_sum`` reduce: a stacked leading axis
    (:func:`merge`), or a mesh axis (``lax.pmax``/``lax.psum``, one set per device)."""
    m_BNT = reduce_max(parts.m_BNT)
    c_BNT = jnp.exp(parts.m_BNT - m_BNT)   # each set rescaled to the common max
    o_BTNH = reduce_sum(parts.o_BTNH * jnp.swapaxes(c_BNT, -1, -2)[..., None])
    return Partial(o_BTNH, m_BNT, reduce_sum(parts.l_BNT * c_BNT))


def merge(a: Partial, b: Partial) -> Partial:
    """Two partials over disjoint key sets combined into one over their union."""
    both = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
    out = combine(both, lambda x: x.max(axis=0, keepdims=True),
                  lambda x: x.sum(axis=0, keepdims=True))
    return jax.tree.map(lambda x: x[0], out)


def finish(part: Partial, dtype) -> jax.Array:
    """``o_BTNH`` normalised; a row that saw no key at all is zero (never met in self- or
    cache attention, where a query always sees itself)."""
    l_BTN = part.l_BNT.transpose(0, 2, 1)
    safe = jnp.where(l_BTN > 0, l_BTN, 1.0)
    return (part.o_BTNH / safe[..., None]).astype(dtype)


# ---- blockwise (flash-style) attention -------------------------------------------------

BLOCK_SIZE = 512   # keys per block: scores held at once are [B, N, T, BLOCK_SIZE]
_NEVER = jnp.iinfo(jnp.int32).max   # order of padding keys: after every query


def _key_blocks(k_BSKH, v_BSKH, vis: Visibility, block: int):
    """Keys, values and their order/segments as ``[nb, ...]`` stacks of ``block`` keys; S is
    padded up to a multiple of ``block`` with keys that no query sees (order ``_NEVER``)."""
    S = k_BSKH.shape[1]
    pad = -S % block

    def stack(x, fill):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(x.shape[0], -1, block, *x.shape[2:]), 1, 0)

    seg = None if vis.k_segment_BS is None else stack(vis.k_segment_BS, 0)
    return stack(k_BSKH, 0), stack(v_BSKH, 0), stack(vis.k_order_BS, _NEVER), seg


def log_sum_exp(part: Partial) -> jax.Array:
    """``lse_BNT``, the log-sum-exp of each row's visible scores (what a backward recomputes
    the probabilities from); +inf for a row that saw no key (its probabilities are 0)."""
    return jnp.where(part.l_BNT > 0, part.m_BNT + jnp.log(part.l_BNT), jnp.inf)


def fold_blocks(part: Partial, q_BTNH, k_BSKH, v_BSKH, vis: Visibility, block: int,
                skip_masked: bool = True) -> Partial:
    """``part`` with the keys ``k``/``v`` folded in ``block`` keys at a time (a scan of
    :func:`accumulate`), so scores held at once are ``[B, N, T, block]``. ``skip_masked``:
    a block no query sees (causal: every block after the queries) is skipped by a
    data-dependent ``lax.cond``; off, every block is computed (its mask still applied)."""
    ks, vs, orders, segs = _key_blocks(k_BSKH, v_BSKH, vis, block)

    def step(part, blk):
        k, v, order, seg = blk
        bvis = vis.keys(order, seg)
        if not skip_masked:
            return accumulate(part, q_BTNH, k, v, bvis), None
        part = jax.lax.cond(bvis.mask().any(),
                            lambda p: accumulate(p, q_BTNH, k, v, bvis), lambda p: p, part)
        return part, None

    return jax.lax.scan(step, part, (ks, vs, orders, segs))[0]


def out_grad_dot(do_BTNH, o_BTNH) -> jax.Array:
    """``d_BNT = Σ_j P_ij dP_ij = do_i · o_i`` (float32), the softmax backward's row term."""
    return jnp.einsum("BTNH,BTNH->BNT", do_BTNH.astype(jnp.float32), o_BTNH.astype(jnp.float32))


def block_grads(q_BTNH, k_BSKH, v_BSKH, vis: Visibility, do_BTNH, lse_BNT, d_BNT):
    """FlashAttention-2's backward for one block of keys: the block's probabilities
    recomputed from q, k and the rows' saved log-sum-exp, nothing of size T × S kept.
    Returns float32 ``(dq_BTNH, dk_BSKH, dv_BSKH)``: this block's part of dq (to add over
    blocks) and the whole of the block's dk and dv for these queries. ``do`` in q's dtype."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    scale = 1.0 / math.sqrt(H)
    f32 = partial(jnp.einsum, preferred_element_type=jnp.float32)
    visible_BTS = vis.mask()
    k_BSNH, v_BSNH = repeat_kv(k_BSKH, N), repeat_kv(v_BSKH, N)
    s_BNTS = _scores(q_BTNH, k_BSNH, visible_BTS)
    p_BNTS = jnp.where(visible_BTS[:, None], jnp.exp(s_BNTS - lse_BNT[..., None]), 0.0)
    dv_BSNH = f32("BNTS,BTNH->BSNH", p_BNTS.astype(do_BTNH.dtype), do_BTNH)
    dp_BNTS = f32("BTNH,BSNH->BNTS", do_BTNH, v_BSNH)
    ds_BNTS = (p_BNTS * (dp_BNTS - d_BNT[..., None]) * scale).astype(q_BTNH.dtype)
    dq_BTNH = f32("BNTS,BSNH->BTNH", ds_BNTS, k_BSNH)
    dk_BSNH = f32("BNTS,BTNH->BSNH", ds_BNTS, q_BTNH)
    # query head n read KV head n // G: its gradient sums over the G query heads
    group = lambda x: x.reshape(*x.shape[:2], K, N // K, H).sum(axis=3)  # noqa: E731
    return dq_BTNH, group(dk_BSNH), group(dv_BSNH)


def grad_blocks(q_BTNH, k_BSKH, v_BSKH, vis: Visibility, do_BTNH, lse_BNT, d_BNT,
                block: int, skip_masked: bool = True):
    """:func:`block_grads` scanned over ``block`` keys at a time (skipping, with
    ``skip_masked``, a block no query sees, as :func:`fold_blocks` does): float32
    ``(dq_BTNH, dk_BSKH, dv_BSKH)`` of these queries against all of ``k``/``v``."""
    B, S, K, H = k_BSKH.shape
    ks, vs, orders, segs = _key_blocks(k_BSKH, v_BSKH, vis, block)

    def step(dq_BTNH, blk):
        k, v, order, seg = blk
        bvis = vis.keys(order, seg)

        def run(dq):
            dq_blk, dk, dv = block_grads(q_BTNH, k, v, bvis, do_BTNH, lse_BNT, d_BNT)
            return dq + dq_blk, (dk, dv)
        if not skip_masked:
            return run(dq_BTNH)
        zeros = jnp.zeros_like(k, jnp.float32)
        return jax.lax.cond(bvis.mask().any(), run, lambda dq: (dq, (zeros, zeros)), dq_BTNH)

    dq_BTNH, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(q_BTNH, jnp.float32),
                                     (ks, vs, orders, segs))
    unstack = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, -1, K, H)[:, :S]  # noqa: E731
    return dq_BTNH, unstack(dk), unstack(dv)


def tie_to_queries(q_BTNH, vis: Visibility):
    """``(q, vis)`` through one ``optimization_barrier``: for JAX the masks then depend on the
    queries. Inside a scan (the layer stack) a custom_vjp forward's work that depends only
    on loop invariants (the masks: orders, segments) is otherwise hoisted out of the scan
    when it is differentiated and computed for every key block at once, stacked: the
    ``[blocks, B, N, T, block]`` arrays this kernel exists to avoid."""
    return jax.lax.optimization_barrier((q_BTNH, vis))


def _forward(q_BTNH, k_BSKH, v_BSKH, vis: Visibility, block: int):
    """``(o_BTNH, lse_BNT)``: the online softmax scanned over key blocks."""
    q_BTNH, vis = tie_to_queries(q_BTNH, vis)
    part = fold_blocks(empty_partial(q_BTNH), q_BTNH, k_BSKH, v_BSKH, vis, block)
    return finish(part, q_BTNH.dtype), log_sum_exp(part)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(q_BTNH, k_BSKH, v_BSKH, vis: Visibility, block: int):
    return _forward(q_BTNH, k_BSKH, v_BSKH, vis, block)[0]


def _blockwise_fwd(q_BTNH, k_BSKH, v_BSKH, vis, block):
    o_BTNH, lse_BNT = _forward(q_BTNH, k_BSKH, v_BSKH, vis, block)
    return o_BTNH, (q_BTNH, k_BSKH, v_BSKH, vis, o_BTNH, lse_BNT)


def no_grad(vis: Visibility):
    """The cotangent of a :class:`Visibility` (integer arrays: float0 zeros)."""
    return jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), vis)


def _blockwise_bwd(block, res, do_BTNH):
    """The backward by :func:`grad_blocks`: each key block's probabilities are recomputed
    from q, k and the saved log-sum-exp, so nothing of size T × S is ever stored."""
    q_BTNH, k_BSKH, v_BSKH, vis, o_BTNH, lse_BNT = res
    d_BNT = out_grad_dot(do_BTNH, o_BTNH)
    dq, dk, dv = grad_blocks(q_BTNH, k_BSKH, v_BSKH, vis, do_BTNH.astype(q_BTNH.dtype),
                             lse_BNT, d_BNT, block)
    return (dq.astype(q_BTNH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype),
            no_grad(vis))


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise(q_BTNH, k_BSKH, v_BSKH, vis: Visibility, block_size: int = BLOCK_SIZE):
    """Flash-style attention in plain JAX: a scan over blocks of ``block_size`` keys with the
    online softmax, and a custom backward that recomputes each block's scores, so forward
    and backward hold O(T · block_size) scores, never O(T · S). Any S works (the last block is
    padded with keys no query sees)."""
    if block_size < 1:
        raise ValueError(f"blockwise attention: block_size={block_size} must be ≥ 1")
    return _blockwise(q_BTNH, k_BSKH, v_BSKH, vis, min(block_size, k_BSKH.shape[1]))


# ---- jax.nn.dot_product_attention --------------------------------------------------------

def cudnn_flash(backend: str, dtype, head_dim: int, plain_causal: bool) -> bool:
    """Whether ``dot_product`` runs cuDNN's fused flash kernel on ``backend``: GPU, fp16/bf16,
    head dim a multiple of 8 up to 128 and the plain causal mask (its own; an explicit mask
    would be materialised). The planner asks it for backends other than this process's."""
    return (backend == "gpu" and plain_causal
            and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128)


def _cudnn_fits(q_BTNH, vis: Visibility) -> bool:
    return cudnn_flash(jax.default_backend(), q_BTNH.dtype, q_BTNH.shape[-1], vis.plain_causal)


def dot_product(q_BTNH, k_BSKH, v_BSKH, vis: Visibility):
    """``jax.nn.dot_product_attention``: cuDNN's fused flash attention where it fits
    (``_cudnn_fits``), XLA's otherwise (with the mask from ``vis``). GQA is native."""
    if _cudnn_fits(q_BTNH, vis):
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True,
                                            implementation="cudnn")
    if vis.plain_causal:
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True)
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=vis.mask()[:, None])


IMPLEMENTATIONS: dict[str, Callable] = {
    "reference": reference, "blockwise": blockwise, "dot_product": dot_product}

AttentionFn = Callable[..., jax.Array]  # (q_BTNH, k_BSKH, v_BSKH, vis, implementation)
_HOOK: contextvars.ContextVar[Optional[AttentionFn]] = contextvars.ContextVar(
    "triax_attention", default=None)


def attention(q_BTNH, k_BSKH, v_BSKH, vis: Visibility, implementation: str = "reference"):
    """Grouped-query attention ``o_BTNH`` by the named implementation, or by the hook that
    a parallelism installed (which receives the same arguments)."""
    hook = _HOOK.get()
    if hook is not None:
        return hook(q_BTNH, k_BSKH, v_BSKH, vis, implementation)
    return kernel(implementation)(q_BTNH, k_BSKH, v_BSKH, vis)


# What ``auto`` means per backend: cuDNN's fused kernel on GPU; on CPU the measurement in
# docs/training.md ("Attention implementations", bench/attention.py); other backends take
# the CPU choice.
AUTO = {"gpu": "dot_product", "cpu": "reference"}
CHOICES = choices.ATTENTION_CHOICES  # tests/test_attention_kernels.py: = ("auto", *IMPLEMENTATIONS)


def resolve(implementation: str, backend: Optional[str] = None) -> str:
    """The concrete implementation ``implementation`` names on ``backend`` (default: JAX's):
    ``auto`` becomes ``AUTO``'s choice; an unknown name is an error naming the choices."""
    if implementation == "auto":
        return AUTO.get(backend or jax.default_backend(), AUTO["cpu"])
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}: choose one of "
                         f"{', '.join(CHOICES)}")
    return implementation


def kernel(implementation: str) -> Callable:
    """The local attention function named ``implementation`` (``auto`` resolved)."""
    return IMPLEMENTATIONS[resolve(implementation)]


@contextlib.contextmanager
def using_attention(fn: Optional[AttentionFn]):
    """Route every :func:`attention` call through ``fn`` while the context is open."""
    token = _HOOK.set(fn)
    try:
        yield
    finally:
        _HOOK.reset(token)
