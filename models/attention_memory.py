"""What each attention implementation keeps in memory: the one home of that fact.

For one layer and one sequence, ``Tq`` queries against ``S`` keys, with ``N`` query heads,
``K`` KV heads and head dim ``H`` as the device holds them (the planner divides by
``tensor``). In elements (of the compute dtype), beyond what the attention *layer* keeps
whatever the kernel: 5·N·H + 3·K·H per token of its own (q, k and v around rope, the
kernel's operands, the output ``wo`` reads; ``triax.costs.memory``'s block formula, the
same for every kernel in ``memory_analysis``: ~1,390 elements per token of tiny with the
reference kernel at short T, blockwise and the ring alike).

- ``reference``: the scores and probabilities (2·N per query-key pair), saved by autodiff;
  its backward holds a third score-sized array while it runs (``SOFTMAX_BACKWARD_SCORES``,
  N per pair, transient);
- ``dot_product`` through XLA (``jax.nn.dot_product_attention`` without cuDNN): the same;
- ``cudnn`` (``dot_product`` on GPU where :func:`~triax.models.attention.cudnn_flash` holds): the softmax
  statistics only (N per query);
- ``blockwise``: the log-sum-exp (N per query); its backward recomputes each key tile's
  scores, so one tile's score-sized arrays (``TILE_BACKWARD_SCORES``: s, p, dp, ds of
  ``models.attention``'s block backward) of N·Tq·min(block, S) are transient.

When the kernel's keys are not the layer's own (``gathered``: context parallelism's
all-gathered K/V, S > Tq), it keeps its operands for the S − Tq keys beyond the layer's:
the reference kernel its GQA-repeated copies (2·N·H per key), the others K and V
(2·K·H per key).

Under ``remat="dots"`` only matmul outputs are saved: the reference and XLA kernels keep
their QK scores (N per pair), the fused kernels (cuDNN, blockwise's custom VJP) nothing.
``remat="full"`` keeps only the block input, nothing of attention.

Checked against ``memory_analysis`` of the compiled step in tests/test_planner_model.py
(reference, whole and under context parallelism) and bench/planner_verify.py.

    >>> m = attention_memory("reference", queries=128, keys=128, heads=8, kv_heads=2,
    ...                      head_dim=8)
    >>> m.saved == 2 * 8 * 128 * 128, m.transient == 8 * 128 * 128
    (True, True)
    >>> attention_memory("cudnn", queries=128, keys=128, heads=8, kv_heads=2,
    ...                  head_dim=8).saved
    1024.0
"""
from __future__ import annotations

from dataclasses import dataclass


from triax.models.attention import BLOCK_SIZE, cudnn_flash, resolve

KERNELS = ("reference", "dot_product", "cudnn", "blockwise")
# The one fitted figure here: the softmax backward of a materialised-score kernel holds
# three score-sized arrays per layer, the saved pair's and this one more (memory_analysis
# of tiny, data=8, 2 and 3 layers, T = 512 and 1024; the context-parallel rows checked in
# tests/test_planner_model.py were not fitted on).
SOFTMAX_BACKWARD_SCORES = 1
# Counted, not fitted: s, p, dp and ds of one key tile in the flash backward
# (models.attention's block backward; memory_analysis approaches it at long sequences).
TILE_BACKWARD_SCORES = 4


@dataclass(frozen=True)
class AttentionMemory:
    """Elements one layer's attention keeps for one sequence: ``saved`` from its forward for
    its backward, ``transient`` alive only while it runs (the backward's working set)."""

    saved: float = 0.0
    transient: float = 0.0

    def __add__(self, other: "AttentionMemory") -> "AttentionMemory":
        return AttentionMemory(self.saved + other.saved, self.transient + other.transient)


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


def tile_scores(heads: float, queries: float, keys: float, block: int = BLOCK_SIZE) -> float:
    """Elements of a flash backward's transient score arrays for one key tile."""
    return TILE_BACKWARD_SCORES * heads * queries * min(block, keys)


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
    extra_keys = max(S - Tq, 0.0) if gathered else 0.0
    operands = (2 * N * H if kernel == "reference" else 2 * K * H) * extra_keys
    if scores:
        return AttentionMemory(2 * N * Tq * S + operands, SOFTMAX_BACKWARD_SCORES * N * Tq * S)
    transient = tile_scores(N, Tq, S, block) if kernel == "blockwise" else 0.0
    return AttentionMemory(float(N * Tq + operands), transient)
