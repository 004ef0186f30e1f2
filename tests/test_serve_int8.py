"""``--quantize int8`` serving (``models.quantize``, ``inference.served_weights``): logits
within a stated tolerance of bf16's, greedy agreement wherever bf16's choice is clear of it;
a tensor=2 replica and pipe=2 equal to the one-device int8 engine (int8 values and scales bit
for bit, fp32 logits tight); weight bytes per device read from the placed arrays and the
compiled decode step, against the planner's figure (``costs``); the ready line and
/metrics name it; an unmerged PEFT adapter over the int8 base within the tolerance of PEFT's
own logits (measured 0.9 %); what it cannot combine with (MoE) is refused by name.

Tolerance: on the tiny model (default init), int8 logits lie within ``LOGIT_TOL`` (2 %) of
the largest bf16 logit of bf16's (measured 1.1 %; bf16 itself is 0.6 % from fp32)."""
import os

import jax
import numpy as np
import pytest
from hf_fixtures import fixture
from prometheus_client import generate_latest

from triax.costs.memory import estimate
from triax.costs.workload import Layout, Workload
from triax.inference.engine import Engine, EngineConfig, held_bytes_per_device
from triax.inference.generate import build_server, engine_config_for
from triax.inference.replicas import replica_meshes
from triax.inference.served_weights import bytes_per_device
from triax.inference.server import Server
from triax.mesh import make_mesh
from triax.models import config
from triax.models.config import LoraConfig
from triax.models.quantize import SUFFIX, served_config
from triax.planner.auto_serve import choose_serving
from triax.serve_config import ServeConfig
from triax.serving.metrics import Metrics
from triax.sharding.introspect import memory_from_compiled
from triax.sharding.partition import abstract_model, init_params

CFG = config.TINY.replace(num_layers=2)
LOGIT_TOL = 0.02           # |int8 - bf16| <= LOGIT_TOL * max|bf16 logits|
STEPS, SLOTS = 4, 4
QUANTIZED = ("wq_DNH", "wk_DKH", "wv_DKH", "wo_NHD", "w_in_D2F", "w_down_FD")


def _ecfg(dtype, quantize):
    return EngineConfig(max_batch=SLOTS, max_len=32, dtype=dtype, quantize=quantize)


def _run(engine, prompts, feed=None):
    """Tokens ``[B, STEPS + 1]`` and their logits; ``feed``: tokens to feed back instead of
    the engine's own (teacher forcing, so two engines see the same contexts)."""
    tok, lg = engine.prefill(range(len(prompts)), prompts, seeds=[0] * len(prompts),
                             with_logits=True)
    toks, logits = [np.asarray(tok)], [np.asarray(lg, np.float32)]
    active = np.ones(SLOTS, bool)
    for i in range(STEPS):
        nxt = toks[-1] if feed is None else feed[:, i]
        tok, lg = engine.decode(nxt, active, np.zeros(SLOTS), with_logits=True)
        toks.append(np.asarray(tok))
        logits.append(np.asarray(lg, np.float32))
    for s in range(SLOTS):
        engine.release(s)
    return np.stack(toks, 1), np.stack(logits, 1)


@pytest.fixture(scope="module")
def setup(devices):
    m1 = make_mesh(devices=devices[:1])
    params = init_params(abstract_model(CFG), m1, "tp", 0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (5, 9, 12, 3)]
    return m1, params, prompts


@pytest.fixture(scope="module")
def bf16_vs_int8(setup):
    m1, params, prompts = setup
    bf16 = _run(Engine(CFG, params, m1, "tp", _ecfg("bfloat16", "none")), prompts)
    int8 = Engine(CFG, params, m1, "tp", _ecfg("bfloat16", "int8"))
    return bf16, _run(int8, prompts, feed=bf16[0]), int8


