"""Generation with a KV cache on any mesh: tensor parallel, replicas, pipeline decode.

    >>> from triax.inference import Server, SamplingConfig
    >>> from triax.models import config
    >>> import jax
    >>> server = Server.from_seed(config.TINY, replicas=1, mesh_sizes={"tensor": 2},
    ...                           devices=jax.devices()[:2])
    >>> rid = server.submit([72, 105], max_new_tokens=8)
    >>> len(server.run()[rid].tokens)
    8

See docs/inference.md.
"""
from triax.inference.checkpoint import CheckpointLoadError, load_params, save_params
from triax.inference.engine import CacheFullError, Engine, EngineConfig, InferenceError
from triax.inference.generate import build_server, generate
from triax.inference.reference import greedy_reference
from triax.inference.sampling import SamplingConfig, SamplingError, sample
from triax.inference.server import Result, Server, replica_meshes, split_devices

__all__ = ["CacheFullError", "CheckpointLoadError", "Engine", "EngineConfig", "InferenceError",
           "Result", "SamplingConfig", "SamplingError", "Server", "build_server", "generate",
           "greedy_reference", "load_params", "replica_meshes", "sample", "save_params",
           "split_devices"]
