"""KV-cache generation equals the no-cache single-device reference on every serving layout."""
import jax
import numpy as np
import pytest

from triax.inference.engine import Engine, EngineConfig
from triax.pipeline import build
from triax.inference.reference import greedy_reference
from triax.inference.replicas import replica_meshes
from triax.inference.server import Server
from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.introspect.hlo import Collective, collectives_from_compiled
from inference_helpers import host_params

CFG = config.TINY.replace(num_layers=2)
PROMPTS = [[72, 101, 108, 108, 111], [7] * 12 + [3, 9], [200, 1, 2], list(range(40, 60))]
NEW = 5
ECFG = EngineConfig(max_batch=4, max_len=32, min_bucket=16)


@pytest.fixture(scope="module")
def params(devices):
    return host_params(CFG, devices)


@pytest.fixture(scope="module")
def reference(params):
    return greedy_reference(CFG, params, PROMPTS, NEW)


LAYOUTS = {  # name: (one replica's mesh, replicas)
    "single": ({}, 1),
    "tensor8": ({"tensor": 8}, 1),
    # Two replicas cover routing over replicas (each compiles its own programs, per device
    # assignment): more would only compile the same programs again.
    "2rep_x_tensor2": ({"tensor": 2}, 2),
    "pipe2_x_tensor2": ({"pipe": 2, "tensor": 2}, 1),
    "data2_pipe2_tensor2": ({"data": 2, "pipe": 2, "tensor": 2}, 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_match_reference(layout, params, reference, devices):
    sizes, replicas = LAYOUTS[layout]
    n = replicas * int(np.prod(list(sizes.values()) or [1]))
    server = Server.from_params(CFG, params, replica_meshes(sizes, replicas, devices[:n]),
                                ecfg=ECFG)
    ids = [server.submit(p, NEW) for p in PROMPTS]
    results = server.run()
    assert [results[i].tokens for i in ids] == reference[0]
    if sizes.get("pipe", 1) > 1:
        _check_pipeline_decode_hlo(server.engines[0], sizes)


def _check_pipeline_decode_hlo(eng, sizes):
    """Weights and cache stay on their stages: over `pipe` the decode step moves one
    micro-batch activation per tick (collective-permute) and only logits-sized results."""
    assert eng.pipelined and eng.cache["k"].sharding.spec[0] == "pipe"
    B, S, M = ECFG.max_batch, sizes["pipe"], eng.microbatches
    # the step served above (all four slots live): its compile is a persistent-cache hit
    over_pipe = [c for c in collectives_from_compiled(eng.lower_decode().compile(), eng.mesh)
                 if "pipe" in c.axes]
    rows = B // M // sizes.get("data", 1)  # one micro-batch's rows on one device
    ticks = build("forward-only", stages=S, microbatches=M).ticks  # M + S - 1 ticks
    assert ticks == M + S - 1
    activation = Collective("collective-permute", ("pipe",), rows * CFG.embed_dim * 4, ticks)
    assert activation in over_pipe
    others = [c for c in over_pipe if c != activation]
    assert all(c.kind != "all-gather" and c.bytes_per_device * c.count <= B * CFG.vocab_size * 4
               for c in others), others


def test_cached_decode_logits_equal_full_recompute(params, reference, devices):
    """Teacher-forced along the reference tokens on a sharded cache (data=2 × tensor=2)."""
    eng = Engine(CFG, params, make_mesh(data=2, tensor=2, devices=devices[:4]), "tp", ECFG)
    # The pool's row groups over data, its KV heads over tensor.
    assert eng.cache["k"].sharding.spec == jax.sharding.PartitionSpec(None, "data", None, None,
                                                                        "tensor")
    ref_tokens, ref_logits = reference
    n = len(PROMPTS)
    cur, logits = eng.prefill(range(n), [np.array(p) for p in PROMPTS], [0] * n,
                              with_logits=True)
    got = [np.asarray(logits)]
    active = np.ones(4, bool)
    for t in range(1, NEW):
        _, logits = eng.decode(np.array([r[t - 1] for r in ref_tokens]), active, np.zeros(4),
                               with_logits=True)
        got.append(np.asarray(logits))
    cur = np.asarray(cur)
    np.testing.assert_allclose(np.stack(got, 1), ref_logits, rtol=1e-5, atol=1e-5)
    assert cur.tolist() == [r[0] for r in ref_tokens]
    # One compile per shape bucket: a single prefill bucket and a single decode shape.
    assert eng._prefill_jit._cache_size() == 1 and eng._decode_jit._cache_size() == 1
