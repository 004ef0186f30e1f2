"""``triax serve`` as its users meet it: one real server subprocess on 127.0.0.1 (a free
port), the tiny Hugging Face Llama fixture with a chat template added, on three replicas of
three layouts at once (pipe=2; context=2; tensor=2: six devices), called through the real
``openai`` client and raw HTTP (httpx). Greedy answers are the golden tokens that
``transformers`` produced (which ``triax generate`` reproduces: tests/test_hf_generate.py).
The server is started once for the module; the last test drains it with SIGTERM."""
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from hf_fixtures import fixture, golden
from triax.hf.tokenizer import load_tokenizer

MODEL = "llama-chat"
TEMPLATE = ("{% for m in messages %}{{ m.role[0] | upper }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}A:{% endif %}")
# One replica per layout: a second replica of a layout would compile all its programs again
# (JAX keys them by device) and route no differently (tests/test_inference_serving.py).
LAYOUT = "pipe=2;context=2;tensor=2"
REPLICAS, DEVICES = 3, 6
SLOTS, MAX_QUEUE, MAX_LEN = 2, 16, 80   # 6 slots in all, 16 waiting at most
# Each replica's pool: 4 blocks of 16 positions, so a pipe=2 replica's two row groups hold 32
# positions each and a one-group replica's 64: no replica holds a request of MAX_LEN.
KV_BLOCKS = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve") / MODEL
    shutil.copytree(fixture("llama"), d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "triax", "serve", "--model-dir", str(d), "--mesh", LAYOUT,
         "--slots", str(SLOTS), "--max-queue", str(MAX_QUEUE), "--max-len", str(MAX_LEN),
         "--kv-blocks", str(KV_BLOCKS), "--dtype", "float32", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": str(DEVICES)})
    line = proc.stdout.readline()  # blocks until ready (or the process ended)
    if "ready at" not in line:
        proc.kill()
        pytest.fail(f"server did not start: {line!r} {proc.stderr.read()[-3000:]}")
    url = re.search(r"http://[\d.]+:\d+", line).group(0)
    yield {"url": url, "line": line, "proc": proc, "tok": load_tokenizer(str(d)),
           "golden": golden("llama")}
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def _client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s["url"] + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def _expected(s, i, k=8) -> str:
    return s["tok"].decode(s["golden"][f"greedy_{i}"][:k])


def _prompts(s) -> list[str]:
    return [str(p) for p in s["golden"]["prompts"]]


def _metric(s, name: str) -> float:
    text = httpx.get(s["url"] + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _settled(s) -> bool:
    """Every slot, KV position and KV pool block is back (bounded wait: cancellation is one
    step away)."""
    for _ in range(200):
        if _metric(s, "triax_busy_slots") == 0 and _metric(s, "triax_kv_positions_in_use") == 0 \
                and _metric(s, "triax_kv_blocks_in_use") == 0:
            return True
        time.sleep(0.02)
    return False


def test_ready_line_health_and_models(served):
    assert "pipe=2; context=2; tensor=2" in served["line"]
    h = httpx.get(served["url"] + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert [m.id for m in _client(served).models.list().data] == [MODEL]
    # Three replicas' pools of --kv-blocks blocks each.
    text = httpx.get(served["url"] + "/metrics").text
    assert re.search(r"^triax_kv_blocks_in_use \S+$", text, re.M), text
    assert _metric(served, "triax_kv_blocks_total") == REPLICAS * KV_BLOCKS
    assert _metric(served, "triax_kv_blocks_in_use") == 0


def test_greedy_completions_equal_the_golden_tokens_on_every_replica(served):
    """120 requests from 16 concurrent clients, mixed prompts and lengths, over the three
    layouts: each answered once with the offline greedy text; every slot back at the end."""
    prompts, url = _prompts(served), served["url"]
    jobs = [(i % 4, 1 + (i * 5) % 8) for i in range(120)]  # (prompt, max_tokens)
    before = _metric(served, "triax_requests_total")

    async def main():
        answers = {}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def client(c):
                for j in range(c, len(jobs), 16):
                    p, k = jobs[j]
                    r = await http.post("/v1/completions", json={
                        "model": MODEL, "prompt": prompts[p], "max_tokens": k,
                        "temperature": 0})
                    assert r.status_code == 200, r.text
                    assert j not in answers
                    answers[j] = r.json()
            await asyncio.gather(*(client(c) for c in range(16)))
        return answers

    answers = asyncio.run(main())
    assert sorted(answers) == list(range(len(jobs)))
    assert len({a["id"] for a in answers.values()}) == len(jobs)
    for j, a in answers.items():
        p, k = jobs[j]
        ch = a["choices"][0]
        assert ch["text"] == _expected(served, p, k), (j, p, k)
        assert ch["finish_reason"] == "length"
        n = len(served["golden"][f"ids_{p}"])
        cached = a["usage"].pop("prompt_tokens_details")["cached_tokens"]
        assert a["usage"] == {"prompt_tokens": n, "completion_tokens": k,
                              "total_tokens": n + k}
        assert 0 <= cached < n   # prefix cache hits, which depend on who came first
    assert _metric(served, "triax_requests_total") - before == len(jobs)
    text = httpx.get(url + "/metrics").text
    for r in range(REPLICAS):  # every layout answered some of them
        assert re.search(rf'triax_requests_total{{.*replica="{r}"}} [1-9]', text), r
        assert f'triax_replica_queue_depth{{replica="{r}"}} 0.0' in text, r   # all served
    assert _settled(served)


def test_streamed_text_equals_non_streamed(served):
    c = _client(served)
    for kw in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}):
        for p in _prompts(served)[:2]:
            whole = c.completions.create(model=MODEL, prompt=p, max_tokens=8, **kw)
            chunks = list(c.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                               stream=True, **kw))
            assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
            assert chunks[-1].choices[0].finish_reason == "length"
            if kw["temperature"]:  # each request's own sampling, not the server's greedy
                assert whole.choices[0].text != _expected(served, _prompts(served).index(p))
    # raw SSE: OpenAI's chunk lines, ending with [DONE]
    with httpx.stream("POST", served["url"] + "/v1/completions", json={
            "model": MODEL, "prompt": _prompts(served)[1], "max_tokens": 3,
            "temperature": 0, "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    texts = [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]]
    assert "".join(texts) == _expected(served, 1, 3)


def test_chat_goes_through_the_models_template(served):
    c = _client(served)
    rendered = "U: Hello world\nA:"  # TEMPLATE, rendered by hand
    ids = [int(t) for t in served["tok"].tok.encode(rendered, add_special_tokens=False).ids]
    chat = c.chat.completions.create(model=MODEL, max_tokens=5, temperature=0,
                                     messages=[{"role": "user", "content": "Hello world"}])
    plain = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].message.role == "assistant"
    streamed = c.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, stream=True,
                                         messages=[{"role": "user", "content": "Hello world"}],
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5


def test_stop_strings_and_stop_token_ids(served):
    c = _client(served)
    p, full = _prompts(served)[0], _expected(served, 0)
    cut = full[3:5]  # a stop string inside the greedy text
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stop=[cut])
    assert r.choices[0].text == full[:full.index(cut)] and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                       stop=[cut], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    g = served["golden"]["greedy_0"]
    stop_id = int(g[2])
    raw = httpx.post(served["url"] + "/v1/completions", json={
        "model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0, "stop": [stop_id]})
    body = raw.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == served["tok"].decode(g[:list(g).index(stop_id)])
    assert _settled(served)


@pytest.mark.parametrize("body, status, param, words", [
    ('{"model": "llama-chat", "prompt": ', 400, None, "not valid JSON"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "4"}, 400, "max_tokens", "integer"),
    ({"model": MODEL, "prompt": "hi", "temprature": 0}, 400, "temprature", "unknown field"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "llama-chat"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": MAX_LEN + 8}, 400, "max_tokens",
     f"context of {MAX_LEN}"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ({"model": MODEL, "prompt": [5, 999]}, 400, "prompt", "vocabulary"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature", "0"),
])
def test_bad_input_gets_an_openai_error(served, body, status, param, words):
    r = httpx.post(served["url"] + "/v1/completions", content=body if isinstance(body, str)
                   else json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err


def test_a_request_no_pool_can_hold_gets_a_400_naming_the_pool_flags(served):
    """Within --max-len but more blocks than a row group holds: refused at once (a 400 in
    OpenAI's shape), not queued forever; the timeout bounds the wait if it were queued."""
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": MAX_LEN - 10, "temperature": 0}
    r = httpx.post(served["url"] + "/v1/completions", json=body, timeout=30,
                   headers={"x-request-timeout": "3"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    # 2 + 70 - 1 = 71 positions: 5 blocks of 16; replica 0's (pipe=2) row groups hold 2.
    for words in ("needs 5 KV blocks of 16 positions", "holds 2 per row group", "--kv-blocks",
                  "--kv-memory"):
        assert words in err["message"], err
    assert _settled(served) and _metric(served, "triax_queue_depth") == 0


def test_openai_client_sees_the_errors(served):
    with pytest.raises(openai.NotFoundError, match="llama-chat"):
        _client(served).completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        _client(served).completions.create(model=MODEL, prompt="hi", max_tokens=0)


def test_full_queue_gets_429_with_retry_after(served):
    async def main():
        async with httpx.AsyncClient(base_url=served["url"], timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "model": MODEL, "prompt": [5, 6], "max_tokens": 30, "temperature": 0})
                for _ in range(60)))
    rs = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert set(codes) == {200, 429} and codes.count(200) >= SLOTS * REPLICAS
    refused = next(r for r in rs if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert _settled(served)


def test_client_disconnect_cancels_and_frees_the_slot(served):
    before = _metric(served, "triax_generated_tokens_total")
    with httpx.stream("POST", served["url"] + "/v1/completions", json={
            "model": MODEL, "prompt": [5, 6], "max_tokens": 30, "temperature": 0,
            "stream": True}) as r:
        next(r.iter_lines())  # the first chunk arrived; now leave
    assert _settled(served)
    assert _metric(served, "triax_generated_tokens_total") - before < 30


def test_request_timeout_cancels_with_408(served):
    before = _metric(served, "triax_generated_tokens_total")
    r = httpx.post(served["url"] + "/v1/completions", headers={"x-request-timeout": "0.001"},
                   json={"model": MODEL, "prompt": [5, 6], "max_tokens": 30, "temperature": 0})
    assert r.status_code == 408 and "timeout" in r.json()["error"]["message"]
    assert _settled(served)
    assert _metric(served, "triax_generated_tokens_total") - before < 30


def test_sigterm_drains_in_flight_requests_and_exits_0(served):
    """Last in the module: it stops the server."""
    proc = served["proc"]
    with httpx.stream("POST", served["url"] + "/v1/completions", json={
            "model": MODEL, "prompt": [5, 6], "max_tokens": 30, "temperature": 0,
            "stream": True}) as r:
        lines = r.iter_lines()
        first = next(lines)
        proc.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]
    chunks = [first] + rest
    assert chunks[-1] == "data: [DONE]"
    assert json.loads(chunks[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):  # no longer admitting
        httpx.get(served["url"] + "/health")
