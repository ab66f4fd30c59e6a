"""Checks that run before a request reaches a route: the API key and the request-body size.

Both answer in OpenAI's error shape without reading more of the request than needed:

* API key (``--api-key``): every route needs ``Authorization: Bearer <key>`` (the scheme
  case-insensitive, RFC 9110 section 11.1), else HTTP 401 with ``type=invalid_request_error``,
  ``code=invalid_api_key`` (OpenAI's answer to a bad key): the completions, the tokenizer
  routes (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), the API documentation
  (``/docs``, ``/redoc``, ``/openapi.json``) and unknown paths alike. The comparison is
  constant-time (:func:`hmac.compare_digest`) and the key, given or expected, is never echoed or
  logged. ``/health`` and ``/metrics`` stay open (probes and Prometheus) unless
  ``protect_open_routes``. A rejected request never reaches the tokenizer.
* Body size (``--max-request-body-bytes``): a ``Content-Length`` above the limit is answered
  413 before any byte of the body is parsed; a chunked body is counted as it arrives and
  answered 413 as soon as it passes the limit. The body is buffered here and replayed to the
  app, so a huge body never reaches JSON parsing or the tokenizer.

A rejected request's body is read and dropped (up to ``MAX_DRAIN_BYTES`` and
``DRAIN_TIMEOUT_S``) after the status line is sent and before the connection is closed:
clients that send the whole body before reading the answer (urllib, requests, httpx, the
openai SDK) then read the 401 or 413 instead of a connection reset, and do not retry. A client
that asked ``Expect: 100-continue`` has not sent its body and is answered at once.

A JSON body sent without a content type or with another one (``text/plain``, curl's default
form encoding) is read as JSON: the routes take nothing else.
"""

from __future__ import annotations

import hmac
from typing import Any

from .protocol import error_body

#: 8 MiB: about 2 million tokens of English text, or a 1-million-token id list, far above any
#: context length served today, yet small enough to parse in tens of milliseconds.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024

OPEN_ROUTES = ("/health", "/metrics")

#: most bytes of a rejected request's body read and dropped before the connection closes
#: (larger declared bodies are answered at once: the client may then see a reset instead)
MAX_DRAIN_BYTES = 64 * 1024 * 1024

#: seconds a rejected request's body is drained at most (a slow sender is then cut off)
DRAIN_TIMEOUT_S = 10.0


def _header(scope: dict, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v
    return None


def _is_json_type(value: bytes) -> bool:
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _error_bytes(message: str, code: str, type: str = "invalid_request_error") -> bytes:
    import json

    return json.dumps(error_body(message, type, None, code)).encode()


async def _send_error(send: Any, status: int, message: str, code: str, headers: list | None = None,
                      type: str = "invalid_request_error") -> None:
    body = _error_bytes(message, code, type)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _drain(receive: Any, budget: int) -> None:
    """Read and drop request-body messages until the body ends, the client leaves, ``budget``
    bytes were read or ``DRAIN_TIMEOUT_S`` passed."""
    import asyncio

    async def run() -> None:
        left = budget
        while left > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            left -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(run(), DRAIN_TIMEOUT_S)
    except asyncio.TimeoutError:
        pass


async def _reject(scope: dict, receive: Any, send: Any, status: int, message: str, code: str,
                  headers: list | None = None, body_pending: bool | None = None, already_read: int = 0) -> None:
    """Answer ``status`` in OpenAI's error shape; a request body still on its way is drained
    (up to ``MAX_DRAIN_BYTES`` in all) between the answer and the connection's close, so the
    client reads the answer (module docstring)."""
    declared = _header(scope, b"content-length")
    try:
        size = int(declared) if declared is not None else None
    except ValueError:
        size = None
    if body_pending is None:
        chunked = b"chunked" in (_header(scope, b"transfer-encoding") or b"").lower()
        body_pending = chunked or (size is not None and size > 0)
    expects_continue = (_header(scope, b"expect") or b"").lower() == b"100-continue"
    drain = body_pending and not expects_continue and (size is None or size <= MAX_DRAIN_BYTES)
    body = _error_bytes(message, code)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            *(headers or [])]
    if body_pending:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    if not drain:
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await _drain(receive, MAX_DRAIN_BYTES - already_read)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class RequestGuardMiddleware:
    """ASGI middleware: API-key check, then the body-size limit, and JSON bodies read as JSON
    whatever their declared content type (module docstring).

    Args:
        app: the wrapped ASGI app.
        max_body_bytes: largest accepted request body in bytes (``None``: unlimited).
        api_key: the expected bearer token (``None``: no authentication).
        protect_open_routes: require the key on ``/health`` and ``/metrics`` too (every other
            route always needs it when ``api_key`` is set).
        metrics: a :class:`~llmserve.serve.metrics.ServiceMetrics` counting the rejections
            (``unauthorized``, ``payload_too_large``), optional.

    Raises:
        ValueError: ``max_body_bytes`` < 1, or an empty ``api_key``.
    """

    def __init__(self, app: Any, max_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 api_key: str | None = None, protect_open_routes: bool = False, metrics: Any = None) -> None:
        self.validate(max_body_bytes, api_key)
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._expected = api_key.encode() if api_key is not None else None
        self.protect_open_routes = protect_open_routes
        self.metrics = metrics

    @staticmethod
    def validate(max_body_bytes: int | None, api_key: str | None) -> None:
        """Raises ValueError for a limit < 1 or an empty key (see the class)."""
        if max_body_bytes is not None and (isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int)
                                           or max_body_bytes < 1):
            raise ValueError(f"max_request_body_bytes must be an integer >= 1 (or None for no limit), "
                             f"got {max_body_bytes!r}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (leave it unset to serve without authentication)")

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.on_rejected(reason)

    def _needs_key(self, path: str) -> bool:
        if self._expected is None:
            return False
        if path in OPEN_ROUTES:
            return self.protect_open_routes
        return True

    def _authorized(self, scope: dict) -> bool:
        given = (_header(scope, b"authorization") or b"").strip()
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        # compared even when malformed, so the time does not tell a bad scheme from a bad key
        return hmac.compare_digest(token.strip(), self._expected) and bool(token)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._needs_key(scope.get("path", "")) and not self._authorized(scope):
            self._rejected("unauthorized")
            await _reject(scope, receive, send, 401, "Incorrect or missing API key: send the header "
                          "'Authorization: Bearer <key>' with the key the server was started with",
                          "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        method = scope.get("method")
        if method in ("POST", "PUT", "PATCH"):
            ctype = _header(scope, b"content-type")
            if ctype is None or not _is_json_type(ctype):
                scope = dict(scope)
                scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"] \
                    + [(b"content-type", b"application/json")]
        limit = self.max_body_bytes
        if limit is None or method in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = None
            if size is not None and size > limit:
                await self._too_large(scope, receive, send, size, True, 0)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(scope, receive, send, None, bool(message.get("more_body", False)), size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any, declared: int | None, pending: bool,
                         already_read: int) -> None:
        self._rejected("payload_too_large")
        size = f"{declared} bytes, " if declared is not None else ""
        await _reject(scope, receive, send, 413, f"request body too large: {size}the limit is "
                      f"{self.max_body_bytes} bytes (raise it with --max-request-body-bytes)", "request_too_large",
                      body_pending=pending, already_read=already_read)
