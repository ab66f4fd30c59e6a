"""Per-request lifecycle traces (llmserve.core.trace): events of the engine and the benchmark.

The end-to-end test runs ``llmserve benchmark --config continuous --requests 8 --arrival-rate 20
--max-batch-size 2 --trace FILE`` in-process on the tiny model and checks every request's event
order and that its spans add up to its end-to-end latency.
"""

from __future__ import annotations

import gzip
import json

import pytest

from llmserve.bench.runner import BenchmarkOptions, run_benchmark
from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.core.sampling_params import SamplingParams
from llmserve.core.trace import (EVENT_KINDS, SPAN_KINDS, RequestTracer, read_trace, request_spans,
                                 write_trace)
from llmserve.engine import LLMEngine
from llmserve.engine.naive import NaiveEngine


def _events_of(events, rid):
    return [e for e in events if e["request_id"] == rid]


def _first(evs, kind):
    return next(e for e in evs if e["event"] == kind)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    opts = BenchmarkOptions(config="continuous", requests=8, arrival_rate=20.0, max_num_seqs=2,
                            trace=str(d / "t.jsonl"), output=str(d / "b.json"), progress=False)
    report, _, _ = run_benchmark(opts)
    assert report["status"] == "ok", report.get("error")
    return report, read_trace(d / "t.jsonl")


def test_benchmark_trace_has_every_request_in_order(traced_run):
    report, events = traced_run
    assert {e["event"] for e in events} <= set(EVENT_KINDS)
    assert report["trace"]["num_events"] == len(events)
    ids = {r["request_id"] for r in report["requests"]}
    assert len(ids) == 8 and {e["request_id"] for e in events} == ids
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    for rec in report["requests"]:
        evs = _events_of(events, rec["request_id"])
        kinds = [e["event"] for e in evs]
        t = {k: _first(evs, k)["t"] for k in ("arrived", "queued", "prefill", "first_token", "finished")}
        assert t["arrived"] <= t["queued"] <= t["prefill"] <= t["first_token"] <= t["finished"]
        assert kinds.count("finished") == 1 and kinds[-1] == "finished"
        assert _first(evs, "finished")["output_tokens"] == rec["output_len"]
        assert _first(evs, "finished")["reason"] == rec["finish_reason"]
        # the CPU steps synchronously: one decode step per output token after the first
        assert kinds.count("decode") == rec["output_len"] - 1
        prefill = [e for e in evs if e["event"] == "prefill"]
        assert sum(e["tokens"] for e in prefill) == rec["prompt_len"]
        for e in evs:
            if e["event"] in ("prefill", "decode"):
                assert 1 <= e["batch_size"] <= 2 and e["batch_tokens"] >= e["batch_size"]
        steps = [e["step"] for e in evs if e["event"] in ("prefill", "decode")]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)


def test_spans_add_up_to_end_to_end_latency(traced_run):
    report, events = traced_run
    spans = request_spans(events)
    step_ms = max(r["itl_ms_max"] or 0.0 for r in report["requests"])
    for rec in report["requests"]:
        s = spans[rec["request_id"]]
        assert [x.kind for x in s][:2] == ["queued", "prefill"] and s[-1].kind == "decode"
        assert all(a.end == b.start for a, b in zip(s, s[1:]))          # contiguous
        total_ms = sum(x.duration for x in s) * 1000
        assert total_ms == pytest.approx(rec["e2e_ms"], abs=step_ms)
        assert s[0].duration * 1000 == pytest.approx(rec["queue_ms"], abs=step_ms)
        assert rec["queue_ms"] + rec["prefill_ms"] + rec["decode_ms"] == pytest.approx(rec["e2e_ms"])


def _run(engine, prompts, max_tokens):
    engine.tracer = RequestTracer()
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return engine.tracer.events()


def test_preemption_is_traced_with_blocks_and_recompute():
    sched = {"max_num_seqs": 4, "max_model_len": 256}
    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32", seed=0,
                       scheduler=SchedulerConfig(**sched), cache=CacheConfig(block_size=16, num_blocks=8))
    eng = LLMEngine(cfg)
    events = _run(eng, [[(7 * i + j) % 500 + 3 for j in range(30)] for i in range(4)], 40)
    pre = [e for e in events if e["event"] == "preempted"]
    assert pre, "8 blocks of 16 for 4 requests of 70 tokens must preempt"
    assert eng.scheduler.num_preemptions == len(pre)
    for e in pre:
        assert e["reason"] == "out of KV blocks" and e["blocks_freed"] >= 1 and e["tokens_dropped"] >= 1
        evs = _events_of(events, e["request_id"])
        after = [x for x in evs if x["t"] >= e["t"] and x["event"] == "prefill"]
        assert after and after[0]["recompute"] is True
        before = [x for x in evs if x["t"] < e["t"] and x["event"] == "prefill"]
        assert before and before[0]["recompute"] is False     # its first prefill was no recompute
    spans = request_spans(events)
    victim = pre[0]["request_id"]
    kinds = [s.kind for s in spans[victim]]
    assert "preempted" in kinds and kinds[kinds.index("preempted") + 1] == "prefill"
    for rid, s in spans.items():
        fin = _first(_events_of(events, rid), "finished")["t"]
        arr = _first(_events_of(events, rid), "arrived")["t"]
        assert sum(x.duration for x in s) == pytest.approx(fin - arr)
        assert {x.kind for x in s} <= set(SPAN_KINDS)


