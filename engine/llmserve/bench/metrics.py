"""Per-request latency records and run aggregates.

Definitions (times from :class:`~llmserve.core.sequence.RequestMetrics`, ``time.perf_counter``
seconds; reported in ms):

* TTFT = ``first_token_time - arrival_time`` (arrival is the request's *scheduled* open-loop
  arrival, so time spent waiting for the submit loop counts, as it would for a real client);
* E2E = ``finish_time - arrival_time`` (``token_times[-1]`` when no finish time was recorded);
* TPOT = ``(E2E - TTFT) / (output_len - 1)`` for requests with >= 2 output tokens (vLLM's
  definition, ``benchmarks/benchmark_serving.py``);
* ITL = differences of consecutive ``token_times`` (pooled over all requests for the aggregate);
* queue time = ``first_scheduled_time - arrival_time``; per request also prefill time =
  ``first_token_time - first_scheduled_time`` and decode time = ``finish_time -
  first_token_time`` (queue + prefill + decode = E2E; a preempted request's recompute counts
  where it happens, usually in decode).

Aggregates are mean/p50/p95/p99 over completed requests with numpy's ``linear`` percentile
(the default; type 7 of Hyndman & Fan), throughputs are per second of the measured phase
(from the benchmark start to the last completion), and goodput (Zhong et al., DistServe,
OSDI 2024; as vLLM) is the number of completed requests meeting every given SLO per second.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["RequestRecord", "build_request_record", "summarize", "percentile",
           "aggregate_records", "LATENCY_METRICS", "STAT_NAMES", "AGGREGATE_KEYS"]

LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms")
STAT_NAMES = ("mean", "p50", "p95", "p99")
_PERCENTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0}

#: Every key of :func:`aggregate_records`'s result (and of the report's ``aggregates``), in CSV order.
AGGREGATE_KEYS: tuple[str, ...] = (
    "num_requests", "num_completed", "num_failed", "total_input_tokens", "total_output_tokens",
    "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
    "slo_ttft_ms", "slo_tpot_ms", "num_slo_met", "goodput", "slo_attainment",
    *(f"{m}_{s}" for m in LATENCY_METRICS for s in STAT_NAMES),
    "num_preemptions", "num_recomputed_tokens", "num_steps",
    "kv_cache_usage_peak", "kv_memory_reduction_vs_contiguous",
    "gpu_util_mean", "gpu_util_peak", "gpu_memory_peak_bytes",
    # automatic prefix caching over the measured phase: queried / hit prompt tokens at
    # admission, hits / queries, blocks holding a hash at the end, blocks evicted
    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
    "prefix_cache_cached_blocks", "prefix_cache_evicted_blocks",
)

#: Request statuses: completed normally, rejected at submission, aborted, still running when the
#: run stopped, or failed with an error.
REQUEST_STATUSES = ("ok", "rejected", "aborted", "unfinished", "error")


@dataclass(slots=True)
class RequestRecord:
    """One measured request (JSON-ready; times in ms, ``None`` where undefined)."""

    index: int
    request_id: str
    status: str
    prompt_len: int
    max_tokens: int
    output_len: int = 0
    priority: int = 0
    finish_reason: str | None = None
    error: str | None = None
    arrival_offset_s: float = 0.0
    submit_lag_ms: float | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms_mean: float | None = None
    itl_ms_max: float | None = None
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    itl_ms: list[float] = field(default_factory=list, repr=False)

    def to_dict(self, include_itl: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not include_itl:
            d.pop("itl_ms")
        return d


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def build_request_record(index: int, request_id: str, *, prompt_len: int, max_tokens: int,
                         priority: int = 0, arrival_offset_s: float = 0.0,
                         metrics: Any = None, output_len: int = 0,
                         finish_reason: str | None = None, status: str = "ok",
                         error: str | None = None, submit_time: float | None = None
                         ) -> RequestRecord:
    """Derive one request's latencies from its timing record.

    Args:
        metrics: an object with ``arrival_time``, ``first_scheduled_time``, ``first_token_time``,
            ``token_times``, ``finish_time``, ``num_preemptions``, ``num_recomputed_tokens``
            (perf_counter seconds), or ``None`` (rejected before the engine saw it).
        output_len: number of output tokens generated.
        submit_time: perf_counter time the benchmark actually called ``add_request``
            (``submit_lag_ms`` = submit - scheduled arrival).
        status: one of :data:`REQUEST_STATUSES`.

    Returns:
        The record; latency fields are ``None`` where the event did not happen.
    """
    if status not in REQUEST_STATUSES:
        raise ValueError(f"status must be one of {REQUEST_STATUSES}, got {status!r}")
    rec = RequestRecord(index=index, request_id=request_id, status=status, prompt_len=prompt_len,
                        max_tokens=max_tokens, output_len=output_len, priority=priority,
                        finish_reason=finish_reason, error=error,
                        arrival_offset_s=float(arrival_offset_s))
    if metrics is None:
        return rec
    arrival = float(metrics.arrival_time)
    token_times = [float(t) for t in (getattr(metrics, "token_times", None) or [])]
    first_sched = getattr(metrics, "first_scheduled_time", None)
    first_tok = getattr(metrics, "first_token_time", None)
    if first_tok is None and token_times:
        first_tok = token_times[0]
    finish = getattr(metrics, "finish_time", None)
    if finish is None and token_times and status == "ok":
        finish = token_times[-1]
    rec.num_preemptions = int(getattr(metrics, "num_preemptions", 0) or 0)
    rec.num_recomputed_tokens = int(getattr(metrics, "num_recomputed_tokens", 0) or 0)
    if submit_time is not None:
        rec.submit_lag_ms = _ms(submit_time - arrival)
    if first_sched is not None:
        rec.queue_ms = _ms(first_sched - arrival)
    if first_tok is not None:
        rec.ttft_ms = _ms(first_tok - arrival)
        if first_sched is not None:
            rec.prefill_ms = _ms(first_tok - first_sched)
    if token_times and len(token_times) >= 2:
        itl = np.diff(np.asarray(token_times)) * 1000.0
        rec.itl_ms = itl.tolist()
        rec.itl_ms_mean = float(itl.mean())
        rec.itl_ms_max = float(itl.max())
    if finish is not None and status == "ok":
        rec.e2e_ms = _ms(finish - arrival)
        if first_tok is not None:
            rec.decode_ms = _ms(finish - first_tok)
        n_out = output_len or len(token_times)
        if n_out >= 2 and rec.ttft_ms is not None:
            rec.tpot_ms = (rec.e2e_ms - rec.ttft_ms) / (n_out - 1)
    return rec


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """``q``-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return None
    return float(np.percentile(arr, q, method="linear"))


