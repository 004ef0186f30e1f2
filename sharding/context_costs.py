"""What each context-parallel scheme (``sharding.context``) keeps and moves, per layer and
per local sequence: the facts the planner (``triax.planner``) asks about context
parallelism, next to the schemes they describe.

With ``C`` devices on the context axis each holds ``T/C`` queries (and, for the ring, the
``T/C`` keys of its block); ``K``, ``H`` as the device holds them.

**Memory** (elements; the local kernel's own figures come from
``models.attention_memory``):

- ``all-gather``: the kernel named by the step's attention implementation runs on the
  local queries against all ``T`` keys (``gathered``); the whole K/V of the layer (2·T·K·H)
  exists for the moment of the kernel, kept by every kernel but ``reference`` (which keeps
  its repeated copies instead, so for it the gathered pair is transient).
- ``ring`` (``sharding.ring``, a flash-style custom VJP): the forward saves q, the local K/V
  block and o (the layer's own) plus the log-sum-exp (N per query); at most
  ``RING_BLOCKS_HELD`` K/V blocks are held at a time, in the backward each with its float32
  dK/dV (4 arrays of (T/C)·K·H per block), and each step folds its block in ``BLOCK_SIZE``
  keys at a time, so one key tile's score arrays (``attention_memory.tile_scores`` of the
  local block, the largest a step computes) are transient. No T × S scores are ever kept,
  whatever ``--attention`` says.

**Collectives** (per layer; ``(kind, elements per op, forward ops, backward ops, dtype)``,
dtype ``"compute"``, ``"float32"`` or ``"int32"``):

- ``all-gather``: K and V all-gathered forward (T·K·H each, the gathered output) and their
  gradients reduce-scattered backward (T·K·H each, the full input); the keys' order
  (int32) is gathered once per step (the layer scan hoists it: ``order_collective``);
- ``ring``: the stacked K/V block (2·(T/C)·K·H) and the keys' order ((T/C), int32) passed
  on C−1 times forward and again backward, where the block's float32 dK/dV accumulator
  travels with it and one last hop takes it home (C permutes).

``full`` remat reruns the forward's collectives in the backward.

    >>> [c[:4] for c in scheme_collectives("ring", seq=1024, context=4, kv_heads=2,
    ...                                    head_dim=8)]
    [('collective-permute', 8192.0, 3, 3), ('collective-permute', 256.0, 3, 3), ('collective-permute', 8192.0, 0, 4)]
    >>> scheme_collectives("all-gather", seq=1024, context=4, kv_heads=2, head_dim=8)
    [('all-gather', 16384, 2, 0, 'compute'), ('reduce-scatter', 16384, 0, 2, 'compute')]
"""
from __future__ import annotations

from triax.models.attention import BLOCK_SIZE
from triax.models.attention_memory import AttentionMemory, attention_memory, tile_scores
from triax.sharding.context import SCHEMES, check_scheme

RING_BLOCKS_HELD = 2       # "no device ever holds more than two K/V blocks" (sharding.ring)
RING_BACKWARD_BLOCK_ARRAYS = 4   # K, V and their float32 gradients, per held block


def scheme_memory(scheme: str, kernel: str, *, seq: int, context: int, heads: float,
                  kv_heads: float, head_dim: int, remat: str = "none") -> AttentionMemory:
    """One layer's attention memory for one local sequence (``seq / context`` queries).
    ``context == 1`` is the plain kernel on the whole sequence."""
    C = context
    if C == 1:
        return attention_memory(kernel, queries=seq, keys=seq, heads=heads,
                                kv_heads=kv_heads, head_dim=head_dim, remat=remat)
    check_scheme(scheme)
    Tq = seq / C
    N, K, H = heads, kv_heads, head_dim
    if scheme == "all-gather":
        own = attention_memory(kernel, queries=Tq, keys=seq, heads=N, kv_heads=K,
                               head_dim=H, remat=remat, gathered=True)
        if remat == "full" or kernel != "reference":
            return own
        return own + AttentionMemory(transient=2 * seq * K * H)   # the gathered K and V
    if remat == "full":
        return AttentionMemory()
    saved = 0.0 if remat in ("dots", "dots_no_batch") else N * Tq    # log-sum-exp
    blocks = RING_BLOCKS_HELD * RING_BACKWARD_BLOCK_ARRAYS * Tq * K * H
    return AttentionMemory(saved, blocks + tile_scores(N, Tq, Tq, BLOCK_SIZE))


def scheme_collectives(scheme: str, *, seq: int, context: int, kv_heads: float,
                       head_dim: int) -> list[tuple[str, float, int, int, str]]:
    """``[(kind, elements per op, forward ops, backward ops, dtype)]`` of one layer's
    attention over the context axis for one local sequence."""
    check_scheme(scheme)
    C = context
    if C == 1:
        return []
    if scheme == "all-gather":
        whole = seq * kv_heads * head_dim
        return [("all-gather", whole, 2, 0, "compute"), ("reduce-scatter", whole, 0, 2, "compute")]
    kv = 2 * seq / C * kv_heads * head_dim            # K and V stacked
    return [("collective-permute", kv, C - 1, C - 1, "compute"),
            ("collective-permute", seq / C, C - 1, C - 1, "int32"),   # the keys' order
            ("collective-permute", kv, 0, C, "float32")]               # dK/dV, then home


def order_collective(scheme: str, *, seq: int, context: int) -> tuple[str, float, int]:
    """``(kind, int32 elements per op, ops per step)``: the all-gather scheme gathers the
    keys' order once per step (the scan hoists it out of the layers); the ring passes it
    with each block (``scheme_collectives``)."""
    check_scheme(scheme)
    if context == 1 or scheme == "ring":
        return ("all-gather", 0.0, 0)
    return ("all-gather", float(seq), 1)


__all__ = ["RING_BACKWARD_BLOCK_ARRAYS", "RING_BLOCKS_HELD", "SCHEMES", "order_collective", "scheme_collectives",
           "scheme_memory"]
