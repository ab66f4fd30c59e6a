"""Prometheus metrics of the serving layer, named like vLLM's (``vllm:`` -> ``llmserve:``).

Each app owns a dedicated :class:`prometheus_client.CollectorRegistry`, so two apps in one
process (tests) never share or double-register series.

Exported series (``_total`` is appended to counters by the exposition format):

| name | type | source |
| --- | --- | --- |
| ``llmserve:num_requests_running`` | gauge | ``engine.stats()`` at scrape |
| ``llmserve:num_requests_waiting`` | gauge | ``engine.stats()`` at scrape |
| ``llmserve:kv_cache_usage_perc`` | gauge (0..1, 1 = full) | ``engine.stats()`` at scrape |
| ``llmserve:num_free_blocks`` / ``llmserve:num_total_blocks`` | gauge | ``engine.stats()`` |
| ``llmserve:num_preemptions_total`` | counter | ``engine.stats()`` (cumulative) |
| ``llmserve:prefix_cache_queries_total`` | counter | prompt tokens looked up in the prefix cache |
| ``llmserve:prefix_cache_hits_total`` | counter | of those, tokens found cached |
| ``llmserve:prompt_tokens_total`` | counter | per admitted request |
| ``llmserve:generation_tokens_total`` | counter | per streamed output token |
| ``llmserve:request_success_total{finished_reason}`` | counter | stop / length / abort |
| ``llmserve:request_rejected_total{reason}`` | counter | invalid_request / queue_full / ... |
| ``llmserve:time_to_first_token_seconds`` | histogram | first_token - arrival |
| ``llmserve:inter_token_latency_seconds`` | histogram | consecutive token times |
| ``llmserve:request_time_per_output_token_seconds`` | histogram | (last - first token) / (n - 1) |
| ``llmserve:e2e_request_latency_seconds`` | histogram | finish - arrival |
| ``llmserve:request_queue_time_seconds`` | histogram | first scheduled - arrival |
| ``llmserve:request_prefill_time_seconds`` | histogram | first token - first scheduled |
| ``llmserve:request_decode_time_seconds`` | histogram | finish - first token |
| ``llmserve:request_inference_time_seconds`` | histogram | finish - first scheduled |
| ``llmserve:request_num_preemptions`` | histogram | preemptions (recomputes) of each request the engine finished |
| ``llmserve:request_prompt_tokens`` / ``llmserve:request_generation_tokens`` | histogram | per request |
| ``llmserve:spec_decode_num_drafts_total`` | counter | verifications (speculative engine only) |
| ``llmserve:spec_decode_num_draft_tokens_total`` | counter | draft tokens proposed (speculative only) |
| ``llmserve:spec_decode_num_accepted_tokens_total`` | counter | draft tokens accepted (speculative only) |
| ``llmserve:spec_decode_num_emitted_tokens_total`` | counter | tokens appended by verifications (speculative only) |

The ``spec_decode`` series (vLLM's names) come from ``engine.stats()["speculative"]`` and are
exported only when the engine speculates (``llmserve serve --speculative-model``); acceptance
rate = accepted / draft tokens.

Timestamps come from the engine's :class:`~llmserve.core.sequence.RequestMetrics`
(``time.perf_counter`` clock), falling back to times measured in the service when a field is
missing. Every update is wrapped: a failure inside metrics is logged and never breaks serving.

Note: ``promtool check metrics`` lints ':' in names ("metric names should not contain ':'",
a naming convention reserved for recording rules); vLLM's names have it too and Prometheus
ingests them. That lint is the only finding on this exposition (tested).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("llmserve.serve.metrics")

PREFIX = "llmserve:"

# Bucket boundaries (seconds), those of vLLM's prometheus logger extended down for fast CPU runs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
PREEMPTION_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

#: Every series name the app exports (dashboards and tests check against it).
EXPORTED_METRICS = (
    "llmserve:num_requests_running",
    "llmserve:num_requests_waiting",
    "llmserve:kv_cache_usage_perc",
    "llmserve:num_free_blocks",
    "llmserve:num_total_blocks",
    "llmserve:num_preemptions_total",
    "llmserve:prefix_cache_queries_total",
    "llmserve:prefix_cache_hits_total",
    "llmserve:prompt_tokens_total",
    "llmserve:generation_tokens_total",
    "llmserve:request_success_total",
    "llmserve:request_rejected_total",
    "llmserve:time_to_first_token_seconds",
    "llmserve:inter_token_latency_seconds",
    "llmserve:request_time_per_output_token_seconds",
    "llmserve:e2e_request_latency_seconds",
    "llmserve:request_queue_time_seconds",
    "llmserve:request_prefill_time_seconds",
    "llmserve:request_decode_time_seconds",
    "llmserve:request_inference_time_seconds",
    "llmserve:request_num_preemptions",
    "llmserve:request_prompt_tokens",
    "llmserve:request_generation_tokens",
)

#: Exported in addition when the engine runs speculative decoding.
SPEC_DECODE_METRICS = (
    "llmserve:spec_decode_num_drafts_total",
    "llmserve:spec_decode_num_draft_tokens_total",
    "llmserve:spec_decode_num_accepted_tokens_total",
    "llmserve:spec_decode_num_emitted_tokens_total",
)


def _first(stats: dict, *keys: str) -> Any:
    for k in keys:
        v = stats.get(k)
        if v is not None:
            return v
    return None


class _EngineStatsCollector(Collector):
    """Reads ``engine.stats()`` at scrape time (gauges and the engine's cumulative counters)."""

    def __init__(self, stats_fn: Callable[[], dict]) -> None:
        self._stats_fn = stats_fn

    def collect(self):
        try:
            s = dict(self._stats_fn() or {})
        except Exception:  # noqa: BLE001 - a scrape never fails because of the engine
            log.exception("engine.stats() failed during a metrics scrape")
            s = {}
        gauges = [
            ("num_requests_running", "Number of requests in the running batch.",
             _first(s, "num_running", "running", "num_requests_running")),
            ("num_requests_waiting", "Number of requests waiting to be scheduled.",
             _first(s, "num_waiting", "waiting", "num_requests_waiting")),
            ("kv_cache_usage_perc", "KV-cache usage as a fraction of all blocks; 1 means 100 percent.",
             _first(s, "kv_cache_usage", "kv_cache_usage_perc", "kv_usage")),
            ("num_free_blocks", "Free KV-cache blocks.", _first(s, "num_free_blocks")),
            ("num_total_blocks", "Total KV-cache blocks.", _first(s, "num_total_blocks")),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc)
            g.add_metric([], float(value) if value is not None else 0.0)
            yield g
        c = CounterMetricFamily(PREFIX + "num_preemptions", "Cumulative number of preemptions by the scheduler.")
        c.add_metric([], float(_first(s, "num_preemptions", "preemptions") or 0))
        yield c
        pc = s.get("prefix_cache") if isinstance(s.get("prefix_cache"), dict) else {}
        for key, doc in (("queries", "Prompt tokens looked up in the prefix cache at admission."),
                         ("hits", "Prompt tokens found in the prefix cache at admission.")):
            c = CounterMetricFamily(PREFIX + f"prefix_cache_{key}", doc)
            c.add_metric([], float(pc.get(key) or 0))
            yield c
        spec = s.get("speculative")
        if isinstance(spec, dict):
            for name, key, doc in (
                    ("spec_decode_num_drafts", "num_verifications", "Number of spec decoding drafts verified."),
                    ("spec_decode_num_draft_tokens", "num_proposed_tokens", "Number of draft tokens proposed."),
                    ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Number of draft tokens accepted."),
                    ("spec_decode_num_emitted_tokens", "num_emitted_tokens",
                     "Number of tokens appended by verifications (accepted plus correction or bonus).")):
                c = CounterMetricFamily(PREFIX + name, doc)
                c.add_metric([], float(spec.get(key) or 0))
                yield c


class ServiceMetrics:
    """Owns the registry and every series; the app calls the ``on_*`` hooks.

    Args:
        stats_fn: returns the engine's ``stats()`` dict (read at scrape time).
    """

    def __init__(self, stats_fn: Callable[[], dict] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if stats_fn is not None:
            r.register(_EngineStatsCollector(stats_fn))
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill (prompt) tokens processed.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.",
                                         registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Count of finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_rejected = Counter(PREFIX + "request_rejected",
                                        "Requests answered with an error before generation, by reason.",
                                        ["reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Histogram of time per output token (after the first) in seconds.",
                              buckets=ITL_BUCKETS, registry=r)
        def latency(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=REQUEST_LATENCY_BUCKETS, registry=r)

        self.e2e = latency("e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.")
        self.queue_time = latency("request_queue_time_seconds",
                                  "Histogram of time spent waiting before first being scheduled, in seconds.")
        self.prefill_time = latency("request_prefill_time_seconds",
                                    "Histogram of time from first scheduled to first token, in seconds.")
        self.decode_time = latency("request_decode_time_seconds",
                                   "Histogram of time from first token to finish, in seconds.")
        self.inference_time = latency("request_inference_time_seconds",
                                      "Histogram of time from first scheduled to finish, in seconds.")
        self.request_preemptions = Histogram(PREFIX + "request_num_preemptions",
                                             "Preemptions (recomputes) of each request the engine finished "
                                             "(client aborts not counted).",
                                             buckets=PREEMPTION_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request.",
                                               buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                                   "Generated tokens per request.",
                                                   buckets=TOKEN_COUNT_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(reason)  # export zeros from the start

    # ---- exposition --------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The text exposition (body, content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ---- hooks -------------------------------------------------------------------------------
    def on_rejected(self, reason: str) -> None:
        try:
            self.request_rejected.labels(reason).inc()
        except Exception:  # noqa: BLE001
            log.exception("metrics update failed")

    def tracker(self, num_prompt_tokens: int) -> "RequestTracker":
        """Start tracking one engine request (one choice)."""
        return RequestTracker(self, num_prompt_tokens)


class RequestTracker:
    """Per-request latency bookkeeping; hooks never raise."""

    __slots__ = ("m", "num_prompt_tokens", "arrival", "first_token", "last_token", "num_tokens", "done")

    def __init__(self, metrics: ServiceMetrics, num_prompt_tokens: int) -> None:
        self.m = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.done = False
        try:
            metrics.prompt_tokens.inc(num_prompt_tokens)
            metrics.request_prompt_tokens.observe(num_prompt_tokens)
        except Exception:  # noqa: BLE001
            log.exception("metrics update failed")

    def on_output(self, out: Any, num_new: int) -> None:
        """``num_new`` output tokens arrived in ``out`` (a RequestOutput)."""
        if num_new <= 0 or self.done:
            return
        try:
            now = time.perf_counter()
            rm = getattr(out, "metrics", None)
            times = list(getattr(rm, "token_times", None) or [])
            total = self.num_tokens + num_new
            if len(times) >= total:
                new_times = times[self.num_tokens:total]
            else:
                new_times = [now] * num_new
            if self.num_tokens == 0:
                arrival = getattr(rm, "arrival_time", None) or self.arrival
                self.m.ttft.observe(max(0.0, new_times[0] - arrival))
                self.first_token = new_times[0]
                prev = new_times[0]
                rest = new_times[1:]
            else:
                prev = self.last_token
                rest = new_times
            for t in rest:
                self.m.itl.observe(max(0.0, t - prev))
                prev = t
            self.last_token = new_times[-1]
            self.num_tokens = total
            self.m.generation_tokens.inc(num_new)
        except Exception:  # noqa: BLE001
            log.exception("metrics update failed")

    def on_finish(self, finish_reason: str | None, out: Any = None) -> None:
        """The request ended (``finish_reason`` stop | length | abort)."""
        if self.done:
            return
        self.done = True
        try:
            now = time.perf_counter()
            rm = getattr(out, "metrics", None) if out is not None else None
            arrival = getattr(rm, "arrival_time", None) or self.arrival
            finish = getattr(rm, "finish_time", None) or now
            self.m.request_success.labels(finish_reason or "abort").inc()
            self.m.e2e.observe(max(0.0, finish - arrival))
            scheduled = getattr(rm, "first_scheduled_time", None)
            first = getattr(rm, "first_token_time", None)
            if scheduled is not None:
                self.m.queue_time.observe(max(0.0, scheduled - arrival))
                self.m.inference_time.observe(max(0.0, finish - scheduled))
                if first is not None:
                    self.m.prefill_time.observe(max(0.0, first - scheduled))
            if first is not None:
                self.m.decode_time.observe(max(0.0, finish - first))
            if rm is not None:
                self.m.request_preemptions.observe(int(getattr(rm, "num_preemptions", 0) or 0))
            if self.num_tokens > 1 and self.first_token is not None and self.last_token is not None:
                self.m.tpot.observe(max(0.0, (self.last_token - self.first_token) / (self.num_tokens - 1)))
            self.m.request_generation_tokens.observe(self.num_tokens)
        except Exception:  # noqa: BLE001
            log.exception("metrics update failed")
