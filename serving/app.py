"""The OpenAI-compatible HTTP layer (FastAPI) over one ``inference.Server``.

The ``Server`` stays the one serving core: each request is ``submit``-ted with its own
sampling and an ``on_token`` callback that feeds an asyncio queue, so streamed and
non-streamed answers come from the same tokens. Stop strings, timeouts and client
disconnects end a request through ``Server.cancel``, which frees its slot.
``create_app(server, tokenizer, "tiny")`` gives the ASGI app; ``triax serve`` runs it on
uvicorn (tests/test_serve_core.py drives it with FastAPI's ``TestClient``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from triax.inference.errors import ContextLengthError, InferenceError
from triax.inference.sampling import SamplingConfig, SamplingError
from triax.inference.request import QueueFullError
from triax.inference.server import Server
from triax.serving import errors
from triax.serving.chat_template import ChatTemplate, ChatTemplateError
from triax.serving.detokenize import Detokenizer
from triax.serving.metrics import Metrics
from triax.serving.protocol import ChatRequest, CompletionRequest
from triax.text.hf_tokenizer import HFTokenizer

APIError = errors.APIError
TIMEOUT_HEADER = "x-request-timeout"  # seconds; may only lower the server's --request-timeout


@dataclass
class Serving:
    """What the endpoints share: the core, the tokenizer, the model's name and template."""

    server: Server
    tokenizer: object
    model_name: str
    chat: Optional[ChatTemplate] = None
    request_timeout: float = 600.0
    layout: str = ""
    ready: bool = False
    metrics: Metrics = field(init=False)

    def __post_init__(self):
        self.metrics = Metrics(self.server)

    @property
    def max_len(self) -> int:
        return min(e.ecfg.max_len for e in self.server.engines)


def encode_rendered(tokenizer, text: str) -> list[int]:
    """A rendered chat: its template already holds the special tokens (as HF's
    ``apply_chat_template`` tokenizes, without adding them again)."""
    if isinstance(tokenizer, HFTokenizer):
        return list(tokenizer.tok.encode(text, add_special_tokens=False).ids)
    return [int(t) for t in tokenizer.encode(text)]


