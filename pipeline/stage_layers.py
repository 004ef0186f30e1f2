"""Layers over stages: the block parameters as ``[S, v, Lc, ...]``, one stage's chunks each.

Chunk ``c`` holds layers ``[c*Lc, (c+1)*Lc)`` with ``Lc = ceil(L / (S*v))``; it runs on stage
``s`` as local chunk ``j = c // S``: circular placement ``c = j*S + s``, or ZB-V's V
(``v_shape``), whose second leg runs back up: local chunk 1 of stage s is ``2S-1-s``. When
``S*v`` does not divide ``L`` the stack is padded with zero blocks, which are exact identities
(a zero attention output projection and a zero MLP down projection leave the residual stream
unchanged); their gradients are dropped again by :meth:`StageLayers.from_stages`.

**Stages of their own lengths** (``counts``, ``pipeline.stage_counts``: stage ``s`` runs its
own ``counts[s]`` layers, one chunk per stage; equal counts are the even layout above). The
blocks are *stored* as ``[S·Lc, ...]`` with ``Lc = max(counts)``: stage ``s``'s layers at
``[s·Lc, s·Lc + counts[s])``, zero blocks after (:meth:`store`). That stack splits evenly over
``pipe``, so each rank holds only its stage's ``Lc`` slots, and entering the pipeline is a
local reshape. The stage skips its padded slots at run time (:attr:`slot_counts`, the
runtime's ``layer_count``: ``models.runtime``), so a short stage computes less and the padded
slots' contents never matter (their gradients are zero and stay zero).

Otherwise storage is the model's ``[L, ...]``. With ``L % S == 0`` and ``v == 1`` the reshape
is local to each device; otherwise XLA moves the weights once per step (see
:func:`pipeline_strategy` for uneven L). Checkpoints hold the model's ``[L, ...]`` whatever the
stages (:meth:`unstore` on save, :meth:`store` on restore).

    >>> StageLayers(num_layers=5, stages=2, virtual=1).per_chunk
    3
    >>> import numpy as np
    >>> v = StageLayers(num_layers=8, stages=4, virtual=2, v_shape=True)
    >>> v.to_stages(np.arange(8))[:, :, 0].tolist()    # [stage][local chunk] -> first layer
    [[0, 7], [1, 6], [2, 5], [3, 4]]
    >>> StageLayers(num_layers=3, stages=2).layer_ids().tolist()   # one padding layer
    [[[0, 1]], [[2, 3]]]
    >>> u = StageLayers(num_layers=5, stages=2, counts=(4, 1))
    >>> u.slots.tolist()                                # storage slot -> model layer (-1: none)
    [0, 1, 2, 3, 4, -1, -1, -1]
    >>> u.store(np.arange(1, 6)).tolist()               # stage 1: layer 5, then 3 zero slots
    [1, 2, 3, 4, 5, 0, 0, 0]
    >>> u.unstore(u.store(np.arange(1, 6))).tolist()
    [1, 2, 3, 4, 5]
    >>> u.layer_ids()[:, 0].tolist()                    # skipped slots numbered past the stack
    [[0, 1, 2, 3], [4, 5, 6, 7]]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from triax.pipeline.chunk_routes import routed, to_compute, to_storage
from triax.pipeline.stage_counts import check_counts
from triax.sharding.rules import Strategy


@dataclass(frozen=True)
class StageLayers:
    num_layers: int
    stages: int
    virtual: int = 1
    v_shape: bool = False     # ZB-V's placement (schedules.chunk_stage)
    counts: Optional[tuple[int, ...]] = None   # stages of their own lengths (v = 1)
    split_backward: bool = False               # the schedule's (refused with counts)

    def __post_init__(self):
        if self.counts is not None:   # equal counts are the plain layout
            counts = check_counts(self.counts, self.num_layers, self.stages, self.virtual,
                                  self.split_backward)
            object.__setattr__(self, "counts", None if len(set(counts)) == 1 else counts)

    @classmethod
    def of(cls, num_layers: int, schedule, counts=None) -> "StageLayers":
        """The layout a ``pipeline.Schedule`` runs (``counts``: uneven stages)."""
        return cls(num_layers, schedule.stages, schedule.virtual, schedule.kind.v_shape,
                   None if counts is None else tuple(counts), schedule.kind.split_backward)

    @property
    def slot_counts(self) -> Optional[np.ndarray]:
        """``[S, v]`` int32: the layers each (stage, local chunk) runs of its ``per_chunk``
        slots, the rest skipped; None for the padded layout, whose slots all run."""
        if self.counts is None:
            return None
        return np.asarray(self.counts, np.int32).reshape(self.stages, 1)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def per_chunk(self) -> int:
        if self.counts is not None:
            return max(self.counts)
        return math.ceil(self.num_layers / self.chunks)

    @property
    def padding(self) -> int:
        """Zero slots added so every chunk holds ``per_chunk`` layers."""
        return self.chunks * self.per_chunk - self.num_layers

    @property
    def even(self) -> bool:
        return self.counts is None and self.num_layers % self.stages == 0

    @property
    def restacked(self) -> bool:
        """Whether the blocks are stored in stage order (``[S·Lc, ...]``, :meth:`store`)
        rather than as the model's ``[L, ...]``: stages of their own lengths."""
        return self.counts is not None

    @property
    def stored_layers(self) -> int:
        """The stored stack's length: ``S·Lc`` when :attr:`restacked`, else ``L``."""
        return self.chunks * self.per_chunk if self.restacked else self.num_layers

    def describe(self) -> str:
        if self.counts is not None:
            return (f"{self.num_layers} layers over {self.stages} uneven stages: "
                    f"{', '.join(map(str, self.counts))} (padded to {self.per_chunk}, the "
                    f"padded slots skipped)")
        pad = f", {self.padding} identity padding layer(s)" if self.padding else ""
        shape = " in a V" if self.v_shape else ""
        return (f"{self.num_layers} layers over {self.stages} stages x {self.virtual} "
                f"chunk(s){shape}: "
                f"{self.per_chunk} per chunk{pad}")

    # ---- the slot table: one home for every layout -----------------------------------------
    @property
    def slots(self) -> np.ndarray:
        """int32 ``[S·v·Lc]``: the model layer each slot holds, -1 for a zero slot; in
        storage order when :attr:`restacked` (stage by stage), else in chunk order."""
        if self.counts is None:   # layers in order, the zero slots at the end
            out = np.arange(self.chunks * self.per_chunk, dtype=np.int32)
            return np.where(out < self.num_layers, out, -1).astype(np.int32)
        real = np.arange(self.per_chunk) < np.asarray(self.counts)[:, None]   # [S, Lc]
        out = np.full(real.shape, -1, np.int32)
        out[real] = np.arange(self.num_layers)
        return out.reshape(-1)

    def _in_compute_order(self, a: np.ndarray) -> np.ndarray:
        """A per-slot table in :attr:`slots`' order → ``[S, v, Lc]`` in compute order."""
        if self.restacked:
            return a.reshape(self.stages, 1, self.per_chunk)
        return self._placed(a)

    def store(self, blocks):
        """The model's ``[L, ...]`` leaves → the stored stack (``[S·Lc, ...]``, zero slots
        from :meth:`_padding`) when :attr:`restacked`; else unchanged. One gather with static
        indices: XLA fuses it into each device's slice of its own stage."""
        if not self.restacked:
            return blocks
        slots = self.slots
        keep, idx = slots >= 0, np.maximum(slots, 0)

        def one(a):
            k = keep.reshape(keep.shape + (1,) * (a.ndim - 1))
            return jnp.where(k, a[idx], self._padding(a, 1))
        return jax.tree.map(one, blocks)

    def unstore(self, blocks):
        """Inverse of :meth:`store`: the stored stack's real slots, in layer order."""
        if not self.restacked:
            return blocks
        real = np.flatnonzero(self.slots >= 0)
        return jax.tree.map(lambda a: a[real], blocks)

    # ---- into and out of the pipeline ------------------------------------------------------
    @property
    def routed(self) -> bool:
        """Interleaved with whole chunks per stage: the chunks enter the pipeline in storage
        order (:meth:`stored_chunks`) and ``chunk_routes`` moves them inside ``shard_map``."""
        return self.counts is None and routed(self.num_layers, self.stages, self.virtual)

    def to_compute(self, tree, axis: str):
        """Inside ``shard_map``: stored chunks → the chunks this stage runs (``routed``)."""
        return to_compute(tree, self.stages, self.virtual, axis, self.v_shape)

    def to_storage(self, tree, axis: str, into=None):
        """Inverse of :meth:`to_compute` (``into``: ``chunk_routes.to_storage``)."""
        return to_storage(tree, self.stages, self.virtual, axis, self.v_shape, into)

    def stored_chunks(self, blocks):
        """The stored stack → ``[S, v, Lc, ...]`` in storage order (chunk ``s*v + r`` at
        ``[s, r]``): a local reshape of the ``layers → pipe`` split."""
        shape = (self.stages, self.virtual, self.per_chunk)
        return jax.tree.map(lambda a: a.reshape(shape + a.shape[1:]), blocks)

    def from_stored_chunks(self, blocks):
        """Inverse of :meth:`stored_chunks`."""
        return jax.tree.map(lambda a: a.reshape((self.stored_layers,) + a.shape[3:]), blocks)

    def enter(self, blocks):
        """The stored blocks → what the pipeline's ``shard_map`` takes: ``[S, v, Lc, ...]`` in
        compute order, or in storage order when :attr:`routed` (moved inside) or
        :attr:`restacked` (already stage by stage). :meth:`leave` is its inverse; a zero slot
        that was skipped (:attr:`slot_counts`) has a zero gradient, so it stays zero."""
        if self.routed or self.restacked:
            return self.stored_chunks(blocks)
        return self.to_stages(blocks)

    def leave(self, blocks):
        if self.routed or self.restacked:
            return self.from_stored_chunks(blocks)
        return self.from_stages(blocks)

    def _padding(self, a, n: int):
        """``n`` zero slots (skipped at run time under ``counts``, identities otherwise)."""
        return jnp.zeros((n,) + a.shape[1:], a.dtype)

    def to_stages(self, blocks):
        """The model's ``[L, ...]`` leaves → ``[S, v, Lc, ...]`` in compute order (zero-padded):
        per-layer state (a KV cache) enters so."""
        if self.restacked:
            return self.stored_chunks(self.store(blocks))
        return jax.tree.map(lambda a: self._placed(
            jnp.pad(a, [(0, self.padding)] + [(0, 0)] * (a.ndim - 1))), blocks)

    def from_stages(self, blocks):
        """Inverse of :meth:`to_stages` (padding dropped)."""
        if self.restacked:
            return self.unstore(self.from_stored_chunks(blocks))

        def one(a):
            a = self._legs(jnp.swapaxes(a, 0, 1))
            a = a.reshape((self.chunks * self.per_chunk,) + a.shape[3:])
            return a[:self.num_layers]
        return jax.tree.map(one, blocks)

    def layer_ids(self) -> np.ndarray:
        """int32 ``[S, v, Lc]``: each (stage, local chunk, slot)'s index in the whole stack,
        in compute order; the zero slots continue the count past ``num_layers`` (in slot
        order). What a layer draws per-layer randomness from (LoRA dropout), so a stage
        draws what the unpipelined stack draws."""
        ids = self.slots.copy()
        pad = ids < 0
        ids[pad] = np.arange(self.num_layers, self.num_layers + pad.sum())
        return self._in_compute_order(ids)

    def _placed(self, a):
        """``[S·v·Lc, ...]`` in layer order → ``[S, v, Lc, ...]`` in compute order (a numpy
        array stays one: a static fact)."""
        a = self._legs(a.reshape((self.virtual, self.stages, self.per_chunk) + a.shape[1:]))
        return a.swapaxes(0, 1)

    def _legs(self, a):
        """``[v, S, ...]`` in chunk order ↔ in stage order: a V's second leg runs backwards
        (its own inverse)."""
        xp = np if isinstance(a, np.ndarray) else jnp
        return xp.concatenate([a[:1], a[1:, ::-1]]) if self.v_shape else a


