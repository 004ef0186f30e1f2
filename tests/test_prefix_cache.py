"""Automatic prefix caching (``inference.prefix_cache``, ``KVBlocks`` with ``prefix_cache``):
a prompt's full blocks are keyed by their tokens and all before them, shared (ref-counted)
by later prompts of the same row group, kept after their last holder ends and evicted least
recently used first. Greedy tokens with the cache equal the no-cache reference on one
device, tensor=2 and pipe=2 (context=2 serves with the cache off: its prompts are striped),
the hits are counted; no shared block is freed while shared; eviction under pressure loses
nothing (one device's pool is small enough to evict)."""
import numpy as np
import pytest

from triax.inference import Engine, EngineConfig, Server
from triax.inference.kv_blocks import KVBlocks
from triax.inference.reference import greedy_reference
from triax.mesh import make_mesh
from triax.models import config
from inference_helpers import host_params

CFG = config.TINY.replace(num_layers=2)
BS = 4
SYSTEM = list(range(100, 113))          # 13 tokens: 3 full blocks shared
PROMPTS = [SYSTEM + [5, 6, 7], SYSTEM + list(range(30, 40)), SYSTEM[:8] + [200, 1],
           SYSTEM + [60]]
NEW = 6


@pytest.fixture(scope="module")
def params(devices):
    return host_params(CFG, devices)


@pytest.fixture(scope="module")
def reference(params):
    return greedy_reference(CFG, params, PROMPTS, NEW)[0]


# ---- the allocator ---------------------------------------------------------------------------
def test_shared_blocks_are_counted_kept_after_use_and_evicted_least_recent_first():
    kv = KVBlocks(groups=1, blocks=6, block_size=2, slots=3, max_blocks=6, prefix_cache=True)
    a = [1, 2, 3, 4, 5]
    kv.reserve(0, 6)
    kv.grow(0, 5)
    kv.register(0, a)                       # blocks 0, 1 hold [1, 2], [3, 4]
    assert kv.lookup(1, a + [9]) == [0, 1] and kv.lookup(1, [1, 2, 7, 7]) == [0]
    assert kv.lookup(1, [1, 2, 3, 4]) == [0]   # never the last token's block
    kv.reserve(1, 6, shared=[0, 1])         # shares two, takes one more later
    kv.grow(1, 5)
    assert kv.tables[1, :3].tolist() == [0, 1, 3] and kv.refs[0, :4].tolist() == [2, 2, 1, 1]
    assert kv.in_use == 4                   # a shared block once
    kv.release(0)                           # block 0 and 1 still held by slot 1: not freed
    assert kv.refs[0, :2].tolist() == [1, 1] and 0 not in kv._free[0] + list(
        kv.prefix[0].unused)
    kv.release(1)                           # now cached, unused: kept, evictable
    assert (kv.in_use, kv.cached, kv.lookup(2, a)) == (0, 2, [0, 1])
    kv.grow(2, 8)                           # 4 blocks: the 4 uncached first
    assert kv.cached == 2 and sorted(kv.tables[2, :4].tolist()) == [2, 3, 4, 5]
    kv.release(2)
    kv.reserve(0, 12)                       # 6 blocks: both cached ones evicted, oldest first
    kv.grow(0, 12)
    assert kv.cached == 0 and kv.lookup(1, a) == [] and kv.in_use == 6
    kv.release(0)
    assert kv.in_use == 0 and not kv.refs.any()


# ---- exact tokens with the cache, on every layout ---------------------------------------------
LAYOUTS = {"one": {}, "tensor2": {"tensor": 2}, "pipe2": {"pipe": 2}}


def _serve(params, devices, sizes, kv_blocks: int = 0):
    n = int(np.prod(list(sizes.values()) or [1]))
    mesh = make_mesh(devices=devices[:n], **(sizes or {"tensor": 1}))
    ecfg = EngineConfig(max_batch=2, max_len=32, min_bucket=32, block_size=BS,
                        kv_blocks=kv_blocks, prefix_cache=True)
    server = Server.from_params(CFG, params, [mesh], "tp", ecfg)
    first = server.submit(PROMPTS[0], NEW)
    server.run()                            # its blocks are cached before the others come
    ids = [first] + [server.submit(p, NEW) for p in PROMPTS[1:]]
    results = server.run()
    return server, [results[i] for i in ids]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tokens_with_the_prefix_cache_equal_the_reference(layout, params, reference,
                                                          devices):
    """On one device the pool is 9 blocks, so admissions evict cached blocks (under
    pressure: nothing is lost); elsewhere the default (slots × max_len)."""
    server, got = _serve(params, devices, LAYOUTS[layout], kv_blocks=9 * (layout == "one"))
    assert [r.tokens for r in got] == reference
    eng = server.engines[0]
    # slot 0's group caches the system prompt's 3 blocks (prompt 2 shares 2 of them where
    # it lands in that group: pipe=2 has a row group per slot)
    hits = [r.cached_tokens for r in got]
    assert hits == ([0, 12, 0, 12] if layout == "pipe2" else [0, 12, 8, 12])
    assert server.stats["prefix_hits"] == sum(hits)
    assert server.stats["prefix_queries"] == sum(map(len, PROMPTS))
    kv = eng.kv
    assert kv.in_use == 0 and not kv.refs.any() and kv.cached > 0   # every block back
    assert kv.cached + sum(map(len, kv._free)) == kv.total
    assert (kv.evicted > 0) == (layout == "one")


def test_context_layouts_serve_without_the_cache(devices):
    """Striped prompts (context=2) are served whole: the cache is off there (their tokens
    are test_kv_paging's), and an engine elsewhere keeps it on."""
    ecfg = EngineConfig(max_batch=2, max_len=32, block_size=BS, prefix_cache=True)
    ctx = Engine(CFG, None, make_mesh(context=2, devices=devices[:2]), "tp", ecfg)
    one = Engine(CFG, None, make_mesh(devices=devices[:1]), "tp", ecfg)
    assert (ctx.prefix_cache, ctx.kv.prefix, one.prefix_cache) == (False, None, True)
