"""End-to-end engine behaviour on the embedded tiny model (CPU).

The central check: greedy outputs are token-identical across the naive control, static
batching, continuous batching, chunked prefill (chunk = block size and a chunk that does not
divide it) and continuous batching under forced preemption, on >= 32 mixed requests.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.engine.async_engine import AsyncLLMEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.naive import NaiveEngine
from llmserve.core.sampling_params import SamplingParams

BLOCK = 16


def make_requests(n=32, seed=0, vocab=151643):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.choice([1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 1, rng.randint(3, 70)])
        prompt = [rng.randrange(10, vocab) for _ in range(plen)]
        reqs.append((prompt, SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=i % 3 != 0)))
    return reqs


def engine_config(mode="continuous", max_seqs=8, chunk=None, num_blocks=None, budget=2048, policy="fcfs"):
    return EngineConfig(model="tiny", device="cpu", dtype="float32",
                        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, memory_bytes=64 << 20),
                        scheduler=SchedulerConfig(mode=mode, policy=policy, max_num_seqs=max_seqs,
                                                  max_num_batched_tokens=budget, prefill_chunk_size=chunk))


def run_all(engine, reqs):
    seqs = [engine.add_request(p, sp) for p, sp in reqs]
    while engine.has_unfinished_requests():
        engine.step()
    return [s.output_token_ids for s in seqs], seqs


@pytest.fixture(scope="module")
def reqs():
    return make_requests()


@pytest.fixture(scope="module")
def naive_outputs(reqs):
    out, _ = run_all(NaiveEngine(engine_config()), reqs)
    return out


@pytest.mark.parametrize("name,cfg", [
    ("static", engine_config(mode="static")),
    ("continuous", engine_config()),
    ("continuous_batch1", engine_config(max_seqs=1)),
    ("chunked_eq_block", engine_config(chunk=BLOCK, budget=64)),
    ("chunked_odd", engine_config(chunk=7, budget=29)),
    ("preemption", engine_config(num_blocks=12, chunk=11, budget=40)),
    ("sjf", engine_config(policy="sjf")),
])
def test_greedy_outputs_identical_across_schedulers(name, cfg, reqs, naive_outputs):
    engine = LLMEngine(cfg)
    free0 = engine.block_manager.num_free_blocks
    out, seqs = run_all(engine, reqs)
    assert out == naive_outputs, name
    assert engine.block_manager.num_free_blocks == free0
    for (p, sp), s in zip(reqs, seqs):
        assert s.is_finished and 1 <= len(s.output_token_ids) <= sp.max_tokens
    if name == "preemption":
        st = engine.stats()
        assert st["num_preemptions"] > 0 and st["num_recomputed_tokens"] > 0


def test_paged_logits_match_reference():
    """Prefill + decodes through the paged path give the reference path's logits."""
    engine = LLMEngine(engine_config())
    prompt = list(range(100, 100 + 2 * BLOCK + 3))
    seq = engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    ids = torch.tensor([seq.all_token_ids[:-1]])
    ref = engine.model.forward_reference(ids)[0]                        # [T, V]
    ref_tokens = ref[len(prompt) - 1:].argmax(-1).tolist()
    assert ref_tokens == seq.output_token_ids


