"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the
handlers that turn FastAPI's own failures into that shape: validation (400, naming the
field; an OpenAI field this server does not implement is named as such), unknown routes
(404), wrong methods (405), and bodies over the size limit (413, ``BodyLimit``).

    >>> APIError(400, "max_tokens must be >= 1", param="max_tokens").body()["error"]["param"]
    'max_tokens'
"""
from __future__ import annotations

import json
from typing import Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from triax.serve_config import HTTP
from triax.serving.protocol import UNSUPPORTED

_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}
MAX_BODY_BYTES = HTTP().max_request_bytes   # a request body's bytes at most, by default


class APIError(Exception):
    """A request answered with ``status`` and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def _field(loc) -> Optional[str]:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem FastAPI/pydantic found, as a 400 naming its field."""
    err = exc.errors()[0]
    kind, field = err.get("type", ""), _field(err.get("loc", ()))
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('msg')}); send a "
                             f"JSON object", code="invalid_json")
    if kind in ("model_type", "model_attributes_type", "dict_type") and field is None:
        got = type(err.get("input")).__name__
        return APIError(400, f"the request body must be a JSON object ({{...}}), got a JSON "
                             f"{'array' if got == 'list' else got}; send one request per "
                             f"call (a batch of prompts goes in prompt: [...])",
                        code="invalid_json")
    if kind == "extra_forbidden" and field in UNSUPPORTED:
        return APIError(400, f"field {field!r} is not supported by this server (triax serve); "
                             f"remove it (docs/serving.md lists the OpenAI fields served)",
                        param=field, code="unsupported_field")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {field!r}; remove it (see the OpenAI API "
                             f"reference for this endpoint's fields)", param=field,
                        code="unknown_field")
    if kind == "missing":
        return APIError(400, f"missing required field {field!r}", param=field,
                        code="missing_field")
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    return APIError(400, f"field {field!r}: {err.get('msg')} (got {shown})", param=field,
                    code="invalid_value")


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


class BodyTooLarge(Exception):
    """A body past the limit (FastAPI re-raises it as a 400 whose cause this is)."""

    def error(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.args[0]} bytes; send a smaller "
                             f"request (or raise the server's --max-request-bytes)",
                        code="request_too_large")


class BodyLimit:
    """ASGI middleware: a request whose body exceeds ``limit`` bytes (by its
    ``content-length``, or as its chunks arrive) is answered 413 in OpenAI's shape."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    def _error(self) -> JSONResponse:
        return BodyTooLarge(self.limit).error().response()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._error()(scope, receive, send)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return msg

        async def sending(msg):
            nonlocal started
            started = True
            await send(msg)

        try:
            await self.app(scope, counted, sending)
        except BodyTooLarge:
            if not started:
                await self._error()(scope, receive, send)


def install(app) -> None:
    """Answer every error the app raises in OpenAI's shape."""
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, BodyTooLarge):
            return exc.__cause__.error().response()
        words = {404: f"no route {request.url.path!r}; see GET /v1/models and docs/serving.md "
                      f"for the endpoints",
                 405: f"method {request.method} is not allowed on {request.url.path!r}"}
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, words.get(exc.status_code, str(exc.detail)),
                        code=code, headers=getattr(exc, "headers", None)).response()
