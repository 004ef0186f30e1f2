"""Attention: one entry point and its kernels (the reference einsum, blockwise, XLA's or
cuDNN's ``dot_product_attention``), built from who sees whom (:mod:`.visibility`) and the
online-softmax pieces (:mod:`.online_softmax`) that blockwise and ring attention share; both
are re-exported here, where the model and the sharding layer import them.

**Hook**: context parallelism replaces the whole function while a step is traced (the
runtime's ``attention``, which the sharding layer sets: ``models.runtime``), as
``models.axes.constrain`` does for activation shardings: the model never names a mesh.

    >>> import jax.numpy as jnp
    >>> q = k = v = jnp.ones((1, 4, 2, 8))
    >>> attention(q, k, v, Visibility.causal(1, 4)).shape
    (1, 4, 2, 8)
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from triax import choices
from triax.models import runtime
from triax.models.online_softmax import (Partial, _scores, accumulate, empty_partial, finish,
                                         repeat_kv)
from triax.models.visibility import Visibility


def reference(q_BTNH, k_BSKH, v_BSKH, vis: Visibility):
    """Scores materialised for every query and key: the plain einsum definition."""
    N = q_BTNH.shape[2]
    k_BSNH, v_BSNH = repeat_kv(k_BSKH, N), repeat_kv(v_BSKH, N)
    p_BNTS = jax.nn.softmax(_scores(q_BTNH, k_BSNH, vis.mask()), axis=-1).astype(v_BSNH.dtype)
    return jnp.einsum("BNTS,BSNH->BTNH", p_BNTS, v_BSNH)


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
    :func:`~triax.models.online_softmax.accumulate`), so scores held at once are
    ``[B, N, T, block]``. ``skip_masked``: a block no query sees (causal: every block after
    the queries) is skipped by a data-dependent ``lax.cond``; off, every block is computed
    (its mask still applied)."""
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
    """The cotangent of a :class:`~triax.models.visibility.Visibility` (integer arrays:
    float0 zeros)."""
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


def attention(q_BTNH, k_BSKH, v_BSKH, vis: Visibility, implementation: str = "reference"):
    """Grouped-query attention ``o_BTNH`` by the named implementation, or by the hook that
    a parallelism set as the runtime's ``attention`` (it receives the same arguments)."""
    hook = runtime.current().attention
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
