"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal the readable path's log-softmax at
every prompt position: whole prefills, chunked prefills, preemption by recompute and prefix
cache hits (tiny model, fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.core.sampling_params import SamplingParams
from llmserve.engine.llm_engine import LLMEngine

BLOCK = 16


def _engine(chunk=None, num_blocks=None, budget=2048, max_seqs=8, prefix=True):
    return LLMEngine(EngineConfig(
        model="tiny", device="cpu", dtype="float32",
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, memory_bytes=64 << 20,
                          enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                  prefill_chunk_size=chunk)))


def _reference(engine, prompt, k):
    """Per prompt token 1.. : (logprob, top-k) from the readable path (the model's paged
    forward, torch attention) over the whole prompt in one step, on a fresh cache."""
    from llmserve.attention import AttentionMetadata

    n = len(prompt)
    nb = -(-n // BLOCK)
    kv = [(torch.zeros_like(kc[:nb + 1]), torch.zeros_like(vc[:nb + 1])) for kc, vc in engine.kv_cache.kv_caches]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(BLOCK, BLOCK + n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(1, nb + 1, dtype=torch.int32)[None], max_query_len=n, max_context_len=n,
        block_size=BLOCK, is_decode_only=False)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(prompt), torch.arange(n), kv, meta)
        logits = engine.model.compute_logits(hidden).float()                          # [T, V]
        full = engine.model.forward_reference(torch.tensor([prompt]))[0].float()        # [T, V]
    # the paged readable path agrees with the dense reference up to fp32 summation order
    torch.testing.assert_close(logits, full, atol=2e-4, rtol=1e-5)
    lp = torch.log_softmax(logits, dim=-1)
    tok = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]                   # [T-1]
    top = lp[:-1].topk(k, dim=-1) if k else None
    return tok, top


def _check(engine, seq, k):
    prompt = seq.prompt_token_ids
    assert len(seq.prompt_logprobs) == len(prompt) - 1
    tok, top = _reference(engine, prompt, k)
    got = torch.tensor([r["token_logprob"] for r in seq.prompt_logprobs], dtype=torch.float32)
    torch.testing.assert_close(got, tok, atol=1e-5, rtol=1e-5)
    for p, rec in enumerate(seq.prompt_logprobs):
        assert len(rec["top"]) == k
        if k:
            vals = torch.tensor([v for _, v in rec["top"]])
            torch.testing.assert_close(vals, top.values[p], atol=1e-5, rtol=1e-5)
            assert rec["top"][0][0] == int(top.indices[p, 0])


def _run(engine, reqs):
    seqs = [engine.add_request(p, sp) for p, sp in reqs]
    while engine.has_unfinished_requests():
        engine.step()
    return seqs


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10, 150000) for _ in range(rng.choice([2, 3, 15, 16, 17, 33, 50]))]
            for _ in range(n)]


@pytest.mark.parametrize("chunk,budget", [(None, 2048), (7, 29), (BLOCK, 40)])
def test_prompt_logprobs_match_reference(chunk, budget):
    eng = _engine(chunk=chunk, budget=budget)
    prompts = _prompts(6)
    seqs = _run(eng, [(p, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=i % 3))
                      for i, p in enumerate(prompts)])
    for i, s in enumerate(seqs):
        _check(eng, s, i % 3)
        assert eng.stats()["prompt_logprobs"]["rows"] == sum(len(p) - 1 for p in prompts)


def test_prompt_logprobs_output_layout_and_tokens_unchanged():
    eng = _engine(chunk=7, budget=29)
    prompt = _prompts(1, seed=3)[0]
    plain = _run(eng, [(prompt, SamplingParams(max_tokens=5, ignore_eos=True))])[0]
    eng2 = _engine(chunk=7, budget=29)
    with_lp = _run(eng2, [(prompt, SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=1))])[0]
    assert with_lp.output_token_ids == plain.output_token_ids     # sampling sees the right rows
    from llmserve.engine.llm_engine import RequestOutput
    out = RequestOutput.from_seq(with_lp, [])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert RequestOutput.from_seq(plain, []).prompt_logprobs is None


def test_prompt_logprobs_under_preemption_are_not_duplicated():
    eng = _engine(chunk=11, num_blocks=12, budget=40)
    at_preemption = []
    orig = eng.scheduler._preempt

    def spy(seq):
        at_preemption.append((len(seq.prompt_logprobs), seq.num_prompt_tokens - 1, seq.num_output_tokens))
        orig(seq)

    eng.scheduler._preempt = spy
    prompts = _prompts(10, seed=1)
    seqs = _run(eng, [(p, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2)) for p in prompts])
    assert eng.stats()["num_preemptions"] > 0
    # some request was preempted while its prompt was partly scored, some after it had output
    assert any(0 < done < total for done, total, _ in at_preemption)
    assert any(out > 0 for _, _, out in at_preemption)
    for s in seqs:
        _check(eng, s, 2)
    assert eng.stats()["prompt_logprobs"]["rows"] == sum(len(p) - 1 for p in prompts)


def test_prompt_logprobs_skip_the_prefix_cache_for_unscored_positions():
    eng = _engine(prefix=True)
    prompt = _prompts(1, seed=5)[0] * 3                      # several full blocks
    _run(eng, [(prompt, SamplingParams(max_tokens=2, ignore_eos=True))])      # fills the cache
    s = _run(eng, [(prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0))])[0]
    _check(eng, s, 0)
    s2 = _run(eng, [(prompt, SamplingParams(max_tokens=2, ignore_eos=True))])[0]
    assert eng.stats()["prefix_cache"]["hits"] > 0 and s2.is_finished


def test_prompt_logprobs_validation_and_speculative_refusal():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    from llmserve.engine.naive import NaiveEngine

    naive = NaiveEngine(EngineConfig(model="tiny", device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        naive.add_request([1, 2, 3], SamplingParams(prompt_logprobs=1))
