"""Benchmark reports: one JSON document per run and one CSV row of flat aggregates.

The JSON schema is explicit so that the Snakemake aggregation can rely on it:
:data:`REQUIRED_FIELDS` are the top-level keys every report has (failed runs included; values
may be ``null``), :data:`REQUIRED_AGGREGATE_KEYS` the keys of ``report["aggregates"]`` and
:data:`REQUIRED_REQUEST_KEYS` those of each ``report["requests"][i]``. :func:`validate_report`
checks a parsed report against them. ``SCHEMA_VERSION`` changes whenever a key is removed or
changes meaning (adding keys keeps the version).

The CSV has the columns :data:`CSV_COLUMNS` (run identification, then the aggregates); a new
file gets the header, an existing one gets the row appended under its own header.

Nothing identifying the host is recorded: no hostname, user name or absolute home paths; the
hardware is described by CPU model, core count, memory size and GPU name.
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from .metrics import AGGREGATE_KEYS

__all__ = ["SCHEMA_VERSION", "REQUIRED_FIELDS", "REQUIRED_AGGREGATE_KEYS", "REQUIRED_REQUEST_KEYS",
           "CSV_COLUMNS", "validate_report", "write_json", "append_csv_row", "csv_row",
           "token_digest", "git_info", "package_versions", "hardware_info", "utc_now",
           "json_safe"]

SCHEMA_VERSION = 1

#: Top-level keys of every benchmark JSON report.
REQUIRED_FIELDS: tuple[str, ...] = (
    "schema_version",     # int, SCHEMA_VERSION
    "status",             # "ok" | "failed"
    "error",              # null | "ExceptionType: message"
    "created_at",         # ISO 8601 UTC start time
    "wall_time_s",        # whole command, engine load included
    "command",            # argv list
    "config",             # resolved benchmark options (every CLI flag)
    "engine_config",      # EngineConfig as a dict (null if it could not be built)
    "profile",            # validated load profile content (after CLI overrides)
    "profile_path",       # file it came from (null for a built-in)
    "seed",               # workload and engine seed
    "workload",           # summary: counts, totals, arrival rate, digest of the request specs
    "warmup",             # {"num_requests", "wall_time_s", "engine_build_s", ...}
    "git",                # {"revision", "dirty", "untracked"}
    "versions",           # python, torch, transformers, triton, numpy, tokenizers, llmserve
    "hardware",           # device, device_name, cpu_model, cpu_count, memory_bytes, gpu_*
    "requests",           # per-request records (REQUIRED_REQUEST_KEYS), index order
    "aggregates",         # REQUIRED_AGGREGATE_KEYS
    "kv_cache",           # usage high-water, paged vs contiguous reservation (null fields + reason on naive)
    "gpu",                # NVML utilisation / memory high-water (null fields + reason on CPU)
    "component_profile",  # null unless --profile-components; else components with totals and shares
    "token_digest",       # sha256 of all generated token ids in request order (see token_digest)
)

REQUIRED_AGGREGATE_KEYS: tuple[str, ...] = AGGREGATE_KEYS

REQUIRED_REQUEST_KEYS: tuple[str, ...] = (
    "index", "request_id", "status", "prompt_len", "max_tokens", "output_len", "priority",
    "finish_reason", "error", "arrival_offset_s", "submit_lag_ms", "queue_ms", "ttft_ms",
    "tpot_ms", "e2e_ms", "itl_ms_mean", "itl_ms_max", "num_preemptions", "num_recomputed_tokens",
)

_CSV_META: tuple[str, ...] = (
    "created_at", "status", "config", "policy", "max_num_seqs", "prefill_chunk_size",
    "max_num_batched_tokens", "block_size", "num_blocks", "attention_backend",
    "linear_backend", "model", "device", "dtype", "profile", "seed", "requests", "arrival_rate",
    "warmup_requests", "git_revision", "git_dirty", "hardware", "token_digest", "workload_digest",
    "wall_time_s", "error", "output", "enable_prefix_caching", "workload_kind",
)
#: Columns of the one-row-per-run CSV.
CSV_COLUMNS: tuple[str, ...] = _CSV_META + AGGREGATE_KEYS


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def validate_report(report: Mapping[str, Any]) -> list[str]:
    """Problems with a parsed report (empty list when it follows the schema)."""
    problems = [f"missing top-level key {k!r}" for k in REQUIRED_FIELDS if k not in report]
    if report.get("status") not in ("ok", "failed"):
        problems.append(f"status must be 'ok' or 'failed', got {report.get('status')!r}")
    if report.get("status") == "failed" and not report.get("error"):
        problems.append("a failed report must carry its error text")
    agg = report.get("aggregates")
    if not isinstance(agg, Mapping):
        problems.append("aggregates must be an object")
    else:
        problems += [f"missing aggregate {k!r}" for k in REQUIRED_AGGREGATE_KEYS if k not in agg]
    reqs = report.get("requests")
    if not isinstance(reqs, list):
        problems.append("requests must be a list")
    else:
        for i, r in enumerate(reqs):
            missing = [k for k in REQUIRED_REQUEST_KEYS if k not in r]
            if missing:
                problems.append(f"requests[{i}] misses {missing}")
                break
    return problems


# ---------------------------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------------------------
def token_digest(token_ids_in_order: Iterable[Iterable[int] | None]) -> str:
    """sha256 hex of the generated token ids, request by request in index order.

    Each request contributes ``",".join(ids) + "\\n"`` (an empty line when it produced nothing),
    so equal digests mean the same tokens for the same requests in the same order.
    """
    h = hashlib.sha256()
    for ids in token_ids_in_order:
        h.update((",".join(str(int(t)) for t in (ids or ())) + "\n").encode())
    return h.hexdigest()


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


#: Paths (relative to the checkout root) whose tracked changes make a run "dirty": the engine and
#: the pipeline that drives it. Results, docs and checksums are outputs, never sources.
SOURCE_PATHS = ("engine", "workflow", "Snakefile", "config", "pyproject.toml")


@lru_cache(maxsize=1)
def _git_info_cached() -> tuple[str | None, bool | None, int | None]:
    here = Path(__file__).resolve().parent
    rev = _git(["rev-parse", "HEAD"], here)
    cwd = here
    if rev is None:
        cwd = Path.cwd()
        rev = _git(["rev-parse", "HEAD"], cwd)
    if rev is None:
        return None, None, None
    top = (_git(["rev-parse", "--show-toplevel"], cwd) or "").strip() or str(cwd)
    # Only the sources count: results/ (which a pipeline run rewrites), docs and checksums do not.
    status = _git(["status", "--porcelain", "--", *SOURCE_PATHS], Path(top)) or ""
    lines = [ln for ln in status.splitlines() if ln.strip()]
    dirty = any(not ln.startswith("??") for ln in lines)
    untracked = sum(1 for ln in lines if ln.startswith("??"))
    return rev.strip(), dirty, untracked


def git_info() -> dict[str, Any]:
    """``{"revision", "dirty", "untracked"}`` of the llmserve source checkout (or the cwd's);
    null fields outside a git checkout. ``dirty`` is True when a tracked file under
    :data:`SOURCE_PATHS` (engine, workflow, Snakefile, config) differs from ``revision``;
    ``untracked`` is the number of untracked, non-ignored files there."""
    rev, dirty, untracked = _git_info_cached()
    return {"revision": rev, "dirty": dirty, "untracked": untracked}


def package_versions() -> dict[str, str | None]:
    """Versions of the packages that shape the numbers (None if not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "triton", "numpy", "tokenizers", "safetensors",
                 "nvidia-ml-py", "llmserve"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        import llmserve
        out["llmserve"] = getattr(llmserve, "__version__", out["llmserve"])
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch
        out["cuda"] = torch.version.cuda
    except ImportError:  # pragma: no cover
        out["cuda"] = None
    return out


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("model name", "hardware", "cpu model", "processor") and ":" in line:
                    val = line.split(":", 1)[1].strip()
                    if val and not val.isdigit():
                        return val
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            r = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                               text=True, timeout=5)
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or None


def _memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def hardware_info(device: str) -> dict[str, Any]:
    """Hostname-free hardware description for ``device`` (``cpu`` or ``cuda[:N]``)."""
    info: dict[str, Any] = {
        "device": device, "device_name": None, "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(), "memory_bytes": _memory_bytes(),
        "machine": platform.machine(), "os": f"{platform.system()} {platform.release()}",
        "gpu_name": None, "gpu_count": 0, "gpu_memory_bytes": None, "gpu_capability": None,
    }
    try:
        import torch
        if torch.cuda.is_available():
            idx = int(device.split(":", 1)[1]) if device.startswith("cuda:") else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            info.update(gpu_name=props.name, gpu_count=torch.cuda.device_count(),
                        gpu_memory_bytes=int(props.total_memory),
                        gpu_capability=f"{props.major}.{props.minor}")
    except Exception:  # noqa: BLE001 - a broken CUDA setup still gets a report
        pass
    info["device_name"] = info["gpu_name"] if device.startswith("cuda") else info["cpu_model"]
    try:  # torch's intra-op thread count (torch.set_num_threads / OMP_NUM_THREADS)
        import torch
        info["torch_threads"] = int(torch.get_num_threads())
    except Exception:  # noqa: BLE001
        info["torch_threads"] = None
    return info


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def json_safe(obj: Any) -> Any:
    """Recursively replace non-finite floats (``inf`` -> ``"inf"``, ``nan`` -> None), tuples
    by lists, paths and other objects by strings, so ``json.dump(allow_nan=False)`` works."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return json_safe(obj.item())
        except (TypeError, ValueError):
            pass
    return str(obj)


def write_json(path: str | os.PathLike, report: Mapping[str, Any]) -> Path:
    """Write the report atomically (temp file + rename), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(json_safe(report), f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def csv_row(report: Mapping[str, Any], output_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The flat CSV row of a report (keys :data:`CSV_COLUMNS`)."""
    cfg = report.get("config") or {}
    agg = report.get("aggregates") or {}
    hw = report.get("hardware") or {}
    git = report.get("git") or {}
    wl = report.get("workload") or {}
    row: dict[str, Any] = {k: None for k in CSV_COLUMNS}
    for k in ("config", "policy", "max_num_seqs", "prefill_chunk_size", "max_num_batched_tokens",
              "block_size", "num_blocks", "attention_backend", "linear_backend", "model",
              "device", "dtype", "requests", "arrival_rate", "warmup_requests"):
        row[k] = cfg.get(k)
    row.update(created_at=report.get("created_at"), status=report.get("status"),
               profile=(report.get("profile") or {}).get("name") or cfg.get("profile"),
               seed=report.get("seed"), git_revision=git.get("revision"), git_dirty=git.get("dirty"),
               hardware=hw.get("device_name"), token_digest=report.get("token_digest"),
               workload_digest=wl.get("digest"), wall_time_s=report.get("wall_time_s"),
               error=(report.get("error") or None), output=str(output_path) if output_path else None,
               enable_prefix_caching=cfg.get("enable_prefix_caching"),
               workload_kind=((report.get("profile") or {}).get("workload") or {}).get("kind"))
    for k in AGGREGATE_KEYS:
        row[k] = agg.get(k)
    return {k: ("" if v is None else v) for k, v in json_safe(row).items()}


def append_csv_row(path: str | os.PathLike, row: Mapping[str, Any]) -> Path:
    """Append one row; a new (or empty) file gets the :data:`CSV_COLUMNS` header first. An
    existing file keeps its own header (columns it lacks are dropped, with a warning)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(CSV_COLUMNS)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
        if header and header != fields:
            dropped = [k for k in fields if k not in header]
            if dropped:
                print(f"warning: {path} has an older header; dropping columns {dropped}", file=sys.stderr)
            fields = header
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in fields})
    return path
