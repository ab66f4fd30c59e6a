"""Benchmark metrics on hand-built timestamps: TTFT, TPOT, ITL, E2E, queue time, percentiles,
throughput and goodput equal hand-computed values."""

from __future__ import annotations

import pytest

from llmserve.bench.metrics import (
    AGGREGATE_KEYS,
    aggregate_records,
    build_request_record,
    percentile,
    summarize,
)
from llmserve.core.sequence import RequestMetrics


def _rec(i, arrival, ttft, itls, sched_delay=0.0, status="ok", prompt_len=10, **kw):
    times = [arrival + ttft]
    for d in itls:
        times.append(times[-1] + d)
    m = RequestMetrics(arrival_time=arrival, first_scheduled_time=arrival + sched_delay,
                       first_token_time=times[0], token_times=times, finish_time=times[-1], **kw)
    return build_request_record(i, f"r{i}", prompt_len=prompt_len, max_tokens=len(times),
                                metrics=m, output_len=len(times), status=status,
                                finish_reason="length" if status == "ok" else None)


def test_single_request_latencies():
    r = _rec(0, 10.0, 0.5, [0.2, 0.3, 0.4], sched_delay=0.1, num_preemptions=1, num_recomputed_tokens=7)
    assert r.ttft_ms == pytest.approx(500.0)
    assert r.e2e_ms == pytest.approx(1400.0)
    assert r.tpot_ms == pytest.approx((1400.0 - 500.0) / 3)
    assert r.itl_ms == pytest.approx([200.0, 300.0, 400.0])
    assert r.itl_ms_mean == pytest.approx(300.0) and r.itl_ms_max == pytest.approx(400.0)
    assert r.queue_ms == pytest.approx(100.0)
    assert (r.num_preemptions, r.num_recomputed_tokens) == (1, 7)


def test_single_token_request_has_no_tpot():
    r = _rec(0, 1.0, 0.25, [])
    assert r.ttft_ms == pytest.approx(250.0) and r.e2e_ms == pytest.approx(250.0)
    assert r.tpot_ms is None and r.itl_ms == []


def test_percentiles_linear_interpolation():
    vals = [100.0, 200.0, 300.0, 400.0, 500.0]
    # numpy 'linear': position (n - 1) * q / 100 -> 4 * 0.95 = 3.8 -> 400 + 0.8 * 100
    assert percentile(vals, 50) == 300.0
    assert percentile(vals, 95) == pytest.approx(480.0)
    assert percentile(vals, 99) == pytest.approx(496.0)
    assert percentile([], 50) is None
    s = summarize([500.0, None, 100.0, 300.0, 200.0, 400.0])
    assert s == pytest.approx({"mean": 300.0, "p50": 300.0, "p95": 480.0, "p99": 496.0})
    assert summarize([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


def test_aggregates_hand_computed():
    # five requests with TTFT 100..500 ms, 3 output tokens each, ITLs (10 ms, 30 ms)
    recs = [_rec(i, float(i), 0.1 * (i + 1), [0.01, 0.03], sched_delay=0.01 * i, prompt_len=20)
            for i in range(5)]
    recs.append(build_request_record(5, "r5", prompt_len=9, max_tokens=4, status="rejected",
                                     error="ValueError: too long"))
    agg = aggregate_records(recs, duration_s=10.0, slo_ttft_ms=350.0, slo_tpot_ms=25.0)
    assert set(agg) == set(AGGREGATE_KEYS)
    assert (agg["num_requests"], agg["num_completed"], agg["num_failed"]) == (6, 5, 1)
    assert agg["total_input_tokens"] == 100 and agg["total_output_tokens"] == 15
    assert agg["request_throughput"] == pytest.approx(0.5)
    assert agg["output_throughput"] == pytest.approx(1.5)
    assert agg["total_token_throughput"] == pytest.approx(11.5)
    assert agg["ttft_ms_mean"] == pytest.approx(300.0)
    assert agg["ttft_ms_p50"] == pytest.approx(300.0)
    assert agg["ttft_ms_p95"] == pytest.approx(480.0)
    assert agg["ttft_ms_p99"] == pytest.approx(496.0)
    # TPOT = (e2e - ttft) / (3 - 1) = (10 + 30) / 2 = 20 ms for all
    assert agg["tpot_ms_p50"] == pytest.approx(20.0) and agg["tpot_ms_p99"] == pytest.approx(20.0)
    # ITLs pooled: five 10s and five 30s -> p50 = 20, p95 = 30, mean = 20
    assert agg["itl_ms_mean"] == pytest.approx(20.0)
    assert agg["itl_ms_p50"] == pytest.approx(20.0)
    assert agg["itl_ms_p95"] == pytest.approx(30.0)
    # E2E = ttft + 40 ms
    assert agg["e2e_ms_p50"] == pytest.approx(340.0)
    # queue: 0, 10, 20, 30, 40 ms
    assert agg["queue_ms_mean"] == pytest.approx(20.0)
    assert agg["queue_ms_p95"] == pytest.approx(38.0)
    # SLOs: TTFT <= 350 holds for 100, 200, 300 ms; TPOT 20 <= 25 for all
    assert agg["num_slo_met"] == 3
    assert agg["goodput"] == pytest.approx(0.3)
    assert agg["slo_attainment"] == pytest.approx(0.5)


def test_aggregates_without_slo_or_duration():
    agg = aggregate_records([_rec(0, 0.0, 0.1, [0.01])], duration_s=None)
    assert agg["goodput"] is None and agg["slo_attainment"] is None
    assert agg["output_throughput"] is None
    assert agg["ttft_ms_p50"] == pytest.approx(100.0)
    empty = aggregate_records([], duration_s=1.0)
    assert empty["num_requests"] == 0 and empty["ttft_ms_p99"] is None


def test_unfinished_request_has_no_e2e():
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.2,
                       token_times=[0.2, 0.3])
    r = build_request_record(0, "x", prompt_len=3, max_tokens=10, metrics=m, output_len=2,
                             status="unfinished")
    assert r.ttft_ms == pytest.approx(200.0) and r.e2e_ms is None and r.tpot_ms is None
    with pytest.raises(ValueError, match="status must be one of"):
        build_request_record(0, "x", prompt_len=3, max_tokens=1, status="weird")
