"""One stash slot: where a micro-batch's forward residuals live from its F to its last
backward op, and where a split backward's cut lives between B_in and W: in the same slot.

A slot is a set of *cells*, one buffer per residual leaf the forward stashes, each of that
leaf's shape and dtype (``executor.run_ticks`` allocates ``[slots, *shape]`` per cell). Cells
keep their leaves' shapes, so XLA splits them over the automatic axes (``tensor``) as it
splits the activations themselves; a flat byte buffer would have to be gathered first.

Under a split backward (ZB-H1, ZB-V) B_in is the last reader of most residuals — attention
probabilities, softmax and norm statistics, the MLP's pre-activations. W reads only each
weight matmul's input, and the cut: the matmuls' output cotangents, which B_in computes. So
the cut is written over the cells of the residuals B_in alone reads, once B_in has read
them, instead of into a buffer of its own: a cut leaf takes a free cell of its shape (up
to unit dimensions) and of its dtype or one that holds it exactly (a bf16 cotangent in an
f32 cell), or is split along one axis into pieces that fit such cells (SwiGLU's fused
gate/up cotangent ``[.., 2, F]`` into two ``[.., F]`` cells), and only what finds no cell
gets cells of its own. A slot then holds max(residuals, W's residuals + cut), not their
sum.

The post-stack's residuals (final norm, head, loss: the leaves the last-chunk flag decides)
are *head cells*, with slots of their own (``tick_program``'s ``head_w``/``head_r``): only a
micro-batch of the model's last chunk holds them, and a stage holds few of those at once
(1F1B, interleaved: one; ZB-V: two), where every chunk's slot would otherwise carry them.
Other chunks write no head cell, so they need no scratch slot.

    >>> import jax, jax.numpy as jnp
    >>> sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    >>> lay = StashLayout.plan([sd(4, 8), sd(4, 8), sd(4, 3), sd(4, 3)],
    ...                        w_reads=[True, False, False, False],
    ...                        cut=[sd(4, 8), sd(4, 2, 3), sd(5)])
    >>> [(c.cells, c.axis) for c in lay.cut]    # over cell 1; split over cells 2, 3; a new cell
    [((1,), None), ((2, 3), 1), ((4,), None)]
    >>> lay.extra_bytes                         # only the [5] finds no free residual cell
    20
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from triax.pipeline.buffers import nbytes, put, take


def _holds(cell_dtype, dtype) -> bool:
    """A cell of ``cell_dtype`` stores every value of ``dtype`` exactly (same kind, wider or
    equal: bf16 in f32, int8 in int32)."""
    cell_dtype, dtype = jnp.dtype(cell_dtype), jnp.dtype(dtype)
    if cell_dtype == dtype:
        return True
    return (jnp.issubdtype(cell_dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)
            or jnp.issubdtype(cell_dtype, jnp.signedinteger)
            and jnp.issubdtype(dtype, jnp.signedinteger)) \
        and jnp.promote_types(cell_dtype, dtype) == cell_dtype


def _core(shape) -> tuple:
    """A shape without its unit dimensions: cells whose shapes agree on it hold each
    other's values by a reshape that moves no element (nor any split of an axis)."""
    return tuple(d for d in shape if d != 1)


@dataclass(frozen=True)
class CutPlace:
    """Where one cut leaf (of ``shape`` and ``dtype``) lives: one cell (``axis`` None), or
    one cell per index along ``axis`` (the leaf split into pieces of its shape without that
    axis)."""

    cells: tuple[int, ...]
    shape: tuple
    dtype: Any
    axis: Optional[int] = None

    @property
    def piece(self) -> tuple:
        """The shape each cell holds (before its unit dimensions are matched)."""
        if self.axis is None:
            return self.shape
        return self.shape[:self.axis] + self.shape[self.axis + 1:]


