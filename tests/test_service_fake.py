"""The HTTP layer against a scripted fake engine (the documented AsyncLLMEngine interface),
served by a real uvicorn on 127.0.0.1: exact token streams make stop strings, split UTF-8
characters, engine errors, a full queue, disconnects and shutdown deterministic.

The same behaviours on the real tiny model are in ``test_service_api.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from llmserve.engine.llm_engine import RequestOutput
from llmserve.core.sequence import RequestMetrics
from llmserve.serve.app import create_app
from llmserve.serve.server import BackgroundServer

FFFD = "\ufffd"


class QueueFullError(RuntimeError):
    """Same name as the engine's, which the app maps to 429."""


class FakeAsyncEngine:
    """Implements AsyncLLMEngine's documented interface: ``generate`` (async iterator of
    ``RequestOutput`` objects, abort on close, ``on_admitted`` called once it is queued),
    ``abort``, ``stats``; plus ``tokenizer``,
    ``max_model_len`` and ``model_config.vocab_size`` that the service reads.

    ``script(prompt_ids, sp) -> list[int]`` decides the output tokens; ``eos`` ends with
    finish_reason 'stop' when it is the last one.
    """

    def __init__(self, tokenizer, script, delay=0.002, max_model_len=256, eos=151643):
        self.tokenizer = tokenizer
        self.script = script
        self.delay = delay
        self.max_model_len = max_model_len
        self.model_config = SimpleNamespace(vocab_size=151936)
        self.eos = eos
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.waiting = 0
        self.fail: BaseException | None = None          # raised at the first __anext__
        self.fail_after: tuple[int, BaseException] | None = None  # raised after k tokens
        self.stats_error = False
        self.requests: list[tuple[list[int], object]] = []
        self.admission_callbacks: list[bool] = []   # whether each generate() got on_admitted

    def stats(self):
        if self.stats_error:
            raise RuntimeError("stats exploded")
        return {"num_running": len(self.active), "num_waiting": self.waiting, "kv_cache_usage": 0.0,
                "num_free_blocks": 100 - len(self.active), "num_total_blocks": 100, "block_size": 16,
                "num_preemptions": 0}

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def generate(self, prompt, sampling_params, request_id=None, priority=0, on_admitted=None):
        self.admission_callbacks.append(on_admitted is not None)
        if self.fail is not None:
            raise self.fail
        sp = sampling_params
        self.requests.append((list(prompt), sp))
        tokens = list(self.script(list(prompt), sp))[: sp.max_tokens]
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.active.add(request_id)
        if on_admitted is not None:
            on_admitted()
        out_ids: list[int] = []
        try:
            for i, t in enumerate(tokens):
                await asyncio.sleep(self.delay)
                if request_id in self.aborted:
                    return
                if self.fail_after is not None and i == self.fail_after[0]:
                    raise self.fail_after[1]
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = time.perf_counter()
                out_ids.append(t)
                now = time.perf_counter()
                metrics.token_times.append(now)
                metrics.first_token_time = metrics.first_token_time or now
                last = i == len(tokens) - 1 or (t == self.eos and not sp.ignore_eos)
                reason = None
                if last:
                    reason = "stop" if t == self.eos else "length"
                    metrics.finish_time = now
                lps = [{"token_logprob": -0.5, "top": [(t, -0.5), (0, -1.5)][: sp.logprobs]}
                       if sp.logprobs is not None else None for _ in out_ids]
                yield RequestOutput(request_id, list(prompt), list(out_ids), [t], last, reason, metrics, lps)
                if last:
                    return
        finally:
            self.active.discard(request_id)


@pytest.fixture(scope="module")
def tok():
    from llmserve.tokenizer import load_tokenizer
    return load_tokenizer(None)


class Harness:
    def __init__(self, tok):
        self.tok = tok
        self.text = "Hello world, this is a test"
        self.engine = FakeAsyncEngine(tok, lambda p, sp: self.ids)
        self.ids = tok.encode(self.text, add_special_tokens=False)
        self.app = create_app(self.engine, served_model_name="fake", max_waiting=4, shutdown_timeout=1.0)
        self.server = BackgroundServer(self.app, shutdown_timeout=1.0).start()
        self.client = httpx.Client(base_url=self.server.url, timeout=30)

    def say(self, text: str) -> None:
        self.ids = self.tok.encode(text, add_special_tokens=False)

    def stream(self, path, body):
        chunks, done = [], False
        with self.client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line:
                    continue
                assert line.startswith("data: ")
                if line == "data: [DONE]":
                    done = True
                    continue
                chunks.append(json.loads(line[6:]))
        assert done
        return chunks

    def settle(self, timeout=5.0):
        deadline = time.monotonic() + timeout
        while self.engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.engine.active


