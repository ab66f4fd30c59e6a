"""Benchmark harness: seeded open-loop workloads, the real-time submit loop, per-request
latency records, NVML sampling, component profiles and JSON/CSV reports.

Modules: :mod:`.workload` (profiles, arrivals, lengths, prompts), :mod:`.sharegpt` (ShareGPT
loader), :mod:`.runner` (``llmserve benchmark``), :mod:`.metrics` (TTFT/TPOT/ITL/E2E, goodput),
:mod:`.gpu_monitor` (NVML), :mod:`.profiler` (component profile), :mod:`.report` (JSON schema,
CSV row, provenance).
"""

from .metrics import AGGREGATE_KEYS, RequestRecord, aggregate_records, build_request_record, summarize
from .report import (
    CSV_COLUMNS,
    REQUIRED_AGGREGATE_KEYS,
    REQUIRED_FIELDS,
    REQUIRED_REQUEST_KEYS,
    validate_report,
)
from .workload import (
    BUILTIN_PROFILES,
    BenchmarkRequest,
    Workload,
    build_workload,
    load_profile,
    validate_profile,
)

__all__ = ["AGGREGATE_KEYS", "BUILTIN_PROFILES", "BenchmarkRequest", "CSV_COLUMNS", "REQUIRED_AGGREGATE_KEYS",
           "REQUIRED_FIELDS", "REQUIRED_REQUEST_KEYS", "RequestRecord", "Workload", "aggregate_records",
           "build_request_record", "build_workload", "load_profile", "summarize", "validate_profile",
           "validate_report", "run_benchmark", "BenchmarkOptions"]


def __getattr__(name):  # lazy: the runner pulls in the engine's config module (torch)
    if name in ("run_benchmark", "BenchmarkOptions"):
        from . import runner
        return getattr(runner, name)
    raise AttributeError(name)
