"""One chunk's backward, split in two for zero-bubble schedules: B_in (the input gradient, on
the critical path) and W (the weight gradients, deferred to fill bubbles).

The forward stashes its pullback's residuals (``pipeline.stage.Residuals``: parameters left
out). The pullback, traced once to a jaxpr, is split generically (``pipeline.jaxpr_split``), so
any stage splits without its model's help: the built-in Transformer (a scan over layers, remat
policies, MoE) as well as a user's ``PipelineModel``. B_in runs only what ``dx`` needs and
returns the *cut*, what the weight gradients need that B_in has computed: each weight
matmul's output cotangent, per layer (the matmul's input is already in the F stash). W runs
the weight-gradient matmuls from the F stash and the cut, and nothing else.

    >>> import jax, jax.numpy as jnp
    >>> from triax.models import config
    >>> from triax.sharding.partition import abstract_model
    >>> from triax.pipeline.executor import loss_only
    >>> from triax.pipeline.stage import Stage
    >>> am = abstract_model(config.TINY.replace(num_layers=1))
    >>> pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    >>> ints = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    >>> extras = ({"tokens": ints, "targets": ints, "weights": jax.ShapeDtypeStruct((2, 8),
    ...            jnp.float32)}, {"inv_total_weight": jnp.float32(1)}, True, True)
    >>> x = jax.ShapeDtypeStruct((2, 8, 64), jnp.float32)
    >>> sb = StageBackward.trace(loss_only(Stage(am.graphdef)), am.shapes["blocks"], pieces,
    ...                          x, extras)
    >>> sb.cut_bytes < sb.stash_bytes
    True
"""
from __future__ import annotations

from dataclasses import dataclass
import jax
import jax.numpy as jnp
import numpy as np

from triax.pipeline import jaxpr_split
from triax.pipeline.stage import Residuals


def _nbytes(shapes) -> int:
    return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in shapes)


@dataclass(frozen=True, eq=False)
class StageBackward:
    """The stash layout of one chunk's forward, and its backward split in two."""

    shapes: tuple                 # ShapeDtypeStructs of the leaves F stashes (no parameters)
    cut_shapes: tuple             # ShapeDtypeStructs of what B_in stashes for W (the cut)
    residuals: Residuals
    split: jaxpr_split.Split      # the pullback (stored, params, dy, dloss) -> grads, split
    consts: tuple                 # the pullback jaxpr's constants
    grad_trees: tuple             # treedefs of (chunk, pieces)

    @classmethod
    def trace(cls, apply, chunk, pieces, x, extras) -> "StageBackward":
        """``apply(chunk, pieces, x, extras) -> (y, loss)`` is what the backward
        differentiates; the arguments may be arrays, tracers or ShapeDtypeStructs."""
        res = Residuals.trace(apply, chunk, pieces, x, extras)
        sds = lambda t: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), t)
        loss_tree = jax.tree.structure(jax.eval_shape(apply, chunk, pieces, x, extras)[1])
        n_loss = loss_tree.num_leaves   # the loss may be a dict (a MoE's auxiliary losses)

        def pullback(stored, chunk, pieces, dy, *dloss):
            cts = (dy, jax.tree.unflatten(loss_tree, dloss))
            d_chunk, d_pieces, dx, _ = res.pullback(stored, chunk, pieces)(cts)
            return [*jax.tree.leaves((d_chunk, d_pieces)), dx]
        closed = jaxpr_split.inline(jax.make_jaxpr(pullback)(
            list(res.shapes), sds(chunk), sds(pieces), sds(x),
            *[jax.ShapeDtypeStruct((), jnp.float32)] * n_loss))
        n_params = len(jax.tree.leaves((chunk, pieces)))
        # W reads the F stash (each weight matmul's input is there) and the parameters; the
        # cut is what W needs that only B_in computes (each matmul's output cotangent). With
        # separate stash and cut buffers this holds less than moving the inputs into the cut
        # and freeing the stash at B_in: the stash's peak slots are S either way.
        split = jaxpr_split.plan(closed.jaxpr, b_used=[False] * n_params + [True],
                                 w_used=[True] * n_params + [False],
                                 avail=[True] * (len(res.shapes) + n_params)
                                 + [False] * (1 + n_loss))
        cut = tuple(jax.ShapeDtypeStruct(k.aval.shape, k.aval.dtype) for k in split.cut)
        trees = (jax.tree.structure(chunk), jax.tree.structure(pieces))
        return cls(res.shapes, cut, res, split, tuple(closed.consts), trees)

    @property
    def stash_bytes(self) -> int:
        """Bytes F stashes per micro-batch (the full residual set, parameters excluded)."""
        return _nbytes(self.shapes)

    @property
    def cut_bytes(self) -> int:
        """Bytes B_in stashes for W per micro-batch."""
        return _nbytes(self.cut_shapes)

    def forward(self, apply, chunk, pieces, x, extras):
        """``((y, loss), stored)``: the forward's outputs and the leaves to stash."""
        return self.residuals.forward(apply, chunk, pieces, x, extras)

    def backward(self, stored, chunk, pieces, dy, dloss):
        """The full backward (1F1B's B): ``(d_chunk, d_pieces, dx)``."""
        d_chunk, d_pieces, dx, _ = self.residuals.pullback(stored, chunk, pieces)((dy, dloss))
        return d_chunk, d_pieces, dx

    def _inputs(self, stored, chunk, pieces, tail, reads):
        args = [*stored, *jax.tree.leaves((chunk, pieces)), *tail]
        return [a for a, r in zip(args, reads) if r]

    def backward_input(self, stored, chunk, pieces, dy, dloss):
        """B_in: only what ``dx`` needs. ``(dx, cut)``, the cut matching ``cut_shapes``."""
        args = self._inputs(stored, chunk, pieces, (dy, *jax.tree.leaves(dloss)),
                            self.split.b_reads)
        (dx,), cut = jaxpr_split.run_b(self.split, self.consts, args)
        return dx, list(cut)

    def backward_weight(self, stored, cut, chunk, pieces):
        """W: the weight gradients from the F stash and the cut: ``(d_chunk, d_pieces)``."""
        args = self._inputs(stored, chunk, pieces, (), self.split.w_reads)
        grads = jaxpr_split.run_w(self.split, self.consts, args, list(cut))
        n = self.grad_trees[0].num_leaves
        return (jax.tree.unflatten(self.grad_trees[0], grads[:n]),
                jax.tree.unflatten(self.grad_trees[1], grads[n:]))
