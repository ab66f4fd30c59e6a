"""Per-request sampling parameters (the fields of an OpenAI completion request that steer decoding)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


GREEDY_EPS = 1e-5

#: The constraint kinds of :class:`StructuredOutput`.
STRUCTURED_KINDS = ("json_object", "json_schema")
#: How a constrained JSON output may use whitespace (:attr:`StructuredOutput.whitespace`).
WHITESPACE_MODES = ("compact", "any")


#: JSON Schema keywords the grammar library (xgrammar) accepts but does not enforce; a schema
#: using one is refused rather than "enforced" with outputs that violate it.
UNENFORCED_SCHEMA_KEYWORDS = ("allOf", "oneOf", "not", "if", "then", "else", "uniqueItems", "contains",
                              "minContains", "maxContains", "dependentRequired", "dependentSchemas",
                              "dependencies", "unevaluatedProperties", "unevaluatedItems")


def unenforced_schema_keyword(schema: Any, path: str = "#") -> str | None:
    """The first part of a JSON schema that constrained decoding would not enforce, as a
    message naming its location, or None: a keyword of :data:`UNENFORCED_SCHEMA_KEYWORDS`, a
    ``$ref`` that does not point inside the schema (``#...``), or an object whose ``required``
    names a property its closed ``properties`` do not have (no output could satisfy it)."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unenforced_schema_keyword(item, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED_SCHEMA_KEYWORDS:
        if key in schema:
            return f"'{key}' at {path} is not enforced by constrained decoding; rewrite the schema without it"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"'$ref' at {path} points outside the schema ({ref!r}); only local references ('#/...') are resolved"
    props, req = schema.get("properties"), schema.get("required")
    if isinstance(req, list) and schema.get("additionalProperties") is False:
        missing = [r for r in req if not isinstance(props, dict) or r not in props]
        if missing:
            return f"'required' at {path} names {missing[:3]}, which 'properties' does not declare, and additional properties are not allowed"
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples", "description", "title"):
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            for name, sub in value.items():       # keys are names here, values schemas
                found = unenforced_schema_keyword(sub, f"{path}/{key}/{name}")
                if found:
                    return found
            continue
        found = unenforced_schema_keyword(value, f"{path}/{key}")
        if found:
            return found
    return None


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow (grammar-constrained decoding).

    Attributes:
        kind: ``json_object`` (any JSON object) or ``json_schema`` (a JSON value valid under
            :attr:`json_schema`).
        json_schema: for ``json_schema``, the schema as JSON text (a ``dict`` or ``bool`` given
            here is serialised, key order kept: objects are generated in the schema's property
            order). ``None`` for ``json_object``.
        whitespace: ``compact`` (one line, ``json.dumps``' default separators ``", "`` and
            ``": "``; bounded output) or ``any`` (any JSON whitespace between tokens, which a
            weak model can fill without end).

    The engine compiles the grammar (once per :attr:`key`) and masks every sampled token to
    the ones the grammar allows; the request finishes (``stop``) when the grammar is complete
    and a stop token is sampled. Properties a schema does not declare are not generated
    (strict), and unsupported schema keywords are those of the grammar library (xgrammar).

    Raises:
        ValueError: on construction, an unknown kind or whitespace mode, a missing schema for
            ``json_schema`` (or one given for ``json_object``), or a schema that is not a JSON
            object or boolean.
    """

    kind: str
    json_schema: str | None = None
    whitespace: str = "compact"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_output.kind must be one of {list(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.whitespace not in WHITESPACE_MODES:
            raise ValueError(f"structured_output.whitespace must be one of {list(WHITESPACE_MODES)}, "
                             f"got {self.whitespace!r}")
        schema: Any = self.json_schema
        if self.kind == "json_object":
            if schema is not None:
                raise ValueError("structured_output.json_schema must be None for kind 'json_object' "
                                 "(use kind 'json_schema' to give a schema)")
            return
        if schema is None:
            raise ValueError("structured_output.json_schema is required for kind 'json_schema'")
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_output.json_schema is not valid JSON: {e}") from None
        else:
            parsed = schema
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"structured_output.json_schema must be a JSON object (or a boolean), "
                             f"got {type(parsed).__name__}")
        problem = unenforced_schema_keyword(parsed)
        if problem:
            raise ValueError(f"structured_output.json_schema: {problem}")
        if not isinstance(schema, str):
            try:
                text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_output.json_schema cannot be written as JSON: {e}") from None
            object.__setattr__(self, "json_schema", text)

    @property
    def key(self) -> tuple[str, str | None, str]:
        """What identifies the compiled grammar (equal keys share one compilation)."""
        return (self.kind, self.json_schema, self.whitespace)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        max_tokens: output tokens to generate at most, >= 1.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. Range [0, 2].
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: per-request seed for a reproducible sampled stream (``None``: engine RNG).
        stop_token_ids: extra token ids that end the request (the stop token is kept in the output).
        stop: stop strings (matched on detokenized text by the service layer; never emitted).
        ignore_eos: keep generating past EOS (benchmarks with fixed output lengths).
        logprobs: return the log-probability of each sampled token and this many top alternatives
            (``None``: none).
        prompt_logprobs: return the log-probability of every prompt token after the first
            (given the tokens before it) and this many top alternatives at each position
            (``None``: none; as vLLM's ``SamplingParams.prompt_logprobs``). Costs the LM head
            over every prompt position of the request.
        num_speculative_tokens: draft tokens proposed per step for this request by a
            :class:`~llmserve.engine.speculative.SpeculativeEngine` (``None``: the engine's default,
            0: no speculation); ignored by the other engines.
        presence_penalty: OpenAI's presence penalty in [-2, 2]: subtracted once from the logit of
            every token that already occurs in the output (0 disables it).
        frequency_penalty: OpenAI's frequency penalty in [-2, 2]: subtracted from a token's logit
            once per occurrence in the output (0 disables it).
        repetition_penalty: the HF/vLLM (CTRL, Keskar et al. 2019) penalty, > 0: the logit of every
            token that occurs in the prompt or the output is divided by it when positive and
            multiplied by it when negative (1 disables it).
        logit_bias: OpenAI's logit bias, ``{token id: bias}`` with bias in [-100, 100], added to
            the logits before any other processing (-100 effectively bans a token). Ids are
            checked against the vocabulary by the engine/service (the model's size is not known here).
        structured_output: a grammar every output token must follow (:class:`StructuredOutput`;
            ``None``: free text). Engines without it refuse such requests.

    Raises:
        ValueError: on construction, for any field outside its range (the message names it).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    num_speculative_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= float(self.temperature) <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20] or None, got {self.prompt_logprobs!r}")
        if self.num_speculative_tokens is not None and (
                isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int)
                or self.num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens must be an integer >= 0 or None, "
                             f"got {self.num_speculative_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= float(v) <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
            setattr(self, name, float(v))
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not (0.0 < float(rp) < float("inf")):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {rp!r}")
        self.repetition_penalty = float(rp)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100.0 <= float(v) <= 100.0:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}")
                bias[k] = float(v)
            self.logit_bias = bias or None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput or None, "
                             f"got {type(self.structured_output).__name__}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are treated as greedy (dividing logits by a vanishing
        temperature overflows to NaN; its limit is the argmax)."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether presence, frequency or repetition penalties change the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_logits_processing(self) -> bool:
        """Whether the sampler must touch this row's logits before choosing (penalties or bias)."""
        return self.has_penalties or bool(self.logit_bias)
