"""Request bodies of the OpenAI-compatible API (pydantic v2) and the error shape.

Field names and defaults follow OpenAI's Completions and Chat Completions APIs; ``top_k``,
``priority`` and ``ignore_eos`` are extensions (as in vLLM). Models are *strict*: a string where
a number belongs, a boolean where an integer belongs, or a float for ``n`` is a wrong type and
answers HTTP 400 (OpenAI rejects them too), never a silent coercion. A field the server does not
implement is never dropped silently: unknown fields answer 400 ``unsupported_parameter`` naming
the field (the fields the openai client, litellm, langchain-openai, lm-eval and guidellm send are
all declared here).

Structured output (``response_format``) and forced tool calls (``tools`` with ``tool_choice``
``"required"`` or a named function; the legacy ``functions`` / ``function_call``) are declared
here and enforced by grammar-constrained decoding (:mod:`llmserve.serve.structured`).

Ranges that depend on the served model (context length, vocabulary) are checked by the app.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 4

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
MAX_LOGIT_BIAS = 100.0


def _valid_unicode(s: str) -> str:
    """Reject text that cannot be encoded as UTF-8 (a lone UTF-16 surrogate such as ``\\ud800``,
    which JSON can spell but no tokenizer or stop matcher can handle)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid Unicode: character {e.start} is a lone surrogate "
                         f"(U+{ord(s[e.start]):04X}); send UTF-8 text or a paired surrogate escape") from None
    return s


#: Every text field that reaches the tokenizer, the chat template or the stop matcher.
Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]


class _Strict(BaseModel):
    """Strict request models: no type coercion, unknown fields refused, no NaN or infinity."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the answer's usage (and
    ``"usage": null`` on every other chunk)."""

    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        default=False, description="extension (vLLM): with include_usage, every chunk carries the usage so far")


