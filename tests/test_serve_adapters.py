"""Many LoRA adapters served at once (``--adapter NAME=DIR``, a table of adapter slots):
rows of the base and of different adapters share one prefill and one decode step, and each
row equals that row served with its adapter alone (logits bit for bit, fp32); the table's
rows match the references (the base: transformers' logits; adapter ``a``: the logits real
``peft`` computed, ``tests/fixtures/hf/llama-peft-adapter``; adapter ``b``, of lower rank,
other alpha and fewer targets: the single-adapter unmerged path); loading and unloading
write into the table without recompiling any step; the HTTP layer (``model`` picks the
adapter, ``/v1/models``, vLLM's load/unload endpoints, a 404 naming the models); and on
data=2 × tensor=2 the table is sharded like its base weights and gives the one-device
logits.
One module-scoped server per layout (the tiny ``llama`` fixture)."""
import os

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient

from hf_fixtures import FIXTURES, fixture, forward_logits, golden
from triax.cli.main import build_parser, main
from triax.cli.serving_flags import serve_config
from triax.hf.load import read_model_config
from triax.hf.peft import load_adapted, read_adapters, read_config, write_adapters
from triax.hf.tokenizer import load_tokenizer
from triax.inference.adapter_table import AdapterNotFound, planned_table, read_factors
from triax.inference.engine import Engine, EngineConfig, InferenceError
from triax.inference.generate import build_server
from triax.inference.sampling import SamplingConfig
from triax.mesh import make_mesh
from triax.models import lora
from triax.models.config import LoraConfig
from triax.serve_config import ServeConfig
from triax.serving.app import create_app
from triax.serving.chat_template import ChatTemplate
from triax.sharding.introspect.hlo import collectives_from_compiled, summarize
from triax.sharding.partition import abstract_model

A = os.path.join(FIXTURES, "llama-peft-adapter")   # peft's: r 4, alpha 8, all 7 targets
GREEDY = SamplingConfig(temperature=0.0)
STEPS = 3   # decode steps after the prefill


@pytest.fixture(scope="module")
def adapter_b(tmp_path_factory):
    """A second adapter: r 2, alpha 4, on q_proj, v_proj and down_proj only (random A, B)."""
    cfg = read_model_config(fixture("llama")).replace(
        lora=LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj")))
    rng = np.random.default_rng(0)
    ad = jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(np.float32),
                      lora.split(abstract_model(cfg).shapes)[0])
    out = str(tmp_path_factory.mktemp("adapters") / "b")
    write_adapters(ad, cfg, out, base_model="llama")
    return out


def _server(devices, adapter_b, mesh: str, n: int):
    config = ServeConfig.of(model_dir=fixture("llama"), adapter=(f"a={A}", f"b={adapter_b}"),
                            max_adapters=3, dtype="float32", mesh=mesh, replicas=1, slots=4,
                            kv_block_size=8)
    return build_server(config, longest=24, max_new_tokens=8, devices=devices[:n])


@pytest.fixture(scope="module")
def one(devices, adapter_b):
    return _server(devices, adapter_b, "tensor=1", 1)


def _rows():
    """(adapter, prompt ids, reference last-position logits or None) of the mixed batch."""
    g, ref = golden("llama"), np.load(os.path.join(A, "reference.npz"))
    return [(None, g["ids_0"], g["logits_0"][-1]), ("a", ref["ids_1"], ref["logits_1"][-1]),
            ("b", ref["ids_2"], None), ("a", ref["ids_3"], ref["logits_3"][-1])]


def _logits(server, adapters, prompts):
    """``[rows, 1 + STEPS, V]``: the prefill's last logits, then each decode step's (fed its
    own greedy tokens), of one batch of rows in slots 0.. with these adapters."""
    eng = server.engines[0]
    slots = list(range(len(prompts)))
    ids = [server.adapters.slot_of(a) for a in adapters]
    tok, lg = eng.prefill(slots, [np.asarray(p) for p in prompts], [0] * len(slots),
                          [GREEDY] * len(slots), with_logits=True, adapters=ids)
    out, active = [np.asarray(lg)], np.isin(np.arange(eng.ecfg.max_batch), slots)
    tok = np.zeros(eng.ecfg.max_batch, np.int32)
    tok[slots] = np.asarray(lg).argmax(-1)
    for _ in range(STEPS):
        _, lg = eng.decode(tok, active, np.zeros_like(tok), [GREEDY] * len(tok),
                           with_logits=True)
        lg = np.asarray(lg)[slots]
        out.append(lg)
        tok[slots] = lg.argmax(-1)
    for s in slots:
        eng.release(s)
    return np.stack(out, 1)


