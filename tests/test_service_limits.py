"""No request can stall paying traffic: ``llmserve serve --api-key`` (the app its flags build, on
the tiny model on CPU, under a real uvicorn on 127.0.0.1). Unauthenticated 6 MB bodies are
answered 401 without reaching the tokenizer, an authenticated 6 MB prompt is refused from its
length, and the tokenizer routes run on their own bounded thread, so a short authenticated
completion keeps its latency meanwhile. The bounds are generous (two shared CPU cores) but far
below the seconds a 6 MB tokenization takes."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from llmserve.cli import build_parser
from llmserve.serve.generation import MAX_TOKENIZER_ROUTE_PENDING
from llmserve.serve.server import BackgroundServer, build_app

KEY = "sk-limits-0c4f"
AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
SHORT = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
SIX_MB_PROMPT = "lorem ipsum dolor " * 333_334          # 6,000,012 characters


@pytest.fixture(scope="module")
def server():
    args = build_parser().parse_args(["serve", "--api-key", KEY, "--max-model-len", "4096",
                                      "--shutdown-timeout", "2"])
    with BackgroundServer(build_app(args), shutdown_timeout=2.0) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/v1/completions", json=SHORT, headers=AUTH).raise_for_status()   # warm
        yield c


def _short_latencies(client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = client.post("/v1/completions", json=SHORT, headers=AUTH)
        out.append(time.perf_counter() - t)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    return out


def _flood(url: str, path: str, body: bytes, headers: dict, statuses: list, n: int = 3) -> list[threading.Thread]:
    def send() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            statuses.append(c.post(path, content=body, headers=headers).status_code)

    threads = [threading.Thread(target=send, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_unauthenticated_6mb_requests_do_not_stall_an_authenticated_completion(server, client):
    base = statistics.median(_short_latencies(client, 3))
    body = json.dumps({"prompt": SIX_MB_PROMPT}).encode()
    for path in ("/tokenize", "/v1/completions"):
        statuses: list[int] = []
        threads = _flood(server.url, path, body, {"content-type": "application/json"}, statuses)
        time.sleep(0.05)                                    # the uploads are under way
        during = _short_latencies(client, 3)
        for t in threads:
            t.join(60)
        assert statuses == [401, 401, 401]
        assert max(during) < 1.0, (path, base, during)


def test_an_authenticated_6mb_prompt_is_refused_from_its_length(server, client):
    body = json.dumps({"model": "tiny", "prompt": SIX_MB_PROMPT, "max_tokens": 8}).encode()
    chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": SIX_MB_PROMPT}]}).encode()
    for path, payload, param in (("/v1/completions", body, "prompt"), ("/v1/chat/completions", chat, "messages")):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            r = client.post(path, content=payload, headers=AUTH)
            times.append(time.perf_counter() - t)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == param
            assert "at least" in err["message"]
        # the whole round trip (6 MB upload, JSON parsing, the refusal) in 10-50 ms here;
        # tokenizing the prompt would take about 5 s
        assert min(times) < 0.1 and max(times) < 1.0, (path, times)


def test_authenticated_6mb_tokenize_requests_do_not_stall_completions(server, client):
    body = json.dumps({"prompt": SIX_MB_PROMPT}).encode()
    statuses: list[int] = []
    threads = _flood(server.url, "/tokenize", body, AUTH, statuses)
    time.sleep(0.3)                                         # they reach the tokenizer thread
    during = _short_latencies(client, 3)
    for t in threads:
        t.join(60)
    assert statuses == [400, 400, 400]                      # over the per-request token cap
    assert max(during) < 1.0, during


def test_tokenizer_routes_are_bounded(tok_app):
    app, srv = tok_app
    service = app.state.service
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/tokenize", json={"prompt": "hello " * 200})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens", r.text
        r = c.post("/detokenize", json={"tokens": [9707] * 101})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        out = c.post("/tokenize", json={"prompt": "hello " * 50}).json()
        assert out["count"] == len(out["tokens"]) == 51
        service._route_pending = MAX_TOKENIZER_ROUTE_PENDING       # as if that many were queued
        try:
            r = c.post("/tokenize", json={"prompt": "hello"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "tokenizer_busy", r.text
        finally:
            service._route_pending = 0
        assert c.post("/detokenize", json={"tokens": [9707, 1879]}).json()["prompt"] == "Hello world"


@pytest.fixture()
def tok_app():
    from llmserve.serve.app import create_app
    from llmserve.tokenizer import load_tokenizer
    from test_service_fake import FakeAsyncEngine

    tok = load_tokenizer(None)
    app = create_app(FakeAsyncEngine(tok, lambda p, sp: [9707]), served_model_name="fake", max_tokenize_tokens=100)
    with BackgroundServer(app) as srv:
        yield app, srv
