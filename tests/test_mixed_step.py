"""The fused mixed step (``ModelRunner._mixed``, ``models.decode.mixed_attention``): with
chunked prefill, a step with one prompt chunk beside running decode rows runs them as one
program, whose forward reads every weight once. Greedy and seeded sampled tokens equal an
unchunked run's and the two-program chunked run's (fp32, a prefix-cache hit among them);
each such step launches one program where the two-program path launched two; in the
compiled program each weight is the operand of one dot, over the decode rows' and the
chunk's tokens together; a chunk's padding and the padding rows write nothing into the
pool, fp32 or int8."""
import re

import jax
import numpy as np
import pytest

from triax.inference import EngineConfig, Server
from triax.inference.engine import Engine
from triax.mesh import make_mesh
from inference_helpers import host_params
from chunked_workload import BS, BUDGET, CFG, ECFG, LONG, NEW, serve_long_prompts

@pytest.fixture(scope="module")
def params(devices):
    return host_params(CFG, devices)


@pytest.fixture(scope="module")
def eng(params, devices):
    return Engine(CFG, params, make_mesh(devices=devices[:1]), "tp", ECFG)


def _serve(eng, max_step_tokens, fused):
    """``serve_long_prompts``' tokens, and the programs each step launched."""
    server = Server([eng], max_step_tokens=max_step_tokens, fused_steps=fused)
    launched, step = [], server._step

    def counted():
        before = dict(eng.launches)
        busy = step()
        # the model's programs (a sampled row's draw runs beside whichever step ran)
        launched.append({k: n - before[k] for k, n in eng.launches.items() if k != "draw"})
        return busy
    server._step = counted
    return server, [r.tokens for r in serve_long_prompts(server, eng)], launched


@pytest.fixture(scope="module")
def runs(eng):
    return {name: _serve(eng, budget, fused) for name, budget, fused in
            (("whole", 0, True), ("two", BUDGET, False), ("fused", BUDGET, True))}


def test_fused_tokens_equal_unchunked_and_two_program_runs(runs):
    fused, tokens, _ = runs["fused"]
    assert tokens == runs["whole"][1], "fused steps' tokens differ from whole prompts'"
    assert tokens == runs["two"][1], "fused steps' tokens differ from two-program chunks'"
    assert all(len(t) == NEW for t in tokens)
    # every long prompt's chunks ran fused beside the streams, one shared cached blocks
    assert fused.stats["mixed_steps"] >= 3 * 3 and fused.stats["prefix_hits"] > 0
    assert runs["two"][0].stats["mixed_steps"] == 0


def test_a_mixed_step_is_one_program_where_two_ran(runs, eng):
    fused, _, steps = runs["fused"]
    mixed = [s for s in steps if s["mixed"]]
    assert len(mixed) == fused.stats["mixed_steps"] >= 3 * 3
    assert all(sum(s.values()) == 1 for s in mixed), "a mixed step launched more programs"
    # the same chunks beside decode rows took two programs a step on the two-program path
    two = [s for s in runs["two"][2] if s["prefill"] and s["decode"]]
    assert len(two) >= len(mixed)
    assert sum(sum(s.values()) for s in steps) < sum(sum(s.values()) for s in runs["two"][2])


def test_the_warmup_compiles_the_mixed_steps_served(runs, eng):
    lines = []
    Server([eng], max_step_tokens=BUDGET).warmup([len(LONG)], lines.append)
    mixed = [x for x in lines if " mixed " in x]
    # every decode bucket beside the one chunk bucket (64), and the served steps were those
    assert len(mixed) == len(eng._decode_buckets()), lines
    assert eng.compiles["mixed"] == {(k, 64) for k in eng._decode_buckets()}
    assert eng._mixed_jit._cache_size() == len(eng.compiles["mixed"])


def _free(eng):
    """Every slot of ``eng`` empty, nothing cached."""
    for s in range(ECFG.max_batch):
        if eng.kv.busy(s):
            eng.release(s)
    eng.kv.forget_cached()


