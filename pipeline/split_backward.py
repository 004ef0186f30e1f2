"""One chunk's backward, split in two for zero-bubble schedules: B_in (the input gradient, on
the critical path) and W (the weight gradients, deferred to fill bubbles).

The forward stashes its pullback's residuals (:class:`Residuals`: parameters left
out), and of those only what the backward cannot get otherwise: a leaf the pullback never
reads is dropped, and one computed without the stage's input activation, from parameters,
the micro-batch's inputs and flags alone (weights cast to the compute dtype, the tied head's
transpose, rotary tables, masks), is recomputed by the backward instead (no matmul allowed),
so a slot holds activations only. The pullback, traced once to a jaxpr, is split generically
(``pipeline.jaxpr_split``), so any stage splits without its model's help: the built-in
Transformer (a scan over layers, remat policies, MoE) as well as a user's ``PipelineModel``.
B_in runs what ``dx`` needs and the pre/post-stack's gradients (embedding, final norm,
head), and returns the *cut*: what the layers' weight gradients need that B_in has
computed, each weight matmul's output cotangent, per layer (the matmul's input is already
in the F stash). W runs the layers' weight-gradient matmuls from the F stash and the cut,
and nothing else.

    >>> import jax, jax.numpy as jnp
    >>> from triax.models import config
    >>> from triax.sharding.partition import abstract_model
    >>> from triax.pipeline.executor import loss_only
    >>> from triax.pipeline.stage import Stage
    >>> from triax.pipeline.stage_inputs import StageInputs
    >>> am = abstract_model(config.TINY.replace(num_layers=1))
    >>> pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    >>> ints = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    >>> extras = StageInputs({"inputs": ints, "targets": ints,
    ...                       "weights": jax.ShapeDtypeStruct((2, 8), jnp.float32)},
    ...                      {"inv_total_weight": jnp.float32(1)}, True, True, jnp.arange(1))
    >>> x = jax.ShapeDtypeStruct((2, 8, 64), jnp.float32)
    >>> sb = StageBackward.trace(loss_only(Stage(am.graphdef)), am.shapes["blocks"], pieces,
    ...                          x, extras)
    >>> sb.cut_bytes < sb.stash_bytes
    True
    >>> lay = sb.layout(split=True, slots=2, head_slots=2)    # the cut over B_in's cells
    >>> lay.extra_bytes < 0.05 * lay.residual_bytes
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from triax.private_jax import partial_eval as pe  # jaxpr DCE: no public API
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun, jaxprs_in_params

from triax.pipeline import jaxpr_split
from triax.pipeline.buffers import nbytes
from triax.pipeline.stage_inputs import StageInputs, leaf_positions
from triax.pipeline.stash_layout import StashLayout


def _sds(t):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), t)


def _has_matmul(jaxpr) -> bool:
    return any(e.primitive.name in jaxpr_split.MATMULS
               or any(_has_matmul(getattr(j, "jaxpr", j)) for j in jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


@dataclass(frozen=True, eq=False)
class Residuals:
    """The stash layout of one forward's pullback: which leaves to store, their shapes.
    ``jax.vjp``'s pullback as flat arrays, less the leaves that are the parameters
    themselves (re-inserted at backward time, never copied).

    ``apply(chunk, pieces, x, extras) -> (y, loss)`` is what is differentiated."""

    treedef: Any
    param_index: tuple            # per pullback leaf: index into the param leaves, or None
    shapes: tuple                 # ShapeDtypeStruct of each stored leaf

    @classmethod
    def trace(cls, apply, chunk, pieces, x, extras):
        """The residuals, and from the same one trace of the forward the jaxpr ``(chunk,
        pieces, x, extras) -> stored leaves`` (what :class:`Rebuild` analyses) and
        ``apply``'s outputs' shapes (``StageBackward.trace`` traced the forward three times
        for these)."""
        info = {}

        def f(chunk, pieces, x, extras):
            out, pullback = jax.vjp(apply, chunk, pieces, x, extras)
            info["out"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), out)
            leaves, info["treedef"] = jax.tree.flatten(pullback)
            info["index"] = _param_index(leaves, (chunk, pieces))
            return [l for l, i in zip(leaves, info["index"]) if i is None]
        traced = jax.jit(f).trace(chunk, pieces, x, extras)   # what jax.eval_shape runs
        res = cls(info["treedef"], tuple(info["index"]), tuple(traced.out_info))
        return res, traced.jaxpr, info["out"]

    def forward(self, apply, chunk, pieces, x, extras):
        """Run the forward; return its outputs and the leaves to stash."""
        out, pullback = jax.vjp(apply, chunk, pieces, x, extras)
        leaves = jax.tree.leaves(pullback)
        if tuple(_param_index(leaves, (chunk, pieces))) != self.param_index:
            raise AssertionError("pullback structure changed between traces")
        return out, [l for l, i in zip(leaves, self.param_index) if i is None]

    def pullback(self, stored, chunk, pieces):
        params = jax.tree.leaves((chunk, pieces))
        it = iter(stored)
        leaves = [next(it) if i is None else params[i] for i in self.param_index]
        return jax.tree.unflatten(self.treedef, leaves)


def _param_index(leaves, params):
    ids = {id(p): k for k, p in enumerate(jax.tree.leaves(params))}
    return [ids.get(id(l)) for l in leaves]


@dataclass(frozen=True, eq=False)
class Rebuild:
    """The residual leaves the backward recomputes: those computed without the stage's input
    activation, from parameters, inputs, constants and flags alone, by no matmul. Stashing
    them would keep a copy per micro-batch in flight of what is the same for all (the
    weights cast to the compute dtype: a copy of the chunk's weights per slot) or cheap."""

    leaves: tuple                 # indices into the residual leaves
    jaxpr: Any                    # ClosedJaxpr: the used inputs -> those leaves
    reads: tuple                  # per flat (chunk, pieces, x, extras) leaf: the jaxpr reads it
    on_last: frozenset            # of the wanted leaves, those the last-chunk flag decides

    @classmethod
    def trace(cls, apply, chunk, pieces, x, extras: StageInputs, wanted,
              closed=None) -> "Rebuild":
        """``wanted``: the residual leaves the backward reads. The leaves that depend on
        ``extras.last`` (the last-chunk flag) are the post-stack's (head, loss). ``closed``:
        the jaxpr of the stored leaves (``Residuals.trace``), else traced here."""
        def stored(chunk, pieces, x, extras):
            _, pullback = jax.vjp(apply, chunk, pieces, x, extras)
            leaves = jax.tree.leaves(pullback)
            return [l for l, i in zip(leaves, _param_index(leaves, (chunk, pieces)))
                    if i is None]
        if closed is None:
            closed = jax.make_jaxpr(stored)(*_sds((chunk, pieces, x, extras)))
        jaxpr, n = closed.jaxpr, len(closed.jaxpr.outvars)
        at = leaf_positions((chunk, pieces, x, extras))   # the jaxpr's invars, by name
        x_in, last_in = jax.tree.leaves(at[2]), at[3].last
        leaves, on_last = [], set()
        for i in wanted:
            one, used = pe.dce_jaxpr(jaxpr, [k == i for k in range(n)])
            if not any(used[k] for k in x_in) and not _has_matmul(one):
                leaves.append(i)
            if used[last_in]:
                on_last.add(i)
        rebuilt, used = pe.dce_jaxpr(jaxpr, [k in leaves for k in range(n)])
        return cls(tuple(leaves), ClosedJaxpr(rebuilt, closed.consts), tuple(used),
                   frozenset(on_last))

    def __call__(self, chunk, pieces, extras) -> list:
        """The recomputed leaves, in ``leaves`` order (the stage's input is never read)."""
        lead, tail = jax.tree.leaves((chunk, pieces)), jax.tree.leaves(extras)
        args = lead + [None] * (len(self.reads) - len(lead) - len(tail)) + tail
        return jaxpr_as_fun(self.jaxpr)(*[a for a, r in zip(args, self.reads) if r])


class SlotInputs(NamedTuple):
    """What a stash slot's layouts are planned from: the stashed leaves' shapes, which of
    them W reads and which are the post-stack's (head), the cut's shapes and which of those
    are the head's."""

    shapes: tuple
    w_reads: tuple
    cut_shapes: tuple
    head: tuple
    cut_head: tuple


def slot_layouts(inputs: SlotInputs, split: bool) -> tuple[StashLayout, StashLayout]:
    """The two slot layouts a stage may allocate: every cell a body cell, and the
    post-stack's residuals (and cut) in head cells; ``split`` (B_in then W) puts the cut
    over the cells of the residuals W does not read."""
    cut = inputs.cut_shapes if split else ()
    return (StashLayout.plan(inputs.shapes, inputs.w_reads, cut),
            StashLayout.plan(inputs.shapes, inputs.w_reads, cut, inputs.head,
                             inputs.cut_head if split else ()))


def pick_layout(layouts, slots: int, head_slots: int):
    """Of ``(body, heads)`` (anything with ``body_bytes`` and ``head_bytes``), the layout that
    holds less in ``slots`` body slots and ``head_slots`` head slots: head cells pay where a
    stage holds few of the last chunk's micro-batches (1F1B and interleaved one, ZB-V two),
    not under ZB-H1 (its last stage holds S)."""
    body, heads = layouts
    size = lambda lay: slots * lay.body_bytes + head_slots * lay.head_bytes  # noqa: E731
    return heads if size(heads) < size(body) else body


@dataclass(frozen=True, eq=False)
class StageBackward:
    """The stash layout of one chunk's forward, and its backward split in two."""

    shapes: tuple                 # ShapeDtypeStructs of the leaves F stashes
    cut_shapes: tuple             # ShapeDtypeStructs of what B_in stashes for W (the cut)
    residuals: Residuals          # every non-parameter pullback leaf
    stashed: tuple                # indices of the residual leaves F stashes
    rebuild: Rebuild              # the residual leaves the backward recomputes
    w_reads: tuple                # per stashed leaf: W reads it (else it is B_in's alone)
    head: tuple                   # per stashed leaf: the post-stack's (the last chunk's only)
    cut_head: tuple               # per cut leaf: the post-stack's (zero unless the last chunk)
    split: jaxpr_split.Split      # the pullback (stored, params, dy, dloss) -> grads, split
    consts: tuple                 # the pullback jaxpr's constants
    grad_trees: tuple             # treedefs of (chunk, pieces)

    @classmethod
    def trace(cls, apply, chunk, pieces, x, extras) -> "StageBackward":
        """``apply(chunk, pieces, x, extras) -> (y, loss)`` is what the backward
        differentiates; the arguments may be arrays, tracers or ShapeDtypeStructs."""
        res, stored, out = Residuals.trace(apply, chunk, pieces, x, extras)
        loss_tree = jax.tree.structure(out[1])
        n_loss = loss_tree.num_leaves   # the loss may be a dict (a MoE's auxiliary losses)

        def pullback(stored, chunk, pieces, dy, *dloss):
            cts = (dy, jax.tree.unflatten(loss_tree, dloss))
            d_chunk, d_pieces, dx, _ = res.pullback(stored, chunk, pieces)(cts)
            return [*jax.tree.leaves((d_chunk, d_pieces)), dx]
        closed = jaxpr_split.inline(jax.make_jaxpr(pullback)(
            list(res.shapes), _sds(chunk), _sds(pieces), _sds(x),
            *[jax.ShapeDtypeStruct((), jnp.float32)] * n_loss))
        n_chunk, n_res = len(jax.tree.leaves(chunk)), len(res.shapes)
        n_params = n_chunk + len(jax.tree.leaves(pieces))
        # W computes the layers' weight gradients, from the F stash (each weight matmul's
        # input is there), the parameters and the cut: what W needs that only B_in computes
        # (each matmul's output cotangent), which then lives in the cells of the residuals
        # B_in alone reads (StashLayout). B_in computes the pre/post-stack's gradients
        # (embedding, final norm, head) itself: deferring the head's one matmul to W would
        # keep the head's residuals and its logits-sized cotangent until W, on every
        # micro-batch of the last chunk a stage holds (ZB-H1's last stage: S), where B_in
        # frees them at once.
        split = jaxpr_split.plan(closed.jaxpr,
                                 b_used=[False] * n_chunk + [True] * (n_params - n_chunk + 1),
                                 w_used=[True] * n_chunk + [False] * (n_params - n_chunk + 1),
                                 avail=[True] * (n_res + n_params) + [False] * (1 + n_loss))
        read = [i for i in range(n_res) if split.b_reads[i] or split.w_reads[i]]
        rebuild = Rebuild.trace(apply, chunk, pieces, x, extras, read, stored)
        stashed = tuple(i for i in read if i not in rebuild.leaves)
        cut = tuple(jax.ShapeDtypeStruct(k.aval.shape, k.aval.dtype) for k in split.cut)
        trees = (jax.tree.structure(chunk), jax.tree.structure(pieces))
        return cls(tuple(res.shapes[i] for i in stashed), cut, res, stashed, rebuild,
                   tuple(split.w_reads[i] for i in stashed),
                   tuple(i in rebuild.on_last for i in stashed),
                   tuple(split.cond_cut(rebuild.on_last)), split, tuple(closed.consts), trees)

    def layout(self, split: bool, slots: int, head_slots: int) -> StashLayout:
        """One slot's cells: the stashed residuals and (``split``: B_in then W) the cut over
        the cells of those W does not read; the post-stack's residuals in head cells (which
        only the last chunk's micro-batches hold, ``head_slots`` of them against ``slots``)
        where that holds less (``pick_layout``)."""
        return pick_layout(self.layouts(split), slots, head_slots)

    def layouts(self, split: bool) -> tuple[StashLayout, StashLayout]:
        """The two slot layouts ``layout`` picks from (``slot_layouts``)."""
        return slot_layouts(self.slot_inputs(), split)

    def slot_inputs(self) -> "SlotInputs":
        """What the slot layouts are planned from."""
        return SlotInputs(self.shapes, self.w_reads, self.cut_shapes, self.head,
                          self.cut_head)

    @property
    def stash_bytes(self) -> int:
        """Bytes F stashes per micro-batch (what the backward reads and cannot recompute)."""
        return sum(map(nbytes, self.shapes))

    @property
    def cut_bytes(self) -> int:
        """Bytes B_in stashes for W per micro-batch."""
        return sum(map(nbytes, self.cut_shapes))

    def forward(self, apply, chunk, pieces, x, extras):
        """``((y, loss), stashed)``: the forward's outputs and the leaves to stash."""
        out, leaves = self.residuals.forward(apply, chunk, pieces, x, extras)
        return out, [leaves[i] for i in self.stashed]

    def _all(self, stashed, chunk, pieces, extras) -> list:
        """Every residual leaf: the stashed, the recomputed, zeros for those never read."""
        leaves = [None] * len(self.residuals.shapes)
        for i, v in zip(self.stashed, stashed):
            leaves[i] = v
        for i, v in zip(self.rebuild.leaves, self.rebuild(chunk, pieces, extras)):
            leaves[i] = v
        return [jnp.zeros(s.shape, s.dtype) if v is None else v
                for v, s in zip(leaves, self.residuals.shapes)]

    def backward(self, stashed, chunk, pieces, extras, dy, dloss):
        """The full backward (1F1B's B): ``(d_chunk, d_pieces, dx)``."""
        stored = self._all(stashed, chunk, pieces, extras)
        d_chunk, d_pieces, dx, _ = self.residuals.pullback(stored, chunk, pieces)((dy, dloss))
        return d_chunk, d_pieces, dx

    def _inputs(self, stashed, chunk, pieces, extras, tail, reads):
        args = [*self._all(stashed, chunk, pieces, extras),
                *jax.tree.leaves((chunk, pieces)), *tail]
        return [a for a, r in zip(args, reads) if r]

    def backward_input(self, stashed, chunk, pieces, extras, dy, dloss):
        """B_in: ``dx`` and the pre/post-stack's gradients, and the cut for W:
        ``(d_pieces, dx, cut)``, the cut matching ``cut_shapes``."""
        args = self._inputs(stashed, chunk, pieces, extras, (dy, *jax.tree.leaves(dloss)),
                            self.split.b_reads)
        outs, cut = jaxpr_split.run_b(self.split, self.consts, args)
        return jax.tree.unflatten(self.grad_trees[1], outs[:-1]), outs[-1], list(cut)

    def backward_weight(self, stashed, cut, chunk, pieces, extras):
        """W: the layers' weight gradients ``d_chunk``, from the stash (only the leaves in
        ``w_reads`` are read: B_in's own may hold the cut by now) and the cut."""
        args = self._inputs(stashed, chunk, pieces, extras, (), self.split.w_reads)
        grads = jaxpr_split.run_w(self.split, self.consts, args, list(cut))
        return jax.tree.unflatten(self.grad_trees[0], grads)