def test_prefix_cache_hit_shows_as_cached_tokens():
    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32", seed=0,
                       scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256),
                       cache=CacheConfig(block_size=16, enable_prefix_caching=True))
    eng = LLMEngine(cfg)
    prompt = [(5 * j) % 400 + 3 for j in range(40)]
    _run(eng, [prompt], 4)                       # fills the cache
    events = _run(eng, [prompt], 4)
    first = _first(events, "prefill")
    assert first["cached_tokens"] == 32 and first["start"] == 32 and first["tokens"] == 8


def test_chunked_prefill_gives_one_event_per_chunk():
    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32", seed=0,
                       scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=256, prefill_chunk_size=16))
    events = _run(LLMEngine(cfg), [list(range(3, 43))], 3)
    chunks = [e for e in events if e["event"] == "prefill"]
    assert [c["tokens"] for c in chunks] == [16, 16, 8]
    assert [c["start"] for c in chunks] == [0, 16, 32]
    assert [c["cached_tokens"] for c in chunks] == [0, 0, 0]


def test_naive_engine_trace():
    eng = NaiveEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", seed=0))
    events = _run(eng, [[3, 4, 5, 6, 7], [8, 9, 10]], 3)
    for rid, plen in (("r0", 5), ("r1", 3)):
        evs = _events_of(events, rid)
        kinds = [e["event"] for e in evs]
        assert kinds == ["arrived", "queued", "prefill", "first_token", "decode", "decode", "finished"]
        assert _first(evs, "prefill")["tokens"] == plen
    # one request at a time: r1 starts after r0 finished
    assert _first(_events_of(events, "r1"), "prefill")["t"] >= _first(_events_of(events, "r0"), "finished")["t"]


def test_rejected_request_is_traced():
    eng = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                 scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=64)))
    eng.tracer = RequestTracer()
    with pytest.raises(ValueError):
        eng.add_request(list(range(3, 60)), SamplingParams(max_tokens=32), request_id="big")
    (e,) = eng.tracer.events()
    assert e["event"] == "rejected" and e["request_id"] == "big" and e["reason"]
    assert request_spans([e]) == {}


def test_tracer_off_by_default_and_drain_forgets():
    eng = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                 scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=128)))
    assert eng.tracer is None
    eng.tracer = tr = RequestTracer()
    eng.add_request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True), request_id="a")
    eng.step()
    eng.step()
    first = tr.drain()
    assert [e["event"] for e in first] == ["arrived", "queued", "prefill", "decode"]
    while eng.has_unfinished_requests():
        eng.step()
    rest = tr.drain()
    assert sorted(e["event"] for e in rest) == ["decode", "decode", "finished", "first_token"]
    assert not [e for e in rest if e["event"] == "prefill"]      # the request stays admitted
    assert tr.drain() == []


def test_spans_with_asynchronous_order():
    # asynchronous scheduling plans the next (decode) step before the first token is read
    ev = [{"t": 0.0, "request_id": "a", "event": "arrived"},
          {"t": 0.5, "request_id": "a", "event": "queued"},
          {"t": 1.0, "request_id": "a", "event": "prefill"},
          {"t": 2.0, "request_id": "a", "event": "decode"},
          {"t": 2.5, "request_id": "a", "event": "first_token"},
          {"t": 3.0, "request_id": "a", "event": "preempted"},
          {"t": 4.0, "request_id": "a", "event": "prefill"},
          {"t": 5.0, "request_id": "a", "event": "decode"},
          {"t": 6.0, "request_id": "a", "event": "finished"}]
    spans = request_spans(reversed(ev))
    assert [(s.kind, s.start, s.end) for s in spans["a"]] == [
        ("queued", 0.0, 1.0), ("prefill", 1.0, 2.5), ("decode", 2.5, 3.0),
        ("preempted", 3.0, 4.0), ("prefill", 4.0, 5.0), ("decode", 5.0, 6.0)]


