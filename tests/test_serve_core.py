"""The serving core's request life as ``triax serve`` needs it, on fake engines (no JAX
compile): an engine error fails only the requests it touched (500 over HTTP) and the server
serves on; ``cancel`` frees a slot; a model without a chat template gets a 400, and so does a
request beyond the context (naming the most ``max_tokens`` that fits, or that the prompt
alone is too long); the chat template renders as Hugging Face renders it; ``priority``
reaches the scheduler, ``usage`` reports cached prompt tokens, ``/metrics`` counts
preemptions and prefix-cache queries and hits and the pool's bytes in its dtype."""

from types import SimpleNamespace

import numpy as np
from fastapi.testclient import TestClient

from triax.inference.engine import Engine, EngineConfig, InferenceError
from triax.inference.kv_blocks import KVBlocks
from triax.inference.sampling import SamplingConfig
from triax.inference.server import Server
from triax.serving.app import create_app
from triax.serving.chat_template import ChatTemplate
from triax.text.byte_tokenizer import ByteTokenizer

POISON = 13  # a fake engine fails when it is fed this token


class FakeEngine:
    """Next token = last + 1; decoding ``POISON`` raises, as a device error would. A pool of
    ``blocks`` blocks of ``block_size`` (default: 64 positions a slot)."""

    def __init__(self, slots=1, blocks=None, block_size=16, prefix_cache=False):
        self.ecfg = EngineConfig(max_batch=slots, max_len=64)
        self.cfg = SimpleNamespace(max_seq_len=256)
        self.sampling = SamplingConfig()
        self.lengths = np.zeros(slots, np.int64)
        self.kv = KVBlocks(groups=1, blocks=blocks or 64 // block_size * slots,
                           block_size=block_size, slots=slots, max_blocks=64 // block_size,
                           prefix_cache=prefix_cache)
        self.recovered = 0
        self.prefix_cache = prefix_cache
        self.pool = SimpleNamespace(dtype="float32", bytes_per_device=lambda: 0)
        self.params = {}   # no weights: triax_weight_bytes reads 0

    def release(self, slot):
        self.kv.release(slot)

    def check_token_ids(self, prompt):
        return [int(t) for t in prompt]

    check_prompt = Engine.check_prompt   # the context and the pool's blocks

    def prefill(self, slots, prompts, seeds, settings=None, cached=None, prompt_lens=None,
                padded=False):   # (its rows are the prompts: nothing pads them)
        for s, p in zip(slots, prompts):
            self.kv.grow(s, len(p))
        self.lengths[list(slots)] = [len(p) for p in prompts]
        return np.array([p[-1] + 1 for p in prompts])

    def decode(self, tokens, active, seeds, settings=None):
        if (active & (tokens == POISON)).any():
            raise RuntimeError("device fault")
        for s in np.flatnonzero(active):
            self.kv.grow(int(s), int(self.lengths[s]) + 1)
        self.lengths[active] += 1
        return tokens + 1

    def recover(self):
        self.recovered += 1


def test_engine_error_fails_only_the_requests_it_touched():
    server = Server([FakeEngine(), FakeEngine()])
    bad = server.submit([POISON - 1], 5)   # replica 0: its first decode is fed POISON
    good = server.submit([1], 5)           # replica 1, in the same step
    with server:
        assert server.result(good, 10).tokens == [2, 3, 4, 5, 6]
        err = server.future(bad).exception(10)
        assert isinstance(err, InferenceError) and "replica 0" in str(err)
        again = server.submit([20], 3)     # the failed replica serves on
        assert server.result(again, 10).tokens == [21, 22, 23]
    assert server.engines[0].recovered == 1 and server.engines[1].recovered == 0
    assert server.free_slots == server.total_slots and server.kv_blocks_in_use == 0
    assert all(e.kv.committed == 0 for e in server.engines)   # no block left reserved


