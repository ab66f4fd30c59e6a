"""Request fields -> SamplingParams (``serve/generation.py``): every SamplingParams field is
either the request field of the same name or listed in ``TRANSLATED_SAMPLING_FIELDS``, and the
service passes each one to the engine, so the mapping cannot drop a field silently."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from llmserve.core.sampling_params import SamplingParams  # noqa: E402
from llmserve.serve import generation  # noqa: E402
from llmserve.serve.generation import (TRANSLATED_SAMPLING_FIELDS, Service,  # noqa: E402
                                       request_sampling_fields)
from llmserve.serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]
REQUESTS = [CompletionRequest, ChatCompletionRequest]


def by_name(model) -> list[str]:
    return [f for f in SAMPLING_FIELDS if f in model.model_fields and f not in TRANSLATED_SAMPLING_FIELDS]


@pytest.mark.parametrize("model", REQUESTS, ids=lambda m: m.__name__)
def test_every_sampling_field_is_a_request_field_or_translated(model):
    missing = [f for f in SAMPLING_FIELDS if f not in model.model_fields and f not in TRANSLATED_SAMPLING_FIELDS]
    assert not missing, (f"SamplingParams fields that {model.__name__} does not declare and "
                         f"TRANSLATED_SAMPLING_FIELDS does not list: {missing}")


def test_the_translation_table_names_only_sampling_fields():
    assert set(TRANSLATED_SAMPLING_FIELDS) <= set(SAMPLING_FIELDS)
    assert all(isinstance(why, str) and why for why in TRANSLATED_SAMPLING_FIELDS.values())


@pytest.mark.parametrize("model", REQUESTS, ids=lambda m: m.__name__)
def test_request_fields_are_copied_by_name(model):
    names = by_name(model)
    assert {"top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "ignore_eos"} <= set(names)
    marks = {name: object() for name in names}
    req = model.model_construct(**marks)
    assert request_sampling_fields(req) == marks
    omitted = model.model_construct(**{name: None for name in names})
    assert request_sampling_fields(omitted) == {}   # omitted: SamplingParams' defaults


def _service(vocab_size: int = 1000) -> Service:
    tokenizer = SimpleNamespace(convert_tokens_to_ids=lambda t: None, unk_token_id=None)
    view = SimpleNamespace(tokenizer=tokenizer, max_model_len=256, vocab_size=vocab_size)
    return Service(view, "tiny", (), metrics=None, max_waiting=None)


@pytest.mark.parametrize("model", REQUESTS, ids=lambda m: m.__name__)
def test_the_service_passes_every_field(model, monkeypatch):
    """Service.sampling_params names every SamplingParams field: the copied ones carry the
    request's values unchanged."""
    names = by_name(model)
    marks = {name: object() for name in names}
    req = model.model_construct(**marks)
    seen = {}
    monkeypatch.setattr(generation, "SamplingParams", lambda **kw: seen.update(kw))
    service = _service()
    try:
        service.sampling_params(req, 5, None, 0, [])
    finally:
        service.close()
    assert sorted(seen) == sorted(SAMPLING_FIELDS)
    assert {name: seen[name] for name in names} == marks


def test_values_reach_sampling_params():
    service = _service()
    try:
        req = CompletionRequest(prompt="x", temperature=0.5, top_p=0.9, top_k=7, seed=3, ignore_eos=True,
                                presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                                logit_bias={"5": -100.0}, stop=["\n"])
        sp = service.sampling_params(req, 9, 2, 1, [11], prompt_logprobs=1)
        assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (9, 0.5, 0.9, 7, 4)
        assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
        assert sp.ignore_eos and sp.stop == [] and sp.stop_token_ids == [11]
        assert (sp.logprobs, sp.prompt_logprobs, sp.logit_bias) == (2, 1, {5: -100.0})
        assert sp.num_speculative_tokens is None and sp.structured_output is None
        default = service.sampling_params(CompletionRequest(prompt="x"), 16, None, 0, [])
        assert default == SamplingParams(max_tokens=16, temperature=1.0)   # OpenAI's temperature
    finally:
        service.close()