def test_mixed_batch_equals_each_adapter_alone(one, adapter_b, devices):
    rows = _rows()
    adapters, prompts = [r[0] for r in rows], [r[1] for r in rows]
    mixed = _logits(one, adapters, prompts)
    for name in (None, "a", "b"):   # the same prompts, every row with this adapter
        alone = _logits(one, [name] * len(rows), prompts)
        for i, a in enumerate(adapters):
            if a == name:
                np.testing.assert_array_equal(mixed[i], alone[i], err_msg=f"row {i} ({a})")
    # ... and each row is its model's: transformers' base, peft's adapter a
    for i, (_, _, want) in enumerate(rows):
        if want is not None:
            np.testing.assert_allclose(mixed[i, 0], want, rtol=1e-4, atol=1e-5)
    base_1 = golden("llama")["logits_1"][-1]   # the same prompt's, without the adapter
    assert np.abs(mixed[1, 0] - base_1).max() > 1e-3
    # adapter b (r 2 of the table's 4, alpha 4, three targets) as the unmerged one-adapter path
    mesh = make_mesh(devices=devices[:1])
    cfg, params = load_adapted(fixture("llama"), adapter_b, mesh, "tp")
    want_b = forward_logits(cfg, params, mesh, "tp", [prompts[2]])[0][-1]
    np.testing.assert_allclose(mixed[2, 0], want_b, rtol=1e-4, atol=1e-5)


def _tokens(server, adapters, prompt, n=5):
    ids = [server.submit(prompt, n, sampling=GREEDY, adapter=a) for a in adapters]
    res = server.run()
    return [res[i].tokens for i in ids]


def test_served_requests_and_load_without_recompiling(one, adapter_b):
    """Through the server's queue: one step of three rows, and each alone."""
    prompt = [int(t) for t in _rows()[0][1][:7]]   # no full KV block: nothing cached
    mixed = _tokens(one, [None, "a", "b"], prompt)
    alone = [_tokens(one, [a], prompt)[0] for a in (None, "a", "b")]
    assert mixed == alone and len({tuple(t) for t in mixed}) == 3, (mixed, alone)
    eng, fresh = one.engines[0], prompt[::-1]   # a prompt no cached block holds
    want = _tokens(one, ["b"], fresh)
    compiled = (eng._prefill_jit._cache_size(), eng._decode_jit._cache_size())
    one.load_adapter("c", adapter_b)   # b again, in the free slot: a write, no compile
    assert one.adapters.slot_of("c") == 3
    assert _tokens(one, ["c"], fresh) == want   # (c's blocks are keyed apart from b's)
    assert (eng._prefill_jit._cache_size(), eng._decode_jit._cache_size()) == compiled
    with pytest.raises(InferenceError, match="all 3 adapter slots are taken"):
        one.load_adapter("d", adapter_b)
    one.unload_adapter("c")
    with pytest.raises(AdapterNotFound, match="no adapter named 'c'.*loaded: a, b"):
        one.submit(prompt, 2, adapter="c")
    # a request in flight keeps its adapter loaded
    rid = one.submit(prompt, 5, sampling=GREEDY, adapter="b")
    with pytest.raises(InferenceError, match="serves 1 request"):
        one.unload_adapter("b")
    one.run()
    assert one.result(rid).tokens == alone[2]


def test_prefix_cache_keys_each_adapter_apart(one):
    """The same prompt under the base and an adapter shares no KV block (their keys and
    values differ); under the same adapter it does."""
    prompt = list(range(40, 52))   # one full block of 8 (the prompt bucket of 16)
    one.submit(prompt, 1, sampling=GREEDY, adapter="a")
    one.run()
    for adapter, hit in ((None, 0), ("b", 0), ("a", 8)):
        rid = one.submit(prompt, 1, sampling=GREEDY, adapter=adapter)
        one.run()
        assert one.result(rid).cached_tokens == hit, adapter


