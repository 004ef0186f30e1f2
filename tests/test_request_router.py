"""One queue per replica (``inference.request_router``, ``inference.scheduler``), on fake
engines (no JAX compile): a burst splits over the least-loaded replicas (running requests
count, ties go to the longest cached prefix) and ``/metrics`` shows each replica's depth; a
request goes only to a replica whose pool can hold it; the bypass bound holds within a
replica's queue; an idle replica takes the first waiting request of the longest other queue
(a fresh one before a preempted one); a preempted request waits in its own replica's queue
and resumes there; ``cancel``, ``max_queue`` and a
failure cover every queue. tests/test_inference_serving.py checks stolen requests' tokens
against the reference on compiled engines."""
import pytest
from prometheus_client import generate_latest

from triax.inference.engine import InferenceError
from triax.inference.request import QueueFullError, Result, _Live
from triax.inference.request_router import steal
from triax.inference.scheduler import Scheduler
from triax.inference.server import Server
from triax.serving.metrics import Metrics
from test_serve_core import FakeEngine


def _ids(server):
    return [[x.result.request_id for x in sch.queue] for sch in server.schedulers]


def _serve(server, steps=200):
    """Step until idle (bounded: a request no replica can admit would loop forever)."""
    for _ in range(steps):
        if not server._step():
            return server.results
    raise AssertionError(f"not idle after {steps} steps; queues {_ids(server)}")


def _count(prompt, n):
    """A fake engine's tokens: each the last plus one."""
    return list(range(prompt[-1] + 1, prompt[-1] + 1 + n))


def test_a_burst_splits_over_the_least_loaded_replicas_and_metrics_show_each_depth():
    server = Server([FakeEngine(slots=2), FakeEngine(slots=2)], max_queue=5)
    ids = [server.submit([100 + 10 * i], 3) for i in range(5)]
    assert _ids(server) == [ids[0::2], ids[1::2]]
    with pytest.raises(QueueFullError, match="5 requests already wait"):
        server.submit([1], 3)   # max_queue bounds the queues together
    scrape = generate_latest(Metrics(server).registry).decode()
    for line in ("triax_queue_depth 5.0", 'triax_replica_queue_depth{replica="0"} 3.0',
                 'triax_replica_queue_depth{replica="1"} 2.0'):
        assert line in scrape, line
    server._step()                 # each replica admits two
    assert server.queued_per_replica == [1, 0] and server.running == 4
    late = server.submit([90], 3)  # replica 0: 2 running + 1 waiting; replica 1: 2 + 0
    assert _ids(server) == [[ids[4]], [late]]
    results = _serve(server)
    assert [results[i].replica for i in ids + [late]] == [0, 1, 0, 1, 0, 1]
    assert all(results[i].tokens == _count([100 + 10 * k], 3) for k, i in enumerate(ids))
    server.submit([60], 3)
    server._step()                 # running on replica 0: its load, though nothing waits
    again = server.submit([70], 3)
    assert _ids(server) == [[], [again]]


def test_a_request_goes_only_to_a_replica_whose_pool_holds_it():
    # replica 0 holds 16 positions a sequence, replica 1 32 (blocks of 16) in its one slot
    server = Server([FakeEngine(slots=2, blocks=1), FakeEngine(slots=1, blocks=2)])
    big = [server.submit(list(range(1, 21)), 5) for _ in range(2)]   # 24 positions
    small = server.submit([7], 3)
    assert _ids(server) == [[small], big]     # though replica 1 is the busier
    with pytest.raises(InferenceError, match="needs 3 KV blocks of 16 positions, and the "
                                             "pool holds 1 per row group"):
        server.submit(list(range(1, 41)), 1)   # no replica's pool: replica 0's error
    assert server.queued == 3
    server._step()
    server._step()             # replica 0 has a free slot and an empty queue ...
    assert _ids(server) == [[], [big[1]]]   # ... but cannot hold the big one
    results = _serve(server)
    assert [results[i].replica for i in big + [small]] == [1, 1, 0]
    assert results[big[1]].tokens == _count([20], 5)


def test_a_tie_goes_to_the_replica_caching_the_longest_prefix():
    engines = [FakeEngine(slots=2, block_size=4, prefix_cache=True) for _ in range(2)]
    server = Server(engines)
    prompt = list(range(1, 10))          # 9 tokens: 2 full blocks before its last token
    kv = engines[1].kv                   # replica 1 served it before: its blocks are cached
    kv.reserve(0, 9)
    kv.grow(0, 9)
    kv.register(0, prompt)
    kv.release(0)
    rid = server.submit(prompt, 2)
    other = server.submit([50, 51], 2)   # replica 1 now the busier
    assert _ids(server) == [[other], [rid]]
    results = _serve(server)
    assert results[rid].cached_tokens == 8 and results[rid].tokens == [10, 11]