@pytest.fixture(scope="module")
def h(tok):
    harness = Harness(tok)
    yield harness
    harness.client.close()
    harness.server.stop()


@pytest.fixture(autouse=True)
def _reset(h):
    h.engine.fail = h.engine.fail_after = None
    h.engine.waiting = 0
    h.engine.delay = 0.002
    h.engine.stats_error = False
    h.say("Hello world, this is a test")
    yield
    assert h.settle(), "requests left running in the fake engine"


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


# ---- stop strings and UTF-8 end to end -------------------------------------------------------
def test_stop_string_spanning_tokens_is_cut_and_the_request_aborted(h):
    pieces = [h.tok.decode([i]) for i in h.ids]
    assert pieces[:4] == ["Hello", " world", ",", " this"]
    body = {"prompt": "hi", "max_tokens": 50, "temperature": 0, "stop": ["ld, th"]}
    r = h.client.post("/v1/completions", json=body)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello wor" and choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 4  # through the token that completed it
    chunks = h.stream("/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello wor"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("ld" not in c["choices"][0]["text"] for c in chunks)
    assert h.settle()
    assert len(h.engine.aborted) >= 2  # both requests were aborted at the stop string


def test_only_a_stream_asks_the_engine_for_its_admission_callback(h):
    h.say("one two")
    before = len(h.engine.admission_callbacks)
    assert h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}).status_code == 200
    h.stream("/v1/completions", {"prompt": "x", "max_tokens": 4})
    h.stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
    h.stream("/v1/completions", {"prompt": "x", "max_tokens": 4, "echo": True})
    assert h.engine.admission_callbacks[before:] == [False, True, True, False]


def test_multibyte_output_streams_without_replacement_chars(h):
    text = "Music 𝄞 robots 🤖🦾 鿿 end"
    h.say(text)
    assert any(FFFD in h.tok.decode([i]) for i in h.ids), "tokens must split characters"
    body = {"prompt": "x", "max_tokens": 100}
    chunks = h.stream("/v1/completions", body)
    deltas = [c["choices"][0]["text"] for c in chunks]
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == text
    assert h.client.post("/v1/completions", json=body).json()["choices"][0]["text"] == text
    chat = h.stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100})
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chat]
    assert all(FFFD not in d for d in deltas) and "".join(deltas) == text
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"


def test_length_finish_flushes_held_stop_prefix(h):
    h.say("abc ab")  # ends with a possible prefix of the stop string "ab!"
    body = {"prompt": "x", "max_tokens": 100, "stop": "ab!"}
    chunks = h.stream("/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc ab"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_eos_finish_reason_and_chat_stop_token(h):
    h.ids = h.tok.encode("done", add_special_tokens=False) + [151645, 5, 6]  # <|im_end|> ...
    r = h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 10})
    assert r.status_code == 200
    # the fake ignores stop_token_ids, but the service passed <|im_end|> to the engine
    _, sp = h.engine.requests[-1]
    assert 151645 in sp.stop_token_ids
    h.ids = h.tok.encode("done", add_special_tokens=False) + [151643]
    r = h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
    assert r.json()["choices"][0] == {"index": 0, "text": "done", "logprobs": None, "finish_reason": "stop"}


