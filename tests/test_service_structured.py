"""Structured output and forced tool calls through the real server: uvicorn on 127.0.0.1 (a free
port) in a background thread over the tiny model (CPU), driven by the official ``openai``
client and httpx. Every constrained answer must parse and validate against its schema; the
tiny model's weights are random, so the schemas are bounded (enums, booleans, small objects,
no extra properties) and the grammar's compact whitespace keeps outputs short.
"""

from __future__ import annotations

import json

import httpx
import pytest

from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.serve.app import create_app
from llmserve.serve.server import BackgroundServer

from test_structured_output import validate

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "size": {"enum": ["S", "M", "L"]}},
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
LIGHT = {"type": "object",
         "properties": {"on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall", "attic"]}},
         "required": ["on", "room"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_light", "description": "switch a light",
                                           "parameters": LIGHT}},
         {"type": "function", "function": {"name": "get_time", "description": "the time now"}}]
NO_ARGS = {"type": "object", "properties": {}}
MSG = [{"role": "user", "content": "Switch the kitchen light on."}]


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32",
                       cache=CacheConfig(block_size=16, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024))
    eng = AsyncLLMEngine(LLMEngine(cfg))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = BackgroundServer(create_app(engine, served_model_name="tiny", shutdown_timeout=2.0),
                           shutdown_timeout=2.0).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_json_schema_response_format(client, engine):
    r = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=64, temperature=0.8, seed=4, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA, "strict": True}})
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.finish_reason == "stop" and ch.message.tool_calls is None
        validate(json.loads(ch.message.content), SCHEMA)
    st = engine.engine.stats()["structured_output"]
    assert st["active"] == 0 and st["rejected_tokens"] == 0


def test_json_schema_streamed(client):
    s = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=64, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA}})
    chunks = list(s)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_forced_named_tool_call(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=64, temperature=0.7, seed=2,
                                       tools=TOOLS, tool_choice={"type": "function",
                                                                 "function": {"name": "set_light"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "set_light" and call.id.startswith("call_")
    validate(json.loads(call.function.arguments), LIGHT)


def test_required_tool_call_single_and_parallel(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=80, temperature=0.9, seed=5, n=2,
                                       tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        assert call.function.name in ("set_light", "get_time")
        validate(json.loads(call.function.arguments), LIGHT if call.function.name == "set_light" else NO_ARGS)
    # parallel calls (the default): an array of calls, or the raw text when max_tokens cut it
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=120, temperature=0, tools=TOOLS,
                                       tool_choice="required")
    ch = r.choices[0]
    if ch.finish_reason == "tool_calls":
        assert ch.message.tool_calls and all(c.function.name in ("set_light", "get_time")
                                             for c in ch.message.tool_calls)
    else:
        assert ch.finish_reason == "length" and ch.message.content.startswith('[{"name": "')


def test_streamed_tool_calls(client):
    s = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=64, temperature=0, stream=True,
                                       tools=TOOLS, tool_choice={"type": "function",
                                                                 "function": {"name": "set_light"}})
    chunks = [c for c in s if c.choices]
    first = chunks[0].choices[0].delta.tool_calls[0]
    assert first.id.startswith("call_") and first.function.name == "set_light"
    args = "".join(tc.function.arguments or "" for c in chunks for tc in (c.choices[0].delta.tool_calls or []))
    validate(json.loads(args), LIGHT)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # "required": the call is sent whole in the last chunk
    s = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=80, temperature=0, stream=True,
                                       tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    chunks = [c for c in s if c.choices]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls" and len(last.delta.tool_calls) == 1
    assert last.delta.tool_calls[0].function.name in ("set_light", "get_time")
    assert not any(c.choices[0].delta.content for c in chunks)


def test_legacy_functions(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=64, temperature=0,
                                       functions=[TOOLS[0]["function"]], function_call={"name": "set_light"})
    ch = r.choices[0]
    assert ch.finish_reason == "function_call" and ch.message.function_call.name == "set_light"
    validate(json.loads(ch.message.function_call.arguments), LIGHT)


def test_tool_round_trip_and_tool_choice_none(client):
    """The call goes back into the history (assistant tool_calls + a tool message); tool_choice
    'none' answers free text."""
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=64, temperature=0, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "set_light"}})
    call = r.choices[0].message.tool_calls[0]
    history = MSG + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"done": true}'}]
    r2 = client.chat.completions.create(model="tiny", messages=history, max_tokens=5, temperature=0, tools=TOOLS,
                                        tool_choice="none")
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].finish_reason in ("stop", "length")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


@pytest.mark.parametrize("extra,param,code", [
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", None),
    ({"functions": [TOOLS[0]["function"]]}, "function_call", "unsupported_parameter"),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", None),
    ({"tools": TOOLS, "functions": [TOOLS[0]["function"]], "tool_choice": "required"}, "functions", None),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools[1].function.name", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "invalid_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", None),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
     "response_format", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "invalid_schema"),
])
def test_invalid_requests_answer_400_naming_the_field(http, extra, param, code):
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_text_format_and_json_object(http):
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3, "temperature": 0,
                                                "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 40, "temperature": 0,
                                                "response_format": {"type": "json_object"}})
    ch = r.json()["choices"][0]
    assert r.status_code == 200 and ch["message"]["content"].startswith("{")
    if ch["finish_reason"] == "stop":
        assert isinstance(json.loads(ch["message"]["content"]), dict)


def test_forced_call_cut_by_max_tokens_is_the_same_streamed_or_not(client):
    """A named call cut short keeps its partial arguments in tool_calls either way; a
    'required' one is its text as content either way; finish_reason 'length' in all four."""
    kw = dict(model="tiny", messages=MSG, max_tokens=3, temperature=0, tools=TOOLS)
    named = {"type": "function", "function": {"name": "set_light"}}
    r = client.chat.completions.create(tool_choice=named, **kw).choices[0]
    assert r.finish_reason == "length" and r.message.content is None
    (call,) = r.message.tool_calls
    assert call.function.name == "set_light" and call.function.arguments.startswith("{")
    chunks = [c for c in client.chat.completions.create(tool_choice=named, stream=True, **kw) if c.choices]
    args = "".join(tc.function.arguments or "" for c in chunks for tc in (c.choices[0].delta.tool_calls or []))
    assert args == call.function.arguments and chunks[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].delta.content for c in chunks)
    r = client.chat.completions.create(tool_choice="required", **kw).choices[0]
    assert r.finish_reason == "length" and r.message.tool_calls is None and r.message.content
    chunks = [c for c in client.chat.completions.create(tool_choice="required", stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
