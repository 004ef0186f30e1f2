"""Context parallelism: the sequence split over the ``context`` mesh axis, attention across it.

The rules map the activations' ``seq`` to ``context``, so every token-wise layer (norms,
MLPs, projections) works on its own T/C tokens and nothing else changes. Attention needs
every earlier key, so it goes through a hook (the runtime's ``attention``, ``models.runtime``) that
runs it in a ``shard_map`` manual over ``context`` by one of two schemes:

- **all-gather**: K and V (and their order/segment arrays) gathered over ``context``; the
  queries stay split. Simple; each device holds the whole K/V of one layer for a moment.
- **ring** (``sharding.ring``): each device keeps its K/V block and passes it on with
  ``ppermute``, C−1 times; every block arriving is folded into an online softmax, so no
  device ever holds more than two K/V blocks. A custom VJP runs the ring again backward
  (dK/dV travel with their blocks), and each step computes only the part of its block that
  the layout says is visible.

**Load balancing** (:func:`zigzag_order`): causally, later tokens see more keys, so with
contiguous chunks the last rank works about twice the mean. The step permutes the tokens
once at its input so that rank i holds chunks i and 2C−1−i (head and tail), and tells the
hook (``layout="zigzag"``): every ring step then costs every rank half a block.
``Visibility`` carries each token's original order, so masks stay right, and the loss, a
sum over tokens, needs no un-permuting.

    >>> zigzag_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
"""
from __future__ import annotations

import functools
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from triax import choices
from triax.mesh.build import mesh_sizes
from triax.models import runtime
from triax.models.attention import BLOCK_SIZE, AttentionFn, kernel
from triax.models.visibility import Visibility
from triax.sharding.ring import LAYOUTS, RingSpec, ring_attention
from triax.sharding.rules import Rules, ShardingError

SCHEMES = choices.CONTEXT_SCHEMES


def context_axes(mesh: Mesh, rules: Rules) -> tuple[str, ...]:
    """The mesh axes (size > 1) the activations' sequence is split over."""
    return rules.split_axes("seq", mesh_sizes(mesh))


def context_size(mesh: Mesh, rules: Rules) -> int:
    return rules.split_size("seq", mesh_sizes(mesh))


def context_axis(mesh: Mesh, rules: Rules) -> Optional[str]:
    """The one mesh axis the sequence is split over (None: not split); refused when the
    rules split it over several, since context attention runs over one."""
    axes = context_axes(mesh, rules)
    if len(axes) > 1:
        raise ShardingError(f"rules map 'seq' to {axes}; context parallelism runs over one "
                            f"mesh axis (map 'seq' to 'context')")
    return axes[0] if axes else None


def split_batch_axes(mesh: Mesh, rules: Rules) -> tuple[str, ...]:
    """The batch's mesh axes of size > 1."""
    sizes = mesh_sizes(mesh)
    return tuple(a for a in rules.mesh_axes("batch") if sizes.get(a, 1) > 1)


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ShardingError(f"context attention scheme {scheme!r}: choose one of "
                            f"{', '.join(SCHEMES)} (--context-attention)")
    return scheme


