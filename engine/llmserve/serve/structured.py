"""Chat requests' ``response_format``, ``tools`` / ``tool_choice`` (and the legacy ``functions`` /
``function_call``) as grammar constraints, and the tool calls read back from constrained outputs.

What each request asks for (:func:`plan_chat`):

- ``response_format`` ``text``: free text; ``json_object``: any JSON object; ``json_schema``: a
  JSON value valid under the given schema (always enforced, as OpenAI's ``strict: true``).
- ``tool_choice`` ``"required"``: a JSON tool call ``{"name": <one of the tools>, "arguments":
  {...}}`` whose arguments follow that tool's ``parameters``; with ``parallel_tool_calls`` (the
  default) a JSON array of one or more such calls. ``{"type": "function", "function": {"name":
  f}}``: the output is ``f``'s arguments object. ``"none"``: plain text (the tools are still
  shown to the model). ``"auto"``, and tools without ``tool_choice`` (OpenAI's default is
  ``auto``), are refused: deciding whether free text is a call needs a model-specific tool-call
  parser, which this server does not have (as vLLM without ``--tool-call-parser``).
- legacy ``functions`` with ``function_call`` ``{"name": f}`` (or ``"none"``): as a named tool,
  answered in the legacy shape (``message.function_call``, ``finish_reason: "function_call"``).

Tools are shown to the model in a system-prompt section listing their JSON definitions and the
call format. Outputs are one-line JSON (the grammar's compact whitespace), so a weak model
cannot pad them without end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..core.sampling_params import StructuredOutput
from .protocol import APIError, ChatCompletionRequest

TOOL_SECTION_HEADER = "# Tools"


@dataclass
class ChatPlan:
    """How a chat request is constrained and answered.

    Attributes:
        spec: the grammar of every choice (``None``: free text).
        mode: ``text`` | ``json`` | ``tool`` (named tool) | ``tools`` (``required``) |
            ``function`` (legacy named function).
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
    def calls_tools(self) -> bool:
        """Whether the answer is a tool or function call (a named tool, ``"required"``, or a
        legacy ``function_call``) rather than text."""
        return self.mode in ("tool", "tools", "function")


def _auto_refusal(param: str, legacy: bool) -> APIError:
    named = ('{"name": "<function>"}' if legacy
             else '{"type": "function", "function": {"name": "<function>"}}')
    required = "" if legacy else '"required" or '
    return APIError(
        f"{param} 'auto' (the default when {'functions' if legacy else 'tools'} are given) is not supported: "
        f"telling a tool call from free text needs a model-specific tool-call parser, which this server does "
        f"not have; send {param} {required}{named} to force a call (grammar-constrained), or 'none'",
        param=param, code="unsupported_parameter")


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
            (``tool_choice`` ``auto``, tools together with functions, a ``tool_choice`` without
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
            raise _auto_refusal(choice_param, legacy)
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
    into their assistant message as the JSON call objects the model is asked to produce."""
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
                except ValueError:
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
    by ``max_tokens`` or a stop string). A named tool's arguments are the output text itself."""
    if plan.mode == "tool":
        try:
            json.loads(text)
        except ValueError:
            return None
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