def test_trace_file_round_trip_and_bad_lines(tmp_path):
    ev = [{"t": 0.1, "request_id": "a", "event": "arrived"}]
    for name in ("t.jsonl", "t.jsonl.gz"):
        assert write_trace(tmp_path / name, ev) == 1
        assert read_trace(tmp_path / name) == ev
    assert gzip.decompress((tmp_path / "t.jsonl.gz").read_bytes()).startswith(b"{")
    first = (tmp_path / "t.jsonl.gz").read_bytes()
    write_trace(tmp_path / "t.jsonl.gz", ev)
    assert (tmp_path / "t.jsonl.gz").read_bytes() == first       # reproducible bytes
    write_trace(tmp_path / "t.jsonl.gz", ev, append=True)
    assert read_trace(tmp_path / "t.jsonl.gz") == ev + ev
    (tmp_path / "bad.jsonl").write_text(json.dumps({"t": 1}) + "\n")
    with pytest.raises(ValueError, match="not a trace event"):
        read_trace(tmp_path / "bad.jsonl")


def test_benchmark_trace_path_that_cannot_be_written_fails_the_run_early(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (blocker / "t.jsonl", tmp_path):          # under a file; a directory
        opts = BenchmarkOptions(config="continuous", requests=2, trace=str(bad),
                                output=str(tmp_path / "b.json"), progress=False)
        report, _, _ = run_benchmark(opts)
        assert report["status"] == "failed" and report["workload"] is None, bad
        assert "--trace" in report["error"] and "cannot be written" in report["error"]


def test_async_engine_writes_the_trace_it_serves(tmp_path):
    import asyncio

    from llmserve.engine.async_engine import AsyncLLMEngine

    path = tmp_path / "serve.jsonl.gz"
    eng = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                 scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=128)))
    aeng = AsyncLLMEngine(eng, trace_path=str(path))
    assert path.exists() and read_trace(path) == []

    async def one(i):
        async for out in aeng.generate([3 + i, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True),
                                       request_id=f"s{i}"):
            last = out
        return last

    async def main():
        return await asyncio.gather(*(one(i) for i in range(3)))

    outs = asyncio.run(main())
    aeng.shutdown()
    events = read_trace(path)
    for out in outs:
        evs = _events_of(events, out.request_id)
        assert [e["event"] for e in evs][-1] == "finished"
        assert sum(e["event"] == "decode" for e in evs) >= 4
    assert eng.tracer.drain() == []                       # everything was flushed
    assert aeng._writer is None                            # the writer thread stopped


def test_serve_trace_flushes_while_running_and_records_aborts(tmp_path):
    import asyncio
    import time as _time

    from llmserve.engine.async_engine import AsyncLLMEngine

    path = tmp_path / "serve.jsonl.gz"
    eng = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                 scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=256)))
    aeng = AsyncLLMEngine(eng, trace_path=str(path))
    aeng.TRACE_FLUSH_S = 0.05

    async def first_tokens_then_leave():
        gen = aeng.generate([3, 4, 5], SamplingParams(max_tokens=200, ignore_eos=True), request_id="gone")
        async for _ in gen:
            break
        await gen.aclose()                                 # the client disconnects

    async def short():
        async for _ in aeng.generate([6, 7], SamplingParams(max_tokens=3, ignore_eos=True), request_id="ok"):
            pass

    async def main():
        await asyncio.gather(first_tokens_then_leave(), short())

    asyncio.run(main())
    deadline = _time.monotonic() + 10
    while _time.monotonic() < deadline:                  # written while the server still runs
        try:
            evs = read_trace(path)
        except EOFError:                                  # caught mid-write
            evs = []
        if {e["request_id"] for e in evs if e["event"] == "finished"} == {"gone", "ok"}:
            break
        _time.sleep(0.05)
    reasons = {e["request_id"]: e["reason"] for e in evs if e["event"] == "finished"}
    assert reasons == {"gone": "abort", "ok": "length"}
    size = path.stat().st_size
    _time.sleep(0.3)                                       # idle: nothing is appended
    assert path.stat().st_size == size
    aeng.shutdown()


def test_serve_refuses_a_trace_path_it_cannot_write_before_loading(tmp_path):
    import argparse

    from llmserve.serve.server import add_serve_subparser, build_app

    blocker = tmp_path / "file"
    blocker.write_text("x")
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_serve_subparser(sub).parse_args(["tiny", "--trace", str(blocker / "t.jsonl")])
    with pytest.raises(ValueError, match="--trace .* cannot be written"):
        build_app(args)
