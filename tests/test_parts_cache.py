"""Engines that take over another engine's device parts (``EnginePartsCache``): the same tokens
as a freshly built engine, none of the previous engine's state, refusals where the parts differ."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.core.sampling_params import SamplingParams
from llmserve.engine import EnginePartsCache, LLMEngine, build_engine
from llmserve.engine.builder import parts_key

BLOCK = 16


def _config(mode="continuous", max_seqs=4, chunk=None, caching=True, policy="fcfs", seed=0, device="cpu",
            model="tiny", dtype="float32", attention_backend="torch", **cache):
    return EngineConfig(model=model, device=device, dtype=dtype, seed=seed, attention_backend=attention_backend,
                        cache=CacheConfig(block_size=BLOCK, enable_prefix_caching=caching,
                                          **(cache or {"memory_bytes": 16 << 20})),
                        scheduler=SchedulerConfig(mode=mode, policy=policy, max_num_seqs=max_seqs,
                                                  max_num_batched_tokens=512, prefill_chunk_size=chunk,
                                                  max_model_len=512))


def _requests(n=7, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):   # lengths at block boundaries and odd ones
        plen = rng.choice([1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3, rng.randint(2, 90)])
        out.append(([rng.randrange(10, 150_000) for _ in range(plen)],
                    SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)))
    return out


def _run(engine, reqs):
    seqs = [engine.add_request(list(p), sp) for p, sp in reqs]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(s.output_token_ids) for s in seqs]


def test_scheduling_fields_share_a_key_and_engine_fields_do_not():
    base = _config()
    for other in (_config(mode="static"), _config(policy="sjf"), _config(chunk=32), _config(caching=False)):
        assert parts_key(other) == parts_key(base)
    for other in (_config(max_seqs=8), _config(seed=1), _config(memory_bytes=32 << 20), _config(num_blocks=64)):
        assert parts_key(other) != parts_key(base)


def test_a_reused_engine_generates_what_a_fresh_one_does():
    """Continuous, then static with chunks and prefix caching off on the first engine's parts:
    the second's tokens equal a freshly built static engine's, its KV cache is the first's, and
    the first engine takes no more requests."""
    reqs = _requests()
    cache = EnginePartsCache()
    first = build_engine(_config(), parts_cache=cache)
    assert not first.startup.get("reused_parts")
    _run(first, reqs)
    assert cache.put(first)
    with pytest.raises(RuntimeError, match="gave its device parts"):
        first.add_request([1, 2, 3])
    second_cfg = _config(mode="static", chunk=BLOCK + 1, caching=False)
    second = build_engine(second_cfg, parts_cache=cache)
    assert second.startup["reused_parts"] and cache.reuses == 1
    assert second.kv_cache is first.kv_cache and second.model is first.model
    assert second.block_manager is not first.block_manager and second.scheduler is not first.scheduler
    fresh = LLMEngine(second_cfg)
    assert _run(second, reqs) == _run(fresh, reqs)
    assert second.stats()["num_steps"] == fresh.stats()["num_steps"]


def test_prefix_cache_hits_do_not_carry_over():
    """The KV cache's blocks keep the first engine's data, but the second engine's block manager
    is new: a prompt the first engine cached is a miss for the second."""
    prompt = list(range(100, 100 + 4 * BLOCK + 5))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    cache = EnginePartsCache()
    first = build_engine(_config(), parts_cache=cache)
    _run(first, [(prompt, sp)])
    _run(first, [(prompt, sp)])          # after the first finished: its full blocks are cached
    assert first.block_manager.prefix_cache_stats()["hits"] > 0
    assert cache.put(first)
    second = build_engine(_config(), parts_cache=cache)
    assert second.startup["reused_parts"]
    _run(second, [(prompt, sp)])
    assert second.block_manager.prefix_cache_stats()["hits"] == 0


def test_parts_are_not_taken_by_another_setting_nor_given_by_a_busy_engine():
    cache = EnginePartsCache()
    first = build_engine(_config(), parts_cache=cache)
    first.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    assert not cache.put(first)                      # requests in flight: nothing kept
    with pytest.raises(RuntimeError, match="idle engine"):
        first.detach_device_parts()
    while first.has_unfinished_requests():
        first.step()
    assert cache.put(first) and cache.holds(_config(mode="static"))
    other = build_engine(_config(max_seqs=8), parts_cache=cache)   # another key: built, cache emptied
    assert not other.startup.get("reused_parts") and other.kv_cache is not first.kv_cache
    assert not cache.holds(_config())
    assert build_engine(_config(), naive=True, parts_cache=cache).__class__.__name__ == "NaiveEngine"


def test_reuse_refuses_tensor_parallel_and_speculative_engines():
    cache = EnginePartsCache()
    first = build_engine(_config(), parts_cache=cache)
    parts = first.detach_device_parts()
    with pytest.raises(ValueError, match="one rank"):
        LLMEngine(dataclasses.replace(_config(), tensor_parallel_size=2), reuse=parts)
    from llmserve.engine import SpeculativeEngine

    with pytest.raises(ValueError, match="builds its own parts"):
        SpeculativeEngine(_config(), draft_model="target", reuse=parts)


def test_run_order_gathers_cells_of_one_group_behind_the_first():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow" / "scripts"))
    run_cells = pytest.importorskip("run_cells")
    a, b, c = object(), object(), object()
    assert run_cells.run_order(list("pqrstu"), [a, b, a, c, b, a]) == [0, 2, 5, 1, 4, 3]
    assert run_cells.run_order(list("pq"), [a, b]) == [0, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("second", [dict(mode="static"), dict(chunk=48), dict(caching=False, policy="sjf")])
def test_reused_cuda_graphs_generate_what_fresh_ones_do(second):
    """On a GPU with the fused forward and CUDA graphs (decode and mixed): a second engine on
    the first's parts (graphs replayed, not captured again) generates a freshly built engine's
    greedy tokens, in steps that replayed the graphs."""
    kw = dict(device="cuda", model="random:qwen2.5-0.5b", dtype="bfloat16", attention_backend="triton",
              gpu_memory_utilization=0.3)
    reqs = _requests(n=9, seed=3)
    cache = EnginePartsCache()
    first = build_engine(_config(max_seqs=8, **kw), parts_cache=cache)
    _run(first, reqs)
    assert cache.put(first)
    cfg = _config(max_seqs=8, **second, **kw)
    reused = build_engine(cfg, parts_cache=cache)
    assert reused.startup["reused_parts"] and reused.startup["graph_capture_s"] == 0.0
    got = _run(reused, reqs)
    assert reused.runner.num_graph_steps > 0 and reused.runner.num_mixed_graph_steps > 0
    del first
    cache.clear()
    fresh = LLMEngine(cfg)
    assert got == _run(fresh, reqs)


def test_parts_of_a_custom_loader_are_not_offered():
    """A ``load_model_fn`` builds weights the configuration does not name: nothing to share."""
    from llmserve.models.loader import load_model

    cache = EnginePartsCache()
    eng = LLMEngine(_config(), load_model_fn=load_model)
    assert not cache.put(eng) and not cache.holds(_config())


def test_mismatched_parts_are_refused_before_the_engine_is_set_up(monkeypatch):
    """The key check comes first: an invariant-mode config does not pin the thread count, nor
    load anything, before it is refused."""
    import llmserve.engine.llm_engine as llm_engine

    parts = build_engine(_config()).detach_device_parts()
    pinned = []
    monkeypatch.setattr(llm_engine, "pin_invariant_threads", lambda config: pinned.append(config))
    with pytest.raises(ValueError, match="other engine settings"):
        LLMEngine(dataclasses.replace(_config(max_seqs=8), batch_invariant=True), reuse=parts)
    assert pinned == []


def test_a_failed_construction_is_not_counted_as_a_reuse(monkeypatch):
    cache = EnginePartsCache()
    assert cache.put(build_engine(_config(), parts_cache=cache))

    def fail(self, config, reuse=None):
        raise RuntimeError("construction failed")

    monkeypatch.setattr(LLMEngine, "_init_engine", fail)
    with pytest.raises(RuntimeError, match="construction failed"):
        build_engine(_config(mode="static"), parts_cache=cache)
    assert cache.reuses == 0 and not cache.holds(_config())


def test_an_engine_that_takes_no_parts_empties_the_cache_first(monkeypatch):
    """The naive engine is built after the held parts were dropped (on a GPU their KV cache
    would otherwise shrink the new engine's free memory)."""
    from llmserve.engine import NaiveEngine

    cache = EnginePartsCache()
    assert cache.put(build_engine(_config(), parts_cache=cache))
    held_at_build = []
    real_init = NaiveEngine.__init__

    def init(self, config, **kw):
        held_at_build.append(cache.holds(_config()))
        real_init(self, config, **kw)

    monkeypatch.setattr(NaiveEngine, "__init__", init)
    build_engine(_config(), naive=True, parts_cache=cache)
    assert held_at_build == [False] and not cache.holds(_config())


def test_a_reused_cpu_engine_in_the_invariant_mode_runs_on_one_thread():
    before = torch.get_num_threads()
    try:
        cache = EnginePartsCache()
        first = build_engine(dataclasses.replace(_config(), batch_invariant=True), parts_cache=cache)
        assert torch.get_num_threads() == 1
        assert cache.put(first)
        torch.set_num_threads(2)                     # what the pipeline's runner does between cells
        second = build_engine(dataclasses.replace(_config(mode="static"), batch_invariant=True), parts_cache=cache)
        assert second.startup["reused_parts"] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_run_benchmark_keeps_parts_only_of_engines_it_built_through_the_cache(tmp_path):
    import argparse
    import shlex

    from llmserve.bench.runner import add_benchmark_args, options_from_args, run_benchmark

    def opts(name):
        p = argparse.ArgumentParser()
        add_benchmark_args(p)
        return options_from_args(p.parse_args(shlex.split(
            f"--model tiny --device cpu --requests 3 --warmup-requests 0 --arrival-rate inf --no-progress "
            f"--max-num-seqs 4 --output {tmp_path / name}.json")))

    cache = EnginePartsCache()
    report, _, _ = run_benchmark(opts("a"), engine_factory=lambda c, naive: LLMEngine(c), parts_cache=cache)
    assert report["status"] == "ok" and cache.reuses == 0 and cache._parts is None
    # a custom factory's engine is built after the held parts were dropped
    assert cache.put(build_engine(_config(), parts_cache=cache))
    held = []

    def factory(c, naive):
        held.append(cache._parts is not None)
        return LLMEngine(c)

    report, _, _ = run_benchmark(opts("a2"), engine_factory=factory, parts_cache=cache)
    assert report["status"] == "ok" and held == [False] and cache._parts is None
    report, _, _ = run_benchmark(opts("b"), parts_cache=cache)
    assert report["status"] == "ok" and cache._parts is not None
    report, _, _ = run_benchmark(opts("c"), parts_cache=cache)
    assert report["status"] == "ok" and cache.reuses == 1 and report["warmup"]["engine_startup"]["reused_parts"]
