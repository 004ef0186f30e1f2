"""OpenAI's API in full, through the real ``openai`` client and raw HTTP, against servers
on 127.0.0.1 (free ports) shared by the module: the tiny Hugging Face Llama fixture in fp32
on a tensor=2 replica (every test) and on a pipe=2 one (the log-probability tests: each
server compiles only the steps its tests use). Every log-probability is checked against the
in-process forward pass (a single device, the full sequence, no cache) to 1e-5: the prompt's
(``echo``), the generated tokens', the top alternatives; a harness-style multiple-choice
scoring equals the model's log-likelihoods; penalties and logit_bias reproduce a numpy
reference decode; n, best_of, seeds, min_tokens, ignore_eos; chat logprobs; structured
output (every sample valid against its JSON schema); tool calls forced by ``tool_choice``
and parsed into ``tool_calls``; the utilities and the error shapes."""
import asyncio
import json
import threading
import time

import httpx
import jax
import jsonschema
import numpy as np
import openai
import pytest
import uvicorn
from flax import nnx

from hf_fixtures import fixture, golden
from triax.choices import SERVE_STRATEGY
from triax.hf.load import load as hf_load
from triax.hf.tokenizer import load_tokenizer
from triax.inference.engine import EngineConfig
from triax.inference.sampling import SamplingConfig
from triax.inference.server import Server
from triax.mesh import make_mesh
from triax.sharding.partition import abstract_model
from triax.serving.app import create_app
from triax.serving.chat_template import ChatTemplate
from triax.serving.tool_calls import HERMES, LLAMA_JSON, parse

MODEL = "llama-openai"
TEMPLATE = ("{% for m in messages %}{{ m.role[0] | upper }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}A:{% endif %}")
MAX_LEN = 64
PAD = 32            # the reference's padded length (one compile)
LIMIT = 2 ** 20     # request body bytes


class Reference:
    """The model's log-probabilities from a full forward pass on one device."""

    def __init__(self, cfg, params):
        graphdef = abstract_model(cfg).graphdef
        self.params = jax.device_put(jax.device_get(params), jax.devices()[0])
        self.fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0])

    def logits(self, seqs) -> list[np.ndarray]:
        """``[len(seq), V]`` per sequence: row t gives token t+1 (causal: padding unseen)."""
        out = []
        for i in range(0, len(seqs), 8):
            batch = np.zeros((8, PAD), np.int32)
            for j, s in enumerate(seqs[i:i + 8]):
                batch[j, :len(s)] = s
            lg = np.asarray(self.fwd(self.params, batch), np.float64)
            out += [lg[j, :len(s)] for j, s in enumerate(seqs[i:i + 8])]
        return out

    def logprobs(self, seqs) -> list[np.ndarray]:
        return [x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
                - x.max(-1, keepdims=True) for x in self.logits(seqs)]

    def greedy(self, prompt, k, adjust=lambda lp, seq: lp):
        """``k`` greedy tokens, each from ``adjust``-ed logits (the penalties' reference)."""
        seq = list(prompt)
        for _ in range(k):
            seq.append(int(np.argmax(adjust(self.logits([seq])[0][-1], seq))))
        return seq[len(prompt):]


@pytest.fixture(scope="module")
def served(devices):
    g = golden("llama")
    tok = load_tokenizer(fixture("llama"))
    meshes = [make_mesh(tensor=2, devices=devices[:2]), make_mesh(pipe=2, devices=devices[2:4])]
    cfg, params, _ = hf_load(fixture("llama"), meshes[0], SERVE_STRATEGY)
    prompts = [[int(t) for t in g[f"ids_{i}"][:12]] for i in range(4)]
    ref = Reference(cfg, params)
    eos = ref.greedy(prompts[0], 3)[2]   # an "end of sequence" the first greedy text meets
    webs = []
    for mesh in meshes:
        # one prompt bucket: a program per set of row controls and batch rows, not also per
        # prompt length bucket (the tests' prompts differ in length)
        server = Server.from_params(cfg, params, [mesh], SERVE_STRATEGY,
                                    EngineConfig(max_batch=2, max_len=MAX_LEN,
                                                 min_bucket=MAX_LEN),
                                    SamplingConfig(stop_tokens=(eos,)))
        app = create_app(server, tok, MODEL, ChatTemplate(TEMPLATE), request_timeout=120,
                         max_request_bytes=LIMIT)
        web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=web.run, daemon=True)
        thread.start()
        for _ in range(3000):    # bounded: the app starts in well under a minute
            if web.started or not thread.is_alive():
                break
            time.sleep(0.01)
        assert web.started, "the server did not start"
        webs.append((web, thread))
    url = [f"http://127.0.0.1:{w.servers[0].sockets[0].getsockname()[1]}" for w, _ in webs]
    yield {"url": url[0], "layouts": dict(zip(("tensor=2", "pipe=2"), url)), "tok": tok,
           "ref": ref, "prompts": prompts, "eos": eos, "vocab": cfg.vocab_size}
    for web, thread in webs:
        web.should_exit = True
        thread.join(60)