def _recorded(eng, name, run):
    """The arguments of ``eng``'s jitted ``name`` program in ``run()``'s last launch."""
    jitted, seen = getattr(eng, name), {}

    def wrap(*a, **kw):
        seen.update(args=a, kw=kw)
        return jitted(*a, **kw)
    setattr(eng, name, wrap)
    try:
        run()
    finally:
        setattr(eng, name, jitted)
    return jitted.lower(*seen["args"], **seen["kw"]).compile().as_text()


def _weight_dots(hlo: str) -> list[int]:
    """Each dot over a weight (a projection: no batch dims, unlike attention's) by the
    rows it runs, from the compiled HLO."""
    return [int(m.group(1)) for m in re.finditer(
        r"= f32\[(\d+),\d+\]\{[\d,]+\} dot\([^)]*\), lhs_contracting", hlo)]


def test_the_compiled_mixed_program_reads_each_weight_once(eng):
    _free(eng)
    eng.prefill([0], [np.arange(5)], seeds=[0])
    active = np.array([True, False, False, False])
    prompt, cached = np.arange(20, 40), 8        # a second chunk: 12 tokens from position 8
    eng.prefill([1], [prompt[:cached]], seeds=[0])
    mixed = _recorded(eng, "_mixed_jit", lambda: eng.mixed(
        np.array([3, 0, 0, 0]), active, np.zeros(4, np.int32), None, 1, prompt, cached, 0))
    decode = _recorded(eng, "_decode_jit", lambda: eng.decode(
        np.array([3, 0, 0, 0]), active, np.zeros(4, np.int32)))
    prefill = _recorded(eng, "_prefill_jit", lambda: eng.prefill(
        [2], [prompt], seeds=[0]))
    C = ECFG.buckets()[0]
    rows = _weight_dots(mixed)
    # q, k, v, o, the MLP's two (one layer body: the layers are scanned) and the head
    assert len(rows) == len(_weight_dots(decode)) == len(_weight_dots(prefill)) == 7
    assert rows == [1 + C] * len(rows), f"weight dots over {rows} rows, not all {1 + C}"
    _free(eng)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_padding_writes_nothing(kv_dtype, params, devices, eng):
    e = eng if kv_dtype == "float32" else Engine(
        CFG, params, make_mesh(devices=devices[:1]), "tp",
        EngineConfig(max_batch=4, max_len=64, min_bucket=64, block_size=BS, kv_dtype="int8"))
    _free(e)
    # slots 0, 2, 3 decode (a bucket of 4 rows: one a padding row); slot 1 takes a 6-token
    # prompt, so positions 6.. of its 64-token chunk are padding, two in its second block
    first = e.prefill([0, 2, 3], [np.arange(5), np.arange(7), np.arange(3)], seeds=[0, 0, 0])
    before = jax.tree.map(np.asarray, e.cache)
    active = np.array([True, False, True, True])
    e.mixed(np.asarray(first)[[0, 0, 1, 2]], active, np.zeros(4, np.int32), None, 1,
            np.arange(30, 36), 0, 0)
    after = jax.tree.map(np.asarray, e.cache)
    assert e.compiles["mixed"] >= {(4, ECFG.buckets()[0])}
    written = {(int(e.kv.tables[s, p // BS]), p % BS) for s, p in ((0, 5), (2, 7), (3, 3))}
    written |= {(int(e.kv.tables[1, p // BS]), p % BS) for p in range(6)}
    blocks, last = {b for b, _ in written}, int(e.kv.tables[1, 1])
    for n in ("k", "v"):
        changed = {(int(b), int(p)) for _, _, b, p in zip(*np.nonzero(
            (after[n] != before[n]).any(axis=(4, 5))))}
        if kv_dtype == "float32":
            assert changed <= written, f"{n}: padding wrote {sorted(changed - written)}"
            continue
        # int8: a written block is requantized whole; the rest stay, scales too, and a
        # fresh block's places past the chunk's end are zeros, never padding's values
        assert {b for b, _ in changed} <= blocks, f"{n}: padding wrote {changed}"
        moved = set(np.flatnonzero((after[f"{n}_scale"] != before[f"{n}_scale"]).any(
            axis=(0, 1, 3))).tolist())
        assert moved <= blocks, f"{n}_scale: blocks {sorted(moved - blocks)} rescaled"
        assert not after[n][:, 0, last, 2:].any(), f"{n}: the chunk's padding was written"
    _free(e)
