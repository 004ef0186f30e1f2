"""1,000 requests from several threads into a server that serves in the background.

Random prompt lengths up to the cache, random ``max_new_tokens``, some requests that cannot be
served (over-long, not fitting the cache, empty, ids outside the vocabulary, no new tokens).
Every valid request completes exactly once with the greedy tokens of the no-cache reference
(and of the engine serving it alone), every invalid one gets its own error, and every slot
comes back free.
"""
import random
import sys
import threading
from collections import Counter

import jax
import pytest

from triax.inference.engine import EngineConfig, InferenceError
from triax.inference.reference import greedy_reference
from triax.inference.replicas import replica_meshes
from triax.inference.server import Server
from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.partition import abstract_model, init_params

pytestmark = pytest.mark.slow  # ~15 s on a loaded 2-core machine

CFG = config.TINY.replace(num_layers=1)
ECFG = EngineConfig(max_batch=2, max_len=16, min_bucket=16)  # one prompt bucket, 2 row buckets
N, THREADS, MAX_NEW = 1000, 4, 5


def load(n=N, seed=0):
    """``n`` (prompt, max_new_tokens, expected error text or None) triples."""
    rng = random.Random(seed)
    V, L = CFG.vocab_size, ECFG.max_len
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.03:    # longer than the model's context
            p, m = [rng.randrange(V) for _ in range(CFG.max_seq_len + rng.randint(1, 9))], 1
            out.append((p, m, f"prompt of {len(p)} tokens is longer than the model's context"))
        elif u < 0.04:
            out.append(([], rng.randint(1, MAX_NEW), "empty prompt"))
        elif u < 0.05:  # one id outside the vocabulary at a random position
            p = [rng.randrange(V) for _ in range(rng.randint(1, L))]
            pos, bad = rng.randrange(len(p)), rng.choice([-1, V, V + 7])
            p[pos] = bad
            out.append((p, 1, f"{bad} at position {pos}"))
        elif u < 0.06:
            out.append(([rng.randrange(V)], 0, "max_new_tokens must be >= 1, got 0"))
        else:           # may or may not fit the cache
            p = [rng.randrange(V) for _ in range(rng.randint(1, L))]
            m = rng.randint(1, MAX_NEW)
            fits = len(p) + m - 1 <= L
            out.append((p, m, None if fits else
                        f"prompt of {len(p)} tokens plus max_new_tokens={m} does not fit"))
    return out


@pytest.fixture(scope="module")
def served(devices):
    params = jax.device_get(init_params(abstract_model(CFG), make_mesh(devices=devices[:1]),
                                        "tp", seed=2))
    server = Server.from_params(CFG, params, replica_meshes({}, 2, devices[:2]), ecfg=ECFG)
    server.warmup([1], sampled=False)   # every request is greedy: no draw program
    reqs = load()
    outcome: dict[int, object] = {}   # request index -> Result or the exception raised
    completions: Counter = Counter()  # request id -> times its future resolved
    barrier = threading.Barrier(THREADS)

    def client(k):
        mine = list(range(k, N, THREADS))
        random.Random(k).shuffle(mine)
        rids = {}
        barrier.wait()                # all threads submit at once
        for i in mine:
            prompt, m, _ = reqs[i]
            try:
                rid = server.submit(prompt, m)
            except InferenceError as e:
                outcome[i] = e
                continue
            rids[i] = rid
            server.future(rid).add_done_callback(lambda f, rid=rid: completions.update([rid]))
        for i, rid in rids.items():
            outcome[i] = server.result(rid, timeout=60)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)       # switch threads often: races become likelier
    try:
        with server:                  # serves in a background thread meanwhile
            threads = [threading.Thread(target=client, args=(k,)) for k in range(THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(old)
    return server, params, reqs, outcome, completions


def test_every_valid_request_completes_once_with_its_own_tokens(served):
    server, params, reqs, outcome, completions = served
    valid = [i for i, (_, _, err) in enumerate(reqs) if err is None]
    assert 700 < len(valid) < 900 and len(outcome) == N
    ref, _ = greedy_reference(CFG, params, [reqs[i][0] for i in valid], MAX_NEW)
    rids = [outcome[i].request_id for i in valid]
    assert len(set(rids)) == len(valid) == len(server.results)  # one id, one result each
    assert all(completions[rid] == 1 for rid in rids) and len(completions) == len(valid)
    assert sum(map(sum, server.slot_uses)) == len(valid)         # each took a slot once
    assert {outcome[i].replica for i in valid} == {0, 1}
    for i, r in zip(valid, ref):
        prompt, m, _ = reqs[i]
        res = outcome[i]
        assert res.prompt == prompt and res.finish_reason == "length", f"request {i}"
        assert res.tokens == r[:m], f"request {i}"
        assert server.results[res.request_id] is res


def test_every_invalid_request_gets_its_own_error(served):
    _, _, reqs, outcome, _ = served
    invalid = [(i, err) for i, (_, _, err) in enumerate(reqs) if err is not None]
    kinds = Counter(err.split(" ")[0] for _, err in invalid)
    assert len(invalid) > 80 and len(kinds) >= 4  # every kind of bad request occurred
    for i, err in invalid:
        assert isinstance(outcome[i], InferenceError), f"request {i}: {outcome[i]!r}"
        assert err in str(outcome[i]), f"request {i}: {outcome[i]}"


def test_no_slot_leaks_and_served_alone_matches(served):
    server, _, reqs, outcome, _ = served
    assert not server.serving and server.pending == 0 and not server.queued
    assert server.free_slots == server.total_slots == 2 * ECFG.max_batch
    rng = random.Random(1)
    sample = rng.sample([i for i, (_, _, err) in enumerate(reqs) if err is None], 6)
    for i in sample:  # the same engines, one request at a time through run()
        rid = server.submit(reqs[i][0], reqs[i][1])
        assert server.run()[rid].tokens == outcome[i].tokens, f"request {i}"
    assert server.free_slots == server.total_slots and server.kv_blocks_in_use == 0


def test_one_serving_loop_at_a_time(served):
    server = served[0]
    with server:
        for second_loop in (server.run, server.start, lambda: server.warmup([1])):
            with pytest.raises(InferenceError, match="serving|serves"):
                second_loop()
    assert not server.serving


def test_a_failed_step_fails_its_requests_frees_their_slots_and_serves_on(served):
    server, _, reqs, _, _ = served
    prompt, m, _ = next(r for r in reqs if r[2] is None and r[1] > 1)
    boom = RuntimeError("device lost")

    def broken(*a, **k):
        raise boom
    for eng in server.engines:  # instance attributes shadow the method for this test only
        eng.decode = broken
    try:
        rids = [server.submit(prompt, m) for _ in range(3)]
        server.start()
        for rid in rids:  # the engine's error fails the requests it was serving ...
            with pytest.raises(InferenceError, match="device lost") as err:
                server.result(rid, timeout=60)
            assert err.value.__cause__ is boom
    finally:
        for eng in server.engines:
            del eng.decode
    assert server.free_slots == server.total_slots and server.kv_blocks_in_use == 0
    rid = server.submit(prompt, m)  # ... and the server serves on
    assert len(server.result(rid, timeout=60).tokens) == m
    server.stop()
    assert server.free_slots == server.total_slots and server.pending == 0
    assert all(e.kv.committed == 0 for e in server.engines)   # every KV block back