def _client(s, url=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=(url or s["url"]) + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.mark.parametrize("layout", ["tensor=2", "pipe=2"])
def test_echo_logprobs_equal_the_forward_pass(served, layout):
    """8 token-id prompts in one request (a batch of the slots at once): the prompt's
    log-probabilities (the first null), the greedy tokens' and the top 5, each to 1e-5."""
    prompts = [p[:n] for p in served["prompts"] for n in (12, 7)]
    r = _client(served, served["layouts"][layout]).completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, temperature=0, echo=True, logprobs=5,
        extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(8))
    ref = served["ref"]
    for p, c in zip(prompts, r.choices):
        gen = ref.greedy(p, 3)
        seq = p + gen
        lp = ref.logprobs([seq])[0]
        want = [None] + [lp[t - 1, seq[t]] for t in range(1, len(seq))]
        got = c.logprobs.token_logprobs
        assert got[0] is None and len(got) == len(seq)
        np.testing.assert_allclose(got[1:], want[1:], atol=1e-5, rtol=0)
        for t in range(1, len(seq)):   # the top 5 and the token (two ids may share a text)
            top = np.array(list(c.logprobs.top_logprobs[t].values()))
            best = np.append(np.sort(lp[t - 1])[::-1][:5], lp[t - 1, seq[t]])
            assert 2 <= len(top) <= 6 and np.abs(top[:, None] - best).min(1).max() < 1e-5
            assert abs(top.max() - best.max()) < 1e-5
        assert c.text == served["tok"].decode(seq)           # echo: prompt and completion
        assert "".join(c.logprobs.tokens) == c.text
        offs = c.logprobs.text_offset
        assert offs == [len("".join(c.logprobs.tokens[:i])) for i in range(len(seq))]
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 24