def test_chunked_prefill_keeps_each_rows_adapter(one):
    """A prompt prefilled in chunks (``max_step_tokens``) runs its adapter in every chunk."""
    prompt = list(range(100, 120))
    whole = _tokens(one, ["a", None], prompt, n=3)
    one.max_step_tokens = 8
    try:
        for e in one.engines:
            e.kv.forget_cached()
        chunks = one.stats["prefill_chunks"]
        assert _tokens(one, ["a", None], prompt, n=3) == whole
        assert one.stats["prefill_chunks"] - chunks >= 4
    finally:
        one.max_step_tokens = 0


def test_http_model_field_and_adapter_endpoints(one, adapter_b):
    tok = load_tokenizer(fixture("llama"), read_model_config(fixture("llama")))
    with TestClient(create_app(one, tok, "llama")) as client:   # updates off by default
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "b2",
                                                        "lora_path": adapter_b})
        assert r.status_code == 403 and "--allow-adapter-updates" in r.text
    app = create_app(one, tok, "llama", ChatTemplate("{% for m in messages %}{{ m.content }}"
                                                     "{% endfor %}"), adapter_updates=True)

    def complete(client, model):
        r = client.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7, 8],
                                                  "max_tokens": 4, "temperature": 0})
        return r.json()["choices"][0]["text"] if r.status_code == 200 else r

    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["llama", "a", "b"]
        base, a, b = (complete(client, m) for m in ("llama", "a", "b"))
        assert len({base, a, b}) == 3
        chats = [client.post("/v1/chat/completions", json={
            "model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}).json() for m in ("llama", "a")]
        assert [c["model"] for c in chats] == ["llama", "a"]
        assert chats[0]["choices"][0]["message"] != chats[1]["choices"][0]["message"]
        r = complete(client, "zzz")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "'llama', 'a', 'b'" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "b2",
                                                        "lora_path": adapter_b})
        assert r.status_code == 200 and "b2" in r.text, r.text
        cards = client.get("/v1/models").json()["data"]
        assert cards[-1] == {**cards[-1], "id": "b2", "root": adapter_b, "parent": "llama"}
        assert complete(client, "b2") == b
        assert client.post("/v1/completions", json={"model": "b2", "prompt": "x"}).json()[
            "model"] == "b2"
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": A})
        assert r.status_code == 400 and "--max-adapters" in r.json()["error"]["message"]
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "b2"}).status_code \
            == 200
        assert complete(client, "b2").status_code == 404
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "b2"})
        assert r.status_code == 404
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "f", "lora_path": "/no"})
        assert r.status_code == 400 and "'/no' is not a directory" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "f", "lora_path": A,
                                                        "load_inplace": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"


def test_sharded_table_equals_one_device(one, devices, adapter_b):
    """data=2 × tensor=2: rows (and their adapter slots) split over data, the table like
    its base weights over tensor."""
    tp = _server(devices, adapter_b, "data=2,tensor=2", 4)
    b_q = tp.engines[0].params["blocks"]["attn"]["lora_q_proj"]["b"]   # [L, slots, r, N, H]
    spec = tuple(b_q.sharding.spec) + (None,) * 5
    assert spec[3] == "tensor", b_q.sharding.spec   # split like wq over heads
    rows = _rows()
    adapters, prompts = [r[0] for r in rows], [r[1] for r in rows]
    np.testing.assert_allclose(_logits(tp, adapters, prompts), _logits(one, adapters, prompts),
                               rtol=1e-5, atol=1e-5)


def test_table_gathers_no_weight_over_tensor(devices):
    """The compiled decode step on tensor=2 (abstract engines: nothing allocated) moves the
    base's collectives plus, where a projection's input is split over tensor (o_proj over
    heads, down_proj over mlp), its rows' rank-wide ``x·A``: L × 2 × B × R fp32 more
    all-reduced bytes; no weight is gathered."""
    base = read_model_config(fixture("llama"))
    table = planned_table(base, [("a", A)], slots=3)   # rank 4, all seven targets
    mesh = make_mesh(tensor=2, devices=devices[:2])
    ecfg = EngineConfig(max_batch=4, max_len=32)
    base_c, table_c = (summarize(collectives_from_compiled(
        Engine(cfg, None, mesh, ecfg=ecfg).lower_decode().compile(), mesh))
        for cfg in (base, table))
    reduce = ("all-reduce", ("tensor",))
    assert table_c[reduce]["bytes"] - base_c[reduce]["bytes"] == base.num_layers * 2 * 4 * 4 * 4
    assert {k: v for k, v in table_c.items() if k != reduce} == \
        {k: v for k, v in base_c.items() if k != reduce}
    assert table_c[reduce]["count"] == base_c[reduce]["count"]   # carried by the same ops


