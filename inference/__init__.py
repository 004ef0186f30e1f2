"""Generation with a KV cache on any mesh: tensor parallel, replicas, pipeline decode.

    >>> from triax.inference import replica_meshes
    >>> [dict(m.shape)["tensor"] for m in replica_meshes({"tensor": 2}, replicas=4)]
    [2, 2, 2, 2]

``Server`` serves requests on such replicas (see ``inference.server`` for an example that
runs), ``Engine`` is one replica, ``generate`` the one-call form. See docs/inference.md.

The names are loaded on first use (as ``triax``'s are): the KV pool's home
(``inference.kv_pool``) sits below the planner's analytic model, which counts that pool, so
importing it must not load the engine and server above (tests/test_layering.py).
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "CheckpointLoadError": "checkpoint", "load_params": "checkpoint", "save_params": "checkpoint",
    "CacheFullError": "engine", "Engine": "engine", "EngineConfig": "engine",
    "InferenceError": "engine", "build_server": "generate", "generate": "generate",
    "greedy_reference": "reference", "SamplingConfig": "sampling", "SamplingError": "sampling",
    "sample": "sampling", "replica_meshes": "replicas", "split_devices": "replicas",
    "QueueFullError": "request", "Result": "request", "Server": "server",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        module = importlib.import_module(f"triax.inference.{_PUBLIC[name]}")
        # Bind every name of that module, so the function ``generate`` replaces the
        # submodule of the same name that loading it set on this package.
        globals().update({n: getattr(module, n) for n, m in _PUBLIC.items()
                          if m == _PUBLIC[name]})
        return globals()[name]
    raise AttributeError(f"module 'triax.inference' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
