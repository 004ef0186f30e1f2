"""Devices into replicas: equal groups, or one layout per replica, one mesh each.

    >>> [len(g) for g in split_devices(list(range(8)), 4)]
    [2, 2, 2, 2]
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import jax
import numpy as np

from triax.inference.engine import InferenceError
from triax.mesh.build import make_mesh


def split_devices(devices: Sequence, replicas: int) -> list[list]:
    """Split ``devices`` into ``replicas`` equal contiguous groups (one per replica)."""
    n = len(devices)
    if replicas < 1 or n % replicas:
        raise InferenceError(f"--replicas {replicas} does not divide the {n} devices; choose a "
                             f"divisor of {n} ({', '.join(str(d) for d in range(1, n + 1) if n % d == 0)})")
    k = n // replicas
    return [list(devices[i * k:(i + 1) * k]) for i in range(replicas)]


def default_replicas(mesh_sizes: Mapping[str, int], n_devices: int) -> int:
    """``--replicas`` left out: as many replicas of ``--mesh`` as the devices hold (1 when the
    mesh has a -1 axis or is not given, i.e. it fills the devices).

    >>> default_replicas({"tensor": 2}, 8), default_replicas({}, 8)
    (4, 1)
    """
    per = math.prod(mesh_sizes.values())   # {}: tensor over every device, one replica
    return n_devices // per if mesh_sizes and per > 0 and n_devices % per == 0 else 1


def replica_meshes(mesh_sizes: Mapping[str, int] | Sequence[Mapping[str, int]],
                   replicas: Optional[int], devices=None) -> list:
    """One mesh per replica; ``mesh_sizes`` describes a single replica (missing axes are 1),
    or is a list with one layout per replica (e.g. ``[{"pipe": 2}, {"context": 2}]``), which
    take consecutive devices. ``replicas`` None: ``default_replicas``."""
    devices = list(jax.devices() if devices is None else devices)
    if replicas is None:
        replicas = (1 if not isinstance(mesh_sizes, Mapping)
                    else default_replicas(mesh_sizes, len(devices)))
    if not isinstance(mesh_sizes, Mapping):
        layouts = [dict(m) for m in mesh_sizes]
        if replicas not in (1, len(layouts)):
            raise InferenceError(f"{len(layouts)} replica layouts but --replicas {replicas}; "
                                 f"give one layout per replica (or leave --replicas out)")
        per = [math.prod(m.values()) for m in layouts]
        if any(n < 1 for n in per) or sum(per) != len(devices):
            raise InferenceError(
                f"the replica layouts take {'+'.join(map(str, per))} devices but there are "
                f"{len(devices)}; give every axis size (no -1) so that they add up to "
                f"{len(devices)}")
        starts = np.cumsum([0] + per)
        return [make_mesh(devices=devices[a:b], **m)
                for m, a, b in zip(layouts, starts[:-1], starts[1:])]
    groups = split_devices(devices, replicas)
    per = math.prod(mesh_sizes.values())
    if per > 0 and per != len(groups[0]):  # (a -1 axis fills the replica's devices)
        desc = ",".join(f"{a}={n}" for a, n in mesh_sizes.items()) or "one device"
        raise InferenceError(
            f"--mesh {desc} has {per} device(s) per replica, but {len(devices)} devices split "
            f"into {replicas} replica(s) give {len(groups[0])} each; choose --mesh and "
            f"--replicas whose product is {len(devices)}")
    return [make_mesh(devices=g, **dict(mesh_sizes)) for g in groups]