def test_flags_name_adapters():
    p = build_parser()

    def config(*argv):
        return serve_config(p.parse_args(["serve", "--model-dir", "m", *argv]))
    src = config("--adapter", "a=/x", "--adapter", "b=/y", "--max-adapters", "4").source
    assert src.named_adapters() == [("a", "/x"), ("b", "/y")] and src.max_adapters == 4
    assert src.uses_table and src.unnamed_adapter is None
    assert config("--adapter", "/x").source.unnamed_adapter == "/x"   # today's meaning
    for argv, words in ((("--adapter", "a=/x", "--adapter", "/y"), "not both"),
                        (("--adapter", "a=/x", "--adapter", "a=/y"), "given twice"),
                        (("--adapter", "a=/x", "--adapter", "b=/y", "--max-adapters", "1"),
                         "give --max-adapters 2"),
                        (("--adapter", "/x", "--max-adapter-rank", "8"),
                         "--max-adapter-rank shape the adapter table")):
        with pytest.raises(ValueError, match=words):
            config(*argv)
    with pytest.raises(ValueError, match="give --model-dir"):
        ServeConfig.of(model="tiny", max_adapters=2)


def test_table_sizes_and_refusals(capsys, adapter_b, tmp_path):
    """The table's slots, rank and targets from the named adapters or the flags; what does
    not fit is refused naming the flag; an adapter's factors are padded to the table's rank
    with its alpha / r in B; generate takes no named adapters."""
    base = read_model_config(fixture("llama"))
    table = planned_table(base, [("b", adapter_b)], rank=4).lora   # q, v, down; rank 4
    a, b = read_factors(adapter_b, base, table)["v_proj"]
    raw = read_adapters(adapter_b, base.replace(lora=read_config(adapter_b)))
    raw_a, raw_b = (raw["blocks"]["attn"]["lora_v_proj"][f] for f in "ab")
    np.testing.assert_array_equal(a[..., :2], raw_a)
    np.testing.assert_array_equal(b[:, :2], raw_b * np.float32(4.0 / 2))
    assert not a[..., 2:].any() and not b[:, 2:].any()
    wide = base.replace(lora=LoraConfig(rank=8, targets=("k_proj",)))
    write_adapters(jax.tree.map(lambda s: np.ones(s.shape, np.float32),
                                lora.split(abstract_model(wide).shapes)[0]),
                   wide, str(tmp_path / "wide"), base_model="llama")
    with pytest.raises(InferenceError, match="r=8 exceeds the table's rank 4; restart with "
                                             "--max-adapter-rank 8"):
        read_factors(str(tmp_path / "wide"), base, table)
    with pytest.raises(InferenceError, match="k_proj are not in the table's .*--adapter-targets "
                                             "q_proj,k_proj,v_proj,down_proj"):
        read_factors(str(tmp_path / "wide"), base, table.__class__(
            rank=8, targets=table.targets, slots=1))
    empty = planned_table(base, [], slots=2)   # loads come later: rank 16, every target
    assert (empty.lora.slots, empty.lora.rank, len(empty.lora.targets)) == (2, 16, 7)
    one_a = planned_table(base, [("a", A)], rank=8, targets=",".join(empty.lora.targets))
    assert (one_a.lora.slots, one_a.lora.rank) == (1, 8)
    with pytest.raises(InferenceError, match="'a' has r=4; give --max-adapter-rank 4"):
        planned_table(base, [("a", A)], rank=2)
    with pytest.raises(InferenceError, match="also adapt .*down_proj"):
        planned_table(base, [("a", A)], targets="q_proj")
    argv = ["generate", "--model-dir", fixture("llama"), "--adapter", f"a={A}", "--prompt",
            "x", "--max-new-tokens", "1"]
    assert main(argv) == 2 and "generate serves one model" in capsys.readouterr().err
