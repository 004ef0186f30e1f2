"""Speculative decoding (``inference.speculative``): the rejection rule keeps the target's
distribution (a chi-square over many seeds), and served tokens are those of plain decoding:
greedy on every layout, sampled under n-gram lookup (the coupled rule), and with a draft
that is the target itself; stop tokens, max_tokens, log-probabilities and cancellation
act as without speculation; blocks taken for rejected positions go back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_counter import compiles_during

from triax.inference.draft_proposer import DraftWeights, draft_for, load_draft
from triax.inference.engine import Engine, EngineConfig
from triax.inference.kv_blocks import KVBlocks
from triax.inference.ngram_proposer import propose
from triax.inference.rejection import rejection_accept
from triax.inference.sampling import SamplingConfig, row_keys
from triax.inference.server import Server
from triax.inference.speculative import SpeculativeConfig, attach
from triax.mesh import make_mesh
from triax.models import config

CFG = config.TINY.replace(num_layers=2)
PROMPTS = [[72, 105, 72, 105, 72, 105, 33], [1, 2, 3, 4, 5, 1, 2, 3], [7] * 5,
           [40, 41, 42, 40, 41]]
NEW = 12


# ---- the rejection rule, alone ---------------------------------------------------------------
def _rounds(P0, P1, Q0, Q1, N):
    """The first two tokens of ``N`` sequences (one seed each) decoded speculatively with
    k=2 from a target whose next-token law is ``P0``, then ``P1[first]``, and a draft's
    ``Q0``, ``Q1[first]``; a round that emits one token is followed by a second round."""
    rows = {"temperature": jnp.ones(N), "top_k": jnp.zeros(N, jnp.int32),
            "top_p": jnp.ones(N)}
    seeds = jnp.arange(N)

    def draw(law_NV, pos):   # the draft's draw: the key of the position it fills
        return jax.vmap(jax.random.categorical)(row_keys(0, seeds, jnp.full(N, pos)),
                                                jnp.log(law_NV)).astype(jnp.int32)

    def round_(p0, q0, base):   # p0, q0: [N, V] laws of the round's first position
        d1 = draw(q0, base + 1)
        d2 = draw(Q1[d1], base + 2)
        logits = jnp.log(jnp.stack([p0, P1[d1], P1[d1]], axis=1))   # the last: the bonus's
        return rejection_accept(logits, jnp.stack([d1, d2], 1), jnp.stack([q0, Q1[d1]], 1),
                                jnp.full(N, 2), 0, seeds, jnp.full(N, base), rows)

    a, tok = round_(jnp.broadcast_to(P0, (N, 4)), jnp.broadcast_to(Q0, (N, 4)), 0)
    first = tok[:, 0]
    _, tok2 = round_(P1[first], Q1[first], 1)
    second = jnp.where(a >= 1, tok[:, 1], tok2[:, 0])
    return first, second


def test_rejection_rule_keeps_the_target_distribution():
    """Chi-square of the first two tokens' joint law over 16 cells, 20000 seeds: the target's
    law passes, the draft's (what always accepting would give) is far off."""
    rng = np.random.default_rng(0)
    P0, Q0 = rng.dirichlet(np.ones(4)), rng.dirichlet(np.ones(4))
    P1, Q1 = rng.dirichlet(np.ones(4), 4), rng.dirichlet(np.ones(4), 4)
    first, second = jax.jit(_rounds, static_argnums=4)(
        *(jnp.asarray(x, jnp.float32) for x in (P0, P1, Q0, Q1)), 20000)
    first, second = np.asarray(first), np.asarray(second)
    counts = np.bincount(first * 4 + second, minlength=16)

    def chi2(law):
        expect = law.reshape(-1) * counts.sum()
        return float(((counts - expect) ** 2 / expect).sum())
    # 15 degrees of freedom: P(chi2 > 37.7) = 0.001
    assert chi2(P0[:, None] * P1) < 37.7, "the speculative tokens do not follow the target"
    assert chi2(Q0[:, None] * Q1) > 1000   # the test can tell the draft from the target


