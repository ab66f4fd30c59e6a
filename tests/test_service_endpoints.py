"""vLLM/OpenAI endpoints and request checking through a real uvicorn (tiny model, CPU):
echoed prompt logprobs, ``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``,
``stream_options.continuous_usage_stats``, refused content parts and unknown fields."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.serve.app import create_app
from llmserve.serve.server import BackgroundServer


@pytest.fixture(scope="module")
def server():
    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32", cache=CacheConfig(block_size=16, num_blocks=128),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, prefill_chunk_size=8,
                                                 max_num_batched_tokens=64))
    eng = AsyncLLMEngine(LLMEngine(cfg))
    srv = BackgroundServer(create_app(eng, served_model_name="tiny", shutdown_timeout=2.0), shutdown_timeout=2.0).start()
    srv.engine = eng
    yield srv
    srv.stop()
    eng.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_echo_logprobs_legacy_shape(server, client):
    ids = [9707, 1879, 11, 419, 374, 264]
    r = client.post("/v1/completions", json={"prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                                             "seed": 1234, "echo": True, "model": "tiny"})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 == len(lp["top_logprobs"]) == len(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    model = server.engine.engine.model
    with torch.inference_mode():
        ref = torch.log_softmax(model.forward_reference(torch.tensor([ids]))[0].float(), -1)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[i - 1, ids[i]]), rel=1e-5, abs=1e-5)
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(float(ref[i - 1].max()), rel=1e-5, abs=1e-5)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # max_tokens 0 with echo scores the prompt only
    r0 = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True})
    assert r0.status_code == 200, r0.text
    c0 = r0.json()["choices"][0]
    assert len(c0["logprobs"]["token_logprobs"]) == len(ids) and c0["finish_reason"] == "length"
    assert r0.json()["usage"]["completion_tokens"] == 0
    assert c0["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:len(ids)], abs=1e-6)
    bad = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_logprobs(client):
    body = {"prompt": "Hello world, how are", "max_tokens": 2, "logprobs": 1, "echo": True, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == "Hello world, how are" and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["token_logprobs"]) == 5


def test_model_card_tokenize_detokenize_tokenizer_info(client):
    card = client.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json()["id"] == "tiny" and card.json()["object"] == "model"
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    t = client.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
    assert t["tokens"] == [9707, 1879] and t["count"] == 2 and t["max_model_len"] == 256
    ts = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert ts["token_strs"] == ["Hello", "Ġworld"]
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3
    assert client.post("/detokenize", json={"tokens": [9707, 1879]}).json() == {"prompt": "Hello world"}
    assert client.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] and "im_start" in info["chat_template"] and info["tokenizer_class"]


def test_continuous_usage_stats(client):
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_choice = [c for c in chunks if c["choices"]]
    assert with_choice and all(c["usage"] is not None for c in with_choice)
    counts = [c["usage"]["completion_tokens"] for c in with_choice]
    assert counts == sorted(counts) and chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hi", "best_off": 2}, "best_off"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "tools": [{"type": "function", "function": {"name": "f", "args": {}}}],
                              "tool_choice": "required"}, "tools[0].function.args"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "functions": [{"name": "f"}], "function_call": {"name": "f", "x": 1}},
     "function_call.x"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
])
def test_unknown_fields_are_refused_by_name(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_parameter" and err["param"] == param and param in err["message"]


def test_image_content_part_is_refused_with_its_cause(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert r.status_code == 400
    assert "image_url" in r.json()["error"]["message"] and "text only" in r.json()["error"]["message"]


def test_client_fields_still_accepted(server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                    n=1, seed=1, user="u", temperature=0, stream=False)
    assert out.choices[0].finish_reason in ("stop", "length")
    s = c.completions.create(model="tiny", prompt="Hi", max_tokens=2, stream=True,
                             stream_options={"include_usage": True})
    assert [ch for ch in s][-1].usage.completion_tokens >= 1


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_stream_options_without_stream_is_refused(client, path, body):
    for extra in ({}, {"stream": False}):
        r = client.post(path, json={**body, **extra, "stream_options": {"include_usage": True}})
        assert r.status_code == 400, r.text
        assert "stream_options" in r.json()["error"]["message"]
    assert client.post(path, json=body).status_code == 200   # the server keeps serving
