"""Load a Hugging Face model directory straight onto a mesh, each process reading only the
slices its own devices hold.

For every triax parameter, ``jax.make_array_from_callback`` asks for the regions this
process's devices own under the strategy's rules; each region is read from the HF tensors it
covers with ``safe_open(...).get_slice`` (``triax.hf.layout.read_region``), so stacked layers,
the fused ``w_in_D2F`` and the stacked experts are assembled slice by slice and no process
ever holds the whole model. Host memory peaks at one device's region of one parameter.

    >>> from triax.mesh import make_mesh
    >>> mesh = make_mesh(tensor=2, devices=jax.devices()[:2])
    >>> cfg, params, report = load("tests/fixtures/hf/llama", mesh)    # doctest: +SKIP
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import jax
from jax.sharding import Mesh

from triax.hf.config import model_config, read_config
from triax.hf.files import Checkpoint, HFError
from triax.hf.layout import Source, read_region, sources
from triax.models.config import ModelConfig
from triax.sharding.partition import abstract_model, param_shardings
from triax.sharding.rules import Strategy


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


def _array(src: Source, sharding, ckpt: Checkpoint) -> jax.Array:
    cache: dict = {}  # devices holding the same region (replicas) share one read

    def region(index):
        key = tuple((s.start, s.stop) if isinstance(s, slice) else s for s in index)
        if key not in cache:
            cache[key] = read_region(src, index, ckpt.read)
        return cache[key]

    return jax.make_array_from_callback(src.triax_shape, sharding, region)


def load_params(directory: str, cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy = "tp",
                ) -> tuple[dict, LoadReport]:
    """``(params, report)``: ``cfg``'s parameters from ``directory``, sharded on ``mesh``."""
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
    flat = {p: _array(by_path[p], shardings[p], ckpt) for p in shapes}
    jax.block_until_ready(list(flat.values()))
    report = LoadReport(ckpt.bytes_read, time.perf_counter() - t0, len(flat))
    ckpt.close()
    return _nest(flat), report


def load(directory: str, mesh: Mesh, strategy: str | Strategy = "tp",
         name: Optional[str] = None) -> tuple[ModelConfig, dict, LoadReport]:
    """``(cfg, params, report)`` of the HF model in ``directory`` on ``mesh``."""
    cfg = read_model_config(directory, name)
    params, report = load_params(directory, cfg, mesh, strategy)
    return cfg, params, report


def tensor_placement(params: dict) -> list[tuple[str, tuple, str]]:
    """``(path, shape, PartitionSpec)`` of every loaded parameter (where it landed)."""
    return [(p, tuple(a.shape), str(a.sharding.spec)) for p, a in _leaves(params).items()]


__all__ = ["LoadReport", "expected_tensors", "load", "load_params", "read_model_config",
           "tensor_placement"]
