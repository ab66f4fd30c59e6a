"""Server hardening through a real uvicorn on 127.0.0.1 (free port), on the tiny model (CPU):
request-body cap and an event loop that keeps answering, penalties and logit_bias over HTTP,
text_offset on split UTF-8 characters, queued aborts in the metrics, the KV-pool rejection's
param/code, speculative-decoding flags and metrics, the API key, and a bounded mutation fuzzer
(chat and completion bodies that reach the tokenizer) that must never see a 5xx.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time

import httpx
import pytest

from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.serve.app import create_app
from llmserve.serve.server import BackgroundServer

KEY = "sk-test-3f9a1c77e0"


def _engine(num_blocks: int, max_num_seqs: int, max_model_len: int) -> AsyncLLMEngine:
    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32",
                       cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1024,
                                                 max_model_len=max_model_len))
    return AsyncLLMEngine(LLMEngine(cfg), max_waiting=64)


@pytest.fixture(scope="module")
def engine():
    eng = _engine(256, 8, 512)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def small_engine():
    """One sequence at a time and 8 KV blocks (128 tokens) in a 512-token context."""
    eng = _engine(8, 1, 512)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def serial_engine():
    """One sequence at a time: a second request waits in the queue."""
    eng = _engine(64, 1, 512)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, served_model_name="tiny")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post_json(client, path, body, **kw):
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                       **kw)


def assert_error(r, status, param=None, code=None, type="invalid_request_error"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == type, err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the exposition")


class HealthProbe:
    """Polls /health on its own connection while something else runs; records latencies."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self.failures = url, [], []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            c.get("/health")  # connect first
            self._ready.set()
            while not self._stop.is_set():
                t = time.perf_counter()
                r = c.get("/health")
                self.latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    self.failures.append(r.status_code)
                time.sleep(0.01)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


# ---- 2. request-body cap and the event loop ------------------------------------------------------
def test_oversized_body_is_413_at_once_and_health_keeps_answering(server, client):
    # declared too large: answered before the body is sent
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        t = time.perf_counter()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 10000000\r\n\r\n{\"prompt\": \"")
        head = s.recv(65536).decode("latin-1")
        assert head.startswith("HTTP/1.1 413"), head
        assert time.perf_counter() - t < 1.0
        assert '"code":"request_too_large"' in head.replace(" ", "")
    # a whole 10 MB body, and a chunked one without Content-Length: 413, /health within 100 ms
    big = json.dumps({"prompt": "word " * 2_000_000}).encode()
    assert len(big) > 10_000_000
    with HealthProbe(server.url) as probe:
        t_end = time.monotonic() + 1.0
        bodies = []
        while time.monotonic() < t_end or len(bodies) < 2:   # keep the server busy for a second
            bodies.append(None)
            content = big if len(bodies) % 2 else (big[i:i + 65536] for i in range(0, len(big), 65536))
            try:
                r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
            except httpx.HTTPError:
                continue  # the server may close before the upload ends: that is the point
            assert_error(r, 413, code="request_too_large")
    assert probe.latencies and not probe.failures
    assert max(probe.latencies) < 0.1, sorted(probe.latencies)[-5:]
    assert client.get("/health").status_code == 200


def test_long_prompt_is_refused_without_tokenizing_it_all(server, client, engine):
    """A ~1.2 MB prompt (under the body cap; tokenizing it takes over a second here) is refused
    after a prefix of it; /health answers meanwhile. The same holds for chat messages."""
    rng = random.Random(0)
    prompt = "".join(rng.choice(["alpha ", "beta ", "gamma ", "x=1; ", "\u00e9t\u00e9 "]) for _ in range(220_000))
    tok = engine.engine.tokenizer
    t = time.perf_counter()
    tok.encode(prompt[:200_000], add_special_tokens=False)
    full_estimate = (time.perf_counter() - t) * len(prompt) / 200_000
    with HealthProbe(server.url) as probe:
        t = time.perf_counter()
        r = post_json(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        took = time.perf_counter() - t
        err = assert_error(r, 400, param="prompt", code="context_length_exceeded")
        assert "at least" in err["message"]
        t = time.perf_counter()
        r = post_json(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})
        took_chat = time.perf_counter() - t
        assert_error(r, 400, param="messages", code="context_length_exceeded")
    assert took < full_estimate / 3 and took_chat < full_estimate / 3, (took, took_chat, full_estimate)
    assert not probe.failures and statistics.median(probe.latencies or [0]) < 0.1, probe.latencies


