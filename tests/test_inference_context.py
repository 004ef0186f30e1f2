"""Generation with the KV cache split over ``context`` (``triax.sharding.context_cache``):
tokens and logits equal one device's and the no-cache reference's, for both prefill schemes;
the compiled prefill attends across the split prompt by its scheme and gathers no
activation; the compiled decode moves only per-slice attention partials over ``context``;
the paged pool per device is 1/C of the whole (each block's positions striped); ``triax generate --mesh context=2,tensor=4``."""
import dataclasses
import importlib
import json

import numpy as np
import pytest

from triax.cli.main import main
from triax.inference.engine import Engine, EngineConfig, held_bytes_per_device
from triax.inference.reference import greedy_reference
from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.introspect.hlo import collectives_from_compiled
from triax.sharding.rules import get_strategy
from inference_helpers import host_params

CFG = config.TINY.replace(num_layers=1)
# The longest prompt (26 tokens) takes the top bucket, max_len=30: 15 tokens per rank on
# context=2; on context=4 the bucket and the cache round up to 32 (8 tokens per rank, padded).
PROMPTS = [[72, 101, 108, 108, 111], [7] * 12 + [3, 9], [200, 1, 2], list(range(40, 66))]
NEW = 5
ECFG = EngineConfig(max_batch=4, max_len=30, min_bucket=6)
LAYOUTS = {"context2_tensor4": {"context": 2, "tensor": 4},
           "context4_data2": {"context": 4, "data": 2}}
CASES = [(layout, scheme) for layout in LAYOUTS for scheme in ("all-gather", "ring")]
F32 = 4


@pytest.fixture(scope="module")
def params(devices):
    return host_params(CFG, devices)


@pytest.fixture(scope="module")
def reference(params):
    return greedy_reference(CFG, params, PROMPTS, NEW)


@pytest.fixture(scope="module")
def one_device(params, reference, devices):
    eng = Engine(CFG, params, make_mesh(devices=devices[:1]), "tp", ECFG)
    return run(eng, reference)


def run(eng, reference, n=len(PROMPTS)):
    """Greedy tokens and logits of the first ``n`` prompts, decoding the reference's tokens."""
    ref_tokens = reference[0]
    tok, lg = eng.prefill(range(n), [np.array(p) for p in PROMPTS[:n]], [0] * n,
                          with_logits=True)
    tokens, logits = [np.asarray(tok)], [np.asarray(lg)]
    for t in range(1, NEW):
        tok, lg = eng.decode(np.array([r[t - 1] for r in ref_tokens[:n]]), np.ones(n, bool),
                             np.zeros(n), with_logits=True)
        tokens.append(np.asarray(tok))
        logits.append(np.asarray(lg))
    return np.stack(tokens, 1), np.stack(logits, 1)


@pytest.fixture(scope="module")
def engines(params):
    out = {}
    for layout, scheme in CASES:
        st = dataclasses.replace(get_strategy("tp"), context_attention=scheme)
        out[layout, scheme] = Engine(CFG, params, make_mesh(**LAYOUTS[layout]), st, ECFG)
    return out