@pytest.mark.parametrize("layout", ["tensor=2", "pipe=2"])
def test_harness_scores_a_multiple_choice_set(served, layout):
    """An evaluation harness's request: contexts with each candidate continuation as token
    ids, ``echo``, ``logprobs: 1``, ``max_tokens: 0``; each candidate's score (the sum of its
    tokens' logprobs) equals the model's log-likelihood to 1e-4, and so does the pick."""
    rng = np.random.RandomState(1)
    questions = [(p[:6], [list(rng.randint(0, served["vocab"], n)) for n in (2, 3, 1, 4)])
                 for p in served["prompts"][:3]]
    batch = [[int(t) for t in ctx + cand] for ctx, cands in questions for cand in cands]
    r = _client(served, served["layouts"][layout]).completions.create(
        model=MODEL, prompt=batch, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert r.usage.completion_tokens == 0
    ref = served["ref"].logprobs(batch)
    k = 0
    for ctx, cands in questions:
        scores, want = [], []
        for cand in cands:
            c, seq = r.choices[k], batch[k]
            assert c.finish_reason == "length" and c.index == k
            assert len(c.logprobs.token_logprobs) == len(seq)
            scores.append(sum(c.logprobs.token_logprobs[len(ctx):]))
            want.append(sum(ref[k][t - 1, seq[t]] for t in range(len(ctx), len(seq))))
            k += 1
        np.testing.assert_allclose(scores, want, atol=1e-4, rtol=0)
        assert int(np.argmax(scores)) == int(np.argmax(want))


def test_streamed_logprobs_equal_the_non_streamed(served):
    c = _client(served)
    kw = dict(model=MODEL, prompt=served["prompts"][1], max_tokens=5, temperature=0,
              logprobs=2, echo=True)
    whole = c.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw)]
    assert "".join(ch.text for ch in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert sum((getattr(ch.logprobs, field) for ch in chunks if ch.logprobs), []) == \
            getattr(whole.logprobs, field), field


def test_n_best_of_and_seeds(served):
    c = _client(served)
    kw = dict(model=MODEL, prompt=served["prompts"][2], max_tokens=6, temperature=1.0,
              seed=5, logprobs=0, extra_body={"ignore_eos": True})
    three = c.completions.create(n=3, **kw)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert len({ch.text for ch in three.choices}) == 3          # each choice its own seed
    again = c.completions.create(n=3, **kw)
    assert [ch.text for ch in again.choices] == [ch.text for ch in three.choices]
    one = c.completions.create(n=1, **kw)                        # choice 0's seed is the seed
    assert one.choices[0].text == three.choices[0].text
    best = c.completions.create(n=1, best_of=3, **kw)
    sums = [sum(ch.logprobs.token_logprobs) for ch in three.choices]
    assert best.choices[0].text == three.choices[int(np.argmax(sums))].text
    assert best.usage.completion_tokens == 18                    # all three were generated
    streamed = {}
    for ch in c.completions.create(n=3, stream=True, **kw):
        streamed[ch.choices[0].index] = streamed.get(ch.choices[0].index, "") + \
            ch.choices[0].text
    assert [streamed[i] for i in range(3)] == [ch.text for ch in three.choices]


# A bias of 0 changes no logit; a request carrying it runs the programs of the bias's set of
# row controls (a program per set and bucket), shared with the tests that need a bias.
ZERO_BIAS = {"logit_bias": {"0": 0.0}}


def _penalized(logits, seq, prompt_len, presence, frequency, repetition, bias):
    """vLLM's penalties on the model's raw logits, in numpy."""
    x = logits.copy()
    for t, b in bias.items():
        x[int(t)] += b
    for t in set(seq):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    counts = np.bincount(seq[prompt_len:], minlength=len(x))
    return x - frequency * counts - presence * (counts > 0)


def test_penalties_and_logit_bias_reproduce_a_numpy_decode(served):
    """Greedy decoding under each control (and all together) equals the reference's argmax
    of the numpy-penalized logits, step by step."""
    ref, p = served["ref"], served["prompts"][3][:8]
    # A bias of 0 (changing no logit) beside each penalty alone: its rows carry the same
    # controls as all together's, one program (a program per set of row controls), while
    # each penalty alone still decides the text.
    settings = [dict(presence_penalty=-2.0, **ZERO_BIAS),
                dict(frequency_penalty=-2.0, **ZERO_BIAS),
                dict(repetition_penalty=0.3, **ZERO_BIAS), dict(logit_bias={"7": 9.0, "11": 4.0}),
                dict(presence_penalty=0.5, frequency_penalty=-0.4, repetition_penalty=0.6,
                     logit_bias={"3": 5.0})]
    for kw in settings:
        body = {"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0,
                "logprobs": 0, "ignore_eos": True, **kw}
        r = httpx.post(served["url"] + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        seq = list(p)
        for _ in range(6):
            x = _penalized(ref.logits([seq])[0][-1], seq, len(p), kw.get("presence_penalty", 0),
                           kw.get("frequency_penalty", 0), kw.get("repetition_penalty", 1),
                           kw.get("logit_bias", {}))
            seq.append(int(np.argmax(x)))
        assert r.json()["choices"][0]["text"] == served["tok"].decode(seq[len(p):]), kw
        plain = ref.greedy(p, 6)
        assert seq[len(p):] != plain, kw          # each control changed the greedy text


def test_stop_tokens_min_tokens_and_ignore_eos(served):
    c, p = _client(served), served["prompts"][0]
    # logprobs: the programs other tests compiled (a program per set of row controls)
    kw = dict(model=MODEL, prompt=p, max_tokens=6, temperature=0, logprobs=0)
    gen = served["ref"].greedy(p, 6)
    assert served["eos"] not in gen[:2]
    stopped = c.completions.create(**kw)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 2
    free = c.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 6
    late = c.completions.create(extra_body={"min_tokens": 4}, **kw)
    assert late.usage.completion_tokens >= 4
    by_id = c.completions.create(stop=[int(gen[1])], extra_body={"ignore_eos": True}, **kw)
    assert by_id.usage.completion_tokens == 1 and by_id.choices[0].finish_reason == "stop"


def test_chat_logprobs_n_and_max_completion_tokens(served):
    c = _client(served)
    msgs = [{"role": "user", "content": "Hello world"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=3, n=2,
                                  frequency_penalty=0, presence_penalty=0,
                                  parallel_tool_calls=True, user="u", metadata={"k": "v"},
                                  extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 8
    ids = served["tok"].tok.encode("U: Hello world\nA:", add_special_tokens=False).ids
    ref = served["ref"]
    seq = list(ids) + ref.greedy(ids, 4)
    lp = ref.logprobs([seq])[0]
    for ch in r.choices:
        content = ch.logprobs.content
        assert "".join(e.token for e in content) == ch.message.content
        np.testing.assert_allclose([e.logprob for e in content],
                                   [lp[t - 1, seq[t]] for t in range(len(ids), len(seq))],
                                   atol=1e-5)
        assert all(len(e.top_logprobs) == 3 and e.bytes == list(e.token.encode())
                   for e in content)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                            temperature=0, logprobs=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in r.choices[0].logprobs.content]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "pick", "n"],
          "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def _valid(text, schema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_response_format_json_schema_holds_on_many_seeds(served):
    """16 samples (two seeds × n=8, temperature 1) under a strict schema: every one parses
    and validates, and ends ``stop`` when its value is complete; the same samples without
    the grammar are not JSON. ``json_object`` gives an object; streamed output too."""
    c = _client(served)
    msgs = [{"role": "user", "content": "JSON"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA,
                                                  "strict": True}}
    kw = dict(model=MODEL, messages=msgs, max_tokens=40, temperature=1.0, n=8)
    texts = []
    for seed in (3, 4):   # (ZERO_BIAS: json_object's programs below)
        r = c.chat.completions.create(seed=seed, response_format=fmt, **kw, **ZERO_BIAS)
        assert all(ch.finish_reason == "stop" for ch in r.choices)
        texts += [ch.message.content for ch in r.choices]
    assert all(_valid(t, SCHEMA) for t in texts), texts
    assert len(set(texts)) > 4
    free = c.chat.completions.create(seed=3, logprobs=True, **kw)   # logprobs: as above
    assert not any(_valid(ch.message.content, SCHEMA) for ch in free.choices)
    # Any object: keys are free text, so the bias makes the random model close them soon.
    close = {str(served["tok"].tok.token_to_id(ch)): 6.0 for ch in ('"', "}", "1")}
    obj = c.chat.completions.create(seed=5, response_format={"type": "json_object"},
                                    logit_bias=close, **kw)
    assert all(isinstance(json.loads(ch.message.content), dict) for ch in obj.choices)
    chunks = c.chat.completions.create(seed=6, response_format=fmt, stream=True,
                                       **{**kw, "n": 1}, **ZERO_BIAS)
    assert _valid("".join(ch.choices[0].delta.content or "" for ch in chunks
                          if ch.choices), SCHEMA)
    with pytest.raises(openai.BadRequestError, match="response_format") as e:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nope"}}})
    assert e.value.body["param"] == "response_format"


def _tool(name, arg, values):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "additionalProperties": False, "required": [arg],
        "properties": {arg: {"enum": values}}}}}