def test_ngram_proposes_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == [9, 2]    # "1 2 3" beats "2 3"
    assert propose([4, 5, 4, 6, 4], 3) == [6, 4]                   # latest "4", cut short
    assert propose([1, 2, 3], 4) == []


def test_shrink_returns_the_blocks_of_rejected_positions():
    kv = KVBlocks(groups=1, blocks=6, block_size=4, slots=2, max_blocks=4)
    kv.reserve(0, 5)
    kv.grow(0, 13)                  # a verify step over positions 5..12: four blocks
    assert kv.in_use == 4
    kv.shrink(0, 7)                 # two accepted: back to two blocks
    assert (kv.in_use, kv.tables[0].tolist()) == (2, [0, 1, 6, 6])
    assert kv.available(1) == 4


# ---- served tokens ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    """One replica of tensor=2, one slot. One replica, not two: a second would compile every
    program again (JAX keys programs by device) and route no differently; several
    replicas speculating, and one decoding plainly beside another speculating, are
    ``test_greedy_ngram_on_pipeline_and_context_layouts``'s server."""
    return Server.from_seed(CFG, replicas=1, mesh_sizes={"tensor": 2},
                            devices=jax.devices()[:2],
                            ecfg=EngineConfig(max_batch=1, max_len=32, min_bucket=16))


def _speculators(eng, draft=None):
    """An n-gram speculator for ``eng`` and, given ``DraftWeights``, a draft one ("tiny"
    names the draft for the flags only), each made once: its programs compile once."""
    out = {}
    for name, d in (("ngram", None), ("draft", draft)):
        if name == "ngram" or d is not None:
            attach([eng], SpeculativeConfig(name, 3, None if d is None else "tiny"),
                   None if d is None else draft_for(d))
            out[name] = eng.speculator
    eng.speculator = None
    return out


@pytest.fixture(scope="module")
def specs(server):
    """The replica's speculators: n-gram, a one-layer draft and a draft that is the target
    itself."""
    eng = server.engines[0]
    out = _speculators(eng, load_draft("tiny", CFG, eng.mesh, "tp", seed=1, num_layers=1))
    out["self"] = _speculators(eng, DraftWeights(CFG, eng.params))["draft"]
    return {k: [v] for k, v in out.items()}


def _use(server, specs, name):
    for i, eng in enumerate(server.engines):
        eng.speculator = None if name is None else specs[name][i]   # None: plain
        if eng.speculator is not None:
            eng.speculator.stats = dict.fromkeys(eng.speculator.stats, 0)


def _serve(server, specs, name, sampling=None, **kw):
    _use(server, specs, name)
    ids = [server.submit(p, NEW, sampling=sampling, **kw) for p in PROMPTS]
    res = server.run()
    return [res[i] for i in ids]


def _stats(server):
    got = [e.speculator.stats for e in server.engines if e.speculator is not None]
    return {k: sum(s[k] for s in got) for k in got[0]}


@pytest.fixture(scope="module")
def plain(server, specs):
    return [r.tokens for r in _serve(server, specs, None)]


def test_greedy_ngram_is_plain_decoding(server, specs, plain):
    _use(server, specs, "ngram")
    server.warmup(sorted({len(p) for p in PROMPTS}))   # the verify steps compile here
    compiled = [{k: set(v) for k, v in e.compiles.items()} for e in server.engines]
    accepts = [e.launches.get("accept", 0) for e in server.engines]
    got = _serve(server, specs, "ngram")
    assert [e.compiles for e in server.engines] == compiled, "serving compiled a program"
    # greedy rows' tokens come from the verify step itself (its argmaxes); the acceptance
    # program (the rejection rule, the target's draws) runs only where a row samples
    assert [e.launches.get("accept", 0) for e in server.engines] == accepts
    assert [r.tokens for r in got] == plain, "ngram speculation changed greedy tokens"
    st = _stats(server)
    assert st["accepted"] > 0 and st["rounds"] < len(PROMPTS) * (NEW - 1)  # it did speculate
    assert server.kv_blocks_in_use == 0


def test_greedy_draft_is_plain_decoding(server, specs, plain):
    got = _serve(server, specs, "draft")
    assert [r.tokens for r in got] == plain, "draft speculation changed greedy tokens"
    assert _stats(server)["proposed"] > 0 and server.kv_blocks_in_use == 0


