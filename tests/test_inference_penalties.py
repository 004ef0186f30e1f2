"""Per-request logit controls against a numpy reference (vLLM's semantics): presence,
frequency and repetition penalties, logit_bias, min_tokens' ban of stop tokens; the
prefill path (seen tokens given) and the decode path (``TokenHistory``); one trace for
any mix of requests with the same controls in use; log-probabilities of the raw logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.inference.logprobs import TOP_LOGPROBS
from triax.inference.penalties import TokenHistory, adjust_logits
from triax.inference.sampling import SamplingConfig, SamplingError, row_settings, sample_step

V, L = 40, 12
RNG = np.random.RandomState(0)
LOGITS = (RNG.randn(7, V) * 3).astype(np.float32)
HIST = RNG.randint(0, 10, (7, L)).astype(np.int32)     # few ids: repeats
PROMPT = np.array([3, 5, 2, 4, 6, 1, 3])
SEEN = np.array([7, 9, 2, 10, 12, 4, 6])                # tokens seen (prompt + output)
CONFIGS = [SamplingConfig(presence_penalty=1.5),
           SamplingConfig(frequency_penalty=0.7),
           SamplingConfig(repetition_penalty=1.8),
           SamplingConfig(logit_bias=((4, 20.0), (7, -3.5))),
           SamplingConfig(min_tokens=9, stop_tokens=(1, 8)),     # generated 6 < 9: banned
           SamplingConfig(),
           SamplingConfig(presence_penalty=-0.5, frequency_penalty=1.1,
                          repetition_penalty=0.7, logit_bias=((0, 2.0),), min_tokens=1,
                          stop_tokens=(5,))]                      # generated 3 >= 1: free


def reference(logits, configs, hist, prompt, seen):
    """vLLM: bias (and min_tokens' ban), then repetition on prompt and output tokens, then
    frequency and presence on the output's counts."""
    out = logits.astype(np.float64).copy()
    for i, c in enumerate(configs):
        for t, b in c.logit_bias:
            out[i, t] += b
        if seen[i] - prompt[i] < c.min_tokens:
            out[i, list(c.stop_tokens)] = -np.inf
        toks = hist[i, :seen[i]]
        for t in set(toks.tolist()):
            x = out[i, t]
            out[i, t] = x / c.repetition_penalty if x > 0 else x * c.repetition_penalty
        counts = np.bincount(toks[prompt[i]:], minlength=V)
        out[i] -= c.frequency_penalty * counts + c.presence_penalty * (counts > 0)
    return out


EXPECTED = reference(LOGITS, CONFIGS, HIST, PROMPT, SEEN)


def test_each_control_equals_numpy_on_the_prefill_path():
    rows = row_settings(CONFIGS, SEEN - PROMPT)
    got = np.asarray(adjust_logits(jnp.asarray(LOGITS), rows, (HIST, SEEN, PROMPT)))
    np.testing.assert_allclose(got, EXPECTED, rtol=1e-6, atol=1e-5)
    for i in (0, 1, 2, 3, 4):   # each control moved its row
        assert not np.allclose(got[i], LOGITS[i]), i
    np.testing.assert_array_equal(got[5], LOGITS[5])


def test_decode_path_reads_the_token_history():
    hist = TokenHistory(slots=7, max_len=L)
    for s in range(7):
        hist.start(s, HIST[s, :PROMPT[s]])
    for step in range(max(SEEN - PROMPT)):
        live = [s for s in range(7) if hist.length[s] < SEEN[s]]
        tokens = np.zeros(7, np.int32)
        tokens[live] = HIST[live, hist.length[live]]
        hist.feed(live, tokens)
    slots, real = np.arange(7), np.ones(7, bool)
    rows = hist.seen_rows(row_settings(CONFIGS, hist.generated(slots, real)), slots, real)
    got = np.asarray(adjust_logits(jnp.asarray(LOGITS), rows))
    np.testing.assert_allclose(got, EXPECTED, rtol=1e-6, atol=1e-5)


def test_one_trace_for_any_requests_with_the_same_controls_and_raw_logprobs():
    traces = []

    @jax.jit
    def step(logits, rows):
        traces.append(1)
        return sample_step(logits, 0, jnp.zeros(7, jnp.int32),
                           jnp.zeros(7, jnp.int32), rows, seen=(HIST, SEEN, PROMPT))

    with_lp = [SamplingConfig(**{**c.__dict__, "logprobs": True}) for c in CONFIGS]
    out = step(LOGITS, row_settings(with_lp, SEEN - PROMPT))
    np.testing.assert_array_equal(np.asarray(out["token"]), EXPECTED.argmax(-1))
    ref_lp = jax.nn.log_softmax(LOGITS.astype(np.float64), -1)   # the model's, unpenalized
    np.testing.assert_allclose(np.asarray(out["logprob"]),
                               ref_lp[np.arange(7), EXPECTED.argmax(-1)], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out["top_ids"]),
                                  np.argsort(-LOGITS, -1)[:, :TOP_LOGPROBS])
    other = [SamplingConfig(presence_penalty=0.1 * i, frequency_penalty=0.2,
                            repetition_penalty=1.0 + i / 10, logit_bias=((i, 1.0),),
                            logprobs=True) for i in range(7)]
    step(LOGITS, row_settings(other, SEEN - PROMPT))
    assert len(traces) == 1     # new requests' values, same program


@pytest.mark.parametrize("kw, words", [
    ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"logit_bias": ((1, 101.0),)}, "[-100, 100]"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "at most 300"),
])
def test_bad_controls_are_refused_naming_them(kw, words):
    with pytest.raises(SamplingError, match=None) as e:
        SamplingConfig(**kw)
    assert words in str(e.value)
