"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the
handlers that turn FastAPI's own validation failures into that shape (400, naming the field).

    >>> APIError(400, "max_tokens must be >= 1", param="max_tokens").body()["error"]["param"]
    'max_tokens'
"""
from __future__ import annotations

from typing import Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 408: "timeout_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


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
        return APIError(exc.status_code, str(exc.detail)).response()