@pytest.mark.parametrize("layout,scheme", CASES)
def test_tokens_and_logits_match_one_device_and_reference(layout, scheme, engines, reference,
                                                          one_device):
    eng = engines[layout, scheme]
    assert eng.context is not None and eng.context.size == LAYOUTS[layout]["context"]
    tokens, logits = run(eng, reference)
    assert tokens.tolist() == reference[0] == one_device[0].tolist()
    np.testing.assert_allclose(logits, reference[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, one_device[1], rtol=1e-5, atol=1e-5)


def test_one_decode_row_per_data_shard(params, reference):
    """Two slots on data=2: the blocks inside the decode's shard_map hold one row each."""
    eng = Engine(CFG, params, make_mesh(context=4, data=2), "tp",
                 dataclasses.replace(ECFG, max_batch=2))
    tokens, logits = run(eng, reference, n=2)   # rows are independent: the first two's
    assert tokens.tolist() == reference[0][:2]
    np.testing.assert_allclose(logits, reference[1][:2], rtol=1e-5, atol=1e-5)


def shapes(eng):
    """Per-device figures of ``eng``'s mesh: context size, data size, the prefill bucket of
    PROMPTS, rows per data shard, KV heads and query heads per device."""
    sizes = dict(eng.mesh.shape)
    C, data, tensor = sizes["context"], sizes["data"], sizes["tensor"]
    T = eng._bucket(max(len(p) for p in PROMPTS))
    # KV heads split over tensor only where they divide (tiny's 2 stay whole on tensor=4)
    kv = CFG.num_kv_heads // tensor if CFG.num_kv_heads % tensor == 0 else CFG.num_kv_heads
    return C, data, T, ECFG.max_batch // data, kv, CFG.num_heads // tensor


def over_context(compiled, eng):
    return [c for c in collectives_from_compiled(compiled, eng.mesh) if "context" in c.axes]


def prefill_compiled(eng, T):
    """The prefill ``run`` served (4 rows, logits out): its compile is a cache hit."""
    b = ECFG.max_batch
    z = np.zeros(b, np.int32)
    args = (eng.params, eng.cache, eng.kv.tables[:b], np.zeros((b, T), np.int32),
            np.ones(b, np.int32), z, eng._rows(b, None), 0)
    return eng._prefill_jit.lower(*args).compile()


@pytest.mark.parametrize("layout,scheme", CASES)
def test_prefill_attends_across_the_split_prompt_and_gathers_no_activation(layout, scheme,
                                                                           engines):
    eng = engines[layout, scheme]
    C, data, T, rows, kv, heads = shapes(eng)
    coll = over_context(prefill_compiled(eng, T), eng)
    kv_whole = rows * T * kv * CFG.head_dim * F32        # one layer's K (or V), gathered
    kv_block = kv_whole // C                              # the block one rank holds
    if scheme == "all-gather":
        gathers = [c for c in coll if c.kind == "all-gather"]
        # K and V of the one layer, gathered once each (their int32 orders are smaller)
        assert sum(c.count for c in gathers if c.bytes_per_device == kv_whole) == 2, coll
        assert all(c.bytes_per_device <= kv_whole for c in gathers), coll
        assert not [c for c in coll if c.kind == "collective-permute"], coll
    else:
        permutes = [c for c in coll if c.kind == "collective-permute"]
        assert all(c.axes == ("context",) for c in permutes), permutes
        # K and V blocks passed on C-1 times (in one permute or two; XLA may split their KV
        # heads over tensor further), beside the blocks' int32 orders [rows, T/C]
        kv_moves = [c for c in permutes if c.bytes_per_device > rows * (T // C) * 4]
        moved, whole = sum(c.count * c.bytes_per_device for c in kv_moves), 2 * (C - 1) * kv_block
        # split at most per KV head: K alone, or a lost block, would come in under that
        assert whole % moved == 0 and moved * CFG.num_kv_heads >= whole, permutes
        assert not [c for c in coll if c.kind == "all-gather"], coll
    # Nothing else crosses `context` but the first sampled token's logits (vocab over tensor).
    others = [c for c in coll if c.kind not in ("all-gather", "collective-permute")]
    assert all(c.kind == "all-reduce" and c.bytes_per_device <= rows * CFG.vocab_size * F32
               for c in others), others


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_moves_partials_not_the_cache_and_the_cache_is_split(layout, engines):
    eng = engines[layout, "all-gather"]
    C, data, T, rows, kv, heads = shapes(eng)
    B = ECFG.max_batch
    compiled = eng.lower_decode().compile()   # every slot's decode step
    # Over `context`: each rank's partial for the one query, o [B, 1, N, H] with its row max
    # and sum [B, N, 1], reduced (pmax, psum), per layer; and no other collective at all.
    coll = over_context(compiled, eng)
    partial = rows * heads * (CFG.head_dim + 2) * F32
    assert all(c.kind == "all-reduce" for c in coll), coll
    assert sum(c.bytes_per_device * c.count for c in coll) == partial * CFG.num_layers, coll
    # The paged pool per device: 1/C of every block's positions (and 1/data of its row
    # groups), donated in place. By default it holds slots × max_len's blocks.
    pool = eng.pool
    assert eng.cache["k"].shape == (CFG.num_layers, data, pool.blocks, pool.block_size,
                                    CFG.num_kv_heads, CFG.head_dim)
    assert pool.total_blocks == B * -(-ECFG.max_len // pool.block_size)
    whole = 2 * CFG.num_layers * pool.total_blocks * pool.block_size * CFG.num_kv_heads \
        * CFG.head_dim * F32
    per_device = whole * kv // CFG.num_kv_heads // (C * data)
    assert eng.pool.bytes_per_device() == per_device
    assert compiled.memory_analysis().alias_size_in_bytes == per_device
    assert held_bytes_per_device(CFG, eng.mesh, eng.strategy, ECFG)["KV cache"] == per_device
    # No collective on any axis moves the cache (a slice's worth of k or v, or more). (A
    # row's draw, with its sort over the vocabulary, is a program of its own.)
    assert all(c.bytes_per_device < per_device // 2
               for c in collectives_from_compiled(compiled, eng.mesh)), compiled


def test_cli_generate_context2_tensor4_gives_the_reference_tokens(capsys, monkeypatch,
                                                                   reference):
    """``triax generate --mesh context=2,tensor=4``: the tokens of ``--mesh tensor=8`` (which
    equal the no-cache reference, tests/test_inference_generate.py), checked against the
    reference itself to save a second CLI run: the module's, as the prompt is the text of
    ``PROMPTS[3]`` (26 bytes, the byte tokenizer's ids; over both ranks of its bucket)."""
    gen = importlib.import_module("triax.inference.generate")   # the package's `generate`
    servers = []                                                 # is the function
    real = gen.generate
    monkeypatch.setattr(gen, "generate", lambda server, *a, **k: (servers.append(server),
                                                                   real(server, *a, **k))[1])
    prompt = bytes(PROMPTS[3]).decode()
    assert list(gen.TOKENIZER.encode(prompt)) == PROMPTS[3]
    assert main(["generate", "--model", "tiny", "--num-layers", "1", "--seed", "0",
                 "--slots", "1", "--prompt", prompt, "--max-new-tokens", "4", "--json",
                 "--mesh", "context=2,tensor=4", "--context-attention", "ring",
                 "--dtype", "float32"]) == 0
    got = [r["tokens"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert got == [reference[0][3][:4]]
    eng = servers[-1].engines[0]
    assert eng.context is not None and eng.strategy.context_attention == "ring"
