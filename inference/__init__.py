"""Generation with a KV cache on any mesh: tensor parallel, replicas, pipeline decode.

    >>> from triax.inference import replica_meshes
    >>> [dict(m.shape)["tensor"] for m in replica_meshes({"tensor": 2}, replicas=4)]
    [2, 2, 2, 2]

``Server`` serves requests on such replicas (see ``inference.server`` for an example that
runs), ``Engine`` is one replica, ``generate`` the one-call form. See docs/inference.md.
"""
from triax.inference.checkpoint import CheckpointLoadError, load_params, save_params
from triax.inference.engine import CacheFullError, Engine, EngineConfig, InferenceError
from triax.inference.generate import build_server, generate
from triax.inference.reference import greedy_reference
from triax.inference.sampling import SamplingConfig, SamplingError, sample
from triax.inference.replicas import replica_meshes, split_devices
from triax.inference.request import QueueFullError, Result
from triax.inference.server import Server

__all__ = ["CacheFullError", "CheckpointLoadError", "Engine", "EngineConfig", "InferenceError",
           "QueueFullError", "Result", "SamplingConfig", "SamplingError", "Server",
           "build_server", "generate", "greedy_reference", "load_params", "replica_meshes",
           "sample", "save_params", "split_devices"]
