"""``llmserve benchmark``: run a seeded open-loop workload against one engine configuration.

The submit loop is single-threaded and real-time: it adds every request whose scheduled
arrival has passed, calls ``engine.step()`` while there is work, and otherwise sleeps until
the next arrival. A request's ``arrival_time`` is its *scheduled* arrival (benchmark start +
offset), so time a request waits for the loop to get round to it (a step in progress) counts
towards its TTFT, as it would for a real open-loop client. Warm-up requests (an independent
random stream of the same profile, all at once) run first and are excluded from statistics.

Configurations (``--config``), matching the reference harness:
  naive       ``NaiveEngine``: one request at a time, full-prefix forward per token, no KV cache
  paged       ``LLMEngine``, continuous batching with max batch 1 (paged cache, no batching)
  static      ``LLMEngine``, ``SchedulerConfig(mode="static")``
  continuous  ``LLMEngine``, ``SchedulerConfig(mode="continuous")``

``--json-schema FILE`` gives every request (warm-up ones too) that JSON schema as a structured
output (grammar-constrained decoding, :class:`~llmserve.core.sampling_params.StructuredOutput`),
to measure what constraining costs against the same seeded workload without it; the report's
``structured_output`` section records the schema (and its sha256) and the engine's grammar
counters (compilations, bitmask rows, their host seconds). With ``ignore_eos`` a request still
ends when its grammar is complete.

Every run writes one JSON report (schema: :mod:`llmserve.bench.report`) and appends one
CSV row, also when it fails (exception, CUDA OOM, ``--timeout``): status ``failed`` plus the
error. The exit status is non-zero for a failed run only with ``--fail-on-error``.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..core.trace import RequestTracer, check_trace_path, write_trace
from ..engine_args import EngineArgs, add_engine_args, int_at_least
from .gpu_monitor import GPUMonitor, empty_gpu_summary
from .metrics import RequestRecord, aggregate_records, build_request_record
from .profiler import run_component_profile, unavailable_profile
from .report import (
    SCHEMA_VERSION,
    append_csv_row,
    csv_row,
    git_info,
    hardware_info,
    package_versions,
    token_digest,
    utc_now,
    write_json,
)
from .workload import (DEFAULT_PROFILE, WORKLOAD_KINDS, BenchmarkRequest, Workload, build_workload,
                       load_profile, validate_profile)

__all__ = ["BenchmarkOptions", "BenchmarkTimeout", "add_benchmark_subparser", "run_benchmark_cli",
           "run_benchmark", "engine_config_of", "make_engine_config", "options_from_args", "main", "CONFIGS"]

CONFIGS = ("naive", "paged", "static", "continuous")


class BenchmarkTimeout(TimeoutError):
    """The run exceeded ``--timeout``."""


@dataclass
class BenchmarkOptions(EngineArgs):
    """Every ``llmserve benchmark`` flag: the engine's (:class:`~llmserve.engine_args.EngineArgs`,
    ``seed`` also seeding the workload, default the profile's) plus the workload and output
    flags below (see :func:`add_benchmark_subparser` for meanings)."""

    config: str = "continuous"
    profile: str | None = None
    workload: str | None = None
    dataset_path: str | None = None
    requests: int | None = None
    arrival_rate: float | None = None
    burstiness: float | None = None
    warmup_requests: int | None = None
    json_schema: str | None = None
    kernel_warmup: bool = True
    output: str | None = None
    csv: str | None = None
    profile_components: bool = False
    profile_steps: int = 256
    fail_on_error: bool = False
    timeout: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    save_itl: bool = False
    trace: str | None = None
    progress: bool = True
    code_hash: str | None = None
    torch_threads: int | None = None
    command: list[str] = field(default_factory=list)

    def resolved_output(self) -> Path:
        if self.output:
            return Path(self.output)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return Path("artifacts") / f"benchmark-{self.config}-{stamp}.json"

    def resolved_csv(self, output: Path) -> Path:
        return Path(self.csv) if self.csv else output.with_suffix(".csv")


# ---------------------------------------------------------------------------------------------
# argparse
# ---------------------------------------------------------------------------------------------
def _rate(s: str) -> float:
    if s.strip().lower() in ("inf", "infinity", "offline"):
        return math.inf
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"--arrival-rate must be > 0 req/s or 'inf', got {s}")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def add_benchmark_args(p: argparse.ArgumentParser) -> None:
    """Add the ``benchmark`` flags to ``p``."""
    g = p.add_argument_group("engine")
    g.add_argument("--config", choices=CONFIGS, default="continuous",
                   help="naive (sequential, no KV cache) | paged (batch 1) | static | continuous")
    add_engine_args(g, exclude=("seed",), help_overrides={
        "max_num_seqs": "most sequences per step (default: 256 on CUDA, 8 on a CPU; paged and naive: 1)"})

    w = p.add_argument_group("workload")
    w.add_argument("--profile", default=None, metavar="FILE",
                   help=f"load profile YAML, or a built-in name (sharegpt, lognormal, "
                        f"offline-random; default {DEFAULT_PROFILE})")
    w.add_argument("--workload", choices=WORKLOAD_KINDS, default=None,
                   help="single-turn | shared-prefix (a shared system prompt in front of every "
                        "prompt) | multi-turn (ShareGPT conversations replayed turn by turn); "
                        "overrides the profile's workload.kind")
    w.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file for ShareGPT profiles (default: the packaged copy)")
    w.add_argument("--requests", type=int_at_least(0), default=None, help="measured requests (overrides the profile)")
    w.add_argument("--arrival-rate", type=_rate, default=None,
                   help="requests/s, open-loop (overrides the profile); 'inf' = offline, all at t=0")
    w.add_argument("--burstiness", type=_positive_float, default=None,
                   help="gamma shape of inter-arrival times (1 = Poisson; overrides the profile)")
    w.add_argument("--seed", type=int_at_least(0), default=None, help="workload and engine seed (default: the profile's)")
    w.add_argument("--warmup-requests", type=int_at_least(0), default=None,
                   help="requests run before measuring, excluded from statistics (default: the profile's)")
    w.add_argument("--json-schema", default=None, metavar="FILE",
                   help="JSON Schema file every request's output must follow (grammar-constrained "
                        "decoding; the report records it)")
    w.add_argument("--no-kernel-warmup", dest="kernel_warmup", action="store_false",
                   help="skip the engine's kernel warm-up (synthetic requests that compile every GPU "
                        "kernel variant before the warm-up requests; CUDA only)")

    o = p.add_argument_group("output")
    o.add_argument("--output", "--out", dest="output", default=None, metavar="X.json",
                   help="JSON report path (default artifacts/benchmark-<config>-<time>.json)")
    o.add_argument("--csv", default=None, help="CSV to append a row to (default: the output's stem + .csv)")
    o.add_argument("--profile-components", action="store_true",
                   help="after the run, profile where step time goes (separate, synchronised pass)")
    o.add_argument("--profile-steps", type=int_at_least(1), default=256,
                   help="most engine steps of the component profile pass (default 256)")
    o.add_argument("--save-itl", action="store_true",
                   help="store every request's inter-token latencies in the JSON (large)")
    o.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="write every measured request's lifecycle events (arrived, queued, prefill "
                        "chunks, first token, decode steps, preemptions, finish) as JSON lines; "
                        "gzip when the name ends in .gz (docs/benchmarking.md, 'Request timelines')")
    o.add_argument("--fail-on-error", action="store_true",
                   help="exit non-zero when the run fails (the report is written either way)")
    o.add_argument("--timeout", type=_positive_float, default=None,
                   help="seconds allowed for warm-up plus measured requests; then the run fails")
    o.add_argument("--slo-ttft-ms", type=_positive_float, default=None, help="TTFT SLO for goodput (ms)")
    o.add_argument("--slo-tpot-ms", type=_positive_float, default=None, help="TPOT SLO for goodput (ms)")
    o.add_argument("--code-hash", default=None,
                   help="the engine's code hash, recorded in the report (the pipeline passes it)")
    o.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it is shown only when stderr is a terminal anyway)")


def add_benchmark_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``benchmark`` on an ``argparse`` subparsers object (``llmserve benchmark``)."""
    p = subparsers.add_parser(
        "benchmark", help="run a seeded open-loop workload and write a JSON report + CSV row",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_benchmark_args(p)
    p.set_defaults(func=run_benchmark_cli)
    return p


def options_from_args(args: argparse.Namespace) -> BenchmarkOptions:
    names = {f.name for f in dataclasses.fields(BenchmarkOptions)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["command"] = list(sys.argv)
    if kw.get("torch_threads") is None:  # record the thread count in force (llmserve sets it from --torch-threads)
        import torch
        kw["torch_threads"] = torch.get_num_threads()
    return BenchmarkOptions(**kw)


def run_benchmark_cli(args: argparse.Namespace) -> int:
    """Entry point for ``llmserve benchmark``; returns the exit status."""
    opts = options_from_args(args)
    report, out, csv_path = run_benchmark(opts)
    agg = report.get("aggregates") or {}
    if report["status"] == "ok":
        def f(v, fmt="{:.1f}"):
            return "n/a" if v is None else fmt.format(v)
        print(f"[{opts.config}] {agg.get('num_completed')}/{agg.get('num_requests')} requests, "
              f"{f(agg.get('output_throughput'))} output tok/s, "
              f"TTFT p50/p95 {f(agg.get('ttft_ms_p50'))}/{f(agg.get('ttft_ms_p95'))} ms, "
              f"TPOT p50/p95 {f(agg.get('tpot_ms_p50'), '{:.2f}')}/{f(agg.get('tpot_ms_p95'), '{:.2f}')} ms",
              file=sys.stderr)
    else:
        print(f"benchmark failed: {report.get('error')}", file=sys.stderr)
    print(f"wrote {out} and {csv_path}", file=sys.stderr)
    if report.get("trace"):
        print(f"wrote {report['trace']['num_events']} request lifecycle events to {report['trace']['path']}",
              file=sys.stderr)
    return 1 if (report["status"] != "ok" and opts.fail_on_error) else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m llmserve.bench.runner ...`` (same flags as ``llmserve benchmark``)."""
    p = argparse.ArgumentParser(prog="llmserve benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_benchmark_args(p)
    return run_benchmark_cli(p.parse_args(argv))


# ---------------------------------------------------------------------------------------------
# Engine construction
# ---------------------------------------------------------------------------------------------
def make_engine_config(opts: BenchmarkOptions, seed: int):
    """The :class:`~llmserve.config.EngineConfig` a benchmark configuration names (usage
    ``"offline"``: :func:`llmserve.engine_args.device_defaults`).

    Raises:
        ValueError: invalid values (from the config dataclasses, naming the field).
    """
    if opts.config not in CONFIGS:
        raise ValueError(f"config must be one of {list(CONFIGS)}, got {opts.config!r}")
    return opts.create_engine_config("offline", mode="static" if opts.config == "static" else "continuous",
                                     seed=seed, max_num_seqs=1 if opts.config in ("paged", "naive") else None)


def engine_config_of(opts: BenchmarkOptions):
    """The :class:`~llmserve.config.EngineConfig` :func:`run_benchmark` builds for ``opts``
    (seed: ``opts.seed``, else the load profile's).

    Raises:
        ValueError/FileNotFoundError: an invalid value or profile.
    """
    seed = opts.seed
    if seed is None:
        profile, _ = load_profile(opts.profile)
        seed = int(profile["seed"])
    return make_engine_config(opts, seed)


def resolved_flags(econf) -> dict[str, Any]:
    """The device-dependent engine flags as an :class:`~llmserve.config.EngineConfig` resolved
    them (the report's ``config`` then names what ran, not ``None``)."""
    s = econf.scheduler
    cuda = econf.device.startswith("cuda")
    fused = econf.fast_path.fused_forward if econf.fast_path.fused_forward is not None else cuda
    return {"dtype": econf.dtype, "attention_backend": econf.attention_backend,
            "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
            "prefill_chunk_size": s.prefill_chunk_size, "fused_forward": fused,
            "async_scheduling": econf.async_scheduling if econf.async_scheduling is not None else cuda,
            # graphs are captured only on CUDA, with the Triton backend, the fused forward and one rank
            "cuda_graph": bool(econf.use_cuda_graph and cuda and econf.attention_backend == "triton"
                               and fused and econf.tensor_parallel_size == 1),
            "seed": econf.seed}


def default_engine_factory(config, naive: bool):
    """Build ``NaiveEngine`` (naive) or ``LLMEngine`` (:func:`llmserve.engine.builder.build_engine`)."""
    from ..engine import build_engine

    return build_engine(config, naive)


def _speculative_engine_factory(opts: BenchmarkOptions) -> Callable[[Any, bool], Any]:
    """Factory building a speculative-decoding engine (``--speculative-model``)."""
    from ..engine import build_engine

    return lambda config, naive: build_engine(config, naive, speculative_model=opts.speculative_model,
                                              num_speculative_tokens=opts.num_speculative_tokens)


def _base_vocab(engine: Any) -> int | None:
    """Exclusive bound for synthetic ids: the model vocab, capped at the tokenizer's base
    (non-special) vocabulary so random prompts contain no control tokens."""
    v = getattr(getattr(engine, "model_config", None), "vocab_size", None)
    tv = getattr(getattr(engine, "tokenizer", None), "vocab_size", None)
    vals = [int(x) for x in (v, tv) if isinstance(x, int) and x > 1]
    return min(vals) if vals else None


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
@dataclass
class _Tracked:
    req: BenchmarkRequest
    request_id: str
    seq: Any = None
    last_output: Any = None
    submit_time: float | None = None
    error: str | None = None
    arrival_offset_s: float | None = None   # actual arrival (later turns: after the previous one)


@dataclass
class _RunState:
    tracked: dict[int, _Tracked] = field(default_factory=dict)
    by_id: dict[str, _Tracked] = field(default_factory=dict)
    active: dict[str, _Tracked] = field(default_factory=dict)   # submitted, not yet finished
    t0: float | None = None
    t_end: float | None = None
    num_steps: int = 0
    kv_usage_peak: float | None = None
    peak_paged_tokens: int = 0
    peak_blocks: int = 0
    peak_contiguous_tokens: int = 0
    peak_request_max_tokens: int = 0
    num_finished: int = 0
    tracer: RequestTracer | None = None


def _sampling_params(req: BenchmarkRequest, temperature: float, seed: int, structured_output: Any = None):
    from ..core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=req.max_tokens, ignore_eos=req.ignore_eos,
                          temperature=temperature,
                          seed=(seed * 1_000_003 + req.index) % (2**31) if temperature > 0 else None,
                          structured_output=structured_output)


def load_json_schema(path: str | Path):
    """``--json-schema``: the file's schema as a compact-whitespace
    :class:`~llmserve.core.sampling_params.StructuredOutput` and the report's description of it.

    Raises:
        ValueError: the file cannot be read, is not JSON, or is not a JSON Schema object.
    """
    import hashlib
    import json

    from ..core.sampling_params import StructuredOutput

    p = Path(path)
    try:
        raw = p.read_bytes()
        schema = json.loads(raw)
    except OSError as e:
        raise ValueError(f"--json-schema {str(p)!r} cannot be read: {e}") from None
    except ValueError as e:
        raise ValueError(f"--json-schema {str(p)!r} is not valid JSON: {e}") from None
    try:
        spec = StructuredOutput("json_schema", schema)
    except ValueError as e:
        raise ValueError(f"--json-schema {str(p)!r}: {e}") from None
    return spec, {"json_schema_path": str(p), "json_schema_sha256": hashlib.sha256(raw).hexdigest(),
                  "json_schema": schema, "whitespace": spec.whitespace, "engine": None}


def _finish_status(t: _Tracked) -> tuple[str, str | None, Any, list[int]]:
    """(record status, finish_reason, metrics, output ids) of a tracked request."""
    if t.error is not None:
        return "rejected", None, None, []
    src = t.seq if t.seq is not None else t.last_output
    metrics = getattr(src, "metrics", None)
    out_ids = list(getattr(src, "output_token_ids", None) or [])
    reason = getattr(src, "finish_reason", None)
    if t.last_output is not None and getattr(t.last_output, "finished", False):
        reason = reason or t.last_output.finish_reason
    if reason in ("stop", "length"):
        return "ok", reason, metrics, out_ids
    if reason == "abort":
        return "aborted", reason, metrics, out_ids
    if reason == "rejected":
        return "rejected", reason, metrics, out_ids
    return "unfinished", None, metrics, out_ids


def _sample_kv(engine: Any, state: _RunState, block_size: int, max_model_len: int) -> None:
    try:
        stats = engine.stats()
    except Exception:  # noqa: BLE001 - stats are optional
        stats = {}
    u = stats.get("kv_cache_usage") if isinstance(stats, dict) else None
    if isinstance(u, (int, float)):
        state.kv_usage_peak = max(state.kv_usage_peak or 0.0, float(u))
    paged = blocks = contiguous = req_max = 0
    for t in state.active.values():
        s = t.seq
        if s is None or getattr(getattr(s, "status", None), "value", None) != "running":
            continue
        nb = len(getattr(s, "block_ids", ()) or ())
        blocks += nb
        paged += nb * block_size
        contiguous += max_model_len
        req_max += min(int(getattr(s, "max_total_tokens", max_model_len)), max_model_len)
    if blocks:
        state.peak_blocks = max(state.peak_blocks, blocks)
        state.peak_paged_tokens = max(state.peak_paged_tokens, paged)
        state.peak_contiguous_tokens = max(state.peak_contiguous_tokens, contiguous)
        state.peak_request_max_tokens = max(state.peak_request_max_tokens, req_max)


def _drive(engine: Any, workload: Workload, state: _RunState, *, prefix: str, temperature: float,
           seed: int, deadline: float | None, on_step: Callable[[], None] | None = None,
           progress: Any = None, structured_output: Any = None) -> None:
    """Submit ``workload`` on its arrival schedule and step the engine until all finish.

    Multi-turn requests (``turn > 0``) are held back until the previous turn of their
    conversation finished (or was rejected); they then arrive ``think_time_s`` later."""
    # (arrival offset s, index, request): a heap, so released later turns slot in by time
    pending = [(r.arrival_offset_s, r.index, r) for r in workload.requests
               if r.conversation is None or r.turn == 0]
    heapq.heapify(pending)
    followups: dict[int, deque] = {}
    for r in sorted(workload.requests, key=lambda r: r.index):
        if r.conversation is not None and r.turn > 0:
            followups.setdefault(r.conversation, deque()).append(r)
    state.t0 = t0 = time.perf_counter()
    n_total = len(workload.requests)

    def release_next_turn(t: _Tracked) -> None:
        q = followups.get(t.req.conversation) if t.req.conversation is not None else None
        if q:
            nxt = q.popleft()
            heapq.heappush(pending, (time.perf_counter() - t0 + nxt.think_time_s, nxt.index, nxt))

    def check_deadline(now: float) -> None:
        if deadline is not None and now > deadline:
            raise BenchmarkTimeout(
                f"timed out ({prefix}): {state.num_finished}/{n_total} requests finished when the "
                f"--timeout expired")

    while True:
        now = time.perf_counter()
        check_deadline(now)
        while pending and t0 + pending[0][0] <= now:
            offset, _, req = heapq.heappop(pending)
            rid = f"{prefix}-{req.index}"
            t = _Tracked(req, rid, arrival_offset_s=offset)
            state.tracked[req.index] = t
            state.by_id[rid] = t
            t.submit_time = time.perf_counter()
            state.active[rid] = t
            try:
                t.seq = engine.add_request(list(req.prompt_token_ids),
                                           _sampling_params(req, temperature, seed, structured_output),
                                           request_id=rid, arrival_time=t0 + offset,
                                           priority=req.priority)
            except ValueError as e:  # never fits: a rejected request, the run goes on
                t.error = f"{type(e).__name__}: {e}"
                state.active.pop(rid, None)
                state.num_finished += 1
                release_next_turn(t)
                if progress is not None:
                    progress.update(1)
        if engine.has_unfinished_requests():
            outs = engine.step()
            state.num_steps += 1
            for o in outs or ():
                t = state.by_id.get(getattr(o, "request_id", None))
                if t is None:
                    continue
                t.last_output = o
                if getattr(o, "finished", False) and state.active.pop(t.request_id, None) is not None:
                    state.num_finished += 1
                    release_next_turn(t)
                    if progress is not None:
                        progress.update(1)
            if on_step is not None:
                on_step()
        elif pending:
            wait = t0 + pending[0][0] - time.perf_counter()
            if deadline is not None:
                wait = min(wait, deadline - time.perf_counter() + 1e-3)
            if wait > 0:
                time.sleep(wait)
        else:
            break
    state.t_end = time.perf_counter()


def _records(state: _RunState, workload: Workload | None) -> tuple[list[RequestRecord], list[list[int]]]:
    records: list[RequestRecord] = []
    tokens: list[list[int]] = []
    if workload is None:
        return records, tokens
    for req in workload.requests:
        t = state.tracked.get(req.index)
        if t is None:
            records.append(build_request_record(req.index, f"bench-{req.index}", prompt_len=req.prompt_len,
                                                max_tokens=req.max_tokens, priority=req.priority,
                                                arrival_offset_s=req.arrival_offset_s,
                                                status="unfinished", error="never submitted"))
            tokens.append([])
            continue
        status, reason, metrics, out_ids = _finish_status(t)
        arrival = req.arrival_offset_s if t.arrival_offset_s is None else t.arrival_offset_s
        records.append(build_request_record(
            req.index, t.request_id, prompt_len=req.prompt_len, max_tokens=req.max_tokens,
            priority=req.priority, arrival_offset_s=arrival, metrics=metrics,
            output_len=len(out_ids), finish_reason=reason, status=status, error=t.error,
            submit_time=t.submit_time))
        tokens.append(out_ids)
    return records, tokens


def _kv_section(engine: Any, state: _RunState, opts: BenchmarkOptions, max_model_len: int | None) -> dict[str, Any]:
    base = {"available": False, "reason": None, "block_size": None, "num_total_blocks": None,
            "usage_peak": None, "peak_blocks_in_use": None, "peak_paged_tokens": None,
            "peak_contiguous_tokens": None, "peak_request_max_tokens": None,
            "memory_reduction_vs_contiguous": None, "memory_reduction_vs_request_max": None,
            "bytes_per_token": None, "peak_paged_bytes": None, "peak_contiguous_bytes": None,
            "definition": ("contiguous = every running sequence reserves max_model_len tokens "
                           "(preallocated per-sequence cache); request_max = each reserves "
                           "prompt_len + max_tokens; paged = blocks in use x block_size; "
                           "peaks over the measured steps, reduction = 1 - paged/contiguous"),
            "final_stats": None}
    if opts.config == "naive":
        base["reason"] = "naive engine keeps no KV cache (full-prefix recompute every token)"
        return base
    if engine is None:
        base["reason"] = "engine was not built"
        return base
    try:
        stats = dict(engine.stats())
    except Exception as e:  # noqa: BLE001
        stats = {"error": f"{type(e).__name__}: {e}"}
    base["final_stats"] = stats
    bs = stats.get("block_size") or getattr(engine, "block_size", None) or opts.block_size
    base["block_size"] = bs
    base["num_total_blocks"] = stats.get("num_total_blocks")
    peak = state.kv_usage_peak
    hw = stats.get("kv_cache_usage_high_water")
    if isinstance(hw, (int, float)):  # the engine's high-water (reset after warm-up, see run)
        peak = max(peak or 0.0, float(hw))
    base["usage_peak"] = peak
    if state.peak_blocks == 0:
        base["reason"] = "no running sequence with KV blocks was observed"
        return base
    base.update(available=True, peak_blocks_in_use=state.peak_blocks,
                peak_paged_tokens=state.peak_paged_tokens,
                peak_contiguous_tokens=state.peak_contiguous_tokens,
                peak_request_max_tokens=state.peak_request_max_tokens)
    if state.peak_contiguous_tokens:
        base["memory_reduction_vs_contiguous"] = 1.0 - state.peak_paged_tokens / state.peak_contiguous_tokens
    if state.peak_request_max_tokens:
        base["memory_reduction_vs_request_max"] = 1.0 - state.peak_paged_tokens / state.peak_request_max_tokens
    mc = getattr(engine, "model_config", None)
    try:
        import torch
        elt = torch.empty((), dtype=engine.config.torch_dtype).element_size()
        bpt = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elt
        base.update(bytes_per_token=bpt, peak_paged_bytes=bpt * state.peak_paged_tokens,
                    peak_contiguous_bytes=bpt * state.peak_contiguous_tokens)
    except Exception:  # noqa: BLE001 - bytes are a nicety
        pass
    return base


class _GCPauses:
    """Python garbage-collector passes during the measured phase (``gc.callbacks``): how many,
    the longest and the total, in ms. Each pass stops the step loop, so its longest pause is
    the longest host pause the collector adds to an inter-token latency."""

    def __init__(self) -> None:
        self.count, self.max_ms, self.total_ms, self._t0 = 0, 0.0, 0.0, None

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt = (time.perf_counter() - self._t0) * 1e3
            self.count += 1
            self.max_ms = max(self.max_ms, dt)
            self.total_ms += dt
            self._t0 = None

    def start(self) -> "_GCPauses":
        import gc

        gc.callbacks.append(self._cb)
        return self

    def stop(self) -> dict:
        import gc

        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)
        return {"gc_collections": self.count, "gc_max_pause_ms": round(self.max_ms, 3),
                "gc_total_pause_ms": round(self.total_ms, 3)}


def run_benchmark(opts: BenchmarkOptions, engine_factory: Callable[[Any, bool], Any] | None = None,
                  parts_cache: Any = None) -> tuple[dict[str, Any], Path, Path]:
    """Run one benchmark and write its JSON report and CSV row (also on failure).

    Args:
        opts: the options (CLI flags).
        engine_factory: ``(EngineConfig, naive: bool) -> engine``; default builds the real one.
        parts_cache: an :class:`~llmserve.engine.builder.EnginePartsCache` shared by the runs
            of one process (the pipeline's cells): the default factory's paged engine takes the
            device parts an earlier run of the same engine settings left there, and a run that
            ends with its engine idle leaves its own (``warmup.engine_startup.reused_parts``
            says which runs took them). Not used with ``engine_factory`` or a speculative model.

    Returns:
        ``(report, json_path, csv_path)``.
    """
    wall0 = time.perf_counter()
    out_path = opts.resolved_output()
    csv_path = opts.resolved_csv(out_path)
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "status": "failed", "error": None,
        "created_at": utc_now(), "wall_time_s": None, "command": opts.command or None,
        "config": {k: v for k, v in dataclasses.asdict(opts).items() if k != "command"},
        "engine_config": None, "profile": None, "profile_path": None, "seed": opts.seed,
        "workload": None, "warmup": None, "git": git_info(), "versions": package_versions(),
        "hardware": hardware_info(opts.device), "requests": [], "aggregates": None,
        "kv_cache": None, "gpu": empty_gpu_summary("run did not reach the measured phase"),
        "component_profile": None, "token_digest": None, "speculative": None, "structured_output": None,
        "code_hash": opts.code_hash, "trace": None,
    }
    engine = None
    shares_parts = False     # built through parts_cache (a custom factory's engine never is)
    workload: Workload | None = None
    state = _RunState()
    monitor: GPUMonitor | None = None
    max_model_len = opts.max_model_len
    try:
        profile, ppath = load_profile(opts.profile)
        report["profile_path"] = ppath
        seed = int(profile["seed"] if opts.seed is None else opts.seed)
        report["seed"] = seed
        n_warm = int(profile["warmup_requests"] if opts.warmup_requests is None else opts.warmup_requests)
        if opts.burstiness is not None:
            profile["arrival"]["burstiness"] = float(opts.burstiness)
        if opts.workload is not None:
            profile = validate_profile({**profile, "workload": {**profile["workload"], "kind": opts.workload}},
                                       source=ppath)
        structured = None
        if opts.json_schema:
            structured, report["structured_output"] = load_json_schema(opts.json_schema)
        if opts.trace:    # a path that cannot be written fails now, not after the run
            check_trace_path(opts.trace)
        econf = make_engine_config(opts, seed)
        report["engine_config"] = dataclasses.asdict(econf)
        report["config"].update(resolved_flags(econf))   # what the device defaults resolved to
        if engine_factory is None and opts.speculative_model:
            engine_factory = _speculative_engine_factory(opts)
        t_build = time.perf_counter()
        if engine_factory is not None and parts_cache is not None:
            parts_cache.clear()   # this engine takes no parts: the held ones' memory goes back first
        if engine_factory is None and parts_cache is not None:
            from ..engine import build_engine

            engine = build_engine(econf, opts.config == "naive", parts_cache=parts_cache)
            shares_parts = True
        else:
            engine = (engine_factory or default_engine_factory)(econf, opts.config == "naive")
        build_s = time.perf_counter() - t_build
        if structured is not None:       # compile it now: a schema the grammar library refuses fails the run
            check = getattr(engine, "check_structured_output", None)
            if callable(check):
                try:
                    check(structured)
                except ValueError as e:
                    raise ValueError(f"--json-schema {opts.json_schema!r}: {e}") from None
        max_model_len = int(getattr(engine, "max_model_len", None) or opts.max_model_len)
        vocab = _base_vocab(engine)
        tok = getattr(engine, "tokenizer", None)
        workload = build_workload(profile, seed=seed, num_requests=opts.requests,
                                  arrival_rate=opts.arrival_rate, tokenizer=tok, vocab_size=vocab,
                                  sharegpt_path=opts.dataset_path)
        report["profile"] = workload.profile
        report["workload"] = workload.summary()
        temperature = float(profile["temperature"])

        t_start = time.perf_counter()
        deadline = t_start + opts.timeout if opts.timeout else None
        kernel_warmup = None
        if opts.kernel_warmup and hasattr(engine, "warmup"):
            kernel_warmup = engine.warmup()
        if n_warm:
            warm = build_workload(profile, seed=seed, num_requests=n_warm, arrival_rate=math.inf,
                                  tokenizer=tok, vocab_size=vocab, stream=1,
                                  sharegpt_path=opts.dataset_path)
            _drive(engine, warm, _RunState(), prefix="warmup", temperature=temperature, seed=seed + 1,
                   deadline=deadline, structured_output=structured)
        from ..engine.triton_cache import triton_cache_entries, triton_kernel_names

        cache0 = triton_cache_entries()
        report["warmup"] = {"num_requests": n_warm, "wall_time_s": time.perf_counter() - t_start,
                            "engine_build_s": build_s,
                            # the build by phase (load, kv_cache, graph_capture seconds; pool size)
                            "engine_startup": dict(getattr(engine, "startup", None) or {}) or None,
                            "kernel_warmup": kernel_warmup,
                            "triton_compiles_measured": None, "triton_kernels_compiled_measured": None}
        freeze_gc = getattr(engine, "freeze_gc", None)
        if callable(freeze_gc):
            freeze_gc()  # the warm-up's survivors out of the collector's way (EngineConfig.freeze_gc)
        reset_stats = getattr(engine, "reset_stats", None)
        if callable(reset_stats):
            reset_stats()  # engine counters (KV high-water, speculative, ...) of the measured phase only

        block_size = int(getattr(engine, "block_size", None) or opts.block_size)
        if opts.trace and not hasattr(engine, "tracer"):
            raise ValueError(f"--trace: the {opts.config} engine records no request lifecycle")
        if hasattr(engine, "tracer"):   # the measured requests only; None detaches an earlier run's
            state.tracer = engine.tracer = RequestTracer() if opts.trace else None
        gc_pauses = _GCPauses().start()
        monitor = GPUMonitor(opts.device).start()
        progress = None
        if opts.progress and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                progress = tqdm(total=len(workload), desc=f"benchmark {opts.config}", unit="req",
                                file=sys.stderr)
            except ImportError:  # pragma: no cover
                progress = None
        try:
            _drive(engine, workload, state, prefix="bench", temperature=temperature, seed=seed,
                   deadline=deadline, progress=progress, structured_output=structured,
                   on_step=lambda: _sample_kv(engine, state, block_size, max_model_len))
        finally:
            if progress is not None:
                progress.close()
            report["gpu"] = monitor.stop()
            monitor = None
            report["host"] = gc_pauses.stop()
            # wall seconds of each phase of the measured steps (LLMEngine.step_seconds: host
            # work, and the host's wait for the device in "device_wait"); None where the
            # engine keeps none (the naive control)
            stats = getattr(engine, "step_seconds", None)
            report["host"]["step_seconds"] = (
                {k: round(v, 6) for k, v in stats.items()} if isinstance(stats, dict) else None)
            if state.tracer is not None:
                engine.tracer = None
        cache1 = triton_cache_entries()
        if cache0 is not None and cache1 is not None:
            # kernels compiled inside the measured phase (each one a stall of every running request)
            compiled = triton_kernel_names(cache1 - cache0)
            report["warmup"]["triton_compiles_measured"] = len(compiled)
            report["warmup"]["triton_kernels_compiled_measured"] = compiled

        if opts.profile_components:
            k = max(1, min(len(workload), econf.scheduler.max_num_seqs))
            prompts = [(r.prompt_token_ids, _sampling_params(r, temperature, seed, structured), r.priority)
                       for r in workload.requests[:k]]
            report["component_profile"] = (
                run_component_profile(engine, prompts, device=opts.device, max_steps=opts.profile_steps)
                if prompts else unavailable_profile("the workload has no requests"))
        report["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a failed run is a row, never a missing file
        report["status"] = "failed"
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc(limit=20)
        if monitor is not None:
            report["gpu"] = monitor.stop()
        if opts.profile_components and report["component_profile"] is None:
            report["component_profile"] = unavailable_profile("the run failed before profiling")
        if not isinstance(e, Exception):  # KeyboardInterrupt/SystemExit: write, then re-raise
            _finish_report(report, opts, state, workload, engine, max_model_len, wall0, out_path, csv_path)
            raise
    _finish_report(report, opts, state, workload, engine, max_model_len, wall0, out_path, csv_path)
    if parts_cache is not None:   # a failed run's engine may hold requests: its parts are dropped
        if report["status"] == "ok" and shares_parts:
            parts_cache.put(engine)
        else:
            parts_cache.clear()
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()   # tensor parallelism: the other ranks stop
    return report, out_path, csv_path


def _finish_report(report: dict[str, Any], opts: BenchmarkOptions, state: _RunState,
                   workload: Workload | None, engine: Any, max_model_len: int, wall0: float,
                   out_path: Path, csv_path: Path) -> None:
    try:
        records, tokens = _records(state, workload)
        duration = (state.t_end or time.perf_counter()) - state.t0 if state.t0 is not None else None
        kv = _kv_section(engine, state, opts, max_model_len)
        gpu = report.get("gpu") or {}
        extra = {"kv_cache_usage_peak": kv.get("usage_peak"),
                 "kv_memory_reduction_vs_contiguous": kv.get("memory_reduction_vs_contiguous"),
                 "gpu_util_mean": gpu.get("util_mean"), "gpu_util_peak": gpu.get("util_peak"),
                 "gpu_memory_peak_bytes": gpu.get("memory_used_peak_bytes")}
        pc = (kv.get("final_stats") or {}).get("prefix_cache") or {}
        if pc:
            extra.update(prefix_cache_queries=pc.get("queries"), prefix_cache_hits=pc.get("hits"),
                         prefix_cache_hit_rate=pc.get("hit_rate"),
                         prefix_cache_cached_blocks=pc.get("cached_blocks"),
                         prefix_cache_evicted_blocks=pc.get("evicted_blocks"))
        report["kv_cache"] = kv
        if hasattr(engine, "speculative_stats"):
            report["speculative"] = engine.speculative_stats()
        if report.get("structured_output") is not None:
            report["structured_output"]["engine"] = (kv.get("final_stats") or {}).get("structured_output")
        report["aggregates"] = aggregate_records(records, duration, slo_ttft_ms=opts.slo_ttft_ms,
                                                 slo_tpot_ms=opts.slo_tpot_ms, extra=extra)
        report["aggregates"]["num_steps"] = state.num_steps
        report["requests"] = [r.to_dict(include_itl=opts.save_itl) for r in records]
        report["token_digest"] = token_digest(tokens) if workload is not None else None
        if state.tracer is not None:
            n = write_trace(opts.trace, state.tracer.events(origin=state.t0 or 0.0))
            report["trace"] = {"path": str(opts.trace), "num_events": n,
                               "clock": "seconds since the measured phase began"}
    except Exception as e:  # noqa: BLE001 - never lose the report
        report["status"] = "failed"
        report["error"] = (report.get("error") or "") + f" | report assembly failed: {type(e).__name__}: {e}"
        if report.get("aggregates") is None:
            report["aggregates"] = aggregate_records([], None)
    report["wall_time_s"] = time.perf_counter() - wall0
    write_json(out_path, report)
    append_csv_row(csv_path, csv_row(report, out_path))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
