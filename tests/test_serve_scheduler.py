"""The scheduler that never reserves up front (``inference.batching``): sequences take KV
blocks as they grow; when a group has none left the lowest-priority, newest running request
is preempted by recompute and resumed exactly (greedy tokens equal the reference); the
``priority`` field orders admission and preemption; a small request that fits goes past a
large one that does not, at most ``max_bypass`` times; the preemptions are counted;
admission leaves the blocks that the running sequences and its own first decode take next,
so nothing is admitted only to be preempted at once."""
import numpy as np
import pytest

from triax.inference import EngineConfig, Server
from triax.inference.reference import greedy_reference
from triax.mesh import make_mesh
from triax.models import config
from inference_helpers import host_params

CFG = config.TINY.replace(num_layers=2)
PROMPTS = [[5, 6, 7], list(range(30, 47)), [200, 1], list(range(60, 69))]
NEW = 12
# 4 slots over 8 blocks of 4 positions: the four requests need 4, 7, 4 and 5 blocks by their
# ends, so they cannot all run to the end at once (but each fits alone).
ECFG = EngineConfig(max_batch=4, max_len=32, min_bucket=32, block_size=4, kv_blocks=8)


@pytest.fixture(scope="module")
def params(devices):
    return host_params(CFG, devices)


@pytest.fixture(scope="module")
def reference(params):
    return greedy_reference(CFG, params, PROMPTS, NEW)[0]


@pytest.fixture(scope="module")
def engine(params, devices):
    """One engine for the module's servers: a new engine's jitted programs would be traced
    and lowered again (its own jit objects); every test leaves its slots and blocks free."""
    return Server.from_params(CFG, params, [make_mesh(devices=devices[:1])], "tp",
                              ECFG).engines[0]


def _server(engine, max_bypass=None):
    for s in range(engine.ecfg.max_batch):   # what a test that failed mid-run left held
        if engine.kv.busy(s):
            engine.release(s)
    server = Server([engine])
    if max_bypass is not None:
        server.schedulers[0].max_bypass = max_bypass   # the replica's queue's bound
    return server


def _queued(server):
    """The ids waiting in the (one) replica's queue."""
    return [x.result.request_id for x in server.schedulers[0].queue]


def _done(server):
    kv = server.engines[0].kv
    return server.kv_blocks_in_use == 0 and not kv.refs.any() and server.queued == 0


def test_preempted_requests_resume_exactly(engine, reference):
    server = _server(engine)
    ids = [server.submit(p, NEW) for p in PROMPTS]
    results = server.run()
    assert [results[i].tokens for i in ids] == reference
    assert server.stats["preemptions"] == sum(results[i].preemptions for i in ids) > 0
    assert _done(server)


def test_priority_orders_admission_and_preemption(engine, reference):
    server = _server(engine)
    low = server.submit(PROMPTS[1], NEW, priority=9)      # 5 blocks now, 7 at its end
    server._step()
    mid = server.submit(PROMPTS[3], NEW)                  # 3 blocks: arrives first ...
    high = server.submit(PROMPTS[0], NEW, priority=-1)    # ... this one (1 block) goes first
    server._step()
    running = {x.result.request_id for x in server.slots[0] if x is not None}
    assert running == {low, high} and _queued(server) == [mid]
    results = server.run()
    assert [results[i].tokens for i in (low, mid, high)] == [reference[1], reference[3],
                                                             reference[0]]
    # out of blocks, the lowest priority is preempted, though high is the newest
    assert results[low].preemptions >= 1 and results[high].preemptions == 0
    assert _done(server)


def test_a_small_request_goes_past_a_large_one_at_most_max_bypass_times(engine, reference):
    server = _server(engine, max_bypass=1)
    running = server.submit(PROMPTS[1], NEW)              # 5 blocks at once
    server._step()
    big = server.submit(PROMPTS[1], NEW)                  # 5 blocks: does not fit the 3 left
    small = [server.submit(PROMPTS[2], 4), server.submit(PROMPTS[0], 4)]   # 1 block each
    server._step()
    live = {x.result.request_id for x in server.slots[0] if x is not None}
    assert live == {running, small[0]}                    # one went past big; then it waits
    assert _queued(server) == [big, small[1]]
    results = server.run()
    assert results[big].tokens == reference[1]
    assert [results[i].tokens for i in small] == [reference[2][:4], reference[0][:4]]
    assert _done(server)


# Prompts at and near block boundaries (blocks of 4): 16 tokens fill 4 blocks exactly, so
# the first decode's position takes a 5th; 13 and 14 tokens need 4 blocks with that position.
EDGE = [list(range(100, 116)), list(range(120, 133)), list(range(140, 154))]


@pytest.fixture(scope="module")
def edge_reference(params):
    return greedy_reference(CFG, params, EDGE, NEW)[0]


def test_admission_reserves_the_first_decode_position(engine, edge_reference):
    """16 tokens: 5 blocks with its first decode's position, reserved at admission; the 13
    behind it (4 blocks) then waits (3 free) instead of being admitted into the 5th block,
    prefilled and preempted at the first decode."""
    server = _server(engine)
    ids = [server.submit(EDGE[0], 4), server.submit(EDGE[1], 4)]
    server._step()
    assert _queued(server) == [ids[1]]
    results = server.run()
    assert [results[i].tokens for i in ids] == [edge_reference[0][:4], edge_reference[1][:4]]
    assert server.stats["preemptions"] == 0 and _done(server)


def test_admission_leaves_the_blocks_running_sequences_take_next(engine, edge_reference):
    """13 tokens, 4 blocks; after 3 steps its next decode (position 16) takes a 5th. The 14
    arriving then needs the 4 free blocks: admitted, it would be preempted in the same step
    for that 5th block; it waits for it instead."""
    server = _server(engine)
    first = server.submit(EDGE[1], NEW)
    for _ in range(3):
        server._step()
    second = server.submit(EDGE[2], NEW)
    server._step()
    assert _queued(server) == [second]
    assert server.engines[0].kv.held.max() == 5
    results = server.run()
    assert [results[i].tokens for i in (first, second)] == edge_reference[1:]
    assert server.stats["preemptions"] == 0 and _done(server)