def test_a_request_past_its_bypass_bound_holds_back_only_its_own_queue():
    # 3 blocks of 4 a replica; a running request holds 2, so one of 2 does not fit yet
    server = Server([FakeEngine(slots=2, blocks=3, block_size=4) for _ in range(2)],
                    max_bypass=0)
    running = [server.submit([101, 102, 103, 104, 105], 4),
               server.submit([201, 202, 203, 204, 205], 4)]
    server._step()
    big = server.submit([301, 302, 303, 304, 305], 4)   # 2 blocks: waits on replica 0
    small = [server.submit([401], 2), server.submit([501], 2)]   # 1 block each
    assert _ids(server) == [[big, small[1]], [small[0]]]
    server._step()   # replica 0's small one may not pass big; replica 1's is not behind it
    assert _ids(server) == [[big, small[1]], []]
    assert server.results[small[0]].replica == 1   # admitted (and done) meanwhile
    results = _serve(server)
    assert results[big].tokens == _count([305], 4)   # (replica 1, idle first, took it)
    assert all(results[i].tokens == _count([101 + 100 * k + 4], 4)
               for k, i in enumerate(running))


def _live(rid, priority=0, preempted=False, prompt=(1,)):
    live = _Live(Result(rid, list(prompt)), max_new=2, seed=0, priority=priority)
    live.result.preemptions = int(preempted)
    return live


def test_steal_takes_the_first_request_of_the_longest_other_queue():
    schedulers = [Scheduler(FakeEngine(slots=2)) for _ in range(3)]
    a, b, c, d = _live(0), _live(1, priority=-1), _live(2), _live(3)
    schedulers[0].queue.extend([a, b, c])
    schedulers[1].queue.append(d)
    assert steal(schedulers, 1) == 0            # its own queue is not empty
    assert steal(schedulers, 2) == 2            # two free slots: two requests
    assert list(schedulers[2].queue) == [b, a]  # replica 0's first two by rank
    assert list(schedulers[0].queue) == [c] and list(schedulers[1].queue) == [d]
    schedulers[2].queue.clear()
    schedulers[2].slots[0] = a                  # one free slot left: one request
    assert steal(schedulers, 2) == 1 and list(schedulers[2].queue) == [c]

    # a preempted request (its blocks may be cached on its replica) only when no fresh one
    old, new = _live(4, preempted=True), _live(5)
    schedulers[0].queue.extend([old, new])
    schedulers[2].queue.clear()
    schedulers[2].slots[0] = None
    assert steal(schedulers, 2) == 2 and list(schedulers[2].queue) == [new, d]
    schedulers[2].queue.clear()
    assert steal(schedulers, 2) == 1 and list(schedulers[2].queue) == [old]

    # never a request the thief's pool cannot hold (16 positions; this one needs 24)
    small = Scheduler(FakeEngine(slots=2, blocks=1))
    long = _live(6, prompt=range(1, 24))
    schedulers[0].queue.extend([long, _live(7)])
    assert steal([schedulers[0], small], 1) == 1 and small.queue[0].result.request_id == 7


def test_an_idle_replica_takes_waiting_work_from_a_busy_one():
    server = Server([FakeEngine(), FakeEngine()])   # one slot each
    long = server.submit([100], 20)
    short = server.submit([200], 1)
    waiting = server.submit([300], 3)   # behind `long` on replica 0
    other = server.submit([400], 3)     # behind `short` on replica 1
    assert _ids(server) == [[long, waiting], [short, other]]
    results = _serve(server)
    # replica 1 ran out of work while `long` still ran: it took `waiting`
    assert results[waiting].replica == 1 and results[other].replica == 1
    assert results[waiting].done < results[long].done
    assert results[waiting].tokens == _count([300], 3) and results[long].tokens == \
        _count([100], 20)


def test_a_preempted_request_waits_on_its_replica_and_resumes_there():
    # 3 blocks of 4 a replica; each request reaches 8 positions (2 blocks): two cannot
    # both grow past their first block
    server = Server([FakeEngine(slots=2, blocks=3, block_size=4) for _ in range(2)])
    x, y, z, w = (server.submit([10 * i + 1, 10 * i + 2, 10 * i + 3], 6) for i in range(4))
    assert _ids(server) == [[x, z], [y, w]]
    server._step()
    server._step()                       # position 5: the newest of each replica preempted
    assert _ids(server) == [[z], [w]] and server.stats["preemptions"] == 2
    results = _serve(server)
    assert [results[i].replica for i in (x, y, z, w)] == [0, 1, 0, 1]
    assert results[z].preemptions == results[w].preemptions == 1
    assert results[z].tokens == _count([23], 6) and results[w].tokens == _count([33], 6)


def test_cancel_and_a_failure_reach_every_queue():
    server = Server([FakeEngine(), FakeEngine()])
    ids = [server.submit([i + 1], 4) for i in range(5)]
    assert _ids(server) == [ids[0::2], ids[1::2]]
    assert server.cancel(ids[3])         # in replica 1's queue
    assert server.result(ids[3], 1).finish_reason == "cancelled"
    assert _ids(server) == [ids[0::2], [ids[1]]]
    server._step()                       # two of them in slots, two waiting
    server._fail(InferenceError("boom"))
    assert server.queued_per_replica == [0, 0] and server.free_slots == 2
    for i in ids[:3] + ids[4:]:
        assert "boom" in str(server.future(i).exception(1))
    assert server.pending == 0 and not server._step()