@dataclass(frozen=True, eq=False)
class StashLayout:
    """The cells of one slot, which residual leaf each holds, and where the cut goes."""

    cells: tuple                  # ShapeDtypeStructs, one buffer each
    residuals: int                # cells 0..residuals-1 hold the stashed residual leaves, in order
    cut: tuple = ()               # a CutPlace per cut leaf
    head: tuple = ()              # per cell: a head cell (its own slots); default none

    @classmethod
    def plan(cls, residuals: Sequence, w_reads: Sequence[bool] = (), cut: Sequence = (),
             head: Sequence[bool] = (), cut_head: Sequence[bool] = ()) -> "StashLayout":
        """``residuals``: the leaves F stashes; ``w_reads``: which of them W reads (the
        others are free once B_in has run); ``cut``: what B_in stashes for W; ``head``:
        which residuals are the post-stack's (default none); ``cut_head``: which cut leaves
        are (zero unless the chunk is the last). A head cut leaf goes into head cells, any
        other into body cells: a non-last chunk's head cells are a scratch slot."""
        cells = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in residuals]
        head = list(head) or [False] * len(cells)
        cut_head = list(cut_head) or [False] * len(cut)
        for name, flags, n in (("w_reads", w_reads if cut else cells, len(cells)),
                               ("head", head, len(cells)), ("cut_head", cut_head, len(cut))):
            if len(flags) != n:
                raise ValueError(f"StashLayout.plan: {name} has {len(flags)} flags for {n} "
                                 f"leaves")
        free = {h: [i for i in range(len(cells)) if cut and not w_reads[i] and head[i] == h]
                for h in (False, True)}
        places: dict[int, CutPlace] = {}
        for j in sorted(range(len(cut)), key=lambda j: -nbytes(cut[j])):
            places[j] = _place(cut[j], free[cut_head[j]], cells)
            head += [cut_head[j]] * (len(cells) - len(head))
        return cls(tuple(cells), len(residuals), tuple(places[j] for j in range(len(cut))),
                   tuple(head))

    def _is_head(self, i: int) -> bool:
        return bool(self.head) and self.head[i]

    @property
    def body_bytes(self) -> int:
        """Bytes of one slot of the body cells (every chunk's)."""
        return sum(nbytes(c) for i, c in enumerate(self.cells) if not self._is_head(i))

    @property
    def head_bytes(self) -> int:
        """Bytes of one slot of the head cells (the last chunk's)."""
        return sum(nbytes(c) for i, c in enumerate(self.cells) if self._is_head(i))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of every cell."""
        return sum(nbytes(c) for c in self.cells)

    @property
    def residual_bytes(self) -> int:
        return sum(nbytes(c) for c in self.cells[:self.residuals])

    @property
    def extra_bytes(self) -> int:
        """The cells the cut needs beyond the residuals' (what finds no free residual cell)."""
        return self.slot_bytes - self.residual_bytes

    def buffers(self, slots: int, head_slots: int) -> list:
        """The zero-filled buffers: ``[slots, *shape]`` per body cell, ``[head_slots,
        *shape]`` per head cell (no scratch slot: only the last chunk writes them; one slot
        is the cell alone, which the last chunk's F overwrites in place)."""
        return [jnp.zeros(tuple(c.shape) if self._is_head(i) and head_slots == 1 else
                          (head_slots if self._is_head(i) else slots,) + tuple(c.shape),
                          c.dtype) for i, c in enumerate(self.cells)]

    def write(self, bufs: list, residuals: Sequence, slot, head_slot, last) -> list:
        """F: the residual leaves into ``slot`` and, when ``last`` (the chunk is the
        model's last), the head cells into ``head_slot`` (dynamic-update-slices: in place)."""
        return self._apply(bufs, list(enumerate(residuals)), slot, head_slot, last)

    def read(self, bufs: list, slot, head_slot) -> list:
        """The residual leaves of ``slot`` and ``head_slot`` (after B_in, those W does not
        read hold the cut; a chunk that is not the last reads some head slot's values,
        which its backward never uses)."""
        return [self._get(b, i, slot, head_slot) for i, b in enumerate(bufs[:self.residuals])]

    def write_cut(self, bufs: list, cut: Sequence, slot, head_slot, last) -> list:
        """B_in: the cut into ``slot`` (head cut leaves: ``head_slot``, when ``last``), over
        the residuals only B_in reads. Everything B_in computed must be done first, so that
        no read of a cell is left for after the cell's overwrite (``executor`` runs B_in
        inside an ordering conditional)."""
        updates = []
        for place, x in zip(self.cut, cut):
            pieces = [x] if place.axis is None else \
                [jax.lax.index_in_dim(x, k, place.axis, keepdims=False)
                 for k in range(len(place.cells))]
            updates += [(cell, piece.reshape(self.cells[cell].shape))
                        for cell, piece in zip(place.cells, pieces)]
        return self._apply(bufs, updates, slot, head_slot, last)

    def _apply(self, bufs: list, updates: list, slot, head_slot, last) -> list:
        """``(cell, value)`` updates into their slots. Head cells have no scratch slot: a
        chunk that is not the last writes a head slot's own values back (in place, one slot;
        a conditional around the write would copy a one-slot buffer whole)."""
        out = list(bufs)
        for cell, x in updates:
            if not self._is_head(cell):
                out[cell] = put(out[cell], x, slot)
                continue
            x = jnp.where(last, x.astype(out[cell].dtype), self._get(out[cell], cell, slot,
                                                                     head_slot))
            out[cell] = x if out[cell].shape == x.shape else put(out[cell], x, head_slot)
        return out

    def _get(self, buf, cell: int, slot, head_slot):
        if not self._is_head(cell):
            return take(buf, slot)
        return buf if buf.shape == tuple(self.cells[cell].shape) else take(buf, head_slot)

    def read_cut(self, bufs: list, slot, head_slot) -> list:
        """W: the cut of ``slot`` and ``head_slot``, as B_in's leaves."""
        out = []
        for place in self.cut:
            parts = [self._get(bufs[c], c, slot, head_slot).astype(place.dtype)
                     .reshape(place.piece) for c in place.cells]
            out.append(parts[0] if place.axis is None else jnp.stack(parts, place.axis))
        return out


def _place(c, free: list, cells: list) -> CutPlace:
    """A cut leaf's cells: a free residual cell of its shape (up to unit dimensions) that
    holds its dtype (the narrowest), else its pieces along the first axis whose pieces all
    find such cells, else a new cell."""
    shape, dtype = tuple(c.shape), jnp.dtype(c.dtype)

    def claim(want, k):
        core = _core(want)
        fits = sorted((i for i in free if _core(cells[i].shape) == core
                       and _holds(cells[i].dtype, dtype)),
                      key=lambda i: jnp.dtype(cells[i].dtype).itemsize)
        if len(fits) < k:
            return None
        for i in fits[:k]:
            free.remove(i)
        return tuple(fits[:k])
    one = claim(shape, 1)
    if one:
        return CutPlace(one, shape, dtype)
    for axis, k in enumerate(shape):
        pieces = claim(shape[:axis] + shape[axis + 1:], k) if k > 1 else None
        if pieces:
            return CutPlace(pieces, shape, dtype, axis)
    cells.append(jax.ShapeDtypeStruct(shape, dtype))
    return CutPlace((len(cells) - 1,), shape, dtype)
