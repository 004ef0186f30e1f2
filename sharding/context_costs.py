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
- ``ring`` (the flash-style custom VJP): the forward saves q, the local K/V block and o
  (the layer's own) plus the log-sum-exp (N per query); at most two K/V blocks are held at
  a time, in the backward each with its gradient (``RING_BACKWARD_ARRAYS`` arrays of
  (T/C)·K·H per block), and each step folds its block in ``BLOCK_SIZE`` keys at a time, so
  one key block's four score-sized arrays (N·(T/C)·min(BLOCK_SIZE, T/C)) are transient. No
  T × S scores are ever kept, whatever ``--attention`` says.

**Collectives** (per layer; ``(kind, elements per op, forward ops, backward ops)``):

- ``all-gather``: K and V all-gathered forward (T·K·H each, the gathered output) and their
  gradients reduce-scattered backward (T·K·H each, the full input);
- ``ring``: K and V passed on C−1 times forward (collective-permutes of (T/C)·K·H each);
  backward, K and V travel on with their gradients, ``RING_BACKWARD_ARRAYS`` arrays C−1
  times.

Each scheme also moves the keys' order (int32, once per step: the layer scan hoists it;
``order_collective``). ``full`` remat reruns the forward's collectives in the backward.

    >>> scheme_collectives("ring", seq=1024, context=4, kv_heads=2, head_dim=8)
    [('collective-permute', 4096.0, 6, 12)]
    >>> scheme_collectives("all-gather", seq=1024, context=4, kv_heads=2, head_dim=8)
    [('all-gather', 16384, 2, 0), ('reduce-scatter', 16384, 0, 2)]
"""
from __future__ import annotations

from triax.models.attention import BLOCK_SIZE
from triax.models.attention_memory import BLOCKWISE_BACKWARD_SCORES, AttentionMemory, \
    attention_memory
from triax.sharding.context import SCHEMES, check_scheme

# Arrays that cross each ring hop in the backward: the K/V block with its gradients (the
# custom VJP's backward, the `ring` branch). The autodiff ring before it passed dK and dV
# only (2): re-check against the compiled HLO (tests/test_planner_model.py) when it changes.
RING_BACKWARD_ARRAYS = 4
RING_BLOCKS_HELD = 2       # "no device ever holds more than two K/V blocks"


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
    blocks = RING_BLOCKS_HELD * RING_BACKWARD_ARRAYS * Tq * K * H
    scores = BLOCKWISE_BACKWARD_SCORES * N * Tq * min(BLOCK_SIZE, Tq)
    return AttentionMemory(saved, blocks + scores)


def scheme_collectives(scheme: str, *, seq: int, context: int, kv_heads: float,
                       head_dim: int) -> list[tuple[str, float, int, int]]:
    """``[(kind, elements per op, forward ops, backward ops)]`` of one layer's attention over
    the context axis for one local sequence (K/V in the compute dtype)."""
    check_scheme(scheme)
    C = context
    if C == 1:
        return []
    if scheme == "all-gather":
        whole = seq * kv_heads * head_dim
        return [("all-gather", whole, 2, 0), ("reduce-scatter", whole, 0, 2)]
    block = seq / C * kv_heads * head_dim
    return [("collective-permute", block, 2 * (C - 1), RING_BACKWARD_ARRAYS * (C - 1))]


def order_collective(scheme: str, *, seq: int, context: int) -> tuple[str, float, int]:
    """``(kind, int32 elements per op, ops per step)``: the keys' order array moved once per
    step (the scan hoists it out of the layers), gathered or passed around the ring."""
    check_scheme(scheme)
    if context == 1:
        return ("all-gather", 0.0, 0)
    if scheme == "all-gather":
        return ("all-gather", float(seq), 1)
    return ("collective-permute", seq / context, context - 1)


__all__ = ["RING_BACKWARD_ARRAYS", "SCHEMES", "order_collective", "scheme_collectives",
           "scheme_memory"]