def test_echo_and_logprobs_shapes(h):
    r = h.client.post("/v1/completions", json={"prompt": "Say", "max_tokens": 3, "echo": True})
    assert r.json()["choices"][0]["text"] == "SayHello world,"
    chunks = h.stream("/v1/completions", {"prompt": "Say", "max_tokens": 3, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == "SayHello world,"
    r = h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hello", " world", ","]
    assert lp["token_logprobs"] == [-0.5] * 3 and lp["text_offset"] == [0, 5, 11]
    assert len(lp["top_logprobs"]) == 3 and all(len(t) == 2 for t in lp["top_logprobs"])
    chunks = h.stream("/v1/completions", {"prompt": "x", "max_tokens": 3, "logprobs": 1})
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 3
    r = h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " world"]
    assert content[1]["bytes"] == list(b" world") and len(content[1]["top_logprobs"]) == 2
    # echo with logprobs: the prompt's entries come first (the first token's logprob is null)
    r = h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "echo": True, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert r.status_code == 200 and lp["tokens"] == ["x", "Hello", " world", ","]
    assert lp["token_logprobs"] == [None, -0.5, -0.5, -0.5] and lp["text_offset"] == [0, 1, 6, 12]


def test_n_and_prompt_lists_count_usage(h):
    assert h.client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "n": 2}).status_code == 200
    assert_error(h.client.post("/v1/completions", json={"prompt": ["a", [1, 2]]}), 400, "prompt")
    body = {"prompt": ["a", "b c", "d e f"], "n": 2, "max_tokens": 3}
    r = h.client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    plen = sum(len(h.tok.encode(p, add_special_tokens=False)) for p in body["prompt"])
    assert r["usage"] == {"prompt_tokens": plen, "completion_tokens": 18, "total_tokens": plen + 18}
    chunks = h.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == r["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    texts = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {i: c["text"] for i, c in enumerate(r["choices"])}


# ---- errors ----------------------------------------------------------------------------------
def test_full_queue_answers_429(h):
    h.engine.waiting = 4
    err = assert_error(h.client.post("/v1/completions", json={"prompt": "x"}), 429, code="queue_full")
    assert err["type"] == "rate_limit_exceeded"
    h.engine.waiting = 0
    h.engine.fail = QueueFullError("the waiting queue is full (4 requests); retry later")
    assert_error(h.client.post("/v1/completions", json={"prompt": "x", "stream": True}), 429, code="queue_full")
    assert h.client.get("/health").json() == {"status": "ok", "batch_invariant": False}


def test_engine_value_error_is_400_even_when_streaming(h):
    h.engine.fail = ValueError("request needs 99 KV blocks but the cache has only 8")
    for stream in (False, True):
        err = assert_error(h.client.post("/v1/completions", json={"prompt": "x", "stream": stream}), 400)
        assert "KV blocks" in err["message"]


def test_internal_error_is_500_in_openai_shape_and_serving_continues(h):
    h.engine.fail = RuntimeError("boom")
    err = assert_error(h.client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert err["type"] == "internal_server_error"
    h.engine.fail = None
    assert h.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    # an error after streaming began is reported in-band, then [DONE]
    h.engine.fail_after = (2, RuntimeError("mid-stream failure"))
    with h.client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["type"] == "internal_server_error"
    assert h.client.get("/health").status_code == 200


def test_metrics_failures_never_break_serving(h):
    m = h.app.state.metrics
    orig = m.ttft.observe
    m.ttft.observe = lambda *a: (_ for _ in ()).throw(RuntimeError("metrics broke"))
    try:
        assert h.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    finally:
        m.ttft.observe = orig
    h.engine.stats_error = True
    r = h.client.get("/metrics")
    assert r.status_code == 200 and "llmserve:generation_tokens_total" in r.text


# ---- disconnects and shutdown ----------------------------------------------------------------
def test_non_streaming_disconnect_aborts(h):
    h.engine.delay = 0.05
    h.say("word " * 200)
    before = len(h.engine.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(h.server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200}, timeout=0.5)
    assert h.settle(3.0), "the engine request kept running after the client left"
    assert len(h.engine.aborted) > before


def test_streaming_disconnect_aborts(h):
    h.engine.delay = 0.05
    h.say("word " * 200)
    before = len(h.engine.aborted)
    with httpx.stream("POST", h.server.url + "/v1/completions",
                      json={"prompt": "x", "max_tokens": 200, "stream": True}, timeout=10) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(3)]
        assert got[0].startswith("data: ")
    assert h.settle(3.0)
    assert len(h.engine.aborted) > before


def test_shutdown_drains_short_requests_and_aborts_long_ones(tok):
    engine = FakeAsyncEngine(tok, lambda p, sp: tok.encode("word " * 300, add_special_tokens=False), delay=0.02,
                             max_model_len=1024)
    app = create_app(engine, served_model_name="fake", shutdown_timeout=0.5)
    server = BackgroundServer(app, shutdown_timeout=0.5).start()
    results: dict[str, object] = {}

    def client(name, max_tokens):
        lines = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": max_tokens, "stream": True}, timeout=30) as r:
                for line in r.iter_lines():
                    lines.append(line)
        except httpx.HTTPError as e:
            lines.append(f"error: {type(e).__name__}")
        results[name] = lines

    threads = [threading.Thread(target=client, args=("short", 10)),
               threading.Thread(target=client, args=("long", 300))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(engine.active) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.active) == 2
    t0 = time.monotonic()
    assert server.stop(timeout=15), "server did not stop"
    elapsed = time.monotonic() - t0
    for t in threads:
        t.join(10)
    assert elapsed < 5.0, f"shutdown took {elapsed:.1f}s with a 0.5 s timeout"
    assert "data: [DONE]" in results["short"]            # drained: finished normally
    assert "data: [DONE]" not in results["long"]         # cut off at the timeout
    assert not engine.active and any(rid.startswith("cmpl") for rid in engine.aborted), (engine.aborted, results["long"][-3:])
