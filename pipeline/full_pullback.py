"""STAND-IN for ``pipeline/split_backward.py::StageBackward`` (issue 11, item 1), built on
today's full pullback (:class:`triax.pipeline.stage.Residuals`), with the agreed interface, so
the executor codes against that interface before the real split lands. At merge the
executor's import of this class is swapped for ``StageBackward`` and this file is deleted.

Here B_in runs the whole pullback and keeps only dx; its cut is the cotangents (dy, dloss),
and W runs the whole pullback again from them, so W costs a full backward: the defect the
real split removes.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from triax.pipeline.stage import Residuals


@dataclass(frozen=True, eq=False)
class FullPullbackBackward:
    """``StageBackward``'s methods on one stored full pullback (see split_iface)."""

    res: Residuals
    cut_shapes: tuple      # (dy, dloss)

    @property
    def shapes(self) -> tuple:
        return self.res.shapes

    @classmethod
    def trace(cls, apply, chunk, pieces, x, extras) -> "FullPullbackBackward":
        res = Residuals.trace(apply, chunk, pieces, x, extras)
        cut = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), jnp.float32))
        return cls(res, cut)

    def forward(self, apply, chunk, pieces, x, extras):
        return self.res.forward(apply, chunk, pieces, x, extras)

    def backward(self, stored, chunk, pieces, dy, dloss):
        d_chunk, d_pieces, dx, _ = self.res.pullback(stored, chunk, pieces)((dy, dloss))
        return d_chunk, d_pieces, dx

    def backward_input(self, stored, chunk, pieces, dy, dloss):
        _, _, dx = self.backward(stored, chunk, pieces, dy, dloss)
        return dx, [dy, jnp.asarray(dloss, jnp.float32)]

    def backward_weight(self, stored, cut, chunk, pieces):
        d_chunk, d_pieces, _ = self.backward(stored, chunk, pieces, cut[0], cut[1])
        return d_chunk, d_pieces
