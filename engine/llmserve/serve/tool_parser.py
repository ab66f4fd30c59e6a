"""Tool calls in free text: the Hermes format Qwen2/Qwen2.5 use (``tool_choice: "auto"``).

Format (Qwen2.5's chat template, after the Hermes function-calling format): the system prompt
lists the tools as JSON inside ``<tools></tools>`` and asks for each call as one block::

    <tool_call>
    {"name": "<function name>", "arguments": {<arguments object>}}
    </tool_call>

An answer may hold text before its calls and several blocks in a row. Earlier calls go back
into the history in the same blocks; tool results go into a user turn as
``<tool_response>...</tool_response>`` blocks.

Parsing rules (one state machine for whole answers and streams, so both agree exactly):

* A block whose JSON is an object with a string ``name`` (one of the request's tools, when
  those are known) and an ``arguments`` object (or the JSON text of one; ``parameters`` is
  accepted as its alias; omitted: ``{}``) is a call. Its ``arguments`` are re-serialized as
  JSON text, as OpenAI's ``tool_calls[].function.arguments``.
* Anything else inside the tags (not JSON, an unknown function, a cut-off block that is not a
  complete call) is returned as text, tags included: a malformed call is never an error.
* Text outside blocks is ``content``. Whitespace between the text and a block, between blocks
  and after the last one is dropped (the template's newlines, not the model's answer); with no
  call at all the text is returned as it is.
* Streams: text is emitted as it arrives, except a tail that may still become ``<tool_call>``
  and trailing whitespace; a call is emitted whole once its block closes (so it can still turn
  out malformed and become text, as in the whole-answer parse).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Union

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

#: a block longer than this many characters is not a call (it is returned as text): bounds
#: the work one answer can cause here (a call's JSON is parsed once, when its block closes)
MAX_CALL_CHARS = 1_000_000


@dataclass(frozen=True)
class ParsedCall:
    """One tool call read from model text.

    Attributes:
        name: the function's name.
        arguments: the arguments object as JSON text (OpenAI's ``function.arguments``).
    """

    name: str
    arguments: str


ParsedItem = Union[str, ParsedCall]


def parse_call_json(body: str, tool_names: frozenset[str] | None = None) -> ParsedCall | None:
    """The call in one block's inner text, or ``None`` when it is not a valid call (see the
    module docstring for what is valid). Never raises."""
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name or (tool_names is not None and name not in tool_names):
        return None
    args: Any = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    text = json.dumps(args, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:      # a lone surrogate (\ud800 in the model's JSON): keep it escaped
        text = json.dumps(args)
    return ParsedCall(name, text)


def _reject_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259): such a block is no call."""
    raise ValueError(f"{name} is not valid JSON")


def _tag_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for k in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if text.endswith(OPEN_TAG[:k]):
            return k
    return 0


