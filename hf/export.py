"""Write triax parameters as a Hugging Face model directory that ``transformers`` loads.

``config.json`` (``triax.hf.config.hf_config``), safetensors shards of at most
``max_shard_size`` bytes with ``model.safetensors.index.json`` (one ``model.safetensors``
when everything fits in one), and the tokenizer files when given. Each HF tensor is gathered
from the mesh on its own (a jitted slice of one layer / expert, then to host) and streamed
into its shard, so host memory stays at one tensor. The directory is built beside the target
and renamed into place at the end: a failure leaves nothing half-written. It and its files
get the modes the user's umask gives (:func:`umask_mode`), not ``mkdtemp``'s private 0700.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> from triax.sharding.partition import abstract_model, init_params
    >>> cfg = config.get("tiny", num_layers=1)
    >>> params = init_params(abstract_model(cfg), make_mesh(devices=jax.devices()[:1]), "tp")
    >>> files = export(params, cfg, "out", max_shard_size=200_000)
    >>> files[:2]
    ['config.json', 'model-00001-of-00002.safetensors']
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import tempfile
from typing import Iterable, Sequence

import jax
import numpy as np

from triax.hf.config import CONFIG, hf_config
from triax.hf.files import INDEX, SINGLE, HFError
from triax.hf.layout import Source, lead_position, sources, to_hf
from triax.models.config import ModelConfig
from triax.units import parse_bytes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_DTYPES = {np.dtype(np.float32): "F32"}


def _leaf(params: dict, path: str):
    for k in path.split("/"):
        params = params[k]
    return params


@functools.partial(jax.jit, static_argnums=(2,))
def _take(arr, idx, axes: tuple[int, ...]):
    """``arr`` at integer ``idx`` on ``axes`` (one compile per parameter shape)."""
    for i, a in sorted(zip(idx, axes), key=lambda t: -t[1]):
        arr = jax.lax.dynamic_index_in_dim(arr, i, a, keepdims=False)
    return arr


def _gather(arr: jax.Array, src: Source, lead_index: tuple) -> np.ndarray:
    if not lead_index:
        return np.asarray(arr)
    pos = lead_position(src, lead_index)
    axes = tuple(i for i, p in enumerate(pos) if not isinstance(p, slice))
    return np.asarray(_take(arr, tuple(np.int32(p) for p in pos if not isinstance(p, slice)),
                            axes))


def _plan(cfg: ModelConfig, max_shard_size: int) -> list[list[tuple]]:
    """Tensors (name, source, lead index, shape) packed in order into shards."""
    shards: list[list[tuple]] = [[]]
    size = 0
    for src in sources(cfg):
        for li in src.lead_indices():
            nbytes = 4 * int(np.prod(src.hf_shape))
            if shards[-1] and size + nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append((src.hf_name(li), src, li, src.hf_shape))
            size += nbytes
    return shards


def _write_shard(path: str, tensors: Sequence[tuple], params: dict) -> None:
    """A safetensors file written tensor by tensor (the header is known from the shapes)."""
    header, offset = {}, 0
    for name, _, _, shape in tensors:
        nbytes = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        for name, src, li, shape in tensors:
            x = to_hf(src, _gather(_leaf(params, src.path), src, li))
            assert x.shape == tuple(shape) and x.dtype == np.float32, (name, x.shape, x.dtype)
            fh.write(x.tobytes())


def umask_mode(path: str) -> None:
    """Give ``path`` the mode the user's umask gives a new one: 0o777 less it for a
    directory, 0o666 less it for a file (``mkdtemp`` makes 0700, safetensors writes 0600)."""
    mask = os.umask(0)   # the only way to read it; set straight back
    os.umask(mask)
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)


def check_target(out_dir: str, overwrite: bool) -> None:
    """Refuse a non-empty ``out_dir`` unless ``overwrite`` (then it is replaced whole)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise HFError(f"--out {out_dir!r} is a file; give a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise HFError(f"--out {out_dir!r} is not empty (it holds "
                      f"{sorted(os.listdir(out_dir))[:3]}); pass --overwrite to replace it, "
                      f"or choose a new directory")


def export(params: dict, cfg: ModelConfig, out_dir: str, max_shard_size: int | str = "5GB",
           tokenizer_files: Iterable[str] = (), overwrite: bool = False) -> list[str]:
    """Write ``params`` (of ``cfg``, on any single-process mesh) to ``out_dir``; returns the
    files written."""
    if jax.process_count() > 1:
        raise HFError("export runs in one process (it gathers each tensor to this host)")
    check_target(out_dir, overwrite)
    limit = parse_bytes(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if limit <= 0:
        raise HFError(f"--max-shard-size {max_shard_size!r} must be positive")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        shards = _plan(cfg, limit)
        n = len(shards)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                         for i in range(n)]
        for fname, tensors in zip(names, shards):
            _write_shard(os.path.join(tmp, fname), tensors, params)
        if n > 1:
            total = sum(4 * int(np.prod(t[3])) for s in shards for t in s)
            index = {"metadata": {"total_size": total},
                     "weight_map": {t[0]: f for f, s in zip(names, shards) for t in s}}
            with open(os.path.join(tmp, INDEX), "w") as fh:
                json.dump(index, fh, indent=2)
        with open(os.path.join(tmp, CONFIG), "w") as fh:
            json.dump(hf_config(cfg), fh, indent=2)
        for f in tokenizer_files:
            shutil.copy(f, os.path.join(tmp, os.path.basename(f)))
        for f in os.listdir(tmp) + [""]:   # every file, then the directory itself
            umask_mode(os.path.join(tmp, f))
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(os.listdir(out_dir))


def tokenizer_files_in(path: str) -> list[str]:
    """The tokenizer files beside (or in) ``path``: a directory or a ``tokenizer.json``."""
    d = path if os.path.isdir(path) else os.path.dirname(path)
    return [os.path.join(d, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(d, f))]