def test_too_large_request_rejected_rest_finish():
    engine = LLMEngine(engine_config(num_blocks=8))
    with pytest.raises(ValueError, match="block|context"):
        engine.add_request(list(range(10, 10 + 8 * BLOCK)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="context"):
        engine.add_request([5] * 10, SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="vocab|\\[0"):
        engine.add_request([10**9], SamplingParams())
    out, seqs = run_all(engine, make_requests(6, seed=3))
    assert all(s.is_finished for s in seqs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_abort_frees_blocks():
    engine = LLMEngine(engine_config())
    total = engine.block_manager.num_free_blocks
    a = engine.add_request(list(range(10, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < total
    assert engine.abort_request(a.request_id)
    assert a.finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == total
    assert not engine.abort_request("nope")


def test_callbacks_and_records():
    engine = LLMEngine(engine_config())
    seen = []
    seq = engine.add_request("Hello world", SamplingParams(max_tokens=6, ignore_eos=True), callback=seen.append)
    while engine.has_unfinished_requests():
        engine.step()
    assert [o.new_token_ids[0] for o in seen] == seq.output_token_ids
    assert seen[-1].finished and seen[-1].finish_reason == "length"
    m = seq.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert len(m.token_times) == 6 and m.token_times == sorted(m.token_times)


def test_seeded_sampling_reproducible_across_batches():
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    e1 = LLMEngine(engine_config())
    alone = e1.generate(["Paged attention is"], sp)[0].output_token_ids
    e2 = LLMEngine(engine_config())
    mixed = e2.generate(["Paged attention is", "Something else entirely", "x"],
                        [sp, SamplingParams(max_tokens=5, temperature=1.0), SamplingParams(max_tokens=3)])
    assert mixed[0].output_token_ids == alone


def test_async_engine_streams_and_aborts():
    engine = LLMEngine(engine_config())
    total = engine.block_manager.num_free_blocks
    aeng = AsyncLLMEngine(engine)

    async def main():
        async def one(i):
            toks = []
            async for out in aeng.generate([10 + i, 20, 30], SamplingParams(max_tokens=8, ignore_eos=True)):
                toks.extend(out.new_token_ids)
            return toks

        results = await asyncio.gather(*(one(i) for i in range(10)))
        assert all(len(t) == 8 for t in results)

        async def cancelled():
            async for _ in aeng.generate([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True)):
                break       # closing the iterator aborts the request

        await cancelled()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not engine.has_unfinished_requests():
                break
        with pytest.raises(ValueError):
            async for _ in aeng.generate([], SamplingParams()):
                pass

    try:
        asyncio.run(main())
    finally:
        aeng.shutdown()
    assert engine.block_manager.num_free_blocks == total


def test_naive_engine_serialises_callers():
    engine = NaiveEngine(engine_config())
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request([8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(len(engine.step()))
    assert steps == [1] * 5        # one token of one request per step: never batched


def test_step_seconds_account_for_the_steps():
    """``stats()["step_seconds"]`` splits step() wall time into schedule / execute / sample /
    device_wait / postprocess; the parts are non-negative and sum to no more than the time
    spent stepping."""
    import time as _time

    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.core.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig())
    for p in ([5, 6, 7], [8, 9]):
        eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    t = _time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    wall = _time.perf_counter() - t
    st = eng.stats()["step_seconds"]
    assert set(st) == {"schedule", "execute", "sample", "device_wait", "postprocess"}
    assert all(v >= 0 for v in st.values()) and st["execute"] > 0
    assert sum(st.values()) <= wall


def test_warmup_runs_every_step_kind_and_leaves_no_trace():
    """``warmup()`` is a no-op on CPU; forced, it runs batched prefills (one longer than the
    prefill chunk), short arrivals next to a decoding background request (decode rows mixed
    with prefill chunks) and a sampled request, then resets the counters: later outputs equal
    a fresh engine's, also for a seeded sampled request; a busy engine refuses to warm up."""
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256, prefill_chunk_size=32,
                                                 max_num_batched_tokens=64))
    eng = LLMEngine(cfg)
    skipped = eng.warmup()
    assert "skipped" in skipped and skipped["requests"] == 0 and eng.num_steps == 0
    steps = []
    original = eng.runner.execute

    def spy(scheduled, pending=None, *rest, **kw):
        news = [item.num_new_tokens for item in scheduled]
        ids = {item.seq.request_id for item in scheduled}
        steps.append((max(news) > 1 and min(news) == 1, any(r.startswith("warmup-bg") for r in ids),
                      {len(item.seq.prompt_token_ids) for item in scheduled}))
        return original(scheduled, pending, *rest, **kw)

    eng.runner.execute = spy
    info = eng.warmup(force=True)
    eng.runner.execute = original
    assert info["requests"] >= 10 and info["seconds"] > 0 and info["triton_compiles"] in (0, None)
    # a decode row next to a prefill chunk while the background request decodes
    assert any(mixed and bg for mixed, bg, _ in steps), "no mixed step next to the background request"
    assert 41 in set().union(*(n for _, _, n in steps))          # the prompt one past the 32-token chunk
    assert eng.num_steps == 0 and eng.max_blocks_in_use == 0 and not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    assert sum(eng.step_seconds.values()) == 0.0 and eng.scheduler.num_preemptions == 0
    assert not eng.sampler._generators                           # the seeded request's generator is gone
    prompts = [[5, 6, 7, 8], list(range(40, 80))]
    sps = [SamplingParams(max_tokens=8, ignore_eos=True),
           SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)]
    fresh = LLMEngine(cfg).generate(prompts, sps)
    after = eng.generate(prompts, sps)
    assert [o.output_token_ids for o in after] == [o.output_token_ids for o in fresh]
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        eng.warmup(force=True)


@pytest.mark.parametrize("sched,cache", [
    (SchedulerConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=64), None),  # no chunking
    (SchedulerConfig(max_num_seqs=1, max_model_len=256, prefill_chunk_size=32), None),      # one sequence
    (SchedulerConfig(max_num_seqs=4, max_model_len=256), CacheConfig(num_blocks=6)),         # tiny KV cache
    (SchedulerConfig(max_num_seqs=4, max_model_len=4), None),                                # tiny context
])
def test_warmup_skips_what_the_engine_cannot_take(sched, cache):
    """Synthetic requests longer than the step budget (no chunked prefill), the context or the
    KV cache are skipped, not raised; the engine is left idle and usable."""
    cfg = EngineConfig(scheduler=sched, cache=cache or CacheConfig())
    eng = LLMEngine(cfg)
    info = eng.warmup(force=True)
    assert info["requests"] >= 1 and not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    out = eng.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].output_token_ids) == 2


