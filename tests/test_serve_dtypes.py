"""Serving dtypes (``--dtype``, ``--kv-dtype``): bf16 serving equals the bf16 no-cache
reference exactly (tokens and logits); an int8 KV pool (a scale per block and KV head) keeps
every logit within ``INT8_TOL`` of the fp32 reference; the pool's size, its bytes on a device,
the planner and ``/metrics`` follow the pool's dtype."""
import numpy as np
import pytest
from prometheus_client import generate_latest

from triax.costs.memory import kv_cache_bytes
from triax.costs.workload import Layout, Workload
from triax.inference import Engine, EngineConfig, Server
from triax.inference.kv_pool import planned_pool
from triax.inference.pool_settings import PoolSettings
from triax.inference.reference import greedy_reference
from triax.mesh import make_mesh
from triax.models import config
from triax.serve_config import ServeConfig
from triax.serving.metrics import Metrics
from triax.sharding.rules import get_strategy
from inference_helpers import host_params, placed_bytes

CFG = config.TINY.replace(num_layers=2)
PROMPTS = [[5, 6, 7], list(range(30, 47)), [200, 1], list(range(60, 69))]
NEW = 12
# int8 keys/values: every logit within 1% of the reference's largest (measured: 0.0024 of
# a largest |logit| of 0.58 on this model).
INT8_TOL = 0.01


@pytest.fixture(scope="module")
def params(devices):
    return host_params(CFG, devices)


@pytest.fixture(scope="module")
def ref32(params):
    return greedy_reference(CFG, params, PROMPTS, NEW)


def _ecfg(**kw):
    return EngineConfig(max_batch=4, max_len=32, min_bucket=32, block_size=4, **kw)


def test_bf16_serving_equals_the_bf16_reference_exactly(params, ref32, devices):
    tokens16, _ = greedy_reference(CFG, params, PROMPTS, NEW, dtype="bfloat16")
    mesh = make_mesh(devices=devices[:1], tensor=1)
    server = Server.from_params(CFG, params, [mesh], "tp", _ecfg(dtype="bfloat16"))
    ids = [server.submit(p, NEW) for p in PROMPTS]
    got = [server.run()[i].tokens for i in ids]
    assert got == tokens16
    assert got != ref32[0], "bf16 changed no greedy token of these prompts"
    eng = server.engines[0]
    assert {str(x.dtype) for x in eng.cache.values()} == {"bfloat16"}
    assert (server.dtype, server.kv_dtype) == ("bfloat16", "bfloat16")
    # /metrics reports the pool's bytes per device in its dtype: what the arrays take
    scrape = generate_latest(Metrics(server).registry).decode()
    line = f'triax_kv_pool_bytes{{dtype="bfloat16",kv_dtype="bfloat16"}} {float(placed_bytes(eng))}'
    assert line in scrape
    fp32 = Engine(CFG, None, mesh, "tp", _ecfg()).pool.bytes_per_device()   # abstract
    assert placed_bytes(eng) * 2 == fp32


def test_int8_kv_keeps_every_logit_within_the_stated_tolerance(params, ref32, devices):
    tokens, logits = ref32
    mesh = make_mesh(devices=devices[:1], tensor=1)
    eng = Engine(CFG, params, mesh, "tp", _ecfg(kv_dtype="int8"))
    first, lg = eng.prefill(range(4), [np.array(p) for p in PROMPTS], [0] * 4,
                            with_logits=True)
    got = [np.asarray(lg)]
    active = np.ones(4, bool)
    for t in range(NEW - 1):   # teacher-forced with the reference's tokens
        _, lg = eng.decode(np.array([r[t] for r in tokens], np.int32), active,
                           np.zeros(4, np.int32), with_logits=True)
        got.append(np.asarray(lg))
    err = np.abs(np.stack(got, 1) - logits).max()
    assert err <= INT8_TOL * np.abs(logits).max(), err
    assert err > 1e-4       # really quantized (an fp32 pool: 2e-7)
    assert {n: str(x.dtype) for n, x in eng.cache.items()} == {
        "k": "int8", "v": "int8", "k_scale": "float32", "v_scale": "float32"}
    assert placed_bytes(eng) == eng.pool.bytes_per_device()


def test_the_pools_size_and_the_planner_follow_the_dtype():
    st, sizes, memory = get_strategy("tp"), {"tensor": 2}, 1 << 16
    blocks = {d: planned_pool(CFG, sizes, st, 4, 64, PoolSettings(kv_memory=memory),
                              dtype=d).total_blocks for d in ("float32", "bfloat16", "int8")}
    # a block per device: 2 · L · P · K/tensor · H · bytes (+ int8's 2 · L · K/tensor · 4)
    per = 2 * CFG.num_layers * 16 * (CFG.num_kv_heads // 2) * CFG.head_dim
    scales = 2 * CFG.num_layers * (CFG.num_kv_heads // 2) * 4
    assert blocks == {"float32": memory // (4 * per), "bfloat16": memory // (2 * per),
                      "int8": memory // (per + scales)}
    for kv_dtype, nbytes in (("auto", 2), ("float32", 4), ("int8", 1)):
        ecfg = EngineConfig(max_batch=4, max_len=64, kv_blocks=8, dtype="bfloat16",
                            kv_dtype=kv_dtype)
        kv = kv_cache_bytes(Workload.of_engine(CFG, ecfg), Layout(tensor=2, strategy="tp"))
        assert kv == 8 * (per * nbytes + (scales if kv_dtype == "int8" else 0))


def test_the_flags_default_to_bf16_and_refuse_other_dtypes():
    eng = ServeConfig.of(model="tiny").engine
    assert (eng.dtype, eng.pool.kv_dtype) == ("bfloat16", "auto")
    with pytest.raises(ValueError, match="--dtype 'float16': choose one of bfloat16, float32"):
        ServeConfig.of(model="tiny", dtype="float16")
    with pytest.raises(ValueError, match="--kv-dtype 'fp8': choose one of auto, bfloat16"):
        ServeConfig.of(model="tiny", kv_dtype="fp8")
    with pytest.raises(ValueError, match="--kv-dtype int8 with context=2"):
        planned_pool(CFG, {"context": 2}, get_strategy("tp"), 4, 64, PoolSettings(),
                     dtype="int8")