def test_int8_logits_within_tolerance_of_bf16(bf16_vs_int8):
    (tok16, lg16), (tok8, lg8), engine = bf16_vs_int8
    assert {engine.params["blocks"][k][n].dtype for k, n in
            (("attn", "wq_DNH"), ("mlp", "w_down_FD"))} == {np.dtype(np.int8)}
    err, scale = np.abs(lg8 - lg16).max(), np.abs(lg16).max()
    assert err > 0, "int8 logits equal bf16's: nothing was quantized"
    assert err <= LOGIT_TOL * scale, f"int8 logits {err:.4g} from bf16's (max {scale:.4g})"
    # Greedy agreement (same contexts): certain where bf16's top-2 margin exceeds twice the
    # tolerance; reported overall by bench/quantized_serving.py.
    top2 = np.sort(lg16, -1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * LOGIT_TOL * scale
    assert clear.any()
    assert (lg8.argmax(-1) == lg16.argmax(-1))[clear].all()
    assert (tok8[:, :-1] == tok16[:, :-1])[clear[:, :-1]].all()


@pytest.fixture(scope="module")
def int8_layouts(setup, devices):
    """The fp32 int8 engine on one device, a server's replica of tensor=2 (quantizing on its
    own mesh the weights handed over from device 0), and pipe=2. One replica: a second
    runs the same path (``Server.from_params`` hands every replica the same weights, each
    engine quantizes on its own mesh) on other devices, compiling every program again."""
    m1, params, prompts = setup
    ecfg = _ecfg("float32", "int8")
    one = Engine(CFG, params, m1, "tp", ecfg)
    server = Server.from_params(CFG, params, replica_meshes({"tensor": 2}, 1, devices[2:4]),
                                "tp", ecfg)
    engines = {"tensor=2 replica": server.engines[0]}
    engines["pipe=2"] = Engine(CFG, params, make_mesh(pipe=2, devices=devices[6:8]), "tp", ecfg)
    return one, _run(one, prompts), engines, prompts


@pytest.mark.parametrize("name", ["tensor=2 replica", "pipe=2"])
def test_int8_layouts_match_single_device(int8_layouts, name):
    one, (tok, lg), engines, prompts = int8_layouts
    eng = engines[name]
    got = jax.device_get(eng.params)
    want = jax.device_get(one.params)
    for k in ("attn", "mlp"):
        for n in (x for x in QUANTIZED if x in want["blocks"][k]):
            for leaf in (n, n + SUFFIX):   # quantized on the mesh: bit for bit
                np.testing.assert_array_equal(got["blocks"][k][leaf], want["blocks"][k][leaf],
                                              err_msg=f"{name} {k}/{leaf}")
            # The scale split like its weight's output axes, whole along its unit input dims.
            w, sc = eng.params["blocks"][k][n], eng.params["blocks"][k][n + SUFFIX]
            ws, ss = (tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
                      for x in (w, sc))
            assert ss == tuple(None if d == 1 else a for d, a in zip(sc.shape, ws)), (n, ss, ws)
    split = "pipe" if name == "pipe=2" else "tensor"
    assert split in eng.params["blocks"]["attn"]["wq_DNH" + SUFFIX].sharding.spec
    t, g = _run(eng, prompts)
    np.testing.assert_array_equal(t, tok, err_msg=f"{name} greedy tokens")
    np.testing.assert_allclose(g, lg, rtol=1e-5, atol=1e-6, err_msg=f"{name} int8 logits")


# ``--plan auto``'s request in test_plan_auto_prices_int8_weights: its engine config is
# tp2_bytes' too, so the decode step choose_serving compiles is tp2_bytes' (a cache hit).
PLAN = dict(longest=8, max_new_tokens=4, slots=SLOTS)
POOL = {"dtype": "bfloat16", "kv_blocks": 8}


@pytest.fixture(scope="module")
def tp2_bytes(setup, devices):
    """Per device on tensor=2, bf16 and int8: placed weights, the compiled decode step's
    argument bytes, and the planner's served-weight bytes. The weights are ``setup``'s,
    placed by each engine on its mesh (an init on tensor=2 would be a program of its own)."""
    mesh = make_mesh(tensor=2, devices=devices[:2])
    params = setup[1]
    out = {}
    for q in ("none", "int8"):
        ecfg = engine_config_for(CFG, {"tensor": 2}, **PLAN, **POOL, quantize=q)
        eng = Engine(CFG, params, mesh, "tp", ecfg)
        args = memory_from_compiled(Engine(CFG, None, mesh, "tp", ecfg).lower_decode()
                                    .compile()).argument_bytes
        planned = estimate(Workload.of_engine(CFG, ecfg), Layout(tensor=2, strategy="tp"))
        out[q] = dict(eng=eng, placed=bytes_per_device(eng.params), args=args,
                      planned=int(planned.params),
                      held=held_bytes_per_device(CFG, mesh, "tp", ecfg)["weights"])
    return out


def test_int8_weight_bytes_per_device(tp2_bytes):
    b16, b8 = tp2_bytes["none"], tp2_bytes["int8"]
    # The quantized projections (and their scales) on device 0: about half of bf16's.
    dev = b8["eng"].params["blocks"]["attn"]["wq_DNH"].addressable_shards[0].device

    def on_dev(params, names):
        return sum(s.data.nbytes for k in ("attn", "mlp") for n, x in params["blocks"][k].items()
                   if n in names for s in x.addressable_shards if s.device == dev)
    proj16 = on_dev(b16["eng"].params, QUANTIZED)
    proj8 = on_dev(b8["eng"].params, QUANTIZED + tuple(n + SUFFIX for n in QUANTIZED))
    assert 0.5 <= proj8 / proj16 <= 0.55, (proj8, proj16)
    # The compiled decode step takes exactly that many fewer bytes (the KV pool is alike).
    assert b16["args"] - b8["args"] == b16["placed"] - b8["placed"] == proj16 - proj8
    # The planner (costs) and the engine's pre-load check price what is placed.
    for q, b in tp2_bytes.items():
        assert b["planned"] == b["held"] == b["placed"], q


def test_plan_auto_prices_int8_weights(tp2_bytes):
    """``--plan auto`` with ``--quantize`` (one candidate: 4 replicas of tensor=2): the plan's
    weights are the engine's placed bytes, and its compiled decode step is the smaller."""
    choice = {q: choose_serving(CFG, **PLAN, mesh_sizes={"tensor": 2}, device_memory="1GiB",
                                pool={**POOL, "quantize": q})
              for q in ("none", "int8")}
    for q, c in choice.items():
        assert int(c.plan.memory.params) == tp2_bytes[q]["placed"], q
    assert choice["int8"].compiled_peak < choice["none"].compiled_peak


def test_int8_ready_line_and_unmerged_adapter(devices):
    """``build_server`` from a Hugging Face base with a PEFT adapter, served unmerged over an
    int8 base: the ready line names it, and the last logits of the fixture's prompts are
    within ``LOGIT_TOL`` of PEFT's own fp32 ones (``reference.npz``)."""
    server = build_server(ServeConfig.of(
        model_dir=fixture("llama"), adapter=fixture("llama-peft-adapter"), mesh="tensor=2",
        replicas=1, quantize="int8", slots=4, dtype="float32"), longest=20, max_new_tokens=1,
        devices=devices[:2])
    line = server.describe()
    assert server.quantize == "int8" and "float32 weights with int8 projections" in line
    assert "base int8" in line and "planned " in line
    scrape = generate_latest(Metrics(server).registry).decode()
    assert (f'triax_weight_bytes{{dtype="float32",quantize="int8"}} '
            f'{float(server.weight_bytes)}') in scrape
    eng = server.engines[0]
    assert eng.params["blocks"]["mlp"]["w_in_D2F"].dtype == np.int8
    ref = np.load(os.path.join(fixture("llama-peft-adapter"), "reference.npz"))
    _, got = eng.prefill(range(4), [ref[f"ids_{i}"] for i in range(4)], seeds=[0] * 4,
                         with_logits=True)
    want = np.stack([ref[f"logits_{i}"][-1] for i in range(4)])
    err, scale = np.abs(np.asarray(got) - want).max(), np.abs(want).max()
    assert 0 < err <= LOGIT_TOL * scale, f"int8 + adapter: {err:.4g} from PEFT's ({scale:.4g})"


def test_int8_refusals_and_lora():
    moe = config.TINY_MOE
    with pytest.raises(ValueError, match="--quantize int8 on the MoE model 'tiny-moe'"):
        served_config(moe, "int8")
    with pytest.raises(ValueError, match="--quantize 'int4'"):
        ServeConfig.of(model="tiny", quantize="int4")
    with pytest.raises(ValueError, match="--quantize 'int4'"):
        EngineConfig(quantize="int4")
    with pytest.raises(ValueError, match="give base_dtype='int8'"):
        CFG.replace(quantize="int8", lora=LoraConfig(rank=2))
    # Unmerged adapters are served over an int8 base (the LoRA int8 base's own form).
    lora = served_config(CFG.replace(lora=LoraConfig(rank=2)), "int8")
    assert lora.lora.base_dtype == "int8" and lora.quantize == "none"
    assert served_config(CFG, "none") is CFG