class HermesToolParser:
    """Incremental parser of Hermes ``<tool_call>`` blocks in a model's output text.

    Feed the text as it is generated (:meth:`feed`, any split, even inside a tag), then call
    :meth:`finish` once; each returns the items completed by then, in order: ``str`` pieces of
    content and :class:`ParsedCall` s. Concatenating every item of a stream gives exactly what
    :func:`parse_tool_calls` returns for the whole text.

    Args:
        tool_names: the functions the request declared; a call naming another one is text
            (``None``: any name).

    Work is linear in the text: each character is scanned a bounded number of times, and a
    block's JSON is parsed once, when it closes (blocks over ``MAX_CALL_CHARS`` are text).
    """

    def __init__(self, tool_names: Iterable[str] | None = None) -> None:
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self.num_calls = 0
        self._in_call = False
        self._buf = ""          # text mode: undecided tail; call mode: the block's inner text
        self._scan_from = 0     # call mode: where to look for the closing tag next
        self._ws = ""           # text mode: whitespace held until non-space text follows
        self._after_block = False   # text mode: right after a block (leading whitespace dropped)
        self._finished = False

    def feed(self, text: str) -> list[ParsedItem]:
        """Add generated text; returns the items it completes (possibly none).

        Raises:
            RuntimeError: called after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("feed() after finish(): make a new parser for each answer")
        out: list[ParsedItem] = []
        self._buf += text
        while self._buf:
            if self._in_call:
                end = self._buf.find(CLOSE_TAG, self._scan_from)
                if end < 0:
                    if len(self._buf) > MAX_CALL_CHARS:      # too long to be a call: text
                        self._in_call = False
                        self._emit_text(out, OPEN_TAG + self._buf)
                        self._buf = ""
                        break
                    self._scan_from = max(0, len(self._buf) - len(CLOSE_TAG) + 1)
                    break
                inner, self._buf = self._buf[:end], self._buf[end + len(CLOSE_TAG):]
                self._in_call = False
                self._close_block(out, inner, closed=True)
                continue
            start = self._buf.find(OPEN_TAG)
            if start >= 0:
                self._emit_text(out, self._buf[:start])
                self._buf = self._buf[start + len(OPEN_TAG):]
                self._in_call, self._scan_from = True, 0
                continue
            keep = _tag_prefix_len(self._buf)
            ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            self._emit_text(out, ready)
            break
        return _merge_text(out)

    def finish(self) -> list[ParsedItem]:
        """End of the answer: flushes held text; an unclosed block is a call if its JSON is a
        complete valid call, else text. Idempotent."""
        if self._finished:
            return []
        self._finished = True
        out: list[ParsedItem] = []
        if self._in_call:
            self._in_call = False
            self._close_block(out, self._buf, closed=False)
        else:
            self._emit_text(out, self._buf)
        self._buf = ""
        if self._ws and self.num_calls == 0:
            out.append(self._ws)
        self._ws = ""
        return _merge_text(out)

    # ---- internals ---------------------------------------------------------------------------
    def _close_block(self, out: list[ParsedItem], inner: str, closed: bool) -> None:
        body = inner
        if not closed:                 # cut off inside the closing tag: the JSON may be whole
            for k in range(min(len(CLOSE_TAG) - 1, len(body)), 0, -1):
                if body.endswith(CLOSE_TAG[:k]):
                    body = body[:-k]
                    break
        call = parse_call_json(body, self.tool_names) if len(body) <= MAX_CALL_CHARS else None
        if call is None:
            self._emit_text(out, OPEN_TAG + inner + (CLOSE_TAG if closed else ""))
            return
        self._ws = ""                  # whitespace before a call is the template's
        self.num_calls += 1
        out.append(call)
        self._after_block = True

    def _emit_text(self, out: list[ParsedItem], text: str) -> None:
        if self._after_block:          # whitespace right after a call is the template's
            text = text.lstrip()
            if not text:
                return
            self._after_block = False
        body = text.rstrip()
        if body:
            out.append(self._ws + body)
            self._ws = ""
        self._ws += text[len(body):]   # held: dropped before a call, kept before more text


def _merge_text(items: list[ParsedItem]) -> list[ParsedItem]:
    merged: list[ParsedItem] = []
    for it in items:
        if isinstance(it, str):
            if not it:
                continue
            if merged and isinstance(merged[-1], str):
                merged[-1] += it
                continue
        merged.append(it)
    return merged


def parse_tool_calls(text: str, tool_names: Iterable[str] | None = None) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer's ``(content, calls)``: ``content`` is the text outside valid call
    blocks (``None`` when empty), ``calls`` the valid calls in order (module docstring for the
    rules; the Hermes format of Qwen2.5's chat template). Never raises."""
    parser = HermesToolParser(tool_names)
    items = parser.feed(text) + parser.finish()
    content = "".join(it for it in items if isinstance(it, str))
    return (content or None), [it for it in items if isinstance(it, ParsedCall)]