def test_warmup_failure_leaves_nothing_queued(monkeypatch):
    """A step that raises during the warm-up aborts the warm-up's requests before the error
    propagates."""
    eng = LLMEngine(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256)))
    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise RuntimeError("simulated device error")

    monkeypatch.setattr(eng.runner, "execute", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        eng.warmup(force=True)
    assert calls and not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    assert NaiveEngine(EngineConfig()).warmup(force=True)["requests"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warmup_on_cuda_with_graphs_leaves_no_trace():
    """On CUDA (Triton attention, decode graphs, asynchronous scheduling) the warm-up runs
    without ``force``, resets the graph counters too, and later greedy outputs equal a fresh
    engine's."""
    cfg = EngineConfig(model="tiny", device="cuda", dtype="bfloat16", attention_backend="triton",
                       use_cuda_graph=True, cache=CacheConfig(num_blocks=512),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024, prefill_chunk_size=64))
    eng = LLMEngine(cfg)
    info = eng.warmup()
    assert "skipped" not in info and info["requests"] > 20
    assert eng.num_steps == 0 and eng.runner.num_graph_steps == 0 and eng.runner.num_eager_steps == 0
    prompts = [[10 + i] * (3 + 40 * i) for i in range(4)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    after = [o.output_token_ids for o in eng.generate(prompts, sp)]
    assert after == [o.output_token_ids for o in LLMEngine(cfg).generate(prompts, sp)]


def test_freeze_gc_moves_live_objects_to_the_permanent_generation():
    """``EngineConfig.freeze_gc``: warm-up (a no-op on CPU apart from this) freezes what is alive,
    so later collector passes skip the model and buffers; off leaves the collector alone."""
    import gc

    from llmserve.config import EngineConfig
    from llmserve.engine import LLMEngine

    gc.unfreeze()
    try:
        eng = LLMEngine(EngineConfig(freeze_gc=False))
        eng.warmup()
        assert gc.get_freeze_count() == 0
        eng = LLMEngine(EngineConfig())
        eng.warmup()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    with pytest.raises(ValueError, match="freeze_gc"):
        EngineConfig(freeze_gc=1)


def test_warmup_runs_eager_steps_and_graph_replays_of_prefill_steps():
    """With graphs of steps with prefill chunks (``runner.mixed_graphs``) the warm-up's requests
    run twice: first with those graphs set aside (the eager kernel variants that steps past the
    largest bucket use compile too), then with them; the runner gets its graphs back."""
    from llmserve.config import EngineConfig, SchedulerConfig

    eng = LLMEngine(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256,
                                                           prefill_chunk_size=32,
                                                           max_num_batched_tokens=64)))

    class NoGraphs:                       # a mixed runner that replays nothing (CPU)
        def eligible(self, scheduled, num_logits):
            return False

    mixed = NoGraphs()
    eng.runner.mixed_graphs = mixed
    seen = []
    original = eng.runner.execute

    def spy(scheduled, pending=None, *rest, **kw):
        seen.append((eng.runner.mixed_graphs is mixed,
                     sorted({item.seq.request_id.split("-")[0] for item in scheduled})))
        return original(scheduled, pending, *rest, **kw)

    eng.runner.execute = spy
    info = eng.warmup(force=True)
    eng.runner.execute = original
    assert eng.runner.mixed_graphs is mixed and not eng.has_unfinished_requests()
    eager = [tags for with_graphs, tags in seen if not with_graphs]
    graphed = [tags for with_graphs, tags in seen if with_graphs]
    assert eager and graphed and seen.index(next(s for s in seen if s[0])) == len(eager)  # eager first
    assert all(tags == ["warmup"] for tags in eager) and all(tags == ["warmup1"] for tags in graphed)
    assert info["requests"] % 2 == 0                 # the same requests in each pass
