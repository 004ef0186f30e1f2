"""Continuous batching over 2 replicas (each compiles its own programs): every request completes
with its own tokens, independent of arrival order, finished slots are reused, shapes compile
once per bucket, and an idle replica takes requests waiting on the other with the same
tokens."""
import random

import jax
import numpy as np
import pytest

from compile_counter import compiles_during
from triax.inference.engine import EngineConfig
from triax.inference.reference import greedy_reference
from triax.inference.sampling import SamplingConfig, row_settings, sample_step
from triax.inference.replicas import replica_meshes
from triax.inference.server import Server
from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.partition import abstract_model, init_params

CFG = config.TINY.replace(num_layers=2)
MAX_NEW = 6


def _requests(n=50, seed=0):
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(1, 14))], rng.randint(1, MAX_NEW))
            for _ in range(n)]


@pytest.fixture(scope="module")
def setup(devices):
    params = jax.device_get(init_params(abstract_model(CFG), make_mesh(devices=devices[:1]),
                                        "tp", seed=1))
    server = Server.from_params(CFG, params, replica_meshes({}, 2, devices[:2]),
                                ecfg=EngineConfig(max_batch=4, max_len=32, min_bucket=16))
    reqs = _requests()
    ref, _ = greedy_reference(CFG, params, [p for p, _ in reqs], MAX_NEW)
    return server, reqs, ref


def _serve(server, reqs, order):
    ids = {server.submit(reqs[i][0], reqs[i][1]): i for i in order}
    results = server.run()
    return {ids[rid]: results[rid] for rid in ids}


def test_fifty_requests_complete_with_their_own_tokens(setup):
    server, reqs, ref = setup
    lengths = [len(p) for p, _ in reqs]   # compiles ahead; must leave no visible trace
    server.warmup(lengths, replicas=[0])   # with the draws: the sampled tests use replica 0
    server.warmup(lengths, replicas=[1], sampled=False)   # greedy only: no draw program
    with compiles_during() as compiles:
        out = _serve(server, reqs, range(len(reqs)))
    # the warm-up compiled every program served (none per batch of prompts, e.g. a slice)
    assert compiles == [], f"serving compiled {len(compiles)} programs after the warm-up"
    assert sorted(out) == list(range(50))
    for i, (prompt, n) in enumerate(reqs):
        r = out[i]
        assert r.prompt == prompt and r.finish_reason == "length"
        assert r.tokens == ref[i][:n], f"request {i}"
        assert 0 <= r.ttft_s <= r.done - r.submitted and r.tokens_per_s > 0
    uses = np.array(server.slot_uses)
    assert uses.sum() == 50 and uses.max() > 1          # 8 slots served 50 requests
    assert {r.replica for r in out.values()} == {0, 1}
    for eng in server.engines:   # decode: one shape per bucket of live rows (1, 2, 4), all
        #                            compiled by the warm-up; prefill per batch and length
        assert eng._decode_jit._cache_size() == len(eng._decode_buckets()) == 3
        assert eng.compiles["decode"] == {(1,), (2,), (4,)}
        assert eng._prefill_jit._cache_size() == len(eng.compiles["prefill"]) == 3
        assert eng.compiles["prefill"] == {(1, 16), (2, 16), (4, 16)}   # batch buckets


def test_results_independent_of_arrival_order(setup):
    server, reqs, _ = setup
    forward = _serve(server, reqs, range(len(reqs)))
    order = list(range(len(reqs)))
    random.Random(3).shuffle(order)
    shuffled = _serve(server, reqs, order)
    assert {i: r.tokens for i, r in forward.items()} == {i: r.tokens for i, r in shuffled.items()}
    assert server.engines[0]._decode_jit._cache_size() == 3  # no recompiles on the second run


