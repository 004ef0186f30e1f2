"""Load a Hugging Face model directory straight onto a mesh, each process reading only the
slices its own devices hold.

Per Hugging Face tensor, ``jax.make_array_from_callback`` asks for the regions this process's
devices own under the strategy's rules, and each region is read with
``safe_open(...).get_slice`` (``triax.hf.layout.read_region``). A stacked triax parameter
(layers, the fused ``w_in_D2F``, the stacked experts) is zero-initialised on its devices and
filled one HF tensor at a time by a jitted in-place update, so no process ever holds the
whole model, and host memory holds one tensor's slice at a time, not the stack. ``dtype``
(the served dtype, ``bfloat16`` say) is what every parameter is built in on the devices: a
model that fits in bfloat16 never passes through float32 there.

    >>> from triax.mesh import make_mesh
    >>> mesh = make_mesh(tensor=2, devices=jax.devices()[:2])
    >>> cfg, params, report = load("tests/fixtures/hf/llama", mesh)    # doctest: +SKIP
"""
from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from triax.hf.config import model_config, read_config
from triax.hf.files import Checkpoint, HFError
from triax.hf.layout import Source, read_region, sources
from triax.models.config import ModelConfig
from triax.sharding.partition import abstract_model, param_shardings
from triax.sharding.rules import Strategy
from triax.choices import SERVE_STRATEGY


@dataclass(frozen=True)
class LoadReport:
    """What one process read: bytes of tensor data (as stored), seconds, parameters built."""

    bytes_read: int
    seconds: float
    tensors: int


def read_model_config(directory: str, name: Optional[str] = None) -> ModelConfig:
    """The ``ModelConfig`` of an HF directory (named after the directory by default)."""
    name = name or f"hf:{directory.rstrip('/').rsplit('/', 1)[-1]}"
    return model_config(read_config(directory), name=name)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor ``cfg``'s model is built from."""
    return {s.hf_name(li): s.hf_shape for s in sources(cfg) for li in s.lead_indices()}


def _leaves(tree, prefix=()) -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_leaves(v, prefix + (k,)))
        else:
            out["/".join(map(str, prefix + (k,)))] = v
    return out


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        *head, last = path.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = v
    return out


def _from_callback(shape, sharding, read) -> jax.Array:
    cache: dict = {}  # devices holding the same region (replicas) share one read

    def region(index):
        key = tuple((s.start, s.stop) if isinstance(s, slice) else s for s in index)
        if key not in cache:
            cache[key] = read(index)
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, region)


def _shards(mesh, entry) -> int:
    """How many ways a spec entry (None, an axis, or a tuple of axes) splits its dimension."""
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return int(np.prod([mesh.shape[x] for x in axes]))


