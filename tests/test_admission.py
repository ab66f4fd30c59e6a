"""One admission rule for every entry point (:mod:`llmserve.core.admission`): the scheduler,
``LLMEngine.check_request`` / ``add_request``, ``NaiveEngine`` and the asynchronous engine all
reject a request that can never be served at once, with the same message."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.core.admission import RequestLimits, RequestRejectedError, request_rejection, validate_request
from llmserve.core.sampling_params import SamplingParams


def test_rules_and_codes():
    lim = RequestLimits(max_model_len=64, block_size=4, num_total_blocks=8, max_num_batched_tokens=16,
                        chunked_prefill=False)
    assert request_rejection(10, 5, lim) is None
    assert request_rejection(16, 16, lim) is None                        # exactly 8 blocks, 16-token prompt
    e = request_rejection(60, 5, lim, "r")
    assert e.code == "context_length_exceeded" and "= 65 tokens exceeds max_model_len=64" in str(e)
    assert str(e).startswith("request 'r': ") and "context" in str(e)
    e = request_rejection(20, 13, lim)
    assert e.code == "kv_cache_capacity_exceeded" and "needs 9 KV blocks of 4 tokens" in str(e)
    e = request_rejection(17, 1, lim)
    assert e.code == "prompt_exceeds_step_budget" and "prefill_chunk_size" in str(e)
    assert request_rejection(17, 1, RequestLimits(64, 4, 8, 16, chunked_prefill=True)) is None
    assert request_rejection(10, 54, RequestLimits(64)) is None          # no KV cache to check
    with pytest.raises(RequestRejectedError) as ei:
        validate_request(64, 1, RequestLimits(64))
    assert isinstance(ei.value, ValueError)
    with pytest.raises(ValueError, match="block_size and num_total_blocks"):
        RequestLimits(64, block_size=4)
    with pytest.raises(ValueError, match="max_model_len"):
        RequestLimits(0)


@pytest.fixture(scope="module")
def engine():
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                  cache=CacheConfig(block_size=16, num_blocks=8),
                                  scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                            max_model_len=512)))


def test_engine_check_request_is_the_schedulers_rule(engine):
    """A prompt above the step budget without chunked prefill is rejected by ``check_request``
    (the asynchronous engine's only check before queueing), not later inside the step loop."""
    with pytest.raises(RequestRejectedError, match="max_num_batched_tokens=32") as ei:
        engine.check_request([5] * 40, SamplingParams(max_tokens=1))
    assert ei.value.code == "prompt_exceeds_step_budget"
    with pytest.raises(RequestRejectedError, match="needs 9 KV blocks of 16 tokens but the cache has only 8"):
        engine.check_request([5] * 10, SamplingParams(max_tokens=130))
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len=512"):
        engine.add_request([5] * 10, SamplingParams(max_tokens=600), request_id="x")
    assert engine.check_request([5] * 20, SamplingParams(max_tokens=4)) == [5] * 20
    assert not engine.has_unfinished_requests()


def test_async_engine_rejects_at_once(engine):
    from llmserve.engine.async_engine import AsyncLLMEngine

    async def go():
        a = AsyncLLMEngine(engine)
        try:
            with pytest.raises(RequestRejectedError, match="max_num_batched_tokens"):
                async for _ in a.generate([5] * 40, SamplingParams(max_tokens=1)):
                    pass
        finally:
            a.shutdown()

    asyncio.run(go())


def test_naive_engine_checks_the_context_only():
    from llmserve.config import EngineConfig, SchedulerConfig
    from llmserve.engine.naive import NaiveEngine

    eng = NaiveEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                   scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=8)))
    assert eng.check_request([5] * 40, SamplingParams(max_tokens=4)) == [5] * 40
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len=64"):
        eng.add_request([5] * 40, SamplingParams(max_tokens=40))
    eng.reset_stats()
    assert eng.stats()["num_steps"] == 0