def test_body_limit_is_configurable(engine):
    app = create_app(engine, served_model_name="tiny", max_request_body_bytes=1000)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert post_json(c, "/v1/completions", {"prompt": "x" * 900, "max_tokens": 1}).status_code != 413
        assert_error(post_json(c, "/v1/completions", {"prompt": "x" * 1000, "max_tokens": 1}), 413)
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        create_app(engine, max_request_body_bytes=0)


# ---- 3./4. penalties and logit_bias over HTTP ---------------------------------------------------
def test_logit_bias_and_penalties_over_http(client):
    base = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    plain = post_json(client, "/v1/completions", base).json()["choices"][0]
    # ban every token the plain answer used, then force one token
    from llmserve.tokenizer import load_tokenizer
    tk = load_tokenizer(None)
    used = tk.encode(plain["text"], add_special_tokens=False)
    banned = post_json(client, "/v1/completions", {**base, "logit_bias": {str(t): -100 for t in used}}).json()
    got = tk.encode(banned["choices"][0]["text"], add_special_tokens=False)
    assert not set(got) & set(used), (got, used)
    forced = post_json(client, "/v1/completions", {**base, "logit_bias": {"9707": 100}}).json()
    assert forced["choices"][0]["logprobs"]["tokens"] == ["Hello"] * 6
    for body in ({"presence_penalty": 1.5, "frequency_penalty": 2.0}, {"repetition_penalty": 1.3},
                 {"presence_penalty": -2, "frequency_penalty": -2}):
        r = post_json(client, "/v1/completions", {**base, **body})
        assert r.status_code == 200, r.text
        r = post_json(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4, **body})
        assert r.status_code == 200, r.text


# ---- 5. text_offset ------------------------------------------------------------------------------
def _stream(client, path, body) -> list[dict]:
    out = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("body", [
    {"prompt": "def main():", "max_tokens": 13, "temperature": 0, "logprobs": 0},
    {"prompt": "\u4f60\u597d\uff0c\u4e16\u754c", "max_tokens": 24, "temperature": 0, "logprobs": 2},
    {"prompt": "def main():", "max_tokens": 13, "temperature": 0, "logprobs": 0, "echo": False, "stop": ["("]},
])
def test_text_offset_is_monotone_inside_the_text_and_equal_when_streamed(client, body):
    whole = post_json(client, "/v1/completions", body).json()["choices"][0]
    text, offs = whole["text"], whole["logprobs"]["text_offset"]
    assert offs == sorted(offs) and all(0 <= o <= len(text) for o in offs), (offs, len(text), text)
    chunks = _stream(client, "/v1/completions", body)
    s_text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    s_offs = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert s_text == text and s_offs == offs
    if "stop" not in body:
        assert len(offs) == body["max_tokens"] or whole["finish_reason"] == "stop"


# ---- 6./7. queued aborts, the KV-pool rejection ----------------------------------------------------
def test_kv_pool_rejection_names_param_and_code(small_engine):
    app = create_app(small_engine, served_model_name="tiny")
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        err = assert_error(post_json(c, "/v1/completions", {"prompt": "x", "max_tokens": 200}), 400,
                           param="max_tokens", code="context_length_exceeded")
        assert "KV blocks" in err["message"]
        assert_error(post_json(c, "/v1/completions", {"prompt": [5] * 200, "max_tokens": 1}), 400,
                     param="prompt", code="context_length_exceeded")
        assert_error(post_json(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 200}), 400,
                     param="max_tokens", code="context_length_exceeded")


