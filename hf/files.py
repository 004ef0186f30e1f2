"""A Hugging Face model directory's safetensors files: which file holds which tensor, checked
before anything is read, and sliced reads that count their bytes.

Opening a :class:`Checkpoint` reads only headers (``model.safetensors`` or
``model.safetensors.index.json`` and the shards it names) and checks that every tensor the
model needs is there with its shape and a dtype that casts to float32, so a bad directory
fails before any device memory is spent. ``read(name, slices)`` then reads only that region
(``safe_open(...).get_slice``), as float32.

    >>> import numpy as np, safetensors.numpy
    >>> safetensors.numpy.save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
    ...                             "model.safetensors")
    >>> ckpt = Checkpoint(".")
    >>> ckpt.read("w", (slice(1, 2), slice(0, 2))), ckpt.bytes_read
    (array([[3., 4.]], dtype=float32), 8)
"""
from __future__ import annotations

import json
import os
import threading
from typing import Mapping, Optional

import numpy as np
from safetensors import SafetensorError, safe_open

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# safetensors dtypes that cast exactly (or by rounding, F64) to triax's float32 parameters.
CASTABLE = {"F16", "BF16", "F32", "F64"}


class HFError(ValueError):
    """A Hugging Face directory, config or tensor that triax cannot use; says the fix."""


class Checkpoint:
    """The safetensors of ``directory``: tensor -> file, headers checked, sliced reads."""

    def __init__(self, directory: str):
        self.directory = directory
        self.file_of = self._file_map()
        self.headers: dict[str, tuple[tuple[int, ...], str]] = {}
        self._handles: dict[str, object] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        for f in sorted(set(self.file_of.values())):
            for name, (shape, dtype) in self._header(f).items():
                if self.file_of.get(name, f) == f:
                    self.headers[name] = (shape, dtype)
        missing = sorted(n for n in self.file_of if n not in self.headers)
        if missing:
            raise HFError(f"{os.path.join(directory, INDEX)} maps {missing[:3]} to shards that "
                          f"do not hold them; the index and the shards disagree (re-download "
                          f"or re-export the model)")

    def _file_map(self) -> dict[str, str]:
        index = os.path.join(self.directory, INDEX)
        single = os.path.join(self.directory, SINGLE)
        if os.path.exists(index):
            try:
                with open(index) as fh:
                    weight_map = json.load(fh)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise HFError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); "
                              f"it needs a 'weight_map' of tensor name -> shard file") from None
            absent = sorted({f for f in weight_map.values()
                             if not os.path.isfile(os.path.join(self.directory, f))})
            if absent:
                raise HFError(f"{index} names shard(s) {absent} that are not in "
                              f"{self.directory}; download the missing files")
            return dict(weight_map)
        if os.path.exists(single):
            return {n: SINGLE for n in self._header(SINGLE)}
        raise HFError(f"{self.directory} has neither {SINGLE} nor {INDEX}; triax reads "
                      f"safetensors weights only (convert .bin files with transformers' "
                      f"save_pretrained(safe_serialization=True))")

    def _header(self, file: str) -> dict[str, tuple[tuple[int, ...], str]]:
        path = os.path.join(self.directory, file)
        try:
            with safe_open(path, "np") as f:
                return {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype())
                        for n in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise HFError(f"cannot read safetensors file {path} ({type(e).__name__}: "
                          f"{str(e).strip()[:200]}); the file is missing or corrupt, "
                          f"re-download it") from None

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Every tensor of ``expected`` present, with that shape and a castable dtype."""
        missing = sorted(n for n in expected if n not in self.headers)
        if missing:
            raise HFError(f"{self.directory} lacks tensor(s) {missing[:5]}"
                          f"{' …' if len(missing) > 5 else ''} that the config's model needs; "
                          f"the weights do not match config.json")
        for name, shape in expected.items():
            got, dtype = self.headers[name]
            if tuple(got) != tuple(shape):
                raise HFError(f"tensor {name!r} in {self.file_of[name]} has shape {list(got)} "
                              f"but config.json implies {list(shape)}; the weights do not "
                              f"match the config")
            if dtype not in CASTABLE:
                raise HFError(f"tensor {name!r} in {self.file_of[name]} has dtype {dtype}, "
                              f"which triax cannot cast to its float32 parameters (use one "
                              f"of {', '.join(sorted(CASTABLE))}; dequantize quantized weights "
                              f"first)")

    def _handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(os.path.join(self.directory, file), "np")
        return h

    def read(self, name: str, slices: Optional[tuple] = None) -> np.ndarray:
        """The region ``slices`` of tensor ``name`` as float32 (reads only that region)."""
        with self._lock:  # callbacks may come from several threads
            part = self._handle(self.file_of[name]).get_slice(name)
            x = part[slices] if slices else part[:]
            self.bytes_read += x.nbytes
        return np.asarray(x, np.float32)

    def close(self) -> None:
        self._handles.clear()
