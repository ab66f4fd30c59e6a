"""``tool_choice: "auto"`` (the default with tools) end to end: the openai SDK, litellm and
langchain's ``bind_tools()`` complete a tool round trip against the served app (a real uvicorn on
127.0.0.1). The engine is a scripted fake (the random tiny model does not call tools by itself):
its first answer is a Qwen2.5-style Hermes ``<tool_call>`` block after some text, its answer to a
prompt holding the tool's result is plain text. Also: what the model is shown (the Hermes tool
section, earlier calls and tool results), the template path of a tokenizer that renders tools,
several calls in one turn, malformed calls as text, ``none`` / ``required`` / named choices."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pytest

from llmserve.serve.app import create_app
from llmserve.serve.server import BackgroundServer

from test_service_fake import FakeAsyncEngine

IM_END = 151645
KEY = "sk-tools-77aa"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 21 degrees and sunny in Paris."
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Script:
    """What the fake model answers: ``first`` to a new question, ``ANSWER`` once a tool result is
    in the prompt."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.first = "Let me check.\n" + CALL

    def __call__(self, prompt_ids, sp):
        prompt = self.tok.decode(prompt_ids)
        text = ANSWER if "<tool_response>" in prompt else self.first
        return self.tok.encode(text, add_special_tokens=False) + [IM_END]


@pytest.fixture(scope="module")
def tok():
    from llmserve.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def script(tok):
    return Script(tok)


@pytest.fixture(scope="module")
def engine(tok, script):
    return FakeAsyncEngine(tok, script, delay=0.0, max_model_len=4096, eos=IM_END)


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, served_model_name="qwen", api_key=KEY)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _reset(script):
    script.first = "Let me check.\n" + CALL
    yield


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _stream(http, body) -> list[dict]:
    chunks = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# ---- the three clients ------------------------------------------------------------------------
def test_openai_round_trip_default_tool_choice(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME])
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    history = ASK + [ch.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "sunny"}'}]
    r2 = client.chat.completions.create(model="qwen", messages=history, tools=[WEATHER, TIME])
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == ANSWER
    assert not r2.choices[0].message.tool_calls
    # streamed, through the SDK's own accumulation
    with client.chat.completions.stream(model="qwen", messages=ASK, tools=[WEATHER, TIME]) as s:
        final = s.get_final_completion()
    fch = final.choices[0]
    assert fch.finish_reason == "tool_calls" and fch.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in fch.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]


def test_async_openai_round_trip(server):
    openai = pytest.importorskip("openai")

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        r = await client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="auto")
        return r.choices[0]

    ch = asyncio.run(run())
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "get_weather"


def test_litellm_round_trip(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # no download at import
    litellm = pytest.importorskip("litellm")
    for prefix in ("openai/", "hosted_vllm/"):
        kw = dict(model=prefix + "qwen", api_base=server.url + "/v1", api_key=KEY, tools=[WEATHER, TIME])
        r = litellm.completion(messages=ASK, **kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", r
        (call,) = msg.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        history = ASK + [{"role": "assistant", "content": msg.content,
                          "tool_calls": [{"id": call.id, "type": "function",
                                          "function": {"name": call.function.name,
                                                       "arguments": call.function.arguments}}]},
                         {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
        r2 = litellm.completion(messages=history, **kw)
        assert r2.choices[0].message.content == ANSWER, (prefix, r2)
        # streamed
        chunks = list(litellm.completion(messages=ASK, stream=True, **kw))
        built = litellm.stream_chunk_builder(chunks, messages=ASK)
        calls = built.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", (prefix, built)
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_langchain_bind_tools_round_trip(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"21 C and sunny in {city}"

    llm = ChatOpenAI(model="qwen", base_url=server.url + "/v1", api_key=KEY, max_retries=0, temperature=0)
    bound = llm.bind_tools([get_weather])
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = bound.invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert ai.tool_calls[0]["args"] == {"city": "Paris"}
    messages += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]),
                                 tool_call_id=ai.tool_calls[0]["id"])]
    final = bound.invoke(messages)
    assert final.content == ANSWER and not final.tool_calls
    # streamed: the chunks add up to the same call
    acc = None
    for chunk in bound.stream([HumanMessage("What is the weather in Paris?")]):
        acc = chunk if acc is None else acc + chunk
    assert acc.tool_calls and acc.tool_calls[0]["name"] == "get_weather"
    assert acc.tool_calls[0]["args"] == {"city": "Paris"}


# ---- what the model sees ----------------------------------------------------------------------
def test_the_prompt_shows_tools_calls_and_results_in_the_hermes_layout(http, engine, tok):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    r = http.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER, TIME]})
    assert r.status_code == 200, r.text
    prompt = tok.decode(engine.requests[-1][0])
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>') in prompt
    assert ("<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\nnoon\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt


def test_a_tokenizer_whose_template_renders_tools_is_used(tok):
    """A checkpoint's own template (Qwen2.5's takes ``tools``) renders the prompt itself."""
    t = copy.copy(tok)
    t.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}[{{ m.role }}]"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
        "{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}[assistant]")
    seen = []
    eng = FakeAsyncEngine(t, lambda p, sp: seen.append(t.decode(p)) or t.encode(CALL, add_special_tokens=False),
                          delay=0.0, max_model_len=4096, eos=IM_END)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    with BackgroundServer(create_app(eng, served_model_name="qwen")) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    # (transformers renders with trim_blocks: the newline after a block tag goes)
    assert seen[-1] == ("TOOLS:get_weather;[user]What is the weather in Paris?[assistant]<tool_call>"
                        '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>[tool]cold[assistant]')


# ---- answers ----------------------------------------------------------------------------------
def test_several_calls_streamed_and_whole_agree(http, script):
    script.first = ("I will look up both.\n" + CALL + "\n"
                    + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    body = {"messages": ASK, "tools": [WEATHER, TIME]}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "I will look up both."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    chunks = _stream(http, body)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == "I will look up both."
    streamed = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [tc["index"] for tc in streamed] == [0, 1]
    assert all(tc["id"].startswith("call_") and tc["type"] == "function" for tc in streamed)
    assert [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in streamed] == calls
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the text before the call is sent before the call's block is complete
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert any(d.get("content") for d in deltas[:first_call])


@pytest.mark.parametrize("output", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',     # cut JSON
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',        # unknown tool
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",                          # not JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',                # cut by max_tokens
])
def test_malformed_calls_are_text_never_an_error(http, script, output):
    script.first = output
    body = {"messages": ASK, "tools": [WEATHER, TIME]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["message"]["content"] == output and "tool_calls" not in ch["message"]
    assert ch["finish_reason"] == "stop"
    deltas = [c["choices"][0]["delta"] for c in _stream(http, body)]
    assert "".join(d.get("content") or "" for d in deltas) == output
    assert not any(d.get("tool_calls") for d in deltas)


def test_plain_text_with_tools_is_content(http, script):
    script.first = "Paris is lovely; no tool needed."
    ch = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]}).json()["choices"][0]
    assert ch["message"] == {"role": "assistant", "content": "Paris is lovely; no tool needed."}
    assert ch["finish_reason"] == "stop"


def test_tool_choice_none_answers_text_even_if_the_model_writes_a_call(http):
    ch = http.post("/v1/chat/completions",
                   json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}).json()["choices"][0]
    assert ch["message"]["content"] == "Let me check.\n" + CALL and ch["finish_reason"] == "stop"


def test_legacy_functions_without_a_choice_say_what_to_send(http):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "functions": [WEATHER["function"]]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "function_call" and "send the functions as tools" in err["message"]
