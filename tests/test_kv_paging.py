"""The paged KV cache (``inference.kv_pool``, ``inference.kv_blocks``): the allocator's
bookkeeping; greedy tokens through scattered blocks equal the no-cache reference on one
device, tensor=2, pipe=2 and context=2; at equal KV memory a mixed workload runs more
sequences at once than slot-reserved caches could hold; blocks come back on cancel; a pool
too small says which flag to raise; the memory check and the planner count the pool."""
import dataclasses

import numpy as np
import pytest

from triax.config_fields import KVPool
from triax.inference import Engine, EngineConfig, InferenceError, Server
from triax.inference.engine import CacheFullError, held_bytes_per_device
from triax.inference.generate import check_serving_memory
from triax.inference.kv_blocks import KVBlocks, KVBlocksError
from triax.inference.kv_pool import bytes_per_block
from triax.inference.reference import greedy_reference
from triax.mesh import make_mesh
from triax.models import config
from triax.costs.memory import kv_cache_bytes
from triax.costs.workload import Layout, Workload
from triax.sharding.rules import get_strategy
from triax.costs.fits import OutOfMemoryPredicted
from inference_helpers import host_params, placed_bytes

CFG = config.TINY.replace(num_layers=2)
BS = 4   # small blocks: a sequence spans many, so the table's order matters
PROMPTS = [[5, 6, 7], list(range(30, 47)), [200, 1], list(range(60, 69))]
NEW = 12


@pytest.fixture(scope="module")
def params(devices):
    return host_params(CFG, devices)


@pytest.fixture(scope="module")
def reference(params):
    return greedy_reference(CFG, params, PROMPTS, 24)[0]


# ---- the allocator ---------------------------------------------------------------------------
def test_blocks_are_reserved_taken_as_the_sequence_grows_and_freed():
    kv = KVBlocks(groups=1, blocks=6, block_size=4, slots=3, max_blocks=4)
    kv.reserve(0, 10)                        # 3 blocks set aside, none taken yet
    assert (kv.in_use, kv.committed, kv.available(1)) == (0, 3, 3)
    kv.grow(0, 3)
    assert kv.tables[0].tolist() == [0, 6, 6, 6] and kv.in_use == 1
    kv.grow(0, 9)                            # into its third block
    assert kv.tables[0].tolist() == [0, 1, 2, 6] and (kv.in_use, kv.committed) == (3, 3)
    assert not kv.can_reserve(1, 13)         # 4 blocks: only 3 left unreserved
    kv.reserve(1, 12)
    with pytest.raises(KVBlocksError, match="already holds"):
        kv.reserve(1, 4)
    with pytest.raises(CacheFullError, match="0 free"):
        kv.reserve(2, 1)                     # every block is taken or reserved
    kv.release(0)
    assert kv.tables[0].tolist() == [6] * 4 and (kv.in_use, kv.committed) == (0, 3)
    with pytest.raises(KVBlocksError, match="released twice"):
        kv.release(0)
    kv.grow(2, 12)                           # direct use: free blocks, no reservation
    assert kv.held[2] == 3 and kv.available(0) == 0
    kv.release(1); kv.release(2)            # a reservation and a direct holding
    assert (kv.in_use, kv.committed, kv.available(0)) == (0, 0, 6)


def test_growth_past_the_pool_or_the_sequence_cap_is_refused():
    kv = KVBlocks(groups=2, blocks=2, block_size=4, slots=4, max_blocks=3)
    kv.grow(0, 8)                            # group 0's two blocks
    with pytest.raises(CacheFullError, match="--kv-blocks"):
        kv.grow(1, 1)                        # slot 1 shares group 0
    kv.grow(2, 8)                            # group 1 has its own
    assert kv.tables[2, :2].tolist() == [0, 1] and kv.in_use == 4
    with pytest.raises(CacheFullError, match="exceed the 12"):
        kv.grow(3, 13)


