"""What each attention implementation keeps in memory: the one home of that fact.

For one layer and one sequence, ``Tq`` queries against ``S`` keys, with ``N`` query heads,
``K`` KV heads and head dim ``H`` as the device holds them (the planner divides by
``tensor``). Counted in elements (of the compute dtype) from the kernels in
:mod:`triax.models.attention`, beyond what the attention *layer* keeps whatever the kernel
(its projections' outputs q, k, v before and after rope, and the output o that ``wo`` reads):

- ``reference``: the GQA-repeated K and V (2·N·H per key) and the scores and probabilities
  (2·N per query-key pair), saved by autodiff; its backward holds a third score-sized array
  while it runs (``SOFTMAX_BACKWARD_SCORES``, N per pair transient);
- ``dot_product`` through XLA (``jax.nn.dot_product_attention`` without cuDNN): GQA is
  native (no repeated copies), the scores and probabilities are kept (2·N per pair), and
  the same transient;
- ``cudnn`` (``dot_product`` on GPU where :func:`cudnn_flash` holds): the softmax
  statistics only (N per query);
- ``blockwise``: the log-sum-exp (N per query); its backward recomputes each key block's
  scores, so one block's four score-sized arrays (s, p, dp, ds:
  ``models.attention._blockwise_bwd``) of N·Tq·min(block, S) are transient.

When the kernel's keys are not the layer's own (``gathered``: context parallelism's
all-gathered K/V), every kernel that keeps its K/V operands (all but ``reference``, which
keeps its repeated copies instead) keeps 2·K·H per gathered key besides.

Under ``remat="dots"`` only matmul outputs are saved: the reference and XLA kernels keep
their QK scores (N per pair), the fused kernels (cuDNN, blockwise's custom VJP) nothing.
``remat="full"`` keeps only the block input, nothing of attention.

Checked against ``memory_analysis`` of the compiled step in tests/test_planner_model.py
(reference and XLA's dot_product, whole and under context parallelism).

    >>> m = attention_memory("reference", queries=128, keys=128, heads=8, kv_heads=2,
    ...                      head_dim=8)
    >>> m.saved == 2 * 8 * 8 * 128 + 2 * 8 * 128 * 128, m.transient == 8 * 128 * 128
    (True, True)
    >>> attention_memory("cudnn", queries=128, keys=128, heads=8, kv_heads=2,
    ...                  head_dim=8).saved
    1024.0
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from triax.models.attention import BLOCK_SIZE, resolve

KERNELS = ("reference", "dot_product", "cudnn", "blockwise")
# The one fitted figure here: the softmax backward of a materialised-score kernel holds
# three score-sized arrays per layer, the saved pair's and this one more (memory_analysis
# of tiny, data=8, 2 and 3 layers, T = 512 and 1024; the context-parallel rows checked in
# tests/test_planner_model.py were not fitted on).
SOFTMAX_BACKWARD_SCORES = 1
BLOCKWISE_BACKWARD_SCORES = 4   # s, p, dp, ds of one key block (_blockwise_bwd)


@dataclass(frozen=True)
class AttentionMemory:
    """Elements one layer's attention keeps for one sequence: ``saved`` from its forward for
    its backward, ``transient`` alive only while it runs (the backward's working set)."""

    saved: float = 0.0
    transient: float = 0.0

    def __add__(self, other: "AttentionMemory") -> "AttentionMemory":
        return AttentionMemory(self.saved + other.saved, self.transient + other.transient)


def cudnn_flash(backend: str, dtype, head_dim: int, plain_causal: bool) -> bool:
    """Whether ``dot_product`` runs cuDNN's fused flash kernel: GPU, fp16/bf16, head dim a
    multiple of 8 up to 128 and the plain causal mask (the conditions of
    ``models.attention._cudnn_fits``, stated for a backend and dtype that need not be this
    process's)."""
    return (backend == "gpu" and plain_causal
            and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128)


def kernel_for(implementation: str, backend: str, dtype, head_dim: int,
               plain_causal: bool = True) -> str:
    """The kernel (one of ``KERNELS``) that ``implementation`` runs on ``backend``:
    ``auto`` resolved (``models.attention.resolve``), ``dot_product`` split into cuDNN's
    flash kernel and XLA's. ``plain_causal``: the mask is the plain lower triangle (false
    for packed documents and inside context parallelism, whose local blocks are not)."""
    impl = resolve(implementation, backend)
    if impl == "dot_product" and cudnn_flash(backend, dtype, head_dim, plain_causal):
        return "cudnn"
    return impl


def attention_memory(kernel: str, *, queries: float, keys: float, heads: float,
                     kv_heads: float, head_dim: int, remat: str = "none",
                     gathered: bool = False, block: int = BLOCK_SIZE) -> AttentionMemory:
    """What ``kernel`` keeps for ``queries`` queries against ``keys`` keys (one layer, one
    sequence; see the module docstring for each term)."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    N, K, H, Tq, S = heads, kv_heads, head_dim, queries, keys
    if remat == "full":
        return AttentionMemory()
    scores = kernel in ("reference", "dot_product")   # scores materialised and saved
    if remat in ("dots", "dots_no_batch"):
        return AttentionMemory(N * Tq * S if scores else 0.0)
    operands = 2 * K * H * S if gathered and kernel != "reference" else 0.0
    backward = SOFTMAX_BACKWARD_SCORES * N * Tq * S
    if kernel == "reference":
        return AttentionMemory(2 * N * H * S + 2 * N * Tq * S, backward)
    if kernel == "dot_product":
        return AttentionMemory(2 * N * Tq * S + operands, backward)
    transient = BLOCKWISE_BACKWARD_SCORES * N * Tq * min(block, S) \
        if kernel == "blockwise" else 0.0
    return AttentionMemory(N * Tq + operands, transient)