# ------------------------------------------------------------------------------------------------
# Rendering: the tools and earlier calls in the same format
# ------------------------------------------------------------------------------------------------
def tool_system_section(functions: list[dict[str, Any]]) -> str:
    """The system-prompt section that offers ``functions`` (``{"name", "description",
    "parameters"}``) in the Hermes format: their definitions inside ``<tools></tools>``, one JSON
    object per line, and the ``<tool_call>`` block to answer with (the layout of Qwen2.5's chat
    template, for tokenizers whose template does not render tools itself)."""
    lines = ["# Tools", "",
             "You may call one or more functions to help with the user's request.", "",
             "The functions are described by the JSON signatures inside <tools></tools>:", "<tools>"]
    for f in functions:
        fn = {"name": f["name"], "parameters": f["parameters"]}
        if f.get("description"):
            fn["description"] = f["description"]
        lines.append(json.dumps({"type": "function", "function": fn}, ensure_ascii=False))
    lines += ["</tools>", "",
              "To call a function, answer with a JSON object holding its name and arguments inside "
              "<tool_call></tool_call> tags, one block per call:",
              OPEN_TAG, '{"name": <function-name>, "arguments": <args-json-object>}', CLOSE_TAG]
    return "\n".join(lines)


def call_block(name: str, arguments: str) -> str:
    """One earlier call as the model writes it: ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``
    (``arguments`` JSON text; kept as a string when it is not JSON)."""
    try:
        args: Any = json.loads(arguments)
    except (ValueError, RecursionError):
        args = arguments
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE_TAG}"


def render_hermes_messages(messages, functions: list[dict[str, Any]]) -> list[dict[str, str]]:
    """:class:`~llmserve.serve.protocol.ChatMessage` s as ``{"role", "content"}`` text for a plain
    ChatML template, in the Hermes layout: the tool section at the end of the (first) system
    message, an assistant's earlier calls as ``<tool_call>`` blocks after its text, and
    consecutive ``tool`` (legacy ``function``) results as ``<tool_response>`` blocks in one user
    turn (as Qwen2.5's chat template renders them)."""
    out: list[dict[str, str]] = []
    prev_tool = False
    for m in messages:
        text = m.text()
        if m.role in ("tool", "function"):
            block = f"<tool_response>\n{text}\n</tool_response>"
            if prev_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            prev_tool = True
            continue
        prev_tool = False
        calls = [(c.function.name, c.function.arguments) for c in (m.tool_calls or [])]
        if m.function_call is not None:
            calls.append((m.function_call.name, m.function_call.arguments))
        if calls:
            text = "\n".join(([text] if text else []) + [call_block(n, a) for n, a in calls])
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": text})
    section = tool_system_section(functions)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
    else:
        out.insert(0, {"role": "system", "content": section})
    return out


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's own chat template takes ``tools`` (a real Qwen2.5 checkpoint's
    does; the built-in ChatML template does not)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and "tool_call" in template


def template_messages(messages) -> list[dict[str, Any]]:
    """:class:`~llmserve.serve.protocol.ChatMessage` s in the OpenAI shape a tool-aware chat
    template reads: assistant ``tool_calls`` with ``arguments`` as objects (the template
    serializes them), ``tool`` messages with their ``content``; ``developer`` is ``system``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        d: dict[str, Any] = {"role": role, "content": m.text()}
        calls = list(m.tool_calls or [])
        pairs = [(c.id, c.function.name, c.function.arguments) for c in calls]
        if m.function_call is not None:
            pairs.append((None, m.function_call.name, m.function_call.arguments))
        if pairs:
            tcs = []
            for cid, name, arguments in pairs:
                try:
                    args: Any = json.loads(arguments)
                except (ValueError, RecursionError):
                    args = arguments
                tc: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
                if cid:
                    tc["id"] = cid
                tcs.append(tc)
            d["tool_calls"] = tcs
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