# ---- exact tokens through scattered blocks, on every layout -------------------------------------
LAYOUTS = {"one": {}, "tensor2": {"tensor": 2}, "data2": {"data": 2}, "pipe2": {"pipe": 2},
           "context2": {"context": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_through_a_scattered_pool_runs_only_the_live_rows(layout, params, reference,
                                                                 devices):
    """8 slots, blocks handed out in a scrambled order, 4 live (slots 1, 2, 5, 7; prefilled
    as a batch of 4 rows), then 2 (slots 2 and 7 stop): greedy tokens through the scattered
    blocks are the no-cache reference's; each step runs a power-of-two bucket of the live
    rows (4, then 2; under data=2 / pipe=2 two per row group, then one each, every row on
    its own group's blocks); the blocks taken are the sequences' and all come back."""
    sizes = LAYOUTS[layout]
    n = int(np.prod(list(sizes.values()) or [1]))
    mesh = make_mesh(devices=devices[:n], **(sizes or {"tensor": 1}))
    eng = Engine(CFG, params, mesh, "tp", EngineConfig(max_batch=8, max_len=32, min_bucket=32,
                                                       block_size=BS))
    rng = np.random.default_rng(0)
    for free in eng.kv._free:                # hand out blocks in a scrambled order
        rng.shuffle(free)
    slots = [1, 2, 5, 7]
    first = np.asarray(eng.prefill(slots, [np.array(p) for p in PROMPTS], [0] * 4))
    # slot 2's 17-token prompt took 5 blocks at once: in the allocator's order, consecutive
    assert (np.diff(eng.kv.tables[2, :eng.kv.held[2]]) != 1).any(), "blocks not out of order"
    out = {s: [int(t)] for s, t in zip(slots, first)}
    cur, active = np.zeros(8, np.int32), np.zeros(8, bool)
    cur[slots], active[slots] = first, True
    for step in range(NEW - 1):
        if step == 4:
            active[[2, 7]] = False           # those two stop; their blocks go back
            eng.release(2), eng.release(7)
        cur = np.asarray(eng.decode(cur, active, np.zeros(8, np.int32)))
        for s in np.flatnonzero(active):
            out[s].append(int(cur[s]))
    for i, s in enumerate(slots):
        assert out[s] == reference[i][:len(out[s])] and len(out[s]) == (NEW if s in (1, 5)
                                                                          else 5)
    assert eng.kv.in_use == sum(-(-(len(PROMPTS[i]) + NEW - 1) // BS) for i in (0, 2))
    assert eng.compiles["decode"] == {(4,), (2,)} and eng._decode_jit._cache_size() == 2
    assert eng.compiles["prefill"] == {(4, 32)}   # 4 prompts: a bucket of 4 rows, not 8
    for s in (1, 5):
        eng.release(s)
    assert eng.kv.in_use == 0


# ---- admission by free blocks --------------------------------------------------------------------
def test_a_mixed_workload_runs_more_sequences_at_once_than_slot_reserved_caches(params,
                                                                               reference,
                                                                               devices):
    """16 blocks of 8 positions: slot-reserved caches of max_len=32 hold 4 sequences. Paged,
    2 long requests (4 blocks each) and 8 short ones (1 block each) all run at once."""
    ecfg = EngineConfig(max_batch=10, max_len=32, min_bucket=32, kv_blocks=16, block_size=8)
    server = Server.from_params(CFG, params, [make_mesh(devices=devices[:1])], "tp", ecfg)
    pool = server.engines[0].pool
    slot_reserved = pool.total_blocks * pool.block_size // ecfg.max_len
    assert slot_reserved == 4
    jobs = [(1, 16), (1, 16)] + [(2 * (i % 2), 4) for i in range(8)]   # (prompt, max_new)
    ids = [server.submit(PROMPTS[p], k) for p, k in jobs]
    results = server.run()
    assert server.stats["peak_running"] == len(jobs) > slot_reserved
    assert [results[i].tokens for i in ids] == [reference[p][:k] for p, k in jobs]
    assert server.kv_blocks_in_use == 0 and server.engines[0].kv.committed == 0


def test_a_request_waits_for_blocks_and_cancel_gives_them_back(params, reference, devices):
    ecfg = EngineConfig(max_batch=4, max_len=32, min_bucket=32, kv_blocks=4, block_size=8)
    server = Server.from_params(CFG, params, [make_mesh(devices=devices[:1])], "tp", ecfg)
    long = server.submit(PROMPTS[1], 16)     # 3 blocks now, the whole pool at 32 positions
    short = server.submit(PROMPTS[3], 4)     # 2 blocks: waits, though 3 slots are free
    server._step()
    assert server.running == 1 and server.queued == 1 and server.kv_blocks_in_use == 3
    assert server.cancel(long)
    server._step()                           # the cancel frees the blocks; short is admitted
    assert server.result(long).finish_reason == "cancelled"
    for _ in range(8):                       # bounded: without the blocks back it would wait
        server._step()
    assert server.future(short).done() and server.result(short).tokens == reference[3][:4]
    assert server.kv_blocks_in_use == 0 and server.engines[0].kv.committed == 0


# ---- too small a pool ----------------------------------------------------------------------------
def test_a_pool_too_small_is_refused_naming_the_flags(params, devices):
    mesh = make_mesh(devices=devices[:1])
    small = EngineConfig(max_batch=2, max_len=32, min_bucket=32, kv_blocks=2, block_size=8)
    server = Server.from_params(CFG, params, [mesh], "tp", small)
    with pytest.raises(InferenceError, match=r"needs 3 KV blocks.*--kv-blocks or --kv-memory"):
        server.submit(PROMPTS[1], 4)         # 20 positions never fit 2 blocks of 8
    assert server.queued == 0
    one = bytes_per_block(CFG, mesh, get_strategy("tp"), 8)
    with pytest.raises(InferenceError, match=rf"--kv-memory {one - 1} bytes holds no KV block"):
        Engine(CFG, None, mesh, "tp", dataclasses.replace(small, kv_blocks=0,
                                                          kv_memory=one - 1))
    with pytest.raises(InferenceError, match="--kv-block-size 3.*context=2"):
        Engine(CFG, None, make_mesh(context=2, devices=devices[:2]), "tp",
               dataclasses.replace(small, block_size=3))
    with pytest.raises(InferenceError, match="--kv-blocks 3.*multiple of 2"):
        Engine(CFG, None, make_mesh(data=2, devices=devices[:2]), "tp",
               dataclasses.replace(small, kv_blocks=3))
    with pytest.raises(ValueError, match="one of --kv-blocks and --kv-memory"):
        KVPool(kv_blocks=4, kv_memory="1GiB")
    with pytest.raises(ValueError, match="--kv-memory"):
        KVPool(kv_memory="lots")


# ---- the memory check and the planner count the pool -------------------------------------------
def test_kv_memory_sizes_the_pool_and_the_checks_count_it(devices):
    mesh = make_mesh(tensor=2, devices=devices[:2])
    st = get_strategy("tp")
    one = bytes_per_block(CFG, mesh, st, 16)
    # fp32 k and v of one block: layers × positions × KV heads (split over tensor) × head dim
    assert one == 2 * CFG.num_layers * 16 * (CFG.num_kv_heads // 2) * CFG.head_dim * 4
    ecfg = EngineConfig(max_batch=4, max_len=64, kv_memory=10 * one + one // 2)
    eng = Engine(CFG, None, mesh, "tp", ecfg)
    assert eng.pool.total_blocks == 10 and eng.pool.bytes_per_device() == 10 * one
    assert placed_bytes(eng) == 10 * one
    assert held_bytes_per_device(CFG, mesh, "tp", ecfg)["KV cache"] == 10 * one
    w = Workload.of(CFG, train=False, dtype="fp32", batch=4, seq=64, kv_memory=ecfg.kv_memory)
    assert kv_cache_bytes(w, Layout(tensor=2, strategy="tp")) == 10 * one
    # The memory check counts the pool, not slots × max_len.
    fits = (sum(held_bytes_per_device(CFG, mesh, "tp", ecfg).values()), "test")
    check_serving_memory(CFG, mesh, st, ecfg, capacity=fits)
    with pytest.raises(OutOfMemoryPredicted, match="KV pool of 12 blocks"):
        check_serving_memory(CFG, mesh, st, dataclasses.replace(ecfg, kv_memory=0,
                                                                kv_blocks=12), capacity=fits)


@pytest.mark.parametrize("mesh,flags", [
    ("tensor=2", ["--kv-blocks", "12", "--kv-block-size", "8"]),
    ("data=2", ["--kv-memory", "20000"]),      # 4 whole blocks per group (4096 bytes each)
    ("tensor=2", []),                          # neither: slots × --seq-len's blocks
])
def test_plan_inference_counts_the_pool_it_is_given(capsys, devices, mesh, flags):
    import json

    from triax.cli.main import main
    from triax.mesh import parse_mesh
    assert main(["plan", "--model", "tiny", "--num-layers", "2", "--inference", "--dtype",
                 "fp32", "--gpu", "h100-80gb", "--gpus-per-node", "2", "--nodes", "1",
                 "--mesh", mesh, "--strategy", "tp", "--batch-size", "4", "--seq-len", "64",
                 "--json", *flags]) == 0
    planned = json.loads(capsys.readouterr().out)["plans"][0]["memory_per_device"]["kv_cache"]
    args = dict(zip(flags[::2], flags[1::2]))
    ecfg = EngineConfig(max_batch=4, max_len=64, kv_blocks=int(args.get("--kv-blocks", 0)),
                        kv_memory=int(args.get("--kv-memory", 0)),
                        block_size=int(args.get("--kv-block-size", 16)))
    eng = Engine(CFG, None, make_mesh(**parse_mesh(mesh), devices=devices[:2]), "tp", ecfg)
    blocks = {"--kv-blocks": 12, "--kv-memory": 8}.get(flags[0] if flags else None, 4 * 4)
    assert eng.pool.total_blocks == blocks
    assert planned == eng.pool.bytes_per_device() == placed_bytes(eng)


# ---- the flags -----------------------------------------------------------------------------------
def test_the_serve_flags_size_the_pool(devices):
    from triax.cli.main import build_parser
    from triax.cli.serving_flags import serve_config
    from triax.inference.generate import build_server
    # 2 layers: the module's model, so its initial weights are the `params` fixture's program
    base = ["serve", "--model", "tiny", "--num-layers", "2", "--mesh", "tensor=1", "--slots",
            "4", "--max-len", "32"]
    args = build_parser().parse_args(base + ["--kv-blocks", "6", "--kv-block-size", "8"])
    server = build_server(serve_config(args), longest=32, max_new_tokens=0,
                          devices=devices[:1])
    kv = server.engines[0].kv
    assert (kv.total, kv.block_size, kv.max_blocks) == (6, 8, 4)
    both = build_parser().parse_args(base + ["--kv-blocks", "6", "--kv-memory", "1MiB"])
    with pytest.raises(ValueError, match="one of --kv-blocks and --kv-memory"):
        serve_config(both)