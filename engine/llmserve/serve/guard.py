"""Checks that run before a request reaches a route: the API key and the request-body size.

Both answer in OpenAI's error shape without reading more of the request than needed:

* API key (``--api-key``): every ``/v1/*`` route needs ``Authorization: Bearer <key>``, else
  HTTP 401 with ``type=invalid_request_error``, ``code=invalid_api_key`` (OpenAI's answer to a
  bad key). The comparison is constant-time (:func:`hmac.compare_digest`) and the key, given
  or expected, is never echoed or logged. ``/health`` and ``/metrics`` stay open (probes and
  Prometheus) unless ``protect_open_routes``.
* Body size (``--max-request-body-bytes``): a ``Content-Length`` above the limit is answered
  413 at once, before any byte of the body is read; a chunked body is counted as it arrives
  and answered 413 as soon as it passes the limit. The body is buffered here and replayed to
  the app, so a huge body never reaches JSON parsing or the tokenizer.
"""

from __future__ import annotations

import hmac
from typing import Any

from .protocol import error_body

#: 8 MiB: about 2 million tokens of English text, or a 1-million-token id list, far above any
#: context length served today, yet small enough to parse in tens of milliseconds.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024

OPEN_ROUTES = ("/health", "/metrics")


async def _send_error(send: Any, status: int, message: str, code: str, headers: list | None = None,
                      type: str = "invalid_request_error") -> None:
    import json

    body = json.dumps(error_body(message, type, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestGuardMiddleware:
    """ASGI middleware: API-key check, then the body-size limit (module docstring).

    Args:
        app: the wrapped ASGI app.
        max_body_bytes: largest accepted request body in bytes (``None``: unlimited).
        api_key: the expected bearer token (``None``: no authentication).
        protect_open_routes: require the key on ``/health`` and ``/metrics`` too.
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
        self._expected = f"Bearer {api_key}".encode() if api_key is not None else None
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
        if path.startswith("/v1/") or path == "/v1":
            return True
        return self.protect_open_routes and path in OPEN_ROUTES

    def _authorized(self, scope: dict) -> bool:
        given = b""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                given = value
                break
        return hmac.compare_digest(given, self._expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._needs_key(scope.get("path", "")) and not self._authorized(scope):
            self._rejected("unauthorized")
            await _send_error(send, 401, "Incorrect or missing API key: send the header "
                              "'Authorization: Bearer <key>' with the key the server was started with",
                              "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        limit = self.max_body_bytes
        if limit is None or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers") or ():
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                if declared is not None and declared > limit:
                    await self._too_large(send, declared)
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
                await self._too_large(send, None)
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

    async def _too_large(self, send: Any, declared: int | None) -> None:
        self._rejected("payload_too_large")
        size = f"{declared} bytes, " if declared is not None else ""
        await _send_error(send, 413, f"request body too large: {size}the limit is {self.max_body_bytes} bytes "
                          "(raise it with --max-request-body-bytes)", "request_too_large",
                          [(b"connection", b"close")])
