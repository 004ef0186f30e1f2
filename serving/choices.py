"""``/v1/completions`` and ``/v1/chat/completions`` as runs of the ``Server``: each prompt
(a string, strings, token ids or lists of them) times ``n`` (or ``best_of``, of which the
``n`` likeliest by cumulative log-probability are returned) is one ``Run`` with its own
seed; choices are indexed as OpenAI indexes them (prompt ``i``'s ``j``-th at ``i·n + j``).
The request's controls become its ``SamplingConfig``: penalties, ``logit_bias``,
``min_tokens``, ``ignore_eos``, stop token ids, log-probabilities (``echo``: the prompt's
own, its first token's null; ``max_tokens: 0`` scores the prompt and generates nothing)."""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Callable, Optional

from fastapi.responses import JSONResponse, StreamingResponse

from triax.inference.request import default_seed
from triax.inference.sampling import SamplingConfig, SamplingError
from triax.serving.errors import APIError, sse
from triax.serving.logprob_format import LogprobWriter
from triax.serving.protocol import ChatRequest, CompletionRequest, NamedToolChoice
from triax.serving.runs import Run, merged
from triax.serving.structured import schema_grammar
from triax.serving.tool_calls import LLAMA_JSON, format_of, forced_schema, openai_calls, parse

DEFAULT_MAX_TOKENS = 16


def choice_seed(seed: Optional[int], prompt: list[int], j: int) -> int:
    """Choice ``j``'s seed: the request's (or the prompt's hash) for the first, mixed with
    ``j`` for the rest, so each choice is reproducible and the choices differ."""
    base = default_seed(prompt) if seed is None else seed
    return base if j == 0 else (base + j * 0x9E3779B1) & 0x7FFFFFFF


def _logit_bias(req, server) -> tuple:
    out = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id; give ids as "
                                f"strings, e.g. {{\"50256\": -100}}", param="logit_bias",
                           code="invalid_value") from None
        if not 0 <= tid < server.vocab_size:
            raise APIError(400, f"logit_bias token id {tid} is outside the vocabulary "
                                f"[0, {server.vocab_size})", param="logit_bias",
                           code="invalid_value")
        out.append((tid, bias))
    return tuple(out)


def sampling_for(st, req, logprobs: bool, prompt_logprobs: bool = False) -> SamplingConfig:
    """The request's ``SamplingConfig`` (the server's seed and stop tokens, unless
    ``ignore_eos``, plus its own)."""
    default = st.server.default_sampling
    eos = () if req.ignore_eos else default.stop_tokens
    try:
        return SamplingConfig(
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
            seed=default.seed, stop_tokens=eos + req.stop_ids(),
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=_logit_bias(req, st.server), min_tokens=req.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except SamplingError as e:
        raise APIError(400, str(e), code="invalid_value") from None


def start_runs(st, prompts: list[list[int]], count: int, n: int, sampling, max_new: int,
               seed, stop, endpoint: str, timeout: float, keep: bool = True,
               per_run: Optional[Callable[[], SamplingConfig]] = None,
               priority: int = 0, adapter: Optional[str] = None) -> list[Run]:
    """``count`` runs per prompt (choice ``i·n + j``); all or none are submitted.
    ``per_run``: each run's own sampling (a grammar's state is per choice); ``adapter``:
    the LoRA adapter the request's ``model`` names (None: the base)."""
    runs: list[Run] = []
    try:
        for i, p in enumerate(prompts):
            for j in range(count):
                runs.append(Run(st, p, per_run() if per_run else sampling, max_new,
                                choice_seed(seed, p, j), stop, endpoint, timeout,
                                index=i * n + j, keep=keep, priority=priority,
                                adapter=adapter))
    except BaseException:
        for r in runs:
            r.cancel()
        raise
    return runs


def _head(st, chat: bool, model: Optional[str] = None) -> dict:
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model or st.model_name}


