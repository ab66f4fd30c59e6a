"""Sampler: greedy, top-k/top-p masks, per-request seeds, sampling frequencies, logprobs."""

from __future__ import annotations

import pytest
import torch

from llmserve.worker.sampler import Sampler, apply_top_k_top_p
from llmserve.core.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    res = Sampler("cpu").sample(logits, [SamplingParams()] * 5, [str(i) for i in range(5)])
    assert res.token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_mask():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.6]))
    # mass before: 0, .5, .7 ...: keep tokens 0 and 1 (token 1 crosses 0.6)
    assert torch.isfinite(out).tolist() == [[True, True, False, False, False]]
    out = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False]]
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(out).sum() == 1


def test_seeded_requests_reproducible_regardless_of_batch():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    sp = SamplingParams(temperature=1.0, seed=42)
    a = [Sampler("cpu").sample(logits, [sp], ["a"]).token_ids[0] for _ in range(1)]
    s = Sampler("cpu")
    stream1 = [s.sample(logits, [sp], ["a"]).token_ids[0] for _ in range(20)]
    s2 = Sampler("cpu", seed=123)
    other = SamplingParams(temperature=1.0)
    stream2 = [s2.sample(torch.cat([logits, logits]), [other, sp], ["x", "a"]).token_ids[1] for _ in range(20)]
    assert stream1 == stream2 and a[0] == stream1[0]


def test_sampling_frequencies_follow_softmax():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(20000, 1)
    s = Sampler("cpu", seed=0)
    toks = torch.tensor(s.sample(logits, [SamplingParams(temperature=1.0)] * 20000,
                                 [str(i) for i in range(20000)]).token_ids)
    freq = torch.bincount(toks, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0]).repeat(5000, 1)
    s = Sampler("cpu", seed=0)
    toks = torch.tensor(s.sample(logits, [SamplingParams(temperature=0.25)] * 5000,
                                 [str(i) for i in range(5000)]).token_ids)
    p0 = (toks == 0).float().mean().item()
    expected = torch.softmax(torch.tensor([4.0, 0.0]), 0)[0].item()
    assert abs(p0 - expected) < 0.02


def test_logprobs_records():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    res = Sampler("cpu").sample(logits, [SamplingParams(logprobs=2)], ["a"])
    rec = res.logprobs[0]
    assert res.token_ids == [0]
    assert rec["token_logprob"] == pytest.approx(torch.log(torch.tensor(0.7)).item(), abs=1e-6)
    assert [t for t, _ in rec["top"]] == [0, 1]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", 2.5), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -2), ("temperature", -0.1)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_precomputed_argmax_is_used_and_never_written():
    """``sample_async(argmax=...)`` (the decode graph's greedy tokens) is taken for greedy rows;
    a sampled row does not write into that buffer; a wrong shape is rejected."""
    s = Sampler("cpu")
    logits = torch.randn(3, 50)
    given = torch.tensor([7, 8, 9])            # deliberately not the argmax: proves it is used
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0)]
    got = s.sample_async(logits, params, ["a", "b", "c"], argmax=given).result().token_ids
    assert got[0] == 7 and got[2] == 9
    assert given.tolist() == [7, 8, 9]
    for bad in (torch.tensor([1, 2]), torch.tensor([1, 2, 3], dtype=torch.int32)):
        with pytest.raises(ValueError, match="argmax must be int64"):
            s.sample_async(logits, params, ["a", "b", "c"], argmax=bad)


def test_sampling_rows_persist_across_unchanged_batches():
    """A batch's per-row tensors are gathered once and reused while its rows stay the same;
    a change of rows (or a new request reusing a released id) rebuilds them with its values."""
    from llmserve.worker.shaping import RowParams, SamplingRows, sampling_probs

    rows = SamplingRows("cpu", capacity=2)
    a = SamplingParams(temperature=0.5, top_k=3)
    b = SamplingParams(temperature=2.0, top_p=0.9)
    first = rows.view(["a", "b"], [a, b])
    assert rows.view(["a", "b"], [a, b]) is first and rows.num_rebuilds == 1
    assert first.temperature.tolist() == [0.5, 2.0] and first.top_k.tolist() == [3, 0]
    assert first.top_k_top_p
    c = SamplingParams(temperature=1.5, frequency_penalty=0.25)
    grown = rows.view(["a", "b", "c"], [a, b, c])                  # past the initial capacity
    assert rows.num_rebuilds == 2 and grown.frequency.tolist() == [0.0, 0.0, 0.25]
    rows.release("a")
    d = SamplingParams(temperature=0.75)
    again = rows.view(["a", "c"], [d, c])                          # id "a" now a new request
    assert again.temperature.tolist() == [0.75, 1.5] and not again.top_k_top_p
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    direct = RowParams.from_params([d, c], "cpu")
    assert torch.equal(sampling_probs(logits, again), sampling_probs(logits, direct))
    assert torch.equal(sampling_probs(logits, again),
                       torch.softmax(logits / torch.tensor([0.75, 1.5])[:, None], -1))
