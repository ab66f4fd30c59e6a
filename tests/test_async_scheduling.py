"""Asynchronous scheduling (``EngineConfig.async_scheduling``): step n+1 is planned and launched
before the host reads step n's sampled tokens, which the next step takes as input ids on the
device. On CPU the overlap buys nothing, but the bookkeeping is the same as on a GPU, so these
tests run it against the synchronous engine: same tokens, same finish reasons, same logprobs,
under chunked prefill, preemption, stop tokens and aborts.
"""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.engine.llm_engine import LLMEngine
from llmserve.core.sampling_params import SamplingParams
from llmserve.core.sequence import PENDING_TOKEN

from test_engine import engine_config, make_requests, run_all


def pair(**kw):
    cfg = engine_config(**kw)
    return (LLMEngine(dataclasses.replace(cfg, async_scheduling=False)),
            LLMEngine(dataclasses.replace(cfg, async_scheduling=True)))


@pytest.mark.parametrize("kw", [
    dict(),                                   # continuous batching
    dict(chunk=16, budget=64),                # chunked prefill: mixed prefill + decode steps
    dict(num_blocks=12, max_seqs=8),          # forced preemption (recompute)
    dict(mode="static"),
])
def test_async_matches_sync_greedy(kw):
    reqs = make_requests(24, seed=3)
    sync, asyn = pair(**kw)
    assert asyn.async_scheduling and not sync.async_scheduling
    out_s, seqs_s = run_all(sync, reqs)
    out_a, seqs_a = run_all(asyn, reqs)
    assert out_a == out_s
    assert [s.finish_reason for s in seqs_a] == [s.finish_reason for s in seqs_s]
    assert all(s.num_pending == 0 for s in seqs_a)
    assert asyn.block_manager.num_free_blocks == asyn.block_manager.num_total_blocks
    if kw.get("num_blocks"):
        assert asyn.stats()["num_preemptions"] > 0


def test_stop_token_mid_flight_and_length_stops():
    """A stop token is only seen after the next step was launched: that step's token for the
    request is discarded. Length stops are known ahead: no step is planned for them."""
    prompts = [[11, 12, 13], [40, 41], [7] * 20]
    sync, asyn = pair()
    probe = sync.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    stop = probe[0].output_token_ids[3]                     # request 0 stops at its 4th token
    sps = [SamplingParams(max_tokens=8, stop_token_ids=[stop], ignore_eos=True),
           SamplingParams(max_tokens=1, ignore_eos=True),
           SamplingParams(max_tokens=5, ignore_eos=True)]
    ref = sync.generate(prompts, sps)
    got = asyn.generate(prompts, sps)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    assert got[0].output_token_ids[-1] == stop and got[0].finish_reason == "stop"
    assert [len(o.output_token_ids) for o in got[1:]] == [1, 5]
    assert asyn.block_manager.num_free_blocks == asyn.block_manager.num_total_blocks


def test_logprobs_and_seeded_sampling_match():
    prompts = [[5, 6, 7, 8], [100] * 9, [3]]
    sps = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1, logprobs=3, ignore_eos=True),
           SamplingParams(max_tokens=4, temperature=1.2, top_k=5, seed=2, ignore_eos=True),
           SamplingParams(max_tokens=5, logprobs=0, ignore_eos=True)]
    sync, asyn = pair()
    ref = sync.generate(prompts, sps)
    got = asyn.generate(prompts, sps)
    for a, b in zip(got, ref):
        assert a.output_token_ids == b.output_token_ids
        assert len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert (x is None) == (y is None)
            if x is not None:
                assert x["token_logprob"] == pytest.approx(y["token_logprob"], abs=1e-5)
                assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]


def test_outputs_arrive_one_step_later_and_never_show_pending_ids():
    """The step that launches a request's first token returns nothing for it; the next step
    returns it. Callbacks and outputs never contain the placeholder id."""
    _, asyn = pair()
    seen = []
    seq = asyn.add_request([9, 8, 7], SamplingParams(max_tokens=3, ignore_eos=True),
                           callback=lambda o: seen.append(list(o.output_token_ids)))
    assert asyn.step() == []                                  # prefill launched, token pending
    assert seq.num_pending == 1 and seq.num_tokens == 4 and seq.output_token_ids == []
    assert seq.token_ids_slice(2, 4) == [7, PENDING_TOKEN]
    outs = asyn.step()                                        # decode launched, first token read
    assert [len(o.output_token_ids) for o in outs] == [1]
    while asyn.has_unfinished_requests():
        asyn.step()
    assert len(seq.output_token_ids) == 3 and seq.finish_reason == "length"
    assert all(PENDING_TOKEN not in ids for ids in seen)
    assert seen[-1] == seq.output_token_ids


def test_abort_while_a_token_is_in_flight():
    sync, asyn = pair()
    reqs = make_requests(6, seed=5)
    ref, _ = run_all(sync, reqs)
    seqs = [asyn.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(reqs)]
    asyn.step()
    asyn.step()
    victim = seqs[0]
    had = list(victim.output_token_ids)
    assert asyn.abort_request("r0")
    while asyn.has_unfinished_requests():
        asyn.step()
    assert victim.finish_reason == "abort" and victim.output_token_ids == had
    assert [s.output_token_ids for s in seqs[1:]] == ref[1:]
    assert asyn.block_manager.num_free_blocks == asyn.block_manager.num_total_blocks


@pytest.mark.parametrize("async_", [False, True])
def test_raising_callback_leaves_other_requests_intact(async_):
    """A client callback that raises propagates out of step(), but only after every token of
    the step was recorded: other requests keep the synchronous engine's tokens and no step
    is read twice."""
    sync, asyn = pair()
    eng = asyn if async_ else sync
    prompts = [[5, 6, 7], [8, 9, 10]]
    ref = LLMEngine(dataclasses.replace(engine_config(), async_scheduling=False)).generate(
        prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    fired = []

    def cb(o):
        if len(o.output_token_ids) == 2 and not fired:
            fired.append(1)
            raise RuntimeError("client callback failed")

    a = eng.add_request(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True))
    b = eng.add_request(prompts[1], SamplingParams(max_tokens=6, ignore_eos=True), callback=cb)
    raised = 0
    while eng.has_unfinished_requests():
        try:
            eng.step()
        except RuntimeError as e:
            assert "client callback" in str(e)
            raised += 1
    assert raised == 1
    assert a.output_token_ids == ref[0].output_token_ids
    assert b.output_token_ids == ref[1].output_token_ids
    assert a.num_pending == b.num_pending == 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks


def test_default_is_off_on_cpu():
    eng = LLMEngine(engine_config())
    assert eng.async_scheduling is False


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_async_graph_decode_matches_sync():
    """On the GPU with CUDA-graph decode (graph inputs filled from the device) and the eager
    path for prefill steps: asynchronous and synchronous engines produce the same tokens."""
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig

    def make(flag):
        return LLMEngine(EngineConfig(model="random:qwen2.5-0.5b", device="cuda", dtype="bfloat16",
                                      attention_backend="triton", async_scheduling=flag,
                                      cache=CacheConfig(block_size=16, num_blocks=512),
                                      scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512,
                                                                prefill_chunk_size=64,
                                                                max_num_batched_tokens=128)))
    reqs = make_requests(12, seed=7)
    ref, _ = run_all(make(False), reqs)
    eng = make(True)
    got, seqs = run_all(eng, reqs)
    assert got == ref
    assert eng.runner.num_graph_steps > 0