def test_abort_before_first_token_is_counted(serial_engine):
    app = create_app(serial_engine, served_model_name="tiny")
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:

        def aborts() -> float:
            return float(next(ln.rsplit(" ", 1)[1] for ln in c.get("/metrics").text.splitlines()
                              if ln.startswith('llmserve:request_success_total{finished_reason="abort"}')))

        before = aborts()
        # one sequence at a time: a long request runs, the next one waits in the queue
        long_req = threading.Thread(target=lambda: post_json(
            httpx.Client(base_url=srv.url, timeout=120), "/v1/completions",
            {"prompt": "x", "max_tokens": 480, "ignore_eos": True}), daemon=True)
        long_req.start()
        time.sleep(0.3)
        for stream in (False, True):
            with pytest.raises(httpx.ReadTimeout):
                with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(60, read=0.5)) as quick:
                    body = {"prompt": "y", "max_tokens": 5, "stream": stream}
                    if stream:
                        with quick.stream("POST", "/v1/completions", json=body) as r:
                            r.read()
                    else:
                        quick.post("/v1/completions", json=body)
        deadline = time.monotonic() + 10
        while aborts() < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert long_req.is_alive(), "the long request ended early: the test proved nothing"
        assert aborts() == before + 2
        long_req.join(120)


def test_non_finite_numbers_are_400_naming_the_field(client):
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}'):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        err = assert_error(r, 400)
        assert "finite" in err["message"] and err["param"] in ("temperature", "top_p"), err


def test_stream_of_more_choices_than_run_at_once_starts_with_the_first(serial_engine):
    """n=3 with one sequence a step: the stream's first chunk comes while later choices still
    wait in the queue (not after each choice has produced a token), and every choice ends."""
    app = create_app(serial_engine, served_model_name="tiny")
    with BackgroundServer(app) as srv:
        body = {"prompt": "x", "max_tokens": 48, "ignore_eos": True, "stream": True, "n": 3}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            waiting_at_first_chunk = serial_engine.stats()["num_waiting"]
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert json.loads(first[6:])["choices"][0]["index"] == 0
        assert waiting_at_first_chunk >= 1, "the stream waited for every choice's first token"
        assert rest[-1] == "data: [DONE]"
        finish = {c["index"]: c["finish_reason"] for ln in rest[:-1]
                  for c in json.loads(ln[6:])["choices"] if c["finish_reason"]}
        assert finish == {0: "length", 1: "length", 2: "length"}


# ---- 8. speculative decoding flags and metrics ------------------------------------------------
def test_serve_speculative_flags_and_metrics():
    from llmserve.cli import build_parser
    from llmserve.serve.metrics import SPEC_DECODE_METRICS
    from llmserve.serve.server import build_app

    args = build_parser().parse_args(["serve", "tiny", "--speculative-model", "tiny", "--num-speculative-tokens",
                                      "3", "--num-blocks", "64", "--max-model-len", "256"])
    app = build_app(args)
    assert type(app.state.service.view.inner).__name__ == "SpeculativeEngine"
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = post_json(c, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        text = c.get("/metrics").text
        for name in SPEC_DECODE_METRICS:
            assert f"\n{name} " in text, name
        drafted = metric(text, "llmserve:spec_decode_num_draft_tokens_total")
        accepted = metric(text, "llmserve:spec_decode_num_accepted_tokens_total")
        assert drafted >= 3 and 0 <= accepted <= drafted
        # penalties take the plain path on a speculative engine
        r = post_json(c, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "frequency_penalty": 1.0})
        assert r.status_code == 200, r.text


# ---- 10. API key ------------------------------------------------------------------------------
def test_api_key_guards_the_routes(engine):
    app = create_app(engine, served_model_name="tiny", api_key=KEY)
    routes = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
              ("GET", "/v1/models", None)]
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer {KEY[:-1]}"}):
                r = c.request(method, path, json=body, headers=headers)
                err = assert_error(r, 401, code="invalid_api_key")
                assert KEY not in r.text and "wrong" not in r.text
                assert r.headers.get("www-authenticate") == "Bearer"
                assert err["param"] is None
            r = c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        assert 'llmserve:request_rejected_total{reason="unauthorized"}' in c.get("/metrics").text
    app = create_app(engine, served_model_name="tiny", api_key=KEY, api_key_protects_metrics=True)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for path in ("/health", "/metrics"):
            assert_error(c.get(path), 401, code="invalid_api_key")
            assert c.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# ---- fuzzing -------------------------------------------------------------------------------------
