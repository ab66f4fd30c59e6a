"""The serving layer: OpenAI-compatible HTTP API (FastAPI), SSE streaming, Prometheus metrics.

``create_app(async_engine)`` builds the app (``service/app.py``); ``llmserve serve``
(``service/server.py``) builds an engine from flags and runs it under uvicorn. Text handling
(UTF-8-safe incremental detokenization, stop strings) is in ``service/detokenizer.py``; request
bodies in ``service/protocol.py``; the ``llmserve:`` metrics in ``service/metrics.py``.
"""

from .detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer", "create_app"]


def __getattr__(name):  # lazy: importing the detokenizer must not require FastAPI
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(name)