def test_sampled_tokens_are_plain_decodings(server, specs):
    """n-gram (coupled rule) and a draft equal to the target (every proposal kept) draw
    exactly plain decoding's tokens at temperature 1."""
    hot = SamplingConfig(temperature=1.0, top_k=50)
    ref = [r.tokens for r in _serve(server, specs, None, hot)]
    assert [r.tokens for r in _serve(server, specs, "ngram", hot)] == ref
    accepts = sum(e.launches.get("accept", 0) for e in server.engines)
    assert [r.tokens for r in _serve(server, specs, "self", hot)] == ref
    assert sum(e.launches.get("accept", 0) for e in server.engines) > accepts
    st = _stats(server)
    assert st["accepted"] == st["proposed"] > 0


def test_stops_length_and_logprobs_match(server, specs, plain):
    stop = plain[0][4]   # a token the first prompt generates
    asked = SamplingConfig(stop_tokens=(stop,), logprobs=True)
    ref = _serve(server, specs, None, asked)
    got = _serve(server, specs, "ngram", asked)
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
    assert {r.finish_reason for r in got} == {"stop", "length"}
    for a, b in zip(got, ref):
        assert len(a.logprobs) == len(a.tokens)
        np.testing.assert_allclose([e["logprob"] for e in a.logprobs],
                                   [e["logprob"] for e in b.logprobs], atol=1e-5)


def test_cancel_mid_round(server, specs, plain):
    """A listener that cancels after its third token: the round's later tokens are dropped,
    as plain decoding never draws them."""
    def serve(name):
        _use(server, specs, name)
        seen = []

        def listen(tok, now):
            seen.append(tok)
            if len(seen) == 3:
                server.cancel(rid)
        rid = server.submit(PROMPTS[0], NEW, on_token=listen)
        return server.run()[rid]
    a, b = serve(None), serve("ngram")
    assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason) == (plain[0][:3],
                                                                          "cancelled")


def test_flags_attach_and_metrics(server, specs):
    """``--speculative ngram`` attaches n-gram speculators; ``/metrics`` reports the
    acceptance rate and the mean accepted length of what was served."""
    from prometheus_client import generate_latest

    from triax.inference.draft_proposer import speculate
    from triax.serve_config import ServeConfig
    from triax.serving.metrics import Metrics
    with pytest.raises(ValueError, match="--draft-model"):
        ServeConfig.of(model="tiny", speculative="draft")
    assert ServeConfig.of(model="tiny").inert_flags(["num_speculative_tokens"]) == [
        "--num-speculative-tokens has no effect without --speculative"]
    speculate(server.engines, ServeConfig.of(model="tiny", speculative="ngram",
                                             num_speculative_tokens=3).engine)
    assert all(e.speculator.k == 3 for e in server.engines)
    _serve(server, specs, "ngram")
    st = server.speculative_stats
    text = generate_latest(Metrics(server).registry).decode()
    rate = float(text.split("\ntriax_speculative_acceptance_rate ")[1].split()[0])
    mean = float(text.split("\ntriax_speculative_mean_accepted_length ")[1].split()[0])
    assert rate == pytest.approx(st["accepted"] / st["proposed"]) and 0 < rate < 1
    assert mean == pytest.approx(1 + st["accepted"] / st["rounds"]) and mean > 1