_WEIRD = ["\ud800", "a\udfffb", "\udbff\udc00", "\x00", "\u202e", "\ufffd", "\U0001f600" * 3, "<|im_end|>",
          "<|endoftext|>", "", " ", "\n" * 5, "\u0301", "\\u0000", "a" * 3000, 0, -1, 2**31, 2**70, 1e308,
          -0.0, 0.5, True, False, None, [], {}, [None], {"a": 1}, [[1, 2]], ["x", 3], [1.5]]
_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
         "n", "stop", "seed", "stream", "logprobs", "top_logprobs", "echo", "logit_bias", "presence_penalty",
         "frequency_penalty", "repetition_penalty", "stream_options", "user", "ignore_eos", "priority"]


def _mutate(obj, rng: random.Random, depth: int = 0):
    """One random structural or value mutation of a JSON value (recursive)."""
    r = rng.random()
    if isinstance(obj, dict) and obj and r < 0.6:
        k = rng.choice(list(obj))
        out = dict(obj)
        roll = rng.random()
        if roll < 0.15:
            del out[k]
        elif roll < 0.3:
            out[rng.choice(_KEYS)] = rng.choice(_WEIRD)
        else:
            out[k] = _mutate(obj[k], rng, depth + 1)
        return out
    if isinstance(obj, list) and obj and r < 0.6:
        i = rng.randrange(len(obj))
        out = list(obj)
        roll = rng.random()
        if roll < 0.2:
            out.pop(i)
        elif roll < 0.35:
            out.insert(i, rng.choice(_WEIRD))
        else:
            out[i] = _mutate(obj[i], rng, depth + 1)
        return out
    if isinstance(obj, str) and r < 0.7:
        pos = rng.randrange(len(obj) + 1)
        w = rng.choice([x for x in _WEIRD if isinstance(x, str)])
        return obj[:pos] + w + obj[pos:]
    return rng.choice(_WEIRD)


_SEEDS = [
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
                              "max_tokens": 3, "stop": ["\n", "END"], "logprobs": True, "top_logprobs": 2,
                              "logit_bias": {"9707": 5}, "presence_penalty": 0.5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello", "name": "bob"}], "max_tokens": 2,
                              "stream": True, "stream_options": {"include_usage": True}, "n": 2}),
    ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 3, "stop": "x", "logprobs": 1, "echo": True,
                         "frequency_penalty": 1.0, "repetition_penalty": 1.2}),
    ("/v1/completions", {"prompt": [[1, 2, 3], [4]], "max_tokens": 2, "stream": True, "seed": 3,
                         "temperature": 0.7, "logit_bias": {"5": -100}}),
]


def test_mutation_fuzzer_never_sees_a_5xx(engine):
    """Seeded random mutations of valid chat and completion bodies (lone surrogates, wrong
    types, huge numbers, missing and extra keys) through the real server: never a 5xx, every
    error in OpenAI's shape, streams well-formed; bounded to 40 s, and the engine ends idle."""
    app = create_app(engine, served_model_name="tiny", max_model_len=24, max_choices=4)
    rng = random.Random(1234)
    seen: dict[int, int] = {}
    t0 = time.monotonic()
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for i in range(600):
            if time.monotonic() - t0 > 40:
                break
            path, seed = _SEEDS[i % len(_SEEDS)]
            body = seed
            for _ in range(rng.randint(1, 3)):
                body = _mutate(body, rng)
            raw = json.dumps(body).encode()
            with c.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
                payload = r.read().decode("utf-8")
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, f"{r.status_code} for {raw[:300]!r}: {payload[:300]}"
            if r.status_code >= 400:
                err = json.loads(payload)["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert payload.rstrip().endswith("data: [DONE]"), payload[-300:]
                assert '"internal_server_error"' not in payload, payload[:500]
        assert c.get("/health").status_code == 200
    assert sum(seen.values()) >= 100 and seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
    deadline = time.monotonic() + 10
    while engine.stats()["num_running"] or engine.stats()["num_waiting"]:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)
