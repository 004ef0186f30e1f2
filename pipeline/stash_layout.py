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
them, instead of into a buffer of its own: a cut leaf takes a free cell of its shape and of
its dtype or one that holds it exactly (a bf16 cotangent in an f32 cell), or is split along
one axis into pieces that fit such cells (SwiGLU's fused gate/up cotangent ``[.., 2, F]``
into two ``[.., F]`` cells), and only what finds no cell gets cells of its own. A slot then
holds max(residuals, W's residuals + cut), not their sum.

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
import numpy as np


def nbytes(sd) -> int:
    return int(np.prod(sd.shape)) * jnp.dtype(sd.dtype).itemsize


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


@dataclass(frozen=True)
class CutPlace:
    """Where one cut leaf (of ``dtype``) lives: one cell (``axis`` None), or one cell per
    index along ``axis`` (the leaf split into pieces of its shape without that axis)."""

    cells: tuple[int, ...]
    dtype: Any
    axis: Optional[int] = None


@dataclass(frozen=True, eq=False)
class StashLayout:
    """The cells of one slot, which residual leaf each holds, and where the cut goes."""

    cells: tuple                  # ShapeDtypeStructs, one buffer each
    residuals: int                # cells 0..residuals-1 hold the stashed residual leaves, in order
    cut: tuple = ()               # a CutPlace per cut leaf

    @classmethod
    def plan(cls, residuals: Sequence, w_reads: Sequence[bool] = (),
             cut: Sequence = ()) -> "StashLayout":
        """``residuals``: the leaves F stashes; ``w_reads``: which of them W reads (the
        others are free once B_in has run); ``cut``: what B_in stashes for W."""
        cells = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in residuals]
        if cut and len(w_reads) != len(cells):
            raise ValueError(f"StashLayout.plan: w_reads has {len(w_reads)} flags for "
                             f"{len(cells)} residuals")
        free = [i for i in range(len(cells)) if cut and not w_reads[i]]
        places: dict[int, CutPlace] = {}
        for j in sorted(range(len(cut)), key=lambda j: -nbytes(cut[j])):
            places[j] = _place(cut[j], free, cells)
        return cls(tuple(cells), len(residuals), tuple(places[j] for j in range(len(cut))))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: every cell."""
        return sum(nbytes(c) for c in self.cells)

    @property
    def residual_bytes(self) -> int:
        return sum(nbytes(c) for c in self.cells[:self.residuals])

    @property
    def extra_bytes(self) -> int:
        """The cells the cut needs beyond the residuals' (what finds no free residual cell)."""
        return self.slot_bytes - self.residual_bytes

    def buffers(self, slots: int) -> list:
        """The zero-filled buffers of ``slots`` slots: ``[slots, *shape]`` per cell."""
        return [jnp.zeros((slots,) + tuple(c.shape), c.dtype) for c in self.cells]

    def write(self, bufs: list, residuals: Sequence, slot) -> list:
        """F: the residual leaves into ``slot`` (a dynamic-update-slice per cell: in place)."""
        out = list(bufs)
        for i, x in enumerate(residuals):
            out[i] = _put(out[i], x, slot)
        return out

    def read(self, bufs: list, slot) -> list:
        """The residual leaves of ``slot`` (after B_in, those W does not read hold the cut)."""
        return [_take(b, slot) for b in bufs[:self.residuals]]

    def write_cut(self, bufs: list, cut: Sequence, slot) -> list:
        """B_in: the cut into ``slot``, over the residuals only B_in reads. Everything B_in
        computed must be done first (``executor`` puts an optimization barrier on B_in's
        outputs), so that no read of a cell is left for after the cell's overwrite."""
        out = list(bufs)
        for place, x in zip(self.cut, cut):
            if place.axis is None:
                out[place.cells[0]] = _put(out[place.cells[0]], x, slot)
                continue
            for k, cell in enumerate(place.cells):
                piece = jax.lax.index_in_dim(x, k, place.axis, keepdims=False)
                out[cell] = _put(out[cell], piece, slot)
        return out

    def read_cut(self, bufs: list, slot) -> list:
        """W: the cut of ``slot``, as B_in's leaves."""
        out = []
        for place in self.cut:
            parts = [_take(bufs[c], slot).astype(place.dtype) for c in place.cells]
            out.append(parts[0] if place.axis is None else jnp.stack(parts, place.axis))
        return out


def _place(c, free: list, cells: list) -> CutPlace:
    """A cut leaf's cells: a free residual cell of its shape that holds its dtype (the
    narrowest), else its pieces along the first axis whose pieces all find such cells, else
    a new cell."""
    shape, dtype = tuple(c.shape), jnp.dtype(c.dtype)

    def take(want, k):
        fits = sorted((i for i in free if tuple(cells[i].shape) == want
                       and _holds(cells[i].dtype, dtype)),
                      key=lambda i: jnp.dtype(cells[i].dtype).itemsize)
        if len(fits) < k:
            return None
        for i in fits[:k]:
            free.remove(i)
        return tuple(fits[:k])
    one = take(shape, 1)
    if one:
        return CutPlace(one, dtype)
    for axis, k in enumerate(shape):
        pieces = take(shape[:axis] + shape[axis + 1:], k) if k > 1 else None
        if pieces:
            return CutPlace(pieces, dtype, axis)
    cells.append(jax.ShapeDtypeStruct(shape, dtype))
    return CutPlace((len(cells) - 1,), dtype)


def _take(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def _put(buf, x, i):
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)
