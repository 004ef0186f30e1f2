"""FSDP inside the pipeline's ``shard_map``: which parameter dims are split over the manual
`data` axis, and the once-per-step gather of them (and the gradients' reduce-scatter) that
keeps every other split, ``tensor`` above all, inside the stage.

    >>> from jax.sharding import PartitionSpec as P
    >>> spec = P("data", "tensor")           # wq under fsdp_tp: embed over data, heads over tensor
    >>> manual_spec(spec), auto_spec(spec), data_dim(spec)
    (P('data', None), P(None, 'tensor'), 0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
from jax.sharding import PartitionSpec as P

from triax.pipeline.executor import DATA, PIPE
from triax.pipeline.schedules import OpKind

# FSDP by layer: per op kind, how often it gathers each layer of its chunk over `data` (F
# runs the layer; B and B_in make it again for the input gradient; W's weight-gradient
# matmuls read activations and cotangents only, so it gathers nothing), and how often it
# reduce-scatters the layer's gradient (where the weight gradients are made).
LAYER_GATHERS = {OpKind.F: 1, OpKind.B: 1, OpKind.B_IN: 1, OpKind.W: 0}
LAYER_SCATTERS = {OpKind.F: 0, OpKind.B: 1, OpKind.B_IN: 0, OpKind.W: 1}


def layer_passes(split_backward: bool, microbatches: int, backward: bool = True):
    """``(gathers, reduce-scatters)`` of each layer per step under FSDP by layer: every
    micro-batch passes each chunk once per op kind (F, then B, or B_in and W)."""
    kinds = [OpKind.F] + ([] if not backward else
                          [OpKind.B_IN, OpKind.W] if split_backward else [OpKind.B])
    return (microbatches * sum(LAYER_GATHERS[k] for k in kinds),
            microbatches * sum(LAYER_SCATTERS[k] for k in kinds))


def _axes(entry) -> tuple:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def manual_spec(spec: P, lead: tuple = ()) -> P:
    """Keep only the manual axes (`data`) of a parameter spec, after ``lead`` entries."""
    return P(*lead, *(DATA if DATA in _axes(e) else None for e in spec))


def auto_spec(spec: P) -> P:
    """The rest of a parameter spec: the axes the pipeline's ``shard_map`` leaves automatic
    (``tensor``, ``expert``). A dim split over `data` and others must have `data` minor, so a
    gather over `data` alone leaves a block of the others."""
    keep = []
    for e in spec:
        axes = _axes(e)
        if DATA in axes and axes[-1] != DATA:
            raise ValueError(f"parameter spec {spec}: a dimension split over {axes} gathers "
                             f"over data in the pipeline only with data last; write "
                             f"{tuple(a for a in axes if a != DATA) + (DATA,)}")
        rest = tuple(a for a in axes if a not in (DATA, PIPE))
        keep.append(rest[0] if len(rest) == 1 else (rest or None))
    return P(*keep)


def data_dim(spec: P) -> Optional[int]:
    for i, e in enumerate(spec):
        if DATA in _axes(e):
            return i
    return None


@dataclass(frozen=True, eq=False)
class FSDP:
    """Per leaf: its `data`-sharded dim (None: replicated over data) and its spec over the
    automatic axes (``tensor``, ``expert``)."""

    dims: Any
    auto: Any

    @property
    def splits(self) -> bool:
        """Some leaf is split over `data` (the gather makes a copy of it)."""
        return any(d is not None for d in jax.tree.leaves(self.dims, is_leaf=lambda x: x is None))

    def _local(self, fn, tree):
        """Run ``fn(tree)`` manual over the automatic axes too, on each leaf's local block:
        a collective over `data` in the partially manual region would first gather the
        automatic axes (XLA replicates them around a manual collective), and tensor
        parallelism would be lost inside the stage."""
        mesh = jax.sharding.get_abstract_mesh()
        auto = set(mesh.axis_names) - set(mesh.manual_axes)
        if not auto or all(d is None for d in jax.tree.leaves(
                self.dims, is_leaf=lambda x: x is None)):
            return fn(tree)
        return jax.shard_map(fn, mesh=mesh, axis_names=auto, in_specs=(self.auto,),
                             out_specs=self.auto, check_vma=False)(tree)

    def gather(self, tree):
        """All-gather the `data`-sharded dimension once per step (outside the tick loop)."""
        return self._local(lambda t: jax.tree.map(
            lambda a, d: a if d is None else jax.lax.all_gather(a, DATA, axis=d, tiled=True),
            t, self.dims), tree)

    def gather_layer(self, layer):
        """FSDP by layer: one layer's parameters (any pytree whose leaves are in this
        FSDP's leaf order, e.g. the stack scan's ``nnx.State`` slice) gathered over `data`
        as an op runs it. Its transpose reduce-scatters the layer's gradient at once."""
        leaves, tree = jax.tree.flatten(layer)
        return jax.tree.unflatten(tree, self.gather(leaves))

    def reduce_unsplit(self, tree):
        """FSDP by layer's step-end reduction: the leaves not split over `data` are summed
        over it; the split ones were reduce-scattered per layer as they were made."""
        return self._local(lambda t: jax.tree.map(
            lambda g, d: jax.lax.psum(g, DATA) if d is None else g, t, self.dims), tree)

    def reduce(self, tree):
        """The one data-parallel gradient reduction of the step (reduce-scatter under FSDP)."""
        return self._local(lambda t: jax.tree.map(
            lambda g, d: jax.lax.psum(g, DATA) if d is None else
            jax.lax.psum_scatter(g, DATA, scatter_dimension=d, tiled=True), t, self.dims),
            tree)