def test_stop_token_ends_a_request_and_frees_its_slot(setup, devices):
    server, reqs, ref = setup
    prompt, _ = reqs[0]
    stop = ref[0][2]  # the third greedy token of request 0
    stopping = Server(server.engines[:1])
    # Stop tokens are checked on the host, so swapping them needs no recompile.
    stopping.engines[0].sampling = SamplingConfig(stop_tokens=(stop,))
    try:
        rid = stopping.submit(prompt, MAX_NEW)
        r = stopping.run()[rid]
    finally:
        stopping.engines[0].sampling = SamplingConfig()
    assert r.finish_reason == "stop" and r.tokens == ref[0][:ref[0].index(stop)]
    assert all(s is None for s in stopping.slots[0])


def test_sampled_results_independent_of_arrival_order(setup):
    """The engine's sampling (and its seed) swapped for a sampled one: each row's settings
    and the seed are the steps' inputs, so the greedy runs' programs serve it, none new."""
    server, reqs, ref = setup
    eng = server.engines[0]
    eng.warmup([len(p) for p, _ in reqs[:12]])   # greedy (compiled already after the first test)
    programs = (eng._prefill_jit._cache_size(), eng._decode_jit._cache_size(),
                eng._draw_jit._cache_size())   # the warm-up's draws too (one per row count)
    # one draw per row count: a prefill's and a decode's of as many rows share it
    assert programs[2] == len(set(eng._prefill_batches()) | set(eng._decode_buckets())) == 3
    eng.sampling = SamplingConfig(temperature=1.5, top_k=20, top_p=0.95, seed=5)
    try:
        forward = _serve(Server([eng]), reqs[:12], range(12))
        shuffled = _serve(Server([eng]), reqs[:12], list(reversed(range(12))))
    finally:
        eng.sampling = SamplingConfig()
    assert {i: r.tokens for i, r in forward.items()} == {i: r.tokens for i, r in shuffled.items()}
    assert any(forward[i].tokens != ref[i][:reqs[i][1]] for i in range(12))  # it did sample
    assert (eng._prefill_jit._cache_size(), eng._decode_jit._cache_size(),
            eng._draw_jit._cache_size()) == programs, "a new sampling rule compiled a new program"


def test_steps_hold_no_draw_and_only_sampled_steps_run_one(setup):
    """A step's program holds no sort (a sampled row's draw, ``sampling.draw``, is a program
    of its own); greedy steps launch no draw; a sampled step's tokens are those of
    ``sample_step`` (penalties and draw in one program) on the step's logits, its seeds and
    positions."""
    server, reqs, _ = setup
    eng = server.engines[0]
    assert "stablehlo.sort" not in eng.lower_decode().as_text()
    prompts = [np.array(p, np.int32) for p, _ in reqs[:3]]
    seeds, hot = [7, 8, 9], SamplingConfig(temperature=1.5, top_k=20, top_p=0.95)
    settings = [hot, SamplingConfig(), hot]   # a greedy row beside sampled ones
    before = eng.launches["draw"]
    try:
        eng.prefill(range(3), prompts, seeds)
        assert eng.launches["draw"] == before, "a greedy step ran the draw"
        tok, logits = eng.prefill(range(3), prompts, seeds, settings, with_logits=True)
        assert eng.launches["draw"] == before + 1
    finally:
        for s in range(3):
            eng.release(s)
    one = jax.jit(sample_step)(logits, eng.sampling_seed(), np.array(seeds, np.int32),
                               np.array([len(p) for p in prompts], np.int32),
                               row_settings(settings))
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(one))
    assert (np.asarray(tok) != np.asarray(logits).argmax(-1)).any()   # it did sample


def test_an_idle_replica_takes_waiting_requests_with_the_same_tokens(setup, monkeypatch):
    """Every request routed to replica 0 (the router forced): replica 1, idle, takes waiting
    ones (``inference.request_router.steal``); each request's tokens are the reference's."""
    server, reqs, ref = setup
    monkeypatch.setattr("triax.inference.server.route", lambda schedulers, live: 0)
    ids = {server.submit(*reqs[i]): i for i in range(12)}
    assert server.queued_per_replica == [12, 0]
    out = server.run()
    assert {out[rid].replica for rid in ids} == {0, 1}
    for rid, i in ids.items():
        assert out[rid].tokens == ref[i][:reqs[i][1]], f"request {i}"
