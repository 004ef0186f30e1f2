"""The OpenAI-compatible HTTP layer (FastAPI) over one ``inference.Server``.

The ``Server`` stays the one serving core: each choice of a request is ``submit``-ted with
its own sampling and an ``on_token`` callback that feeds an asyncio queue
(``serving.runs``), so streamed and non-streamed answers come from the same tokens; the
completions and chat endpoints are ``serving.choices``; a request's ``model`` names the base or
a LoRA adapter, which ``serving.adapters`` loads and unloads. Besides them: ``/v1/models``,
``/tokenize`` and ``/detokenize`` (vLLM's shapes), ``/health`` and ``/metrics``.
``create_app(server, tokenizer, "tiny")`` gives the ASGI app; ``triax serve`` runs it on
uvicorn (tests/test_serve_core.py drives it with FastAPI's ``TestClient``).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from triax.inference.errors import InferenceError
from triax.inference.server import Server
from triax.serving import adapters, choices, errors
from triax.serving.chat_template import ChatTemplate, ChatTemplateError
from triax.serving.delivery import Mailbox
from triax.serving.metrics import Metrics
from triax.serving.protocol import (ChatRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest)
from triax.serving.runs import TIMEOUT_HEADER
from triax.serving.structured import Grammars
from triax.text.hf_tokenizer import HFTokenizer

APIError = errors.APIError


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
        self.mailbox = Mailbox()   # streamed tokens to the event loop, a wakeup per phase
        self.server.phase_listeners.append(self.mailbox.flush)
        self._grammars: Optional[Grammars] = None

    @property
    def grammars(self) -> Grammars:
        """Structured output's grammars over this model's tokenizer (built on first use)."""
        if self._grammars is None:
            srv = self.server
            self._grammars = Grammars(self.tokenizer, srv.vocab_size,
                                      srv.default_sampling.stop_tokens)
        return self._grammars

    @property
    def max_len(self) -> int:
        return self.server.max_len

    def adapter_for(self, model: Optional[str]) -> Optional[str]:
        """The LoRA adapter a request's ``model`` names (None: the base; else a 404)."""
        return adapters.resolve(self, model)


def encode_rendered(tokenizer, text: str) -> list[int]:
    """A rendered chat: its template already holds the special tokens (as HF's
    ``apply_chat_template`` tokenizes, without adding them again)."""
    if isinstance(tokenizer, HFTokenizer):
        return list(tokenizer.tok.encode(text, add_special_tokens=False).ids)
    return [int(t) for t in tokenizer.encode(text)]


def _check(st: Serving, req) -> None:
    adapters.resolve(st, req.model)


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


def _encode_prompts(st: Serving, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids and its text (``echo`` returns it)."""
    ids, texts = [], []
    for p in req.prompts():
        if isinstance(p, str):
            ids.append([int(t) for t in st.tokenizer.encode(p)])
            texts.append(p)
        else:
            try:
                ids.append(st.server.check_token_ids(p))
            except InferenceError as e:
                raise APIError(400, str(e), param="prompt", code="invalid_prompt") from None
            texts.append(st.tokenizer.decode(list(p)) if req.echo else "")
    return ids, texts


def create_app(server: Server, tokenizer, model_name: str, chat: Optional[ChatTemplate] = None,
               request_timeout: float = 600.0, layout: str = "",
               max_request_bytes: int = errors.MAX_BODY_BYTES, adapter_updates: bool = False):
    """The FastAPI app; its lifespan starts ``server`` serving and, at shutdown (SIGTERM), stops
    admitting and finishes what is in flight before returning. A request body over
    ``max_request_bytes`` is answered 413. ``adapter_updates``: the LoRA load and unload
    endpoints answer (else 403, ``--allow-adapter-updates``)."""
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
    app.add_middleware(errors.BodyLimit, limit=max_request_bytes)
    adapters.install(app, st, adapter_updates)

    @app.get("/health")
    async def health():
        if not st.ready:
            raise APIError(503, "the server is starting or draining", code="not_ready")
        return {"status": "ok", "model": st.model_name, "layout": st.layout}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": adapters.model_cards(st)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(st.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check(st, req)
        prompts, texts = _encode_prompts(st, req)
        return await choices.complete(st, req, prompts, texts, _timeout(st, request))

    def _render(messages, tools=None) -> str:
        if st.chat is None:
            raise APIError(400, f"model {st.model_name!r} has no chat template (no "
                                f"chat_template in its tokenizer_config.json); use "
                                f"/v1/completions, or serve a --model-dir whose "
                                f"tokenizer_config.json has one", param="messages",
                           code="no_chat_template")
        try:
            return st.chat.render([m.for_template() for m in messages], tools=tools)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages", code="chat_template") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        text = _render(req.messages, req.tools and [t.model_dump(exclude_none=True)
                                                     for t in req.tools])
        _check(st, req)
        return await choices.chat(st, req, encode_rendered(st.tokenizer, text),
                                  _timeout(st, request))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        _check(st, req)
        if req.prompt is not None:
            ids = ([int(t) for t in st.tokenizer.encode(req.prompt)]
                   if req.add_special_tokens else encode_rendered(st.tokenizer, req.prompt))
        else:
            ids = encode_rendered(st.tokenizer, _render(req.messages))
        return {"count": len(ids), "max_model_len": st.max_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        _check(st, req)
        try:
            ids = st.server.check_token_ids(req.tokens)
        except InferenceError as e:
            raise APIError(400, str(e), param="tokens", code="invalid_value") from None
        return {"prompt": st.tokenizer.decode(ids)}

    return app
