"""Chat requests' ``response_format``, ``tools`` / ``tool_choice`` (and the legacy ``functions`` /
``function_call``) as grammar constraints, and the tool calls read back from constrained outputs.

What each request asks for (:func:`plan_chat`):

- ``response_format`` ``text``: free text; ``json_object``: any JSON object; ``json_schema``: a
  JSON value valid under the given schema (always enforced, as OpenAI's ``strict: true``).
- ``tool_choice`` ``"auto"``, also the default when tools are given (as OpenAI's): free text
  in which the model may call tools in its own format, the Hermes ``<tool_call>`` blocks of
  Qwen2/Qwen2.5 (:mod:`llmserve.serve.tool_parser`), read back into ``tool_calls``.
- ``tool_choice`` ``"required"``: a JSON tool call ``{"name": <one of the tools>, "arguments":
  {...}}`` whose arguments follow that tool's ``parameters``; with ``parallel_tool_calls`` (the
  default) a JSON array of one or more such calls. ``{"type": "function", "function": {"name":
  f}}``: the output is ``f``'s arguments object. ``"none"``: plain text (the tools are still
  shown to the model).
- legacy ``functions`` with ``function_call`` ``{"name": f}`` (or ``"none"``): as a named tool,
  answered in the legacy shape (``message.function_call``, ``finish_reason: "function_call"``);
  their ``"auto"`` (the legacy default) is refused: send ``tools``.

Forced calls show the tools to the model in a system-prompt section listing their JSON
definitions and the bare call format; ``"auto"`` shows them in the Hermes layout (the tokenizer's
own template when it renders tools, as a Qwen2.5 checkpoint's does). Outputs are one-line JSON (the grammar's compact whitespace), so a weak model
cannot pad them without end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..core.sampling_params import StructuredOutput
from .protocol import APIError, ChatCompletionRequest
from .tool_parser import render_hermes_messages

TOOL_SECTION_HEADER = "# Tools"


@dataclass
class ChatPlan:
    """How a chat request is constrained and answered.

    Attributes:
        spec: the grammar of every choice (``None``: free text).
        mode: ``text`` | ``json`` | ``tool`` (named tool) | ``tools`` (``required``) |
            ``function`` (legacy named function) | ``auto`` (free text that may hold Hermes
            ``<tool_call>`` blocks).
        function: the forced function's name (``tool`` / ``function`` modes).
        parallel: ``tools`` mode: a JSON array of calls (else a single call object).
        functions: the request's functions (``{"name", "description", "parameters"}``), shown
            to the model.
        checks: ``(param, StructuredOutput)`` compiled one by one first, so a bad schema is
            named by its field.
    """

    spec: StructuredOutput | None = None
    mode: str = "text"
    function: str | None = None
    parallel: bool = False
    functions: list[dict[str, Any]] = field(default_factory=list)
    checks: list[tuple[str, StructuredOutput]] = field(default_factory=list)

    @property
    def tool_names(self) -> list[str]:
        """The names of the functions the request declared."""
        return [f["name"] for f in self.functions]

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is a tool or function call (a named tool, ``"required"``, or a
        legacy ``function_call``) rather than text."""
        return self.mode in ("tool", "tools", "function")


def _legacy_auto_refusal() -> APIError:
    return APIError(
        "function_call 'auto' (the default when the legacy functions are given) is not supported: send the "
        "functions as tools (tool_choice 'auto' is), or function_call {\"name\": \"<function>\"} to force a "
        "call, or 'none'", param="function_call", code="unsupported_parameter")


def _spec(schema: Any, param: str) -> StructuredOutput:
    try:
        return StructuredOutput("json_schema", schema)
    except ValueError as e:
        raise APIError(f"{param}: {e}", param=param, code="invalid_schema") from None


