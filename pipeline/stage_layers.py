"""Layers over stages: the stacked ``[L, ...]`` block parameters as ``[S, v, Lc, ...]``.

Chunk ``c`` holds layers ``[c*Lc, (c+1)*Lc)`` with ``Lc = ceil(L / (S*v))``; it runs on stage
``s`` as local chunk ``j = c // S``: circular placement ``c = j*S + s``, or ZB-V's V
(``v_shape``), whose second leg runs back up: local chunk 1 of stage s is ``2S-1-s``. When ``S*v`` does not divide ``L`` the
stack is padded with zero blocks, which are exact identities (a zero attention output
projection and a zero MLP down projection leave the residual stream unchanged); their
gradients are dropped again by :meth:`StageLayers.from_stages`.

**Uneven stages** (``counts``, ``pipeline.stage_counts``: stage ``s`` runs its own
``counts[s]`` layers, one chunk per stage): the stage array is ``[S, 1, max(counts), ...]``,
each stage's layers first and zero blocks after; the stage skips those padded slots at run
time (:attr:`slot_counts`, the runtime's ``layer_count``: ``models.runtime``), so a short
stage computes less. Storage is kept whole on every pipe rank, as for uneven L.

Storage stays the model's ``[L, ...]`` (checkpoints do not depend on the schedule). With
``L % S == 0`` and ``v == 1`` the reshape is local to each device; otherwise XLA moves the
weights once per step (see :func:`pipeline_strategy` for uneven L).

    >>> StageLayers(num_layers=5, stages=2, virtual=1).per_chunk
    3
    >>> import numpy as np
    >>> v = StageLayers(num_layers=8, stages=4, virtual=2, v_shape=True)
    >>> v.to_stages(np.arange(8))[:, :, 0].tolist()    # [stage][local chunk] -> first layer
    [[0, 7], [1, 6], [2, 5], [3, 4]]
    >>> StageLayers(num_layers=3, stages=2).layer_ids().tolist()   # one padding layer
    [[[0, 1]], [[2, 3]]]
    >>> u = StageLayers(num_layers=5, stages=2, counts=(4, 1))
    >>> u.to_stages(np.arange(1, 6))[:, 0].tolist()     # stage 1: layer 5, then 3 zero slots
    [[1, 2, 3, 4], [5, 0, 0, 0]]
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
from triax.pipeline.stage_counts import check_counts, offsets
from triax.sharding.rules import Strategy


@dataclass(frozen=True)
class StageLayers:
    num_layers: int
    stages: int
    virtual: int = 1
    v_shape: bool = False     # ZB-V's placement (schedules.chunk_stage)
    counts: Optional[tuple[int, ...]] = None   # uneven stages: layers per stage (v = 1)
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
        """Identity layers appended so every chunk holds ``per_chunk`` layers."""
        return self.chunks * self.per_chunk - self.num_layers

    @property
    def even(self) -> bool:
        return self.num_layers % self.stages == 0 and (
            self.counts is None or len(set(self.counts)) == 1)

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
        """``[L, ...]`` → ``[S, v, Lc, ...]`` in storage order (chunk ``s*v + r`` at ``[s, r]``):
        a local reshape of the ``layers → pipe`` split."""
        shape = (self.stages, self.virtual, self.per_chunk)
        return jax.tree.map(lambda a: a.reshape(shape + a.shape[1:]), blocks)

    def from_stored_chunks(self, blocks):
        """Inverse of :meth:`stored_chunks`."""
        return jax.tree.map(lambda a: a.reshape((self.num_layers,) + a.shape[3:]), blocks)

    def enter(self, blocks):
        """What the pipeline's ``shard_map`` takes: ``[S, v, Lc, ...]`` in compute order, or in
        storage order when :attr:`routed` (moved inside). :meth:`leave` is its inverse."""
        return self.stored_chunks(blocks) if self.routed else self.to_stages(blocks)

    def leave(self, blocks):
        return self.from_stored_chunks(blocks) if self.routed else self.from_stages(blocks)

    def _padding(self, a, n: int):
        """``n`` slots after a short stage's layers: zero blocks (skipped at run time)."""
        return jnp.zeros((n,) + a.shape[1:], a.dtype)

    def to_stages(self, blocks):
        """``[L, ...]`` leaves → ``[S, v, Lc, ...]`` (zero-padded)."""
        if self.counts is not None:
            # One gather with static indices, the padded slots selected to ``_padding``: XLA
            # fuses it into each device's slice of its own stage. A stack of per-stage
            # concatenations instead became one replicated [S, Lc] copy per stage.
            real = np.arange(self.per_chunk) < np.asarray(self.counts)[:, None]   # [S, Lc]
            idx = np.zeros(real.shape, np.int32)
            idx[real] = np.arange(self.num_layers)

            def one(a):
                keep = real.reshape(real.shape + (1,) * (a.ndim - 1))
                return jnp.where(keep, a[idx], self._padding(a, 1))[:, None]
            return jax.tree.map(one, blocks)
        return jax.tree.map(lambda a: self._placed(
            jnp.pad(a, [(0, self.padding)] + [(0, 0)] * (a.ndim - 1))), blocks)

    def layer_ids(self) -> np.ndarray:
        """int32 ``[S, v, Lc]``: each (stage, local chunk, slot)'s index in the whole stack,
        in compute order (:meth:`to_stages`'); the padding layers continue the count past
        ``num_layers``. What a layer draws per-layer randomness from (LoRA dropout), so a
        stage draws what the unpipelined stack draws. Uneven stages: a stage's layers, then
        its skipped slots numbered past ``num_layers``."""
        if self.counts is not None:
            real = np.arange(self.per_chunk) < np.asarray(self.counts)[:, None]   # [S, Lc]
            ids = np.empty(real.shape, np.int32)
            ids[real] = np.arange(self.num_layers)                  # row-major: stage order
            ids[~real] = np.arange(self.num_layers, real.size)      # skipped slots after
            return ids[:, None]
        return self._placed(np.arange(self.chunks * self.per_chunk, dtype=np.int32))

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

    def from_stages(self, blocks):
        """Inverse of :meth:`to_stages` (padding dropped)."""
        if self.counts is not None:
            return jax.tree.map(lambda a: jnp.concatenate(
                [a[s, 0, :c] for s, c in enumerate(self.counts)]), blocks)

        def one(a):
            a = self._legs(jnp.swapaxes(a, 0, 1))
            a = a.reshape((self.chunks * self.per_chunk,) + a.shape[3:])
            return a[:self.num_layers]
        return jax.tree.map(one, blocks)


def pipeline_strategy(strategy: Strategy, num_layers: int, stages: int,
                      counts=None) -> Strategy:
    """The strategy the pipeline trains with.

    ``layers → pipe`` needs ``stages | num_layers`` (JAX shardings must divide evenly) and
    equal stages. For an uneven count or uneven ``counts`` (``stage_layers``) the block stack
    is kept whole on every pipe rank instead (each stage slices its own layers locally; the
    layer gradients are gathered over ``pipe`` once per step). Even splits are returned
    unchanged.
    """
    if not stack_kept_whole(num_layers, stages, counts):
        return strategy
    return strategy.with_updates(layers=None)


def stack_kept_whole(num_layers: int, stages: int, counts=None) -> bool:
    """Whether every pipe rank stores the whole block stack (:func:`pipeline_strategy`): then
    each stage's ``[v, Lc, ...]`` chunk is a fresh per-device copy (:meth:`StageLayers.enter`
    slices or pads it out of the stack), not a view of the ``layers → pipe`` shard."""
    return num_layers % stages != 0 or (counts is not None and len(set(counts)) > 1)
