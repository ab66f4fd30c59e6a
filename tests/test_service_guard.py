"""The request guard through a real uvicorn on 127.0.0.1 (a scripted fake engine, so no model
runs): the API key on every route but /health and /metrics, the Bearer scheme in any case, a
readable 413 for a 10 MB body in the standard clients (urllib, requests, httpx sync and async,
the openai SDK sync and async), JSON bodies sent with another content type."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request

import httpx
import pytest

from llmserve.serve.app import create_app
from llmserve.serve.server import BackgroundServer

from test_service_fake import FakeAsyncEngine

KEY = "sk-guard-5d1e2a"
AUTH = {"Authorization": f"Bearer {KEY}"}
BIG = json.dumps({"model": "fake", "prompt": "word " * 2_000_000, "max_tokens": 1}).encode()   # 10 MB


@pytest.fixture(scope="module")
def tok():
    from llmserve.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def engine(tok):
    return FakeAsyncEngine(tok, lambda p, sp: tok.encode(" ok", add_special_tokens=False), max_model_len=4096)


@pytest.fixture(scope="module")
def keyed(engine):
    with BackgroundServer(create_app(engine, served_model_name="fake", api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_server(engine):
    with BackgroundServer(create_app(engine, served_model_name="fake")) as srv:
        yield srv


def _err(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


ROUTES = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
          ("GET", "/v1/models", None),
          ("POST", "/tokenize", {"prompt": "hello"}),
          ("POST", "/detokenize", {"tokens": [9707, 1879]}),
          ("GET", "/tokenizer_info", None),
          ("GET", "/docs", None),
          ("GET", "/redoc", None),
          ("GET", "/openapi.json", None)]


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_every_route_needs_the_key(keyed, method, path, body):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            r = c.request(method, path, json=body, headers=headers)
            _err(r, 401, "invalid_api_key")
            assert KEY not in r.text and r.headers.get("www-authenticate") == "Bearer"
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = c.request(method, path, json=body, headers={"Authorization": f"{scheme} {KEY}"})
            assert r.status_code == 200, r.text


def test_open_routes_and_unknown_paths(keyed, engine):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        _err(c.get("/nope"), 401, "invalid_api_key")
        _err(c.get("/nope", headers=AUTH), 404, "not_found")
    app = create_app(engine, served_model_name="fake", api_key=KEY, api_key_protects_metrics=True)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for path in ("/health", "/metrics"):
            _err(c.get(path), 401, "invalid_api_key")
            assert c.get(path, headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_unauthenticated_body_is_drained_and_answered_401(keyed):
    import requests

    r = requests.post(keyed.url + "/tokenize", data=BIG[:6_000_000], timeout=30,
                      headers={"content-type": "application/json"})
    _err(r, 401, "invalid_api_key")


# ---- 413 in the standard clients ---------------------------------------------------------------
def test_413_in_urllib(open_server):
    for _ in range(3):
        req = urllib.request.Request(open_server.url + "/v1/completions", data=BIG, method="POST",
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 413
        assert json.loads(e.value.read())["error"]["code"] == "request_too_large"


def test_413_in_requests(open_server):
    import requests

    _err(requests.post(open_server.url + "/v1/completions", data=BIG, timeout=30,
                       headers={"content-type": "application/json"}), 413, "request_too_large")
    # a chunked upload (no Content-Length)
    chunks = (BIG[i:i + 65536] for i in range(0, len(BIG), 65536))
    _err(requests.post(open_server.url + "/v1/completions", data=chunks, timeout=30), 413, "request_too_large")


def test_413_in_httpx_sync_and_async(open_server):
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        _err(c.post("/v1/completions", content=BIG, headers={"content-type": "application/json"}),
             413, "request_too_large")

    async def run():
        async with httpx.AsyncClient(base_url=open_server.url, timeout=30) as c:
            return await c.post("/v1/completions", content=BIG, headers={"content-type": "application/json"})

    _err(asyncio.run(run()), 413, "request_too_large")


def test_413_in_the_openai_client_sync_and_async(open_server):
    openai = pytest.importorskip("openai")
    prompt = "word " * 2_000_000
    client = openai.OpenAI(base_url=open_server.url + "/v1", api_key="x", timeout=30)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="fake", prompt=prompt, max_tokens=1)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"

    async def run():
        aclient = openai.AsyncOpenAI(base_url=open_server.url + "/v1", api_key="x", timeout=30)
        with pytest.raises(openai.APIStatusError) as e:
            await aclient.completions.create(model="fake", prompt=prompt, max_tokens=1)
        return e.value

    err = asyncio.run(run())
    assert err.status_code == 413


def test_413_before_the_body_when_the_client_waits_for_100_continue(open_server):
    with socket.create_connection(("127.0.0.1", open_server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: 10000000\r\n\r\n")
        head = s.recv(65536).decode("latin-1")
        assert head.startswith("HTTP/1.1 413"), head


# ---- content type -----------------------------------------------------------------------------
@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "application/json; charset=utf-8"])
def test_json_body_with_any_content_type(open_server, ctype):
    body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2}).encode()
    headers = {"content-type": ctype} if ctype else {}
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        r = c.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "text/plain"})
        err = _err(r, 400, None)
        assert "not valid JSON" in err["message"]