def _params_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema (OpenAI: omitted ``parameters`` = no arguments)."""
    p = fn.get("parameters")
    return {"type": "object", "properties": {}} if p is None else p


def plan_chat(body: ChatCompletionRequest) -> ChatPlan:
    """Validate the structured-output and tool fields of ``body`` and build its :class:`ChatPlan`.

    Raises:
        APIError: 400 naming the field: conflicting or unsupported combinations
            (legacy ``function_call`` ``auto``, tools together with functions, a ``tool_choice`` without
            tools, an unknown function name, duplicate names, a forced call together with a
            JSON ``response_format``).
    """
    plan = ChatPlan()
    rf = body.response_format
    if body.tools is not None and body.functions is not None:
        raise APIError("send tools or the legacy functions, not both", param="functions")
    if body.tools is None and body.tool_choice is not None:
        raise APIError("tool_choice needs tools", param="tool_choice")
    if body.tools is None and body.parallel_tool_calls is not None:
        raise APIError("parallel_tool_calls needs tools", param="parallel_tool_calls")
    if body.functions is None and body.function_call is not None:
        raise APIError("function_call needs functions", param="function_call")
    legacy = body.functions is not None
    if body.tools is not None:
        fns = [t.function for t in body.tools]
        prefix = "tools[{i}].function"
    elif legacy:
        fns = list(body.functions)
        prefix = "functions[{i}]"
    else:
        fns = []
    names: dict[str, int] = {}
    for i, f in enumerate(fns):
        if f.name in names:
            raise APIError(f"function name {f.name!r} is used twice ({prefix.format(i=names[f.name])} and "
                           f"{prefix.format(i=i)}); function names must be unique",
                           param=f"{prefix.format(i=i)}.name")
        names[f.name] = i
        plan.functions.append({"name": f.name, "description": f.description,
                               "parameters": _params_schema({"parameters": f.parameters})})

    if rf is not None and rf.type == "json_object":
        plan.spec, plan.mode = StructuredOutput("json_object"), "json"
    elif rf is not None and rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        plan.spec, plan.mode = _spec(rf.json_schema.schema_, param), "json"
        plan.checks.append((param, plan.spec))

    if fns:
        choice = body.function_call if legacy else body.tool_choice
        choice_param = "function_call" if legacy else "tool_choice"
        if choice is None or choice == "auto":
            if legacy:
                raise _legacy_auto_refusal()
            if plan.mode == "json":
                raise APIError(f"response_format {rf.type!r} cannot be combined with tools the model may call "
                               "(tool_choice 'auto', the default): send tool_choice 'none' to answer JSON",
                               param="response_format")
            plan.mode = "auto"
            return plan
        if choice == "none":
            return plan
        if plan.mode == "json":
            raise APIError(f"response_format {rf.type!r} cannot be combined with a forced tool call "
                           f"({choice_param}): the output is the call", param="response_format")
        for i, f in enumerate(plan.functions):
            plan.checks.append((f"{prefix.format(i=i)}.parameters", _spec(f["parameters"],
                                                                         f"{prefix.format(i=i)}.parameters")))
        if choice == "required":
            calls = [{"type": "object",
                      "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for f in plan.functions]
            one = calls[0] if len(calls) == 1 else {"anyOf": calls}
            plan.parallel = body.parallel_tool_calls is not False
            schema = {"type": "array", "items": one, "minItems": 1} if plan.parallel else one
            plan.spec, plan.mode = _spec(schema, "tools"), "tools"
            return plan
        name = choice.name if legacy else choice.function.name
        if name not in names:
            raise APIError(f"{choice_param} names function {name!r}, which is not among the "
                           f"{'functions' if legacy else 'tools'} ({sorted(names)})",
                           param=f"{choice_param}.name" if legacy else f"{choice_param}.function.name")
        i = names[name]
        plan.spec = _spec(plan.functions[i]["parameters"], f"{prefix.format(i=i)}.parameters")
        plan.mode, plan.function = ("function" if legacy else "tool"), name
    return plan


def tool_section(functions: list[dict[str, Any]]) -> str:
    """The system-prompt text that shows the model its functions and the call format."""
    lines = [TOOL_SECTION_HEADER, "",
             "You can call the functions below. A call is a JSON object "
             '{"name": <function name>, "arguments": <arguments object following its parameters>}.',
             "Functions (one JSON definition per line):"]
    for f in functions:
        d = {"name": f["name"], "parameters": f["parameters"]}
        if f.get("description"):
            d["description"] = f["description"]
        lines.append(json.dumps(d, ensure_ascii=False))
    return "\n".join(lines)


def chat_messages(body: ChatCompletionRequest, plan: ChatPlan) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` text for the chat template: the tool section in
    the (first) system message, and earlier calls (``tool_calls`` / ``function_call``) written
    into their assistant message as the JSON call objects the model is asked to produce
    (``auto``: in the Hermes layout, :func:`~llmserve.serve.tool_parser.render_hermes_messages`)."""
    if plan.mode == "auto":
        return render_hermes_messages(body.messages, plan.functions)
    return render_messages(body.messages, plan.functions)


def render_messages(messages, functions: list[dict[str, Any]] = ()) -> list[dict[str, str]]:
    """:class:`~llmserve.serve.protocol.ChatMessage` s as template text (see :func:`chat_messages`);
    ``functions`` (``{"name", "description", "parameters"}``) go into the system message."""
    out: list[dict[str, str]] = []
    for m in messages:
        text = m.text()
        calls = [(c.function.name, c.function.arguments) for c in (m.tool_calls or [])]
        if m.function_call is not None:
            calls.append((m.function_call.name, m.function_call.arguments))
        if calls:
            parts = [text] if text else []
            for name, args in calls:
                try:
                    args_v = json.loads(args)
                except (ValueError, RecursionError):
                    args_v = args
                parts.append(json.dumps({"name": name, "arguments": args_v}, ensure_ascii=False))
            text = "\n".join(parts)
        out.append({"role": m.role, "content": text})
    if functions:
        section = tool_section(list(functions))
        for m in out:
            if m["role"] in ("system", "developer"):
                m["content"] = f"{m['content']}\n\n{section}" if m["content"] else section
                break
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's shape (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(plan: ChatPlan, text: str) -> list[dict[str, Any]] | None:
    """The tool calls in a constrained output: ``[{"id", "type": "function", "function":
    {"name", "arguments"}}]``; ``None`` when ``text`` is not a complete call (the output was cut
    by ``max_tokens`` or a stop string). A named tool's arguments are the output text itself, whole
    or cut short (as a stream sends them)."""
    if plan.mode == "tool":
        return [{"id": new_call_id(), "type": "function", "function": {"name": plan.function, "arguments": text}}]
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if plan.parallel else [value]
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str) or "arguments" not in it:
            return None
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": it["name"],
                                   "arguments": json.dumps(it["arguments"], ensure_ascii=False)}})
    return calls