TOOLS = [_tool("weather", "city", ["Rome", "Oslo"]), _tool("time", "zone", ["UTC"])]


def test_tool_choice_forces_calls_parsed_into_tool_calls(served):
    """A named function and ``required``: every sample is a call of an offered tool whose
    arguments follow its schema (``finish_reason: tool_calls``), streamed as a tool-call
    delta too; ``none`` calls nothing; a conversation with earlier calls renders."""
    c = _client(served)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=50,
              temperature=1.0, tools=TOOLS, **ZERO_BIAS)   # the schema test's programs
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = c.chat.completions.create(n=4, seed=1, **kw, tool_choice={
        "type": "function", "function": {"name": "weather"}})
    required = c.chat.completions.create(n=8, seed=2, tool_choice="required", **kw)
    for ch in named.choices + required.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    assert {ch.message.tool_calls[0].function.name for ch in named.choices} == {"weather"}
    assert {ch.message.tool_calls[0].function.name for ch in required.choices} <= set(params)
    chunks = list(c.chat.completions.create(seed=3, tool_choice="required", stream=True, **kw))
    (delta,) = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    jsonschema.validate(json.loads(delta.function.arguments), params[delta.function.name])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # logprobs on the two plain requests: the programs other tests compiled
    none = c.chat.completions.create(seed=1, tool_choice="none", logprobs=True,
                                     **{**kw, "max_tokens": 4})
    assert none.choices[0].message.tool_calls is None
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert c.chat.completions.create(model=MODEL, messages=history, max_tokens=2, tools=TOOLS,
                                     logprobs=True).choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="not among tools"):
        c.chat.completions.create(**kw, tool_choice={"type": "function",
                                                     "function": {"name": "nope"}})