class _SamplingFields(_Strict):
    """Fields shared by both endpoints.

    A field named like a :class:`~llmserve.core.sampling_params.SamplingParams` field reaches
    the engine under that name (``None``, the default here, leaving the engine's default);
    the few that are converted on the way are listed in
    ``llmserve.serve.generation.TRANSLATED_SAMPLING_FIELDS``.
    """

    model: Optional[Text] = Field(default=None, description="served model name; omitted means the served model")
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = Field(
        default=None, description="0 is greedy; default 1.0")
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=-1, le=2**31 - 1)]] = Field(
        default=None, description="extension; 0 or -1 disables")
    n: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = 1
    stop: Optional[Union[NonEmptyText, Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)]]] = None
    seed: Optional[Annotated[int, Field(ge=0, le=2**63 - 1)]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    priority: Optional[Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]] = Field(
        default=0, description="extension; lower is served first under the priority policy")
    ignore_eos: Optional[bool] = Field(default=False, description="extension; keep generating past EOS")
    user: Optional[Text] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = Field(
        default=None, description="OpenAI: subtracted once from tokens already in the output")
    frequency_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = Field(
        default=None, description="OpenAI: subtracted per occurrence in the output")
    repetition_penalty: Optional[Annotated[float, Field(gt=0.0, allow_inf_nan=False)]] = Field(
        default=None, description="extension (vLLM/HF): > 1 discourages tokens of the prompt and output; 1 disables")
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]] = Field(
        default=None, description="OpenAI: token id (as a string) -> bias in [-100, 100] added to its logit")

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with integer keys (ValueError naming the bad key otherwise)."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            if not (k.isascii() and k.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids written as decimal strings, got {k!r}")
            out[int(k)] = float(v)
        return out

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingFields":
        # as OpenAI and vLLM answer: options of a stream on a request that does not stream
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        """``stop`` as a list of strings (empty when omitted)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of token ids,
    or a list of token-id lists; each prompt yields ``n`` choices. ``max_tokens`` counts
    completion tokens (default 16); ``logprobs`` asks for that many top alternatives per token
    (with ``echo``, for the prompt's tokens too). A non-empty ``suffix`` and a ``best_of`` other than ``n``
    answer 400 ``unsupported_parameter``."""

    prompt: Union[NonEmptyText,
                  Annotated[list[NonEmptyText], Field(min_length=1)],
                  TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = Field(
        default=16, description="0 (with echo) scores the prompt only")
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (one entry per prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # one token-id prompt
        return list(p)


class ChatContentPart(_Strict):
    """A text content part. Other part types (``image_url``, ``input_audio``, ``file``) answer
    400: the served model reads text only."""

    type: str
    text: Optional[Text] = None
    # declared so that the part's type, not an unknown field, is named in the answer
    image_url: Optional[Any] = None
    input_audio: Optional[Any] = None
    file: Optional[Any] = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"content parts of type {v!r} are not supported: the served model reads text "
                             "only; send {\"type\": \"text\", \"text\": ...} parts or a string")
        return v

    @model_validator(mode="after")
    def _has_text(self) -> "ChatContentPart":
        if self.text is None:
            raise ValueError("a text content part needs a text string")
        return self


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
MAX_TOOLS = 128


class ToolCallFunction(_Strict):
    """A function call in an assistant message of the history: name and JSON arguments text."""

    name: Text
    arguments: Text


class MessageToolCall(_Strict):
    """A tool call of an assistant message in the history (OpenAI's ``tool_calls`` item)."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    """One message of a chat request: its role and text (a string or text parts); an assistant
    message may carry the tool or function calls it made, a ``tool`` message the id of the call
    it answers.

    Raises:
        ValueError: (as HTTP 400) tool or function calls on a message that is not the
            assistant's.
    """

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[Text, Annotated[list[ChatContentPart], Field(min_length=1)]]] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[MessageToolCall]] = Field(
        default=None, description="an assistant message's tool calls (the history of a tool-call turn)")
    tool_call_id: Optional[Text] = Field(default=None, description="a tool message: the call it answers")
    function_call: Optional[ToolCallFunction] = Field(
        default=None, description="legacy: an assistant message's function call")

    @model_validator(mode="after")
    def _calls_from_the_assistant(self) -> "ChatMessage":
        if (self.tool_calls or self.function_call) and self.role != "assistant":
            raise ValueError(f"tool_calls and function_call belong to assistant messages, not {self.role!r} ones")
        return self

    def text(self) -> str:
        """The message's text: the string, or its text parts joined ("" when it has none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI's shape): ``name``, ``description``, ``schema``,
    ``strict``. The schema is always enforced (as with ``strict: true``)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)

    name: FunctionName
    description: Optional[Text] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    """``{"type": "text"}`` (free text), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format of type 'json_schema' needs a json_schema object "
                                 "({\"name\": ..., \"schema\": {...}})")
            if self.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema needs a schema (a JSON Schema object)")
        elif self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed with type 'json_schema', not {self.type!r}")
        return self


class FunctionDefinition(_Strict):
    """A function the model may call: ``parameters`` is a JSON Schema object (omitted: no
    parameters, ``{}`` arguments)."""

    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(_Strict):
    """An item of ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    """A function chosen by name (``tool_choice.function``, legacy ``function_call``)."""

    name: FunctionName


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: the answer is a call of it (grammar-constrained)."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; messages are rendered with the ChatML template.

    ``max_completion_tokens`` (or the older ``max_tokens``) counts completion tokens; omitted,
    the answer may fill the rest of the context. ``logprobs`` (a boolean here) with
    ``top_logprobs`` alternatives per token; ``response_format`` and forced tool calls are
    enforced by grammar-constrained decoding (:mod:`llmserve.serve.structured`).

    Raises:
        ValueError: (as HTTP 400) messages without any text.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[Annotated[list[ToolDefinition], Field(min_length=1, max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        default=None, description="'auto' (the default with tools: the model's own tool-call blocks are "
                                  "parsed), 'required' or a named function (forced, grammar-constrained calls), "
                                  "or 'none'")
    parallel_tool_calls: Optional[bool] = Field(
        default=None, description="with tool_choice 'required': allow several calls (default true)")
    functions: Optional[Annotated[list[FunctionDefinition], Field(min_length=1, max_length=MAX_TOOLS)]] = Field(
        default=None, description="legacy form of tools")
    function_call: Optional[Union[Literal["none", "auto"], NamedFunction]] = Field(
        default=None, description="legacy form of tool_choice: a named function or 'none' ('auto': send tools)")

    @field_validator("messages")
    @classmethod
    def _has_content(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.text() for m in v):
            raise ValueError("messages must contain some text")
        return v


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM): ``prompt`` text, or chat ``messages`` rendered by the template."""

    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = True
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM): token ids -> ``{"prompt": text}``."""

    model: Optional[Text] = None
    tokens: list[Annotated[int, Field(ge=0)]]


class ErrorInfo(BaseModel):
    """The ``error`` object: a message, OpenAI's error type, the field at fault and a code."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """The body of every non-2xx answer: ``{"error": {message, type, param, code}}``."""

    error: ErrorInfo


class APIError(Exception):
    """Raised inside handlers; rendered as :class:`ErrorResponse` with ``status_code``.

    Args:
        message: the explanation the client reads.
        status_code: the HTTP status (400 by default; 429 for a full queue, 503 while shutting
            down).
        param: the request field at fault, dotted, if any.
        code: a machine-readable code (``context_length_exceeded``, ``queue_full``, ...).
        type: OpenAI's error type.
    """

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        """The answer's JSON body, ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The body of an error answer, ``{"error": {message, type, param, code}}`` (as
    :class:`ErrorResponse`); also the payload of an in-band error chunk of a stream."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ModelCard(BaseModel):
    """A served model (``GET /v1/models``, ``/v1/models/{id}``): its name, creation time (Unix
    seconds) and context length in tokens."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmserve"
    root: Optional[str] = None
    max_model_len: int
    batch_invariant: bool = Field(default=False, description="extension: outputs are bitwise the "
                                  "same whatever a request is batched with (--batch-invariant)")


class ModelList(BaseModel):
    """``GET /v1/models``: the served model (one card)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    """Token counts of an answer: prompt, completion (every choice's) and their sum."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    """One choice of a completion: its text (the echoed prompt first, with ``echo``), its
    ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and why
    it ended (``stop``, ``length``, ``abort``)."""

    index: int
    text: str
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    """The whole answer of ``POST /v1/completions``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ResponseToolCall(BaseModel):
    """A tool call in an answer: its id and the function's name and arguments (JSON text)."""

    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]   # {"name", "arguments" (JSON text)}


class ChatResponseMessage(BaseModel):
    """The assistant's answer: ``content`` text, or ``tool_calls`` (legacy: ``function_call``)
    with ``content`` null."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ResponseToolCall]] = None
    function_call: Optional[dict[str, str]] = None


class ChatCompletionChoice(BaseModel):
    """One choice of a chat answer: its message, ``logprobs`` (``{"content": [...]}``) and
    finish reason (``stop``, ``length``, ``tool_calls``, ``function_call``, ``abort``)."""

    index: int
    message: ChatResponseMessage
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    """The whole answer of ``POST /v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Optional[Usage] = None