def test_http_engine_error_is_a_500_and_the_server_serves_on():
    server = Server([FakeEngine(slots=2)])
    with TestClient(create_app(server, ByteTokenizer(), "fake")) as http:
        body = {"model": "fake", "max_tokens": 4, "temperature": 0}
        r = http.post("/v1/completions", json={**body, "prompt": [POISON - 1]})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        r = http.post("/v1/completions", json={**body, "prompt": [60]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "=>?@"
        r = http.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    assert server.free_slots == server.total_slots and server.engines[0].kv.committed == 0


def test_a_request_beyond_the_context_gets_a_400_naming_what_fits():
    server = Server([FakeEngine()])          # max_len 64
    with TestClient(create_app(server, ByteTokenizer(), "fake")) as http:
        def error(prompt, max_tokens):
            r = http.post("/v1/completions", json={"model": "fake", "prompt": prompt,
                                                   "max_tokens": max_tokens})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "context_length_exceeded", err
            return err
        err = error([1, 2, 3], 70)           # 3 + 70 - 1 = 72 positions of 64
        assert err["param"] == "max_tokens" and "at most 62" in err["message"], err
        assert "lower max_tokens" in err["message"], err     # the HTTP field's name
        err = error(list(range(1, 71)), 1)   # the prompt alone: no max_tokens fits
        assert err["param"] == "prompt", err
        assert "longer than the context of 64 cached positions" in err["message"], err
        assert "at most 0" not in err["message"] and "max_new_tokens" not in err["message"]
        r = http.post("/v1/completions", json={"model": "fake", "prompt": [20, 21, 22],
                                               "max_tokens": 62, "temperature": 0})
        assert r.status_code == 200, r.text  # the most that fits is served
    assert server.free_slots == server.total_slots and server.engines[0].kv.committed == 0


def test_cancel_frees_queued_and_live_requests():
    server = Server([FakeEngine()])
    live, queued = server.submit([1], 50), server.submit([2], 50)
    server._step()                           # `live` takes the only slot
    assert server.engines[0].kv.committed == 1   # its prompt's block: no more set aside
    assert server.cancel(queued) and server.result(queued).finish_reason == "cancelled"
    assert server.cancel(live)
    server._step()
    res = server.result(live, 1)
    assert res.finish_reason == "cancelled" and len(res.tokens) < 50
    assert server.free_slots == 1 and not server.cancel(live)
    assert server.engines[0].kv.committed == 0   # the cancelled request's blocks came back


def test_chat_template_renders_as_hugging_face_does():
    # Llama-3's template shape: trim_blocks/lstrip_blocks strip the block lines' whitespace.
    t = ChatTemplate("{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'system' %}"
                     "[S]{{ m.content | trim }}\n    {% else %}[{{ m.role }}]{{ m.content }}\n"
                     "    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[assistant]"
                     "{% endif %}", bos_token="<s>")
    out = t.render([{"role": "system", "content": " be brief "},
                    {"role": "user", "content": "hi"}])
    assert out == "<s>\n[S]be brief\n[user]hi\n[assistant]"  # (no block-line indents)
    assert t.render([{"role": "user", "content": "x"}], add_generation_prompt=False) == \
        "<s>\n[user]x\n"


def test_priority_usage_and_metrics_reach_http():
    server = Server([FakeEngine(slots=1)])
    with TestClient(create_app(server, ByteTokenizer(), "fake")) as http:
        body = {"model": "fake", "max_tokens": 2, "temperature": 0, "prompt": [60]}
        r = http.post("/v1/completions", json={**body, "priority": 3})
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert http.post("/v1/completions", json={**body, "priority": "x"}).status_code == 400
        server.stats.update(preemptions=2, prefix_queries=40, prefix_hits=32)
        scrape = http.get("/metrics").text
    for line in ("triax_preemptions_total 2.0", "triax_prefix_cache_queries_total 40.0",
                 "triax_prefix_cache_hits_total 32.0",
                 'triax_kv_pool_bytes{dtype="float32",kv_dtype="float32"} 0.0'):
        assert line in scrape, line
