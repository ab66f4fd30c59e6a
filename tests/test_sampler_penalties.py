"""logit_bias and presence / frequency / repetition penalties in the sampler: batched results
equal a straightforward per-request PyTorch reference on random logits, rows without any
processing are untouched, a token still on the device (asynchronous scheduling) counts, and
the engine's outputs stay right across preemption and recompute."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.core.sampling_params import SamplingParams
from llmserve.worker.sampler import Sampler, TokenHistory, apply_logits_processing

V = 64


def reference(logits: torch.Tensor, sp: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, the textbook definitions, token by token (OpenAI for bias/presence/frequency,
    HF's RepetitionPenaltyLogitsProcessor for repetition)."""
    x = logits.clone()
    for tok, b in (sp.logit_bias or {}).items():
        x[tok] += b
    for tok in set(prompt) | set(output):
        if sp.repetition_penalty != 1.0:
            x[tok] = x[tok] / sp.repetition_penalty if x[tok] > 0 else x[tok] * sp.repetition_penalty
    for tok in set(output):
        x[tok] -= sp.frequency_penalty * output.count(tok) + sp.presence_penalty
    return x


def random_case(rng: random.Random, i: int):
    kind = i % 5
    if kind == 0:
        sp = SamplingParams()                       # nothing: must be untouched
    elif kind == 1:
        sp = SamplingParams(logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(3)})
    elif kind == 2:
        sp = SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2))
    elif kind == 3:
        sp = SamplingParams(repetition_penalty=rng.uniform(0.5, 2.0))
    else:
        sp = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.3,
                            logit_bias={1: 5.0, 2: -100})
    prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(V) for _ in range(rng.randrange(0, 12))]
    return sp, prompt, output


@pytest.mark.parametrize("seed", range(5))
def test_batched_processing_equals_per_request_reference(seed):
    rng = random.Random(seed)
    logits = torch.randn(10, V, generator=torch.Generator().manual_seed(seed)) * 3
    cases = [random_case(rng, i) for i in range(10)]
    params = [c[0] for c in cases]
    history = [TokenHistory(p, o) for _, p, o in cases]
    got = apply_logits_processing(logits, params, history)
    for i, (sp, p, o) in enumerate(cases):
        torch.testing.assert_close(got[i], reference(logits[i], sp, p, o), rtol=1e-6, atol=1e-5)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[5], logits[5])


def test_greedy_sampling_uses_processed_logits_and_keeps_given_argmax_buffer():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    top = int(logits[1].argmax())
    params = [SamplingParams(), SamplingParams(logit_bias={top: -100}), SamplingParams(logit_bias={7: 100})]
    given = logits.argmax(-1)
    keep = given.clone()
    res = Sampler("cpu").sample_async(logits, params, ["a", "b", "c"], argmax=given).result()
    assert res.token_ids[0] == int(logits[0].argmax())
    assert res.token_ids[1] != top and res.token_ids[2] == 7
    assert torch.equal(given, keep)


def test_penalised_sampling_matches_reference_distribution_with_a_seed():
    """A seeded sampled row draws the same token as the reference logits through a plain sampler."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    sp = SamplingParams(temperature=0.8, seed=11, frequency_penalty=1.5, presence_penalty=0.5,
                        repetition_penalty=1.2, logit_bias={3: 4.0})
    prompt, output = [1, 2, 3], [3, 3, 9, 10]
    got = Sampler("cpu").sample(logits, [SamplingParams(), sp], ["x", "y"],
                                history=[None, TokenHistory(prompt, output)]).token_ids[1]
    ref_logits = reference(logits[1], sp, prompt, output)[None]
    want = Sampler("cpu").sample(ref_logits, [SamplingParams(temperature=0.8, seed=11)], ["y"]).token_ids[0]
    assert got == want


def test_pending_device_token_is_counted():
    logits = torch.zeros(1, V)
    sp = SamplingParams(frequency_penalty=2.0)
    prev = torch.tensor([5, 9])                     # previous step's ids; row 1 is ours
    got = apply_logits_processing(logits, [sp], [TokenHistory([1], [9], pending_row=1)], prev)
    assert got[0, 9].item() == pytest.approx(-4.0) and got[0, 5].item() == 0.0


def test_penalties_without_history_are_refused_and_bias_ids_checked():
    with pytest.raises(ValueError, match="penalties need"):
        apply_logits_processing(torch.zeros(1, V), [SamplingParams(presence_penalty=1.0)], None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_logits_processing(torch.zeros(1, V), [SamplingParams(logit_bias={V: 1.0})], None)


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
                                dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
                                dict(repetition_penalty=float("inf")), dict(logit_bias={1: 101}),
                                dict(logit_bias={1: "x"}), dict(logit_bias={-1: 1.0}),
                                dict(presence_penalty="1")])
def test_sampling_params_validate_penalties(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def tiny_engines():
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.engine.naive import NaiveEngine

    def cfg(num_blocks, async_scheduling=False):
        return EngineConfig(model="tiny", device="cpu", dtype="float32",
                            cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                                      max_model_len=256),
                            async_scheduling=async_scheduling)
    return NaiveEngine(cfg(64)), LLMEngine(cfg(64)), LLMEngine(cfg(64, True)), LLMEngine(cfg(6))


def test_engine_penalties_equal_naive_across_batching_async_and_preemption(tiny_engines):
    """Greedy outputs with penalties: the sequential reference engine, the paged engine, the
    asynchronous-scheduling engine and a paged engine whose small cache forces preemption
    (recompute) all produce the same tokens, and penalties change the output."""
    naive, paged, paged_async, small = tiny_engines
    prompts = [[1 + i, 2, 3, 4, 5 + i] * 3 for i in range(6)]
    sps = [SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5),
           SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
           SamplingParams(max_tokens=12, ignore_eos=True),
           SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={int(t): -100 for t in range(0, 400)}),
           SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0),
           SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=0.7, presence_penalty=-1.0)]
    want = [naive.generate([p], sp)[0].output_token_ids for p, sp in zip(prompts, sps)]
    for eng in (paged, paged_async, small):
        got = [o.output_token_ids for o in eng.generate(prompts, sps)]
        assert got == want, type(eng).__name__
    assert small.stats()["num_preemptions"] > 0
    plain = [o.output_token_ids for o in paged.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert sum(a != b for a, b in zip(plain, want)) >= 2, "penalties changed nothing"
    assert all(t >= 400 for t in want[3])