def pipeline_strategy(strategy: Strategy, num_layers: int, stages: int,
                      counts=None) -> Strategy:
    """The strategy the pipeline trains with.

    ``layers → pipe`` needs the stored stack to split evenly over ``stages`` (JAX shardings
    must divide evenly). Uneven ``counts`` (``stage_layers``) store ``[S·Lc, ...]``
    (:meth:`StageLayers.store`), which always does: each rank holds its own stage's slots.
    For an uneven count without ``counts`` the block stack is kept whole on every pipe rank
    instead (each stage slices its own layers locally; the layer gradients are gathered over
    ``pipe`` once per step). Even splits are returned unchanged. Without ``counts`` this is
    also the strategy of the model's own ``[L, ...]`` form (``Pipeline.model_strategy``).
    """
    if not stack_kept_whole(num_layers, stages, counts):
        return strategy
    return strategy.with_updates(layers=None)


def stack_kept_whole(num_layers: int, stages: int, counts=None) -> bool:
    """Whether every pipe rank stores the whole block stack (:func:`pipeline_strategy`): then
    each stage's ``[v, Lc, ...]`` chunk is a fresh per-device copy (:meth:`StageLayers.enter`
    slices or pads it out of the stack), not a view of the ``layers → pipe`` shard. Uneven
    ``counts`` never do: their stage-ordered stack splits evenly."""
    uneven = counts is not None and len(set(counts)) > 1
    return not uneven and num_layers % stages != 0
