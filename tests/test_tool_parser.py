"""The Hermes tool-call parser on hand-written model outputs: whole answers, and the same answers
streamed in every split (one and two cut points at every character boundary), which must give
exactly the whole-answer result."""

from __future__ import annotations

import json

import pytest

from llmserve.serve.tool_parser import (CLOSE_TAG, MAX_CALL_CHARS, OPEN_TAG, HermesToolParser, ParsedCall,
                                        call_block, parse_tool_calls, render_hermes_messages,
                                        tool_system_section)

NAMES = ["get_weather", "get_time", "search"]


def block(obj) -> str:
    return f"{OPEN_TAG}\n{json.dumps(obj)}\n{CLOSE_TAG}"


W = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
T = {"name": "get_time", "arguments": {}}

CASES = [
    # (model output, expected content, expected calls as (name, arguments object))
    ("The weather is fine.", "The weather is fine.", []),
    ("", None, []),
    (block(W), None, [("get_weather", W["arguments"])]),
    ("Let me check.\n" + block(W), "Let me check.", [("get_weather", W["arguments"])]),
    (block(W) + "\n" + block(T) + "\n", None, [("get_weather", W["arguments"]), ("get_time", {})]),
    ("Two calls:\n\n" + block(W) + "\n\n" + block(T), "Two calls:",
     [("get_weather", W["arguments"]), ("get_time", {})]),
    # arguments as JSON text, "parameters" as their alias, omitted arguments
    (block({"name": "search", "arguments": json.dumps({"q": "été"})}), None, [("search", {"q": "été"})]),
    (block({"name": "search", "parameters": {"q": "x"}}), None, [("search", {"q": "x"})]),
    (block({"name": "get_time"}), None, [("get_time", {})]),
    # compact, no newlines inside the tags
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, [("get_time", {})]),
    # malformed blocks stay text, tags included; valid ones around them are still calls
    ("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    (block({"name": "rm_rf", "arguments": {}}), block({"name": "rm_rf", "arguments": {}}), []),
    (block({"name": "search", "arguments": [1, 2]}), block({"name": "search", "arguments": [1, 2]}), []),
    (block(["get_time"]), block(["get_time"]), []),
    (block(W) + "\n<tool_call>{oops}</tool_call>", "<tool_call>{oops}</tool_call>",
     [("get_weather", W["arguments"])]),
    # cut off: a complete JSON call without (all of) its closing tag is a call; a cut JSON is text
    (f'{OPEN_TAG}\n{json.dumps(T)}\n</tool', None, [("get_time", {})]),
    (f'{OPEN_TAG}\n{json.dumps(T)}', None, [("get_time", {})]),
    ('Sure <tool_call>\n{"name": "get_weather", "arguments": {"ci',
     'Sure <tool_call>\n{"name": "get_weather", "arguments": {"ci', []),
    # look-alikes of the tag are text
    ("a < b and <tool_calls> or <tool_cal", "a < b and <tool_calls> or <tool_cal", []),
    ("<tool_call", "<tool_call", []),
    # text after a call, and whitespace kept when there is no call
    (block(T) + "\nDone.", "Done.", [("get_time", {})]),
    ("  indented\n\n", "  indented\n\n", []),
    ("multi-byte ☃ 𝄞 text " + block(T), "multi-byte ☃ 𝄞 text", [("get_time", {})]),
]


def _collect(items) -> tuple[str | None, list[tuple[str, dict]]]:
    content = "".join(it for it in items if isinstance(it, str))
    calls = [(it.name, json.loads(it.arguments)) for it in items if isinstance(it, ParsedCall)]
    return content or None, calls


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_answer(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("text,content,calls", CASES)
def test_every_split_of_the_stream_equals_the_whole_answer(text, content, calls):
    n = len(text)
    for i in range(n + 1):
        for j in range(i, n + 1):
            p = HermesToolParser(NAMES)
            items = p.feed(text[:i]) + p.feed(text[i:j]) + p.feed(text[j:]) + p.finish()
            assert _collect(items) == (content, calls), (i, j)
            assert p.num_calls == len(calls)


def test_character_by_character_stream_emits_text_early_and_calls_when_closed():
    text = "Checking now.\n" + block(W) + "\n" + block(T)
    p = HermesToolParser(NAMES)
    seen: list = []
    first_call_at = None
    for k, ch in enumerate(text):
        out = p.feed(ch)
        seen += out
        if any(isinstance(x, ParsedCall) for x in out) and first_call_at is None:
            first_call_at = k
    seen += p.finish()
    # the text is out before the first block starts; the first call exactly when its tag closes
    assert "".join(x for x in seen if isinstance(x, str)) == "Checking now."
    assert first_call_at == len("Checking now.\n" + block(W)) - 1
    assert [x.name for x in seen if isinstance(x, ParsedCall)] == ["get_weather", "get_time"]


def test_unknown_names_are_accepted_without_a_tool_list_and_arguments_are_json_text():
    content, calls = parse_tool_calls(block({"name": "anything", "arguments": {"a": [1, {"b": None}]}}))
    assert content is None and calls == [ParsedCall("anything", '{"a": [1, {"b": null}]}')]


def test_a_block_over_the_bound_is_text_and_the_parser_never_raises():
    huge = OPEN_TAG + "x" * (MAX_CALL_CHARS + 10)
    p = HermesToolParser(NAMES)
    items = p.feed(huge) + p.feed(CLOSE_TAG) + p.finish()
    assert _collect(items) == (huge + CLOSE_TAG, [])
    deep = OPEN_TAG + "[" * 100_000 + "]" * 100_000 + CLOSE_TAG
    assert parse_tool_calls(deep, NAMES) == (deep, [])
    with pytest.raises(RuntimeError, match="finish"):
        p.feed("more")


def test_rendering_round_trips_through_the_parser():
    text = call_block("get_weather", json.dumps(W["arguments"]))
    assert parse_tool_calls(text, NAMES) == (None, [ParsedCall("get_weather", json.dumps(W["arguments"]))])
    section = tool_system_section([{"name": "get_time", "description": "now", "parameters": {"type": "object"}}])
    assert "<tools>" in section and OPEN_TAG in section and '"name": "get_time"' in section


def test_non_json_constants_and_lone_surrogates():
    """NaN/Infinity are not JSON: such a block stays text. A lone surrogate escape in the
    arguments stays escaped, so the answer can be encoded as UTF-8."""
    nan = OPEN_TAG + '\n{"name": "get_weather", "arguments": {"city": NaN}}\n' + CLOSE_TAG
    assert parse_tool_calls(nan, NAMES) == (nan, [])
    lone = OPEN_TAG + '\n{"name": "get_weather", "arguments": {"city": "\\ud800x"}}\n' + CLOSE_TAG
    content, calls = parse_tool_calls(lone, NAMES)
    assert content is None and calls[0].arguments.encode("utf-8")
    assert json.loads(calls[0].arguments) == {"city": "\ud800x"}
    ok = OPEN_TAG + '\n{"name": "get_weather", "arguments": {"city": "Zürich 北京"}}\n' + CLOSE_TAG
    assert parse_tool_calls(ok, NAMES)[1][0].arguments == '{"city": "Zürich 北京"}'