def test_tool_call_formats_parse_and_templates_see_the_tools():
    assert parse('<tool_call>\n{"name": "a", "arguments": {"x": [1]}}\n</tool_call>'
                 '<tool_call>{"name": "b", "arguments": {}}</tool_call>', HERMES) == \
        ("", [{"name": "a", "arguments": '{"x": [1]}'}, {"name": "b", "arguments": "{}"}])
    assert parse("no call here", HERMES) == ("no call here", [])
    assert parse('<tool_call>{"oops"</tool_call>', HERMES) == ('<tool_call>{"oops"</tool_call>',
                                                              [])
    assert parse('{"name": "f", "arguments": "{}"}', LLAMA_JSON) == \
        ("", [{"name": "f", "arguments": "{}"}])
    assert parse('{"not": "a call"}', LLAMA_JSON) == ('{"not": "a call"}', [])
    t = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                     "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert t.render([{"role": "user", "content": "hi"}], tools=TOOLS) == \
        "[weather][time]hi"


def test_tokenize_detokenize_and_models(served):
    url = served["url"]
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == [int(t) for t in served["tok"].encode("Hello world")]
    assert r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user",
                                                             "content": "Hi"}]}).json()
    assert chat["tokens"] == served["tok"].tok.encode("U: Hi\nA:",
                                                      add_special_tokens=False).ids
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json() == \
        {"prompt": "Hello world"}
    assert _client(served).models.list().data[0].model_extra["max_model_len"] == MAX_LEN


@pytest.mark.parametrize("method, path, body, status, code", [
    ("GET", "/v1/nothing", None, 404, "not_found"),
    ("GET", "/v1/completions", None, 405, "method_not_allowed"),
    ("POST", "/v1/completions", "x" * (LIMIT + 1), 413, "request_too_large"),
    ("POST", "/v1/completions", [{"model": MODEL, "prompt": "hi"}], 400, "invalid_json"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400,
     "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "!"}, 400,
     "unsupported_field"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "functions": [],
                                      "messages": [{"role": "user", "content": "x"}]}, 400,
     "unsupported_field"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "tool_choice": "required",
                                      "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "best_of": 3,
                                 "stream": True}, 400, "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"9999": 1}},
     400, "invalid_value"),
])
def test_error_shapes_are_uniform(served, method, path, body, status, code):
    content = body if isinstance(body, str) or body is None else json.dumps(body)
    r = httpx.request(method, served["url"] + path, content=content,
                      headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code, err


def test_concurrent_streams_share_the_batch(served):
    """Requests with different controls at once, in one step's rows: each equals its own
    answer alone (a row's penalties are its own)."""
    p = served["prompts"][1]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0,
               "ignore_eos": True, "presence_penalty": -0.4 * i, "logprobs": 1, **ZERO_BIAS}
              for i in range(6)]

    async def main():
        async with httpx.AsyncClient(base_url=served["url"], timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=b)
                                          for b in bodies))
    together = [r.json()["choices"][0]["text"] for r in asyncio.run(main())]
    alone = [httpx.post(served["url"] + "/v1/completions", json=b, timeout=120).json()[
        "choices"][0]["text"] for b in bodies]
    assert together == alone and len(set(alone)) > 1
