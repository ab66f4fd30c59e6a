"""OpenAI-shaped errors: every validation failure, unknown route or unexpected exception becomes
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (5xx only for real server faults).
"""

from __future__ import annotations
import logging
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from .metrics import ServiceMetrics
from .protocol import APIError, error_body


log = logging.getLogger("llmserve.serve")


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error answer: HTTP ``status`` with the body
    ``{"error": {"message", "type", "param", "code"}}`` (:func:`~llmserve.serve.protocol.error_body`).

    Args:
        status: the HTTP status code (4xx for the client's faults, 5xx for the server's).
        message: the human-readable explanation.
        type: OpenAI's error type (``invalid_request_error``, ``service_unavailable``, ...).
        param: the request field at fault, dotted (``stream_options.include_usage``), if any.
        code: a machine-readable code (``model_not_found``, ``unsupported_parameter``, ...).
    """
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _param_of(loc: tuple) -> str | None:
    """``('body', 'stream_options', 'include_usage')`` -> ``stream_options.include_usage``;
    pydantic's union-branch tags (``constrained-str``, ``list[int]``) end the path, and those
    naming a model class (``NamedFunction``: no field is capitalised) are skipped."""
    out = ""
    for p in loc:
        if p == "body" and not out:
            continue
        if isinstance(p, str) and p[:1].isupper() and p.isidentifier():
            continue
        if isinstance(p, int) or (isinstance(p, str) and p.isdigit()):
            if not out:
                break
            out += f"[{p}]"
        elif isinstance(p, str) and p.isidentifier() and p not in ("str", "int", "float", "bool", "list", "dict"):
            out += f".{p}" if out else p
        else:
            break
    return out or None


_FIELD_HINTS = {
    "prompt": "prompt must be a non-empty string, a non-empty list of non-empty strings, a non-empty list of "
              "token ids (integers >= 0), or a non-empty list of such lists",
    "stop": "stop must be a non-empty string or a list of at most 4 non-empty strings",
}


def _unsupported(errors: list[dict]) -> tuple[str, str] | None:
    """The first field the request models do not declare (pydantic ``extra_forbidden``), as
    ``(message, param)``."""
    for e in errors:
        if e.get("type") == "extra_forbidden":
            loc = tuple(e.get("loc", ()))
            param = _param_of(loc) or str(loc[-1])
            why = "this server does not support it; remove it (see the API reference for the accepted fields)"
            return f"unsupported parameter {param!r}: {why}", param
    return None


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request body", None
    # an explicit refusal from a validator (e.g. an image content part) beats the type errors
    # of the other branches of a union
    errors = sorted(errors, key=lambda e: e.get("type") != "value_error")
    first = errors[0]
    param = _param_of(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if first.get("type") in ("json_invalid", "json_type"):
        return f"request body is not valid JSON: {msg}", None
    if param is None and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return f"request body must be a JSON object: {msg}", None
    top = param.split(".")[0].split("[")[0] if param else None
    if top in _FIELD_HINTS and sum(1 for e in errors if _param_of(tuple(e.get("loc", ()))) == param) > 1:
        text = f"{_FIELD_HINTS[top]} ({msg})"
    else:
        text = f"{param}: {msg}" if param else msg
    others = sorted({p for p in (_param_of(tuple(e.get("loc", ()))) for e in errors[1:])
                     if p and p.split(".")[0].split("[")[0] != top})
    if others:
        text += f" (also invalid: {', '.join(others[:5])})"
    return text, param


def install_error_handlers(app: FastAPI, metrics: ServiceMetrics | None = None) -> None:
    """Every error answers in OpenAI's shape; bad input is 400, never 422 or 500."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if metrics is not None:
            metrics.on_rejected(exc.code or ("queue_full" if exc.status_code == 429 else "invalid_request"))
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        unsupported = _unsupported(errors)
        if unsupported is not None:
            if metrics is not None:
                metrics.on_rejected("unsupported_parameter")
            return error_response(400, unsupported[0], param=unsupported[1], code="unsupported_parameter")
        msg, param = _validation_message(errors)
        if metrics is not None:
            metrics.on_rejected("invalid_request")
        return error_response(400, msg, param=param)

    @app.exception_handler(ValidationError)
    async def _pydantic_error(_: Request, exc: ValidationError) -> JSONResponse:
        msg, param = _validation_message(list(exc.errors()))
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return error_response(exc.status_code, str(exc.detail), type=kind, code=code)

    app.add_middleware(InternalErrorMiddleware)


class InternalErrorMiddleware:
    """Catch-all for true internal errors: answer 500 in OpenAI's shape and keep the connection
    usable. (Starlette's own ``Exception`` handler re-raises after answering, which makes uvicorn
    drop the keep-alive connection.)"""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def _send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, _send)
        except Exception as exc:  # noqa: BLE001 - this is the catch-all
            log.exception("internal error while serving %s %s", scope.get("method"), scope.get("path"))
            if started:
                return  # the status line is gone; the body is cut short
            resp = error_response(500, f"internal server error: {type(exc).__name__}: {exc}",
                                  type="internal_server_error")
            await resp(scope, receive, send)


class ClientDisconnected(Exception):
    """The client went away before the answer was ready (answered with status 499, which nobody
    reads)."""
