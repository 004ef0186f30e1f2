"""Where every parameter lives: logical axes, PartitionSpec, global and per-device shapes."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from triax.sharding.partition import AbstractModel, param_shardings, path_str


@dataclass(frozen=True)
class ParamPlacement:
    path: str
    logical_axes: tuple
    spec: tuple
    global_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    bytes_per_device: int

    def to_json(self) -> dict:
        return {"path": self.path, "logical_axes": list(self.logical_axes),
                "spec": [list(e) if isinstance(e, tuple) else e for e in self.spec],
                "global_shape": list(self.global_shape), "shard_shape": list(self.shard_shape),
                "bytes_per_device": self.bytes_per_device}


def placement_table(am: AbstractModel, mesh, strategy, optimizer: bool = False
                    ) -> list[ParamPlacement]:
    """One row per parameter, in tree order.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> from triax.sharding.partition import abstract_model
    >>> rows = placement_table(abstract_model(config.TINY), make_mesh(tensor=8), "tp")
    >>> [(r.path, r.spec, r.shard_shape) for r in rows if r.path == "head_DV"]
    [('head_DV', (None, 'tensor'), (64, 33))]
    """
    shardings = param_shardings(am, mesh, strategy, optimizer=optimizer)
    flat_shapes = jax.tree_util.tree_flatten_with_path(am.shapes)[0]
    flat_logical = jax.tree.leaves(am.logical, is_leaf=lambda x: isinstance(x, tuple))
    rows = []
    for (path, sd), logical, sh in zip(flat_shapes, flat_logical, jax.tree.leaves(shardings)):
        shard = tuple(sh.shard_shape(sd.shape))
        rows.append(ParamPlacement(
            path=path_str(path), logical_axes=tuple(logical), spec=tuple(sh.spec),
            global_shape=tuple(sd.shape), shard_shape=shard,
            bytes_per_device=int(np.prod(shard)) * sd.dtype.itemsize))
    return rows