@functools.lru_cache(maxsize=None)
def _placer(sharding: NamedSharding, shape: tuple, splits: tuple, dtype: str):
    """Jitted ``(zeros, put)`` for one stacked parameter. ``splits[a]`` is how many shards
    stacked axis ``a`` has (1 on body axes); a chunk holds one entry of each shard (size
    ``splits[a]`` on that axis) and ``put(stack, chunk, ks)`` writes it in place (donated) at
    entries ``j·(shape[a]/splits[a]) + ks[a]`` of each stacked axis."""
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    lead = [a for a, n in enumerate(splits) if n]

    def put(stack, chunk, ks):
        split_shape, chunk_shape, starts = [], [], []
        for a, size in enumerate(shape):
            if a in lead:  # this axis as (shards, entries per shard): local to each shard
                split_shape += [splits[a], size // splits[a]]
                chunk_shape += [splits[a], 1]
                starts += [0, ks[lead.index(a)]]
            else:
                split_shape.append(size)
                chunk_shape.append(size)
                starts.append(0)
        out = jax.lax.dynamic_update_slice(stack.reshape(split_shape),
                                           chunk.reshape(chunk_shape), starts)
        return out.reshape(shape)
    return zeros, jax.jit(put, out_shardings=sharding, donate_argnums=0)


def _array(src: Source, sharding: NamedSharding, ckpt: Checkpoint,
           dtype: str = "float32") -> jax.Array:
    """One triax parameter on ``sharding``. A stacked one is built on the devices one chunk at
    a time, a chunk being one HF tensor per shard of the stacked axes (one layer per pipeline
    stage, say), each read only where this process's devices hold it: host memory holds about
    one tensor's slice per device, never the stack."""
    shape = src.triax_shape
    if not src.lead:
        return _from_callback(shape, sharding, lambda index: read_region(
            src, index, ckpt.read).astype(dtype))
    lead_axes = sorted(src._perm[j] for j in range(len(src.lead)))
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    splits = tuple(_shards(sharding.mesh, spec[a]) if a in lead_axes else 0
                   for a in range(len(shape)))
    per = {a: shape[a] // splits[a] for a in lead_axes}   # entries per shard
    chunk_shape = tuple(splits[a] if a in lead_axes else n for a, n in enumerate(shape))
    zeros, put = _placer(sharding, shape, splits, dtype)
    stack = zeros()
    for ks in itertools.product(*(range(per[a]) for a in lead_axes)):
        k = dict(zip(lead_axes, ks))

        def read(index, k=k):
            full = [range(*sl.indices(n)) for sl, n in zip(
                tuple(index) + (slice(None),) * (len(shape) - len(index)), chunk_shape)]
            out = np.empty([len(r) for r in full], dtype)
            for pos in itertools.product(*(range(len(full[a])) for a in lead_axes)):
                region, where = [], []
                for a, r in enumerate(full):
                    if a in k:
                        e = full[a][pos[lead_axes.index(a)]] * per[a] + k[a]
                        region.append(slice(e, e + 1))
                        where.append(slice(pos[lead_axes.index(a)], pos[lead_axes.index(a)] + 1))
                    else:
                        region.append(slice(r.start, r.stop))
                        where.append(slice(None))
                out[tuple(where)] = read_region(src, tuple(region), ckpt.read)
            return out

        chunk = _from_callback(chunk_shape, sharding, read)
        stack = put(stack, chunk, tuple(np.int32(x) for x in ks))
    return stack


def load_params(directory: str, cfg: ModelConfig, mesh: Mesh,
                strategy: str | Strategy = SERVE_STRATEGY, dtype: str = "float32",
                ) -> tuple[dict, LoadReport]:
    """``(params, report)``: ``cfg``'s parameters from ``directory``, sharded on ``mesh``,
    in ``dtype`` (see the module doc)."""
    t0 = time.perf_counter()
    ckpt = Checkpoint(directory)
    ckpt.check(expected_tensors(cfg))
    am = abstract_model(cfg)
    shapes = {p: tuple(s.shape) for p, s in _leaves(am.shapes).items()}
    by_path = {s.path: s for s in sources(cfg)}
    if set(by_path) != set(shapes):  # the model's tree changed: the mapping must follow
        raise HFError(f"triax.hf.layout maps {sorted(set(by_path) ^ set(shapes))} that the "
                      f"model does not have (or misses them); update hf/layout.py")
    for p, shape in shapes.items():
        assert by_path[p].triax_shape == shape, (p, by_path[p].triax_shape, shape)
    shardings = _leaves(param_shardings(am, mesh, strategy))
    dtype = jnp.dtype(dtype).name
    flat = {p: _array(by_path[p], shardings[p], ckpt, dtype) for p in shapes}
    jax.block_until_ready(list(flat.values()))
    report = LoadReport(ckpt.bytes_read, time.perf_counter() - t0, len(flat))
    ckpt.close()
    return _nest(flat), report


def load(directory: str, mesh: Mesh, strategy: str | Strategy = SERVE_STRATEGY,
         name: Optional[str] = None, dtype: str = "float32"
         ) -> tuple[ModelConfig, dict, LoadReport]:
    """``(cfg, params, report)`` of the HF model in ``directory`` on ``mesh``, in ``dtype``."""
    cfg = read_model_config(directory, name)
    params, report = load_params(directory, cfg, mesh, strategy, dtype)
    return cfg, params, report


def tensor_placement(params: dict) -> list[tuple[str, tuple, str]]:
    """``(path, shape, PartitionSpec)`` of every loaded parameter (where it landed)."""
    return [(p, tuple(a.shape), str(a.sharding.spec)) for p, a in _leaves(params).items()]


__all__ = ["LoadReport", "expected_tensors", "load", "load_params", "read_model_config",
           "tensor_placement"]
