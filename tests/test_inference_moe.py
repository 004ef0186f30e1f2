"""MoE at inference routes dropless (the runtime's ``moe_inference``): the KV-cache engine,
whose prefill pads prompts to a bucket and whose decode sees one token per call, gives the
no-cache reference's greedy tokens in capacity mode as in dropless mode."""
import pytest

from triax.inference.engine import EngineConfig
from triax.inference.reference import greedy_reference
from triax.inference.replicas import replica_meshes
from triax.inference.server import Server
from triax.models import config
from inference_helpers import host_params

PROMPTS = [[72, 101, 108, 108, 111], [7] * 12 + [3, 9], [200, 1, 2], list(range(40, 60))]
NEW = 6
ECFG = EngineConfig(max_batch=4, max_len=32, min_bucket=16)
BASE = config.TINY_MOE.replace(num_layers=1)


@pytest.fixture(scope="module")
def params(devices):
    # capacity_factor does not change the parameter tree: one init serves every mode
    return host_params(BASE, devices, seed=3)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_engine_equals_reference(capacity_factor, params, devices):
    cfg = BASE.replace(moe=BASE.moe.replace(capacity_factor=capacity_factor))
    reference, _ = greedy_reference(cfg, params, PROMPTS, NEW)
    server = Server.from_params(cfg, params, replica_meshes({}, 1, devices[:1]),
                                ecfg=ECFG)
    ids = [server.submit(p, NEW) for p in PROMPTS]
    results = server.run()
    assert [results[i].tokens for i in ids] == reference