def _usage(prompts, runs) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(r.detok.tokens) for r in runs)
    # OpenAI's cached_tokens: each prompt's positions read from cached blocks (its first run's)
    cached = sum(r.cached_tokens() for r in runs[::max(len(runs) // max(len(prompts), 1), 1)])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _collect(runs: list[Run]) -> list[str]:
    try:
        return [await r.collect() for r in runs]   # all run at once on the server
    finally:
        for r in runs:
            r.cancel()


def _best(runs: list[Run], texts: list[str], n: int, count: int) -> list[tuple[Run, str]]:
    """Per prompt, the ``n`` of its ``count`` runs with the highest cumulative logprob,
    re-indexed in that order."""
    out = []
    for i in range(0, len(runs), count):
        group = list(zip(runs[i:i + count], texts[i:i + count]))
        if count > n:
            group = sorted(group, key=lambda rt: -rt[0].logprob)[:n]
        for j, (run, text) in enumerate(group):
            run.index = (i // count) * n + j
            out.append((run, text))
    return out


def _check_completion(req: CompletionRequest) -> tuple[int, int]:
    """(max_tokens, runs per prompt), or a 400 naming the field."""
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens: 0 generates nothing; give max_tokens >= 1, or add "
                            "echo: true to score the prompt alone", param="max_tokens",
                       code="invalid_value")
    count = req.best_of or req.n
    if count < req.n:
        raise APIError(400, f"best_of={count} must be >= n={req.n}", param="best_of",
                       code="invalid_value")
    if req.stream and count > req.n:
        raise APIError(400, "best_of > n cannot stream (the best are known at the end); "
                            "drop stream or best_of", param="best_of", code="invalid_value")
    return max_tokens, count


async def complete(st, req: CompletionRequest, prompts: list[list[int]], texts: list[str],
                   timeout: float):
    """``/v1/completions``: the response (or its SSE stream) for these encoded prompts
    (``texts``: each prompt's text, for ``echo``)."""
    max_tokens, count = _check_completion(req)
    k = req.logprobs
    sampling = sampling_for(st, req, logprobs=k is not None or count > req.n,
                            prompt_logprobs=req.echo and k is not None)
    runs = start_runs(st, prompts, count, req.n, sampling, max(max_tokens, 1), req.seed,
                      req.stop_strings(), "completions", timeout, keep=max_tokens > 0,
                      priority=req.priority, adapter=st.adapter_for(req.model))
    which = {id(r): i // count for i, r in enumerate(runs)}
    writer = {id(r): LogprobWriter(st.tokenizer, prompts[which[id(r)]], k or 0, req.echo)
              for r in runs}
    head = _head(st, chat=False, model=req.model)

    def choice(run, text, finish, lp_tokens, first):
        echo = texts[which[id(run)]] if req.echo and first else ""
        lp = (writer[id(run)].completion(lp_tokens, run.prompt_logprobs)
              if k is not None else None)
        return {"index": run.index, "text": echo + text, "logprobs": lp, "finish_reason": finish}

    if not req.stream:
        outs = _best(runs, await _collect(runs), req.n, count)
        return JSONResponse({**head, "choices": [choice(r, t, r.finish, r.entries, True)
                                                 for r, t in outs],
                             "usage": _usage(prompts, runs)})

    async def events():
        started = set()
        try:
            async for run, d, toks in merged(runs):
                first = id(run) not in started
                started.add(id(run))
                if d is None:
                    yield sse({**head, "choices": [choice(run, "", run.finish, [], first)]})
                else:
                    yield sse({**head, "choices": [choice(run, d, None, toks, first)]})
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(prompts, runs)})
        except APIError as e:  # the status line is sent: the error goes in the stream
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _grammar_and_calls(st, req: ChatRequest) -> tuple[Optional[str], Optional[str]]:
    """(the grammar decoding follows, the tool-call format answers are parsed in)."""
    choice = req.tool_choice or ("auto" if req.tools else "none")
    if choice != "none" and not req.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
    named = isinstance(choice, NamedToolChoice)
    if named and choice.function.name not in {t.function.name for t in req.tools}:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among "
                            f"tools", param="tool_choice", code="invalid_value")
    if not (named or choice == "required"):
        grammar = st.grammars.make(req.response_format) if req.response_format else None
        return grammar, format_of(st.chat.source) if choice == "auto" else None
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, "response_format and a forced tool_choice contradict; give one",
                       param="response_format", code="invalid_value")
    schema = forced_schema([t.model_dump(exclude_none=True) for t in req.tools],
                           choice.model_dump() if named else choice)
    return st.grammars.make(None, schema_grammar(schema)), LLAMA_JSON


def _message(text: str, fmt: Optional[str]) -> tuple[dict, bool]:
    """The assistant message for ``text`` (its tool calls parsed in ``fmt``); whether it
    calls tools."""
    content, calls = parse(text, fmt) if fmt else (text, [])
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content or None,
            "tool_calls": openai_calls(calls)}, True


async def chat(st, req: ChatRequest, prompt: list[int], timeout: float):
    """``/v1/chat/completions``: the response (or its SSE stream) for the rendered prompt."""
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens == 0:
        raise APIError(400, "max_tokens must be >= 1", param="max_tokens", code="invalid_value")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                       code="invalid_value")
    sampling = sampling_for(st, req, logprobs=req.logprobs)
    grammar, calls = _grammar_and_calls(st, req)
    per_run = grammar and (lambda: dataclasses.replace(sampling,
                                                       constraint=st.grammars.state(grammar)))
    runs = start_runs(st, [prompt], req.n, req.n, sampling, max_tokens or DEFAULT_MAX_TOKENS,
                      req.seed, req.stop_strings(), "chat", timeout, per_run=per_run,
                      priority=req.priority, adapter=st.adapter_for(req.model))
    writer = {id(r): LogprobWriter(st.tokenizer, prompt, req.top_logprobs or 0) for r in runs}
    head = _head(st, chat=True, model=req.model)

    def logprobs(run, toks):
        return {"content": writer[id(run)].chat(toks)} if req.logprobs else None

    if not req.stream:
        out = []
        for r, t in zip(runs, await _collect(runs)):
            msg, called = _message(t, calls)
            out.append({"index": r.index, "message": msg, "logprobs": logprobs(r, r.entries),
                        "finish_reason": "tool_calls" if called else r.finish})
        return JSONResponse({**head, "choices": out, "usage": _usage([prompt], runs)})
    head["object"] = "chat.completion.chunk"

    def chunk(run, delta: dict, finish=None, lp=None):
        return sse({**head, "choices": [{"index": run.index, "delta": delta, "logprobs": lp,
                                         "finish_reason": finish}]})

    async def events():
        try:
            for r in runs:
                yield chunk(r, {"role": "assistant", "content": ""})
            held = {id(r): "" for r in runs}   # with tools: the answer is parsed at its end
            async for run, d, toks in merged(runs):
                if d is not None and calls is None:
                    yield chunk(run, {"content": d}, None, logprobs(run, toks))
                elif d is not None:
                    held[id(run)] += d
                elif calls is None:
                    yield chunk(run, {}, run.finish)
                else:
                    msg, called = _message(held[id(run)], calls)
                    if msg["content"]:
                        yield chunk(run, {"content": msg["content"]}, None,
                                    logprobs(run, run.entries))
                    if called:
                        yield chunk(run, {"tool_calls": [{"index": k, **c} for k, c in
                                                         enumerate(msg["tool_calls"])]})
                    yield chunk(run, {}, "tool_calls" if called else run.finish)
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": _usage([prompt], runs)})
        except APIError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