def zigzag_order(T: int, C: int) -> np.ndarray:
    """Original token index at each position of the head-tail layout: 2C chunks, rank i
    (positions ``i·T/C …``) holding chunks i and 2C−1−i."""
    if T % (2 * C):
        raise ShardingError(f"sequence length {T} with context={C}: the balanced (zigzag) "
                            f"layout needs T divisible by 2·context = {2 * C}; choose such a "
                            f"sequence length or a smaller context axis")
    chunks = np.arange(T).reshape(2 * C, T // (2 * C))
    pick = [c for i in range(C) for c in (i, 2 * C - 1 - i)]
    return chunks[pick].reshape(T)


def zigzag_batch(batch: Mapping[str, jax.Array], C: int) -> dict:
    """The step's batch in the zigzag layout, plus ``order`` (each token's original index,
    what ``Visibility`` compares). Every ``[B, T]`` array is permuted the same way."""
    B, T = batch["inputs"].shape[:2]
    perm = jnp.asarray(zigzag_order(T, C), jnp.int32)
    out = {k: jnp.take(v, perm, axis=1) for k, v in batch.items()}
    out["order"] = jnp.broadcast_to(perm, (B, T))
    if "positions" not in batch:   # rotary positions follow the tokens' original indices
        out["positions"] = out["order"]
    return out


def _local_attention(scheme: str, implementation: str, axis: str, C: int,
                     layout: Optional[str]):
    def all_gather(q_BTNH, k_BSKH, v_BSKH, vis: Visibility):
        gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
        k_seg = None if vis.k_segment_BS is None else gather(vis.k_segment_BS)
        full = vis.keys(gather(vis.k_order_BS), k_seg)
        return kernel(implementation)(q_BTNH, gather(k_BSKH), gather(v_BSKH), full)

    def ring(q_BTNH, k_BSKH, v_BSKH, vis: Visibility):
        return ring_attention(RingSpec(axis, C, layout, BLOCK_SIZE), q_BTNH, k_BSKH, v_BSKH,
                              vis)

    fn = ring if scheme == "ring" else all_gather

    def local(q_BTNH, k_BSKH, v_BSKH, vis):
        with runtime.using(constraint=None):   # activation constraints name the full mesh
            return fn(q_BTNH, k_BSKH, v_BSKH, vis)
    return local


def context_attention(mesh: Mesh, rules: Rules, scheme: str = "all-gather",
                      layout: Optional[str] = None) -> Optional[AttentionFn]:
    """The attention hook for ``mesh`` (None without a context axis). ``layout`` vouches for
    the tokens' order along the split sequence, which the ring's causal skipping reads:
    ``"zigzag"`` (:func:`zigzag_batch`), ``"contiguous"`` (order 0…T−1), or None (any
    order: blocks are skipped by a data-dependent test)."""
    check_scheme(scheme)
    if layout is not None and layout not in LAYOUTS:
        raise ShardingError(f"context layout {layout!r}: choose one of {', '.join(LAYOUTS)} "
                            f"or None (any order)")
    axis = context_axis(mesh, rules)
    if axis is None:
        return None
    C, batch_axes = context_size(mesh, rules), split_batch_axes(mesh, rules)

    def hook(q_BTNH, k_BSKH, v_BSKH, vis: Visibility, implementation: str):
        T, S = q_BTNH.shape[1], k_BSKH.shape[1]
        if T != S or T % C:
            # Not self-attention over the split sequence (decode against a cache): whole
            # arrays, XLA gathers what it needs.
            return kernel(implementation)(q_BTNH, k_BSKH, v_BSKH, vis)
        if layout == "zigzag" and (T // C) % 2:
            raise ShardingError(f"sequence length {T} with context={C}: the zigzag layout "
                                f"holds two chunks per rank and needs T divisible by "
                                f"2·context = {2 * C}")
        # A local block of a causal sequence is not itself plain causal (dot_product's
        # is_causal would be wrong there): keep only the orders and segments.
        vis = Visibility(vis.q_order_BT, vis.k_order_BS, vis.q_segment_BT, vis.k_segment_BS)
        context = jax.sharding.get_abstract_mesh()
        nested = not context.empty and context.manual_axes   # inside the pipeline's shard_map
        m = context if nested else mesh
        # The batch axes are manual too: left automatic, XLA would regather the batch over
        # them at the boundary (the specs say nothing of them).
        rows = tuple(a for a in batch_axes if not nested or a not in context.manual_axes)
        seq = P(rows or None, axis)
        vis_spec = Visibility(seq, seq, None if vis.q_segment_BT is None else seq,
                              None if vis.k_segment_BS is None else seq)
        return jax.shard_map(
            _local_attention(scheme, implementation, axis, C, layout), mesh=m,
            axis_names={axis, *rows},
            in_specs=(seq, seq, seq, vis_spec), out_specs=seq,
        )(q_BTNH, k_BSKH, v_BSKH, vis)
    return hook