class _Run:
    """One submitted request: its queue of tokens and its detokenizer."""

    def __init__(self, st: Serving, prompt: list[int], req, endpoint: str, timeout: float):
        self.st, self.prompt, self.req, self.endpoint = st, prompt, req, endpoint
        self.detok = Detokenizer(st.tokenizer, req.stop_strings())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.deadline = time.monotonic() + timeout
        self.timeout, self.done, self.finish = timeout, False, ""
        self.submitted = time.perf_counter()
        loop = asyncio.get_running_loop()
        put = lambda item: loop.call_soon_threadsafe(self.queue.put_nowait, item)  # noqa: E731
        eng = st.server.engines[0]
        try:
            sampling = SamplingConfig(temperature=req.temperature, top_k=req.top_k,
                                      top_p=req.top_p, seed=eng.sampling.seed,
                                      stop_tokens=eng.sampling.stop_tokens + req.stop_ids())
            self.rid = st.server.submit(prompt, req.max_tokens, seed=req.seed,
                                        sampling=sampling, on_token=lambda t, s: put((t, s)),
                                        priority=req.priority)
        except QueueFullError as e:
            st.metrics.rejected.labels("429").inc()
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"})
        except ContextLengthError as e:   # the one context check: the engine's
            raise APIError(400, str(e), param="max_tokens" if e.fits else "prompt",
                           code="context_length_exceeded") from None
        except (InferenceError, SamplingError) as e:
            raise APIError(400, str(e), param="prompt", code="invalid_prompt") from None
        st.server.future(self.rid).add_done_callback(lambda f: put(None))

    async def deltas(self) -> AsyncIterator[str]:
        """Text as it becomes final; sets ``finish``. Raises ``APIError`` on a timeout or an
        engine failure; cancels the request if the caller stops listening."""
        m, last = self.st.metrics, None
        try:
            while True:
                left = self.deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(self.queue.get(), max(left, 0.0))
                except TimeoutError:
                    raise APIError(408, f"the request ran past its timeout of "
                                        f"{self.timeout:g} s; raise it with the "
                                        f"{TIMEOUT_HEADER} header or the server's "
                                        f"--request-timeout, or lower max_tokens",
                                   code="timeout") from None
                if item is None:
                    break
                tok, t = item
                (m.ttft.observe(t - self.submitted) if last is None else m.itl.observe(t - last))
                last = t
                delta = self.detok.push(tok)
                if delta:
                    yield delta
                if self.detok.stopped:
                    self.st.server.cancel(self.rid)
                    self.finish = "stop"
                    break
            if not self.finish:
                try:
                    res = self.st.server.future(self.rid).result(0)
                except Exception as e:  # the engine failed on this request
                    raise APIError(500, f"generation failed: {e}", code="engine_error") \
                        from None
                self.finish = "stop" if res.finish_reason == "stop" else "length"
                m.requests.labels(self.endpoint, self.finish, str(res.replica)).inc()
                tail = self.detok.flush()
                if tail:
                    yield tail
            else:
                m.requests.labels(self.endpoint, self.finish, "").inc()
            m.latency.observe(time.perf_counter() - self.submitted)
            self.done = True
        finally:
            if not self.done:  # timeout, failure or a client that left
                self.st.server.cancel(self.rid)

    def usage(self) -> dict:
        n = len(self.detok.tokens)
        res = self.st.server.results.get(self.rid)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n,
                "total_tokens": len(self.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": res.cached_tokens if res else 0}}


def _check(st: Serving, req) -> None:
    if req.model != st.model_name:
        raise APIError(404, f"model {req.model!r} is not served here; this server serves "
                            f"{st.model_name!r} (GET /v1/models)", param="model",
                       code="model_not_found")
    if req.n != 1:
        raise APIError(400, f"n={req.n}: this server returns one choice per request; send "
                            f"n=1 (or several requests)", param="n", code="unsupported")


def _timeout(st: Serving, request: Request) -> float:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return st.request_timeout
    try:
        value = float(raw)
    except ValueError:
        raise APIError(400, f"header {TIMEOUT_HEADER}: {raw!r} is not a number of seconds",
                       param=TIMEOUT_HEADER) from None
    if not value > 0:
        raise APIError(400, f"header {TIMEOUT_HEADER} must be > 0 seconds, got {raw}",
                       param=TIMEOUT_HEADER)
    return min(value, st.request_timeout)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _respond(st: Serving, run: _Run, chat: bool):
    """The non-streamed answer, or the SSE stream of OpenAI chunks ending ``[DONE]``."""
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": st.model_name}
    if not run.req.stream:
        text = "".join([d async for d in run.deltas()])
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": None, "finish_reason": run.finish} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": run.finish})
        return JSONResponse({**head, "choices": [choice], "usage": run.usage()})
    head["object"] = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: Optional[str], finish=None, first=False) -> dict:
        if chat:
            d = ({"role": "assistant", "content": ""} if first else
                 {} if delta is None else {"content": delta})
            c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [c]}

    async def events():
        try:
            if chat:
                yield _sse(chunk(None, first=True))
            async for d in run.deltas():
                yield _sse(chunk(d))
            yield _sse(chunk(None, run.finish))
            if run.req.include_usage:
                yield _sse({**head, "choices": [], "usage": run.usage()})
        except APIError as e:  # the status line is sent: the error goes in the stream
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def create_app(server: Server, tokenizer, model_name: str, chat: Optional[ChatTemplate] = None,
               request_timeout: float = 600.0, layout: str = ""):
    """The FastAPI app; its lifespan starts ``server`` serving and, at shutdown (SIGTERM), stops
    admitting and finishes what is in flight before returning."""
    st = Serving(server, tokenizer, model_name, chat, request_timeout, layout)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not server.serving:
            server.start()
        st.ready = True
        try:
            yield
        finally:
            st.ready = False
            await asyncio.to_thread(server.stop, True)

    app = FastAPI(title="triax", lifespan=lifespan)
    app.state.serving = st
    errors.install(app)

    @app.get("/health")
    async def health():
        if not st.ready:
            raise APIError(503, "the server is starting or draining", code="not_ready")
        return {"status": "ok", "model": st.model_name, "layout": st.layout}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.model_name, "object": "model",
                                            "created": 0, "owned_by": "triax",
                                            "max_model_len": st.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(st.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = (list(req.prompt) if isinstance(req.prompt, list) else
                  [int(t) for t in st.tokenizer.encode(req.prompt)])
        _check(st, req)
        return await _respond(st, _Run(st, prompt, req, "completions", _timeout(st, request)),
                              chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        if st.chat is None:
            raise APIError(400, f"model {st.model_name!r} has no chat template (no "
                                f"chat_template in its tokenizer_config.json); use "
                                f"/v1/completions, or serve a --model-dir whose "
                                f"tokenizer_config.json has one", param="messages",
                           code="no_chat_template")
        try:
            text = st.chat.render([{"role": m.role, "content": m.text()}
                                   for m in req.messages])
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages", code="chat_template") from None
        prompt = encode_rendered(st.tokenizer, text)
        _check(st, req)
        return await _respond(st, _Run(st, prompt, req, "chat", _timeout(st, request)),
                              chat=True)

    return app