def test_greedy_ngram_on_pipeline_and_context_layouts(server, plain):
    """The verify pass through the pipeline's forward-only schedule (pipe=2) and over a
    context-split pool (context=2), with n-gram proposals and a draft (the target's own
    weights: every proposal kept), on a server of these two replicas: greedy tokens are
    plain decoding's (the module server's, tensor=2: layouts agree). Three runs give each
    layout both speculators, and the context replica plain decoding beside the pipeline's
    n-gram (a server may mix them). The pipeline's two micro-batches take a slot each; the
    context replica has one slot (one decode bucket)."""
    params, devs = server.engines[0].params, jax.devices()
    server = Server([Engine(CFG, params, make_mesh(pipe=2, devices=devs[4:6]),
                            ecfg=EngineConfig(max_batch=2, max_len=32, min_bucket=16)),
                     Engine(CFG, params, make_mesh(context=2, devices=devs[6:8]),
                            ecfg=EngineConfig(max_batch=1, max_len=32, min_bucket=16))])
    # (load_draft's own init is the module fixture's "self")
    specs = [_speculators(e, DraftWeights(CFG, e.params)) for e in server.engines]
    for pipe, ctx in (("ngram", None), ("draft", "ngram"), ("ngram", "draft")):
        _use(server, {"run": [specs[0][pipe], specs[1].get(ctx)]}, "run")   # None: plain
        ids = [server.submit(p, NEW) for p in PROMPTS]
        res = server.run()
        assert [res[i].tokens for i in ids] == plain, f"pipe {pipe}, context {ctx}"
        assert {res[i].replica for i in ids} == {0, 1}
        for eng, how in zip(server.engines, (pipe, ctx)):
            if how is not None:
                st = eng.speculator.stats
                assert st["accepted"] > 0, (how, st)
                assert how == "ngram" or st["accepted"] == st["proposed"], st


def test_planner_prices_k_acceptance_and_the_draft():
    """Decode bound by reading the weights: verifying k + 1 positions costs the same step,
    and tokens per second grow by the expected accepted length; a draft adds its k steps
    and its weights and pool to each device; compute-bound (a large batch of short
    sequences), proposals that are never kept only cost."""
    from dataclasses import replace

    from triax.costs.hardware import load_catalog
    from triax.costs.memory import estimate
    from triax.costs.speculative import draft_workload, expected_tokens
    from triax.costs.workload import Layout, Workload
    from triax.planner.evaluate import evaluate
    cluster = load_catalog(None).cluster("h100-80gb", 8, 1)
    lay = Layout(tensor=8)
    w = Workload.of(config.get("llama3-8b"), train=False, batch=1, seq=2048)
    plain = evaluate(w, lay, cluster)
    spec = evaluate(replace(w, spec_k=4, acceptance=0.7), lay, cluster)
    assert spec.step_time_s == plain.step_time_s
    assert spec.tokens_per_s == pytest.approx(plain.tokens_per_s * expected_tokens(4, 0.7))
    drafted = replace(w, spec_k=4, acceptance=0.7, draft=config.get("llama3-1b"))
    d = estimate(draft_workload(drafted), lay)
    assert evaluate(drafted, lay, cluster).memory.params == plain.memory.params + d.params
    assert evaluate(drafted, lay, cluster).memory.kv_cache == (plain.memory.kv_cache
                                                               + d.kv_cache)
    assert evaluate(drafted, lay, cluster).step_time_s > plain.step_time_s
    big = Workload.of(config.get("llama3-8b"), train=False, batch=512, seq=128)
    assert (evaluate(replace(big, spec_k=4, acceptance=0.0), lay, cluster).tokens_per_s
            < evaluate(big, lay, cluster).tokens_per_s)
    with pytest.raises(ValueError, match="--acceptance-rate"):
        Workload.of(config.get("tiny"), train=False, spec_k=2, acceptance=1.5)


