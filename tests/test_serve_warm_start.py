"""``triax serve --warmup`` (``inference.warm_start``): on a warm persistent compile cache
only the first replica of each layout compiles before ready, the rest on first use, serving
the same tokens; a cold cache warms them all; the flag is checked."""
import jax
import numpy as np
import pytest

from triax.inference.engine import EngineConfig
from triax.inference.replicas import replica_meshes
from triax.inference.server import Server
from triax.inference.warm_start import HIT, MISS, cache_lookups, lazy_rest, warm_replicas
from triax.models import config
from triax.serve_config import ServeConfig
from triax.sharding.partition import abstract_model, init_params

CFG = config.TINY
ECFG = EngineConfig(max_batch=1, max_len=32, min_bucket=16)   # one program each


@pytest.fixture(scope="module")
def params():
    devices = jax.devices()
    return init_params(abstract_model(CFG), replica_meshes({}, 1, devices[:1])[0], "tp", 0)


def _server(params):
    """Replicas on one device, on tensor=2, on one device: two layouts; new engines (new
    jitted programs) each call."""
    meshes = replica_meshes([{}, {"tensor": 2}, {}], None, jax.devices()[:4])
    return Server.from_params(CFG, params, meshes, ecfg=ECFG)


def _greedy(engine, steps: int = 3) -> list[int]:
    # the rows read on the host, as the server does: indexing on the device is a program
    out = [int(np.asarray(engine.prefill([0], [np.array([72, 105, 33])], seeds=[0],
                                         padded=True))[0])]
    active = np.array([True])
    for _ in range(steps):
        out.append(int(np.asarray(engine.decode(np.array([out[-1]]), active, np.zeros(1)))[0]))
    return out


def test_a_warm_cache_leaves_later_replicas_to_first_use_with_the_same_tokens(params):
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("no persistent compile cache (tests/suite_env.py sets one)")
    first = _server(params)
    assert warm_replicas(first, [1], "all") == [0, 1, 2]   # fills the cache if it was cold
    assert all(e.compiles["decode"] for e in first.engines)
    second = _server(params)   # a second start: every program is in the persistent cache
    with cache_lookups() as seen:
        # tensor=2 is another layout: replica 1's hits say nothing of its programs
        assert warm_replicas(second, [1], "auto") == [0, 1]
    assert seen[HIT] > 0 and seen[MISS] == 0
    ready, _, lazy = second.engines
    assert ready.compiles["decode"] and ready.compiles["prefill"]
    assert not lazy.compiles["decode"] and not lazy.compiles["prefill"]
    assert _greedy(lazy) == _greedy(ready), "a replica warmed on first use served other tokens"


def test_policies():
    assert lazy_rest("auto", hits=12, misses=0) and lazy_rest("first", hits=0, misses=12)
    assert not lazy_rest("auto", hits=0, misses=0)        # no cache: warm them all
    assert not lazy_rest("auto", hits=11, misses=1)       # a compile: the rest would too
    assert not lazy_rest("all", hits=12, misses=0)
    with pytest.raises(ValueError, match="--warmup"):
        ServeConfig.of(model="tiny", warmup="lazy")
