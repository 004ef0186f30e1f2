"""Shared by the inference tests: a model's weights made once on one device, on the host, so
every engine under test (any mesh) places the same values; the bytes an engine's cache
arrays take on one device."""
import math

import jax

from triax.mesh import make_mesh
from triax.sharding.partition import abstract_model, init_params


def host_params(cfg, devices, seed: int = 0):
    """``cfg``'s initial weights (seed ``seed``) as host arrays."""
    return jax.device_get(init_params(abstract_model(cfg), make_mesh(devices=devices[:1]),
                                      "tp", seed=seed))


def placed_bytes(eng) -> int:
    """Bytes of ``eng``'s KV cache arrays (k and v) on one device, read off their sharding."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in eng.cache.values())
