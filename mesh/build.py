"""Mesh construction: named axes, topology-aware device order, hybrid (node-aware) meshes.

Axis order is fixed: ``replica`` outermost (slowest links: HSDP's replica groups, which
exchange one all-reduce of the sharded gradients per step), then ``data``, ``pipe``,
``expert``, ``context`` and ``tensor`` innermost, so tensor-parallel collectives stay on the
fastest links and context groups (a ring of K/V passes every layer) sit right beside them.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

AXES: tuple[str, ...] = ("replica", "data", "pipe", "expert", "context", "tensor")


def resolve_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fill in missing axes (1) and one ``-1`` axis; check the product against the devices."""
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axis {sorted(unknown)}; mesh axes are {', '.join(AXES)}")
    out = {a: int(sizes.get(a, 1)) for a in AXES}
    fill = [a for a, s in out.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"only one mesh axis may be -1 (fill), got {fill}")
    bad = [a for a, s in out.items() if s == 0 or s < -1]
    if bad:
        raise ValueError(f"mesh axis sizes must be positive (or -1 to fill): {bad}")
    known = math.prod(s for s in out.values() if s != -1)
    if fill:
        if num_devices % known:
            raise ValueError(
                f"cannot fill mesh axis {fill[0]!r}: the other axes multiply to {known}, "
                f"which does not divide the {num_devices} devices")
        out[fill[0]] = num_devices // known
    product = math.prod(out.values())
    if product != num_devices:
        desc = ",".join(f"{a}={s}" for a, s in out.items() if s != 1) or "all axes 1"
        raise ValueError(
            f"mesh {desc} multiplies to {product} devices, but JAX sees {num_devices} "
            f"device(s); choose sizes whose product is {num_devices}")
    return out


def make_mesh(data: int = 1, tensor: int = 1, pipe: int = 1, expert: int = 1,
              devices: Sequence[jax.Device] | None = None, context: int = 1,
              replica: int = 1) -> Mesh:
    """Build a ``Mesh`` over ``(replica, data, pipe, expert, context, tensor)`` with Auto
    axis types.

    Auto axes let XLA's SPMD partitioner insert the collectives. One size may be -1.
    ``replica`` is a batch axis that no parameter rule names: under FSDP it makes HSDP
    (parameters sharded over ``data`` within a group, replicated across groups).

    >>> mesh = make_mesh(data=-1)          # all devices on `data`
    >>> mesh.axis_names
    ('replica', 'data', 'pipe', 'expert', 'context', 'tensor')
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_sizes(dict(data=data, tensor=tensor, pipe=pipe, expert=expert,
                               context=context, replica=replica), len(devices))
    shape = tuple(sizes[a] for a in AXES)
    try:
        arr = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def make_hybrid_mesh(data: int = 1, tensor: int = 1, pipe: int = 1, expert: int = 1,
                     devices: Sequence[jax.Device] | None = None,
                     num_nodes: int | None = None, context: int = 1,
                     replica: int = 1) -> Mesh:
    """A (within node) × (across nodes) mesh: ``tensor`` never crosses a node boundary.

    Nodes are ``process_index`` groups (or ``slice_index`` on TPU). ``tensor`` must divide
    the per-node device count; ``replica``, then ``data``, then ``pipe`` absorb the
    across-node factor (HSDP's replica groups span nodes, its shard groups stay inside).

    >>> import jax
    >>> m = make_hybrid_mesh(replica=2, data=4, devices=jax.devices()[:8], num_nodes=2)
    >>> [sorted({d.id // 4 for d in m.devices[r].flat}) for r in range(2)]   # node per replica
    [[0], [1]]
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_sizes(dict(data=data, tensor=tensor, pipe=pipe, expert=expert,
                               context=context, replica=replica), len(devices))
    groups = _node_groups(devices, num_nodes)
    per_node = len(groups[0])
    nodes = len(groups)
    if per_node % sizes["tensor"]:
        raise ValueError(
            f"tensor={sizes['tensor']} does not divide the {per_node} devices per node; "
            f"tensor parallelism must stay within a node (choose tensor dividing {per_node})")
    # Split the across-node factor off the outer axes, outermost first.
    across, remaining = {}, nodes
    for a in ("replica", "data", "pipe", "expert"):
        g = math.gcd(sizes[a], remaining)
        across[a], remaining = g, remaining // g
    if remaining != 1:
        raise ValueError(
            f"cannot lay mesh {sizes} over {nodes} nodes of {per_node} devices without "
            f"tensor crossing nodes; make replica*data*pipe*expert a multiple of {nodes}")
    within = {a: sizes[a] // across.get(a, 1) for a in AXES}
    node_arr = np.asarray([np.asarray(g, dtype=object).reshape([within[a] for a in AXES])
                           for g in groups], dtype=object)
    node_arr = node_arr.reshape([across.get(a, 1) for a in AXES] + [within[a] for a in AXES])
    n = len(AXES)
    perm = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
    arr = node_arr.transpose(perm).reshape([sizes[a] for a in AXES])
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _node_groups(devices, num_nodes):
    if num_nodes is not None:
        if len(devices) % num_nodes:
            raise ValueError(f"{len(devices)} devices do not split into {num_nodes} equal nodes")
        k = len(devices) // num_nodes
        return [devices[i * k:(i + 1) * k] for i in range(num_nodes)]
    key = (lambda d: getattr(d, "slice_index", None) or 0) if any(
        getattr(d, "slice_index", None) for d in devices) else (lambda d: d.process_index)
    groups: dict[int, list] = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    out = [groups[k] for k in sorted(groups)]
    if len({len(g) for g in out}) != 1:
        raise ValueError(f"nodes hold unequal device counts: {[len(g) for g in out]}")
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """Parse the CLI form ``data=2,tensor=2,pipe=2`` (axes left out are 1)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--mesh expects axis=size pairs like data=2,tensor=4; got {part!r}")
        name = name.strip()
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r} in --mesh; axes are {', '.join(AXES)}")
        if name in out:
            raise ValueError(f"mesh axis {name!r} given twice in --mesh")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name}={value!r}: size must be an integer") from None
    return out


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """Axis name → size; an ``AbstractMesh`` (no devices) answers too, as the planner's do."""
    return dict(mesh.shape)


def describe(mesh: Mesh) -> str:
    """The mesh in words, axes of size 1 left out: ``"data=2 × tensor=4"`` (or ``"1 device"``)."""
    return " × ".join(f"{a}={s}" for a, s in mesh_sizes(mesh).items() if s > 1) or "1 device"
