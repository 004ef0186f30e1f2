"""Chunked prefill (``inference.chunked_prefill``, ``Server(max_step_tokens=)``): long
prompts that arrive while streams decode are prefilled a few KV blocks per step, the streams
decoding between the chunks; greedy and seeded sampled tokens equal an unchunked run's, with
prefix caching on (a second long prompt shares the first one's blocks), on one device and
on tensor=2; a row preempted while it prefills in chunks starts again and ends exactly. The
planner's rules (budget, whole blocks, progress, whole-prompt rows) on their own."""
import pytest

from triax.inference import EngineConfig, Server
from triax.inference.chunked_prefill import Pending, plan_chunks
from triax.inference.engine import Engine, InferenceError
from triax.mesh import make_mesh
from inference_helpers import host_params
from chunked_workload import (BS, BUDGET, CFG, ECFG, LONG, LONG_SHARED, NEW, STREAMS,
                              serve_long_prompts)


@pytest.fixture(scope="module")
def params(devices):
    return host_params(CFG, devices)


@pytest.fixture(scope="module")
def engines(params, devices):
    return {name: Engine(CFG, params, make_mesh(devices=devices[:n], tensor=n), "tp", ECFG)
            for name, n in (("one", 1), ("tensor2", 2))}


def _serve(eng, max_step_tokens):
    """``serve_long_prompts``'s results, and the streams' token times."""
    server = Server([eng], max_step_tokens=max_step_tokens)
    seen = {}
    results = serve_long_prompts(
        server, eng, on_token=lambda i: lambda t, now: seen.setdefault(i, []).append(now))
    return server, results, seen


@pytest.fixture(scope="module")
def unchunked(engines):
    """The reference: whole prompts on one device (layouts agree exactly in fp32, so
    tensor=2 is checked against it too, without compiling its own whole-prompt programs)."""
    return _serve(engines["one"], 0)[1]


@pytest.mark.parametrize("layout", ["one", "tensor2"])
def test_chunked_tokens_equal_unchunked_with_the_prefix_cache(layout, engines, unchunked):
    eng = engines[layout]
    whole = unchunked
    server, chunked, seen = _serve(eng, BUDGET)
    assert [r.tokens for r in chunked] == [r.tokens for r in whole], (
        f"{layout}: chunked prefill's tokens differ from whole prompts'")
    assert all(len(r.tokens) == NEW for r in chunked)
    # every long prompt ran in several chunks, and one shared cached blocks
    assert server.stats["prefill_chunks"] >= len(STREAMS) + 3 * 3
    assert server.stats["prefix_hits"] > 0
    # the streams kept decoding while the first long prompt prefilled
    long = chunked[len(STREAMS)]
    between = [t for times in seen.values() for t in times
               if long.submitted < t < long.first_token]
    assert len(between) >= 2 * 3, "the streams stalled during the chunked prefill"


def test_chunked_rows_preempted_under_pressure_resume_exactly(params, unchunked, devices):
    # 16 blocks of 4 for 4 slots: the requests need 4 + 4 + 13 + 13 blocks by their ends, so
    # the growing streams preempt the newest, the long prompt, still prefilling one block a
    # step (a budget of 4 under 2 decode rows), and it starts again.
    tight = Engine(CFG, params, make_mesh(devices=devices[:1]), "tp",
                   EngineConfig(max_batch=4, max_len=64, min_bucket=64, block_size=BS,
                                kv_blocks=16))
    prompts = STREAMS + [LONG, LONG_SHARED]
    # The reference: these prompts' greedy tokens in the module's unchunked run (whole
    # prompts, unpressured; greedy tokens do not depend on the rows beside them, nor on a
    # cached prefix: tests/test_prefix_cache.py), read, not served again.
    reference = [r.tokens for i, r in enumerate(unchunked) if i != len(STREAMS) + 1]
    server = Server([tight], max_step_tokens=4)
    ids = [server.submit(p, NEW) for p in prompts]
    results = server.run()
    assert server.kv_blocks_in_use == 0 and server.prefilling == [{}]
    # (and the chunks ran fused beside the streams: tests/test_mixed_step.py)
    assert server.stats["preemptions"] > 0 and server.stats["mixed_steps"] > 0
    assert [results[i].tokens for i in ids] == reference


def _rows(*specs):
    return [Pending(None, i, list(range(n)), done, whole)
            for i, (n, done, whole) in enumerate(specs)]


def test_the_plan_keeps_the_budget_in_whole_blocks_and_always_progresses():
    # 30 tokens left, 20 budget, blocks of 8: two blocks now; the next row waits
    assert [(p.slot, e) for p, e in plan_chunks(_rows((30, 0, False), (3, 0, False)), 20, 8)] \
        == [(0, 16)]
    # decode rows used it all: the first row still gets one block
    assert [(p.slot, e) for p, e in plan_chunks(_rows((30, 8, False)), -3, 8)] == [(0, 16)]
    # a row that must go whole runs whole when first, and waits when it would overrun
    assert [(p.slot, e) for p, e in plan_chunks(_rows((30, 0, True)), 10, 8)] == [(0, 30)]
    assert [(p.slot, e) for p, e in plan_chunks(_rows((4, 0, False), (30, 0, True)), 10, 8)] \
        == [(0, 4)]
    # the rests that fit all go, the last partly
    assert [(p.slot, e) for p, e in plan_chunks(_rows((5, 0, False), (6, 0, False),
                                                       (40, 16, False)), 30, 8)] \
        == [(0, 5), (1, 6), (2, 32)]


def test_a_negative_budget_is_refused(engines):
    with pytest.raises(InferenceError, match="max_step_tokens=-1"):
        Server([engines["one"]], max_step_tokens=-1)


def test_the_flag_is_parsed_and_a_negative_one_is_refused():
    from triax.cli.main import build_parser
    from triax.cli.serving_flags import serve_config
    from triax.serve_config import ServeConfig
    args = build_parser().parse_args(["serve", "--model", "tiny", "--max-step-tokens", "48"])
    assert serve_config(args).engine.max_step_tokens == 48
    with pytest.raises(ValueError, match="--max-step-tokens -1"):
        ServeConfig.of(model="tiny", max_step_tokens=-1)