def summarize(values: Iterable[float | None]) -> dict[str, float | None]:
    """``{"mean", "p50", "p95", "p99"}`` of the non-None values (all None when there are none)."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {s: None for s in STAT_NAMES}
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for name, q in _PERCENTILES.items():
        out[name] = float(np.percentile(arr, q, method="linear"))
    return out


def aggregate_records(records: Sequence[RequestRecord], duration_s: float | None, *,
                      slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                      extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Flat run aggregates (keys: :data:`AGGREGATE_KEYS`).

    Args:
        records: every measured request (any status).
        duration_s: the measured phase's wall time, seconds (throughputs are None if 0/None).
        slo_ttft_ms, slo_tpot_ms: goodput SLOs; a request meets the TPOT SLO trivially when it
            has a single output token. ``goodput`` is None when neither is given.
        extra: values for the KV cache / GPU keys (missing ones are None).
    """
    done = [r for r in records if r.status == "ok"]
    agg: dict[str, Any] = {k: None for k in AGGREGATE_KEYS}
    agg["num_requests"] = len(records)
    agg["num_completed"] = len(done)
    agg["num_failed"] = len(records) - len(done)
    agg["total_input_tokens"] = int(sum(r.prompt_len for r in done))
    agg["total_output_tokens"] = int(sum(r.output_len for r in done))
    agg["duration_s"] = duration_s
    ok_dur = duration_s is not None and duration_s > 0 and math.isfinite(duration_s)
    if ok_dur:
        agg["request_throughput"] = len(done) / duration_s
        agg["output_throughput"] = agg["total_output_tokens"] / duration_s
        agg["total_token_throughput"] = (agg["total_input_tokens"] + agg["total_output_tokens"]) / duration_s
    for m in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
        for s, v in summarize(getattr(r, m) for r in done).items():
            agg[f"{m}_{s}"] = v
    for s, v in summarize(x for r in done for x in r.itl_ms).items():
        agg[f"itl_ms_{s}"] = v
    agg["num_preemptions"] = int(sum(r.num_preemptions for r in records))
    agg["num_recomputed_tokens"] = int(sum(r.num_recomputed_tokens for r in records))
    agg["slo_ttft_ms"], agg["slo_tpot_ms"] = slo_ttft_ms, slo_tpot_ms
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        def meets(r: RequestRecord) -> bool:
            if slo_ttft_ms is not None and (r.ttft_ms is None or r.ttft_ms > slo_ttft_ms):
                return False
            if slo_tpot_ms is not None and r.tpot_ms is not None and r.tpot_ms > slo_tpot_ms:
                return False
            return True
        n_met = sum(1 for r in done if meets(r))
        agg["num_slo_met"] = n_met
        agg["slo_attainment"] = n_met / len(records) if records else None
        agg["goodput"] = n_met / duration_s if ok_dur else None
    for k, v in (extra or {}).items():
        if k in agg and agg[k] is None:
            agg[k] = v
    return agg