def test_bad_settings_are_named():
    """A draft of another vocabulary (a Hugging Face directory), k < 1, an unknown method."""
    from hf_fixtures import fixture

    from triax.inference.errors import InferenceError
    with compiles_during() as compiles, \
            pytest.raises(InferenceError, match="vocabulary of 320 ids and the target 264"):
        load_draft(fixture("llama"), CFG, make_mesh(devices=jax.devices()[:1]), "tp")
    assert compiles == [], "the draft's weights were placed before its vocabulary was read"
    with pytest.raises(InferenceError, match="--num-speculative-tokens 0"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(InferenceError, match="choose one of ngram, draft"):
        SpeculativeConfig("medusa")
    with pytest.raises(InferenceError, match="needs --draft-model"):
        SpeculativeConfig("draft", 4)


def test_draft_sampling_matches_plain_sampling(server):
    """End to end through the engine: 800 seeded requests at temperature 1, top-k 3, served
    plainly and with a draft near the target (its weights perturbed: some proposals kept,
    some not); the joint law of their second and third tokens (the first speculative
    round's) agrees by a two-sample chi-square."""
    server = Server.from_params(CFG, server.engines[0].params,   # the seed-0 weights
                                [make_mesh(devices=jax.devices()[:1])],
                                ecfg=EngineConfig(max_batch=32, max_len=16, min_bucket=16))
    hot, n = SamplingConfig(temperature=1.0, top_k=3), 800

    def tokens():
        ids = [server.submit([5, 6, 7], 3, seed=s, sampling=hot) for s in range(n)]
        res = server.run()
        return np.array([res[i].tokens[1] * 1000 + res[i].tokens[2] for i in ids])
    plain = tokens()
    eng = server.engines[0]
    rng = np.random.default_rng(1)   # the noise drawn on the host: no program to compile
    noise = jax.tree.map(lambda x: jax.device_put(np.asarray(
        np.asarray(x) * (1 + 0.2 * rng.standard_normal(x.shape)), x.dtype), x.sharding),
        eng.params)
    attach([eng], SpeculativeConfig("draft", 2, "tiny"), draft_for(DraftWeights(CFG, noise)))
    spec = tokens()
    st = eng.speculator.stats
    assert 0 < st["accepted"] < st["proposed"]
    cells = np.unique(np.concatenate([plain, spec]))
    a = np.array([np.sum(plain == c) for c in cells])
    b = np.array([np.sum(spec == c) for c in cells])
    keep = a + b >= 10   # chi-square cells with enough mass; the rest pooled
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    chi2 = float(np.sum((a - b) ** 2 / np.maximum(a + b, 1)))
    df = len(a) - 1
    assert chi2 < df + 4 * np.sqrt(2 * df), f"chi-square {chi2:.1f} on {df} degrees of freedom"


def test_under_pool_pressure_with_prefix_cache(server):
    """A pool of 7 blocks of 8 for 2 slots (a sequence ends at 5 blocks): sequences are
    preempted and recomputed, prompts share cached blocks, verify steps take blocks past
    their rows' lengths and give the rejected ones back; greedy tokens are plain decoding's
    and every block comes back. One prompt bucket (48): the lengths are not the point, and
    each bucket would compile every prefill again."""
    server = Server.from_params(CFG, server.engines[0].params,   # the seed-0 weights
                                [make_mesh(devices=jax.devices()[:1])],
                                ecfg=EngineConfig(max_batch=2, max_len=48, min_bucket=48,
                                                  kv_blocks=7, block_size=8,
                                                  prefix_cache=True))
    prompts = [list(range(100, 116)) + p for p in PROMPTS]   # two blocks in common

    def serve():
        ids = [server.submit(p, NEW) for p in prompts]
        res = server.run()
        return [res[i].tokens for i in ids]
    plain = serve()
    before = dict(server.stats)
    attach(server.engines, SpeculativeConfig("ngram", 4))
    assert serve() == plain
    assert server.stats["preemptions"] > before["preemptions"]
    assert server.stats["prefix_hits"] > before["prefix_hits"]
    assert server.engines[0].speculator.stats["accepted"] > 0 and server.kv_blocks_in_use == 0


def test_rejected_positions_give_their_blocks_back(server, specs):
    """A verify step over positions 14..17 takes a second block of 16; when a proposal is
    rejected before position 16 the row is rolled back to one block."""
    _use(server, specs, "ngram")
    eng, spec = server.engines[0], specs["ngram"][0]
    prompt = [1, 2, 3, 9] * 3 + [1, 2]
    first = int(np.asarray(eng.prefill([0], [np.array(prompt)], seeds=[0], padded=True))[0])
    ctx = [first, 5, 6, 7, 8] * 2 + [first]   # the lookup proposes 5 6 7 8
    rnd = spec.launch(np.array([first]), np.array([True]), np.zeros(1, np.int32),
                      [eng.sampling], [ctx], [NEW], [None])
    assert eng.kv.held[0] == 2 and rnd.counts[0] == 3   # k = 3: positions 14..17
    (toks, _), = spec.collect(rnd).values()
    assert eng.lengths[0] == len(prompt) + len(toks)
    assert eng.kv.held[0] == eng.kv.need(int(eng.lengths[0])), "rejected blocks kept"
    eng.release(0)
