"""Aggregate checkpoint-3 benchmark runs into the summary, headline, chunked-prefill, rate,
failure-regime and batch-invariant tables.

Input: the JSON reports of ``llmserve benchmark`` (schema: ``llmserve.bench.report``), one
per matrix cell and repetition, each with its ``<cell>.provenance.json`` beside it (written by
``workflow/scripts/run_cells.py``), grouped by sweep. Output, per table: a CSV (every number,
full error text) and a Markdown page (header with the matched run conditions: arrival rate,
requests per run, repetitions, load, model, hardware, torch threads, software, code hash and
git commit; the table; the output digest groups). Usage (the pipeline's ``aggregate`` rule)::

    python workflow/scripts/aggregate_checkpoint3.py --profile cpu \\
        --sweep main raw/a.json raw/b.json --sweep failure_regimes raw/c.json \\
        --defaults '{"rate": "inf", ...}' --headline-batch 8 --out-dir results/checkpoint3/cpu

Rules (docs/benchmarking.md explains them):

* Matching: runs are only put side by side when they share the load profile (content, arrival
  rate excepted: that is a matrix column), seed, request count, model, dtype, warm-up rule,
  software (package versions and the llmserve code hash) and hardware. Otherwise this script
  exits with status 1 and names the field, the differing values and the cells.
* Repetitions: each number is the median over the cell's successful repetitions, with min and
  max; status, errors and request counts cover every repetition.
* Failures stay: a failed cell is a row with its error; nothing is dropped.
* Digests: under greedy decoding every scheduler must generate the same tokens for the same
  workload. A cell's ``token_digest`` is compared with the naive (sequential, no KV cache)
  control that ran the same workload with the same weights (linear backend) in the same
  batch-invariant mode (a cell with the mode on and no such control is compared with the paged
  batch-1 cell in the mode when there is one, as on a GPU, else with the naive control with the
  mode off, and the verdict says so). On a GPU without the mode the verdict
  is ``n/a: not batch-invariant``: random bf16 weights give near-tied logits and the kernels'
  reduction order depends on the batch, so tokens may legitimately differ.
* Batch-invariant mode: each cell of the ``batch_invariant`` sweep with the mode on is shown
  beside the same configuration with it off (its cost as a throughput ratio).
* Contention: a run whose provenance records other processes using more than
  ``--contention``'s ``max_other_cores`` cores, or more than ``max_steal_fraction`` of the CPU
  time stolen, is contended; a cell's status says how many of its runs were, and every page's
  header gives the machine's load over all its runs (``machine_load.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pandas as pd
from machine_load import is_contended  # noqa: E402  (workflow/scripts/, next to this file)
from matrix_columns import SLICE_COLUMNS  # noqa: E402
from matrix_columns import COLUMN_NAMES, ID_DEFAULTS, parse_cell_id  # noqa: E402

#: The matrix columns (workflow/scripts/matrix_columns.py), in cell-id order.
PARAM_COLUMNS = list(COLUMN_NAMES)
#: A parameter's value when a cell id (or an older provenance file) does not name it.
PARAM_DEFAULTS = ID_DEFAULTS

#: Numbers aggregated over repetitions: output column stem -> key of report["aggregates"].
METRICS = OrderedDict([
    ("output_throughput", "output_throughput"),      # output tokens / s of the measured phase
    ("ttft_p50_ms", "ttft_ms_p50"),
    ("ttft_p95_ms", "ttft_ms_p95"),
    ("tpot_p50_ms", "tpot_ms_p50"),
    ("tpot_p95_ms", "tpot_ms_p95"),
    ("itl_p95_ms", "itl_ms_p95"),
    ("itl_p99_ms", "itl_ms_p99"),
    ("e2e_p95_ms", "e2e_ms_p95"),
    ("goodput", "goodput"),                           # requests/s meeting both SLOs (DistServe)
    ("slo_attainment", "slo_attainment"),
    ("request_throughput", "request_throughput"),
    ("kv_usage_peak", "kv_cache_usage_peak"),         # fraction of the KV blocks, high-water
    ("kv_memory_reduction", "kv_memory_reduction_vs_contiguous"),
    ("preemptions", "num_preemptions"),
    ("recomputed_tokens", "num_recomputed_tokens"),
    ("completed", "num_completed"),
])
#: Metrics with min and max over repetitions in the CSV (shown as median [min–max]).
RANGED = ("output_throughput", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms",
          "itl_p95_ms", "itl_p99_ms", "e2e_p95_ms", "goodput", "slo_attainment",
          "request_throughput")


class MatchError(ValueError):
    """Runs that must not be compared were given together."""


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def provenance_path(report_path: Path) -> Path:
    """``raw/X.json`` -> ``raw/X.provenance.json``."""
    return report_path.with_name(report_path.name[: -len(".json")] + ".provenance.json")


def _profile_sans_rate(profile: dict | None) -> str | None:
    if not profile:
        return None
    p = json.loads(json.dumps(profile))
    (p.get("arrival") or {}).pop("rate", None)
    return json.dumps(p, sort_keys=True)


def load_run(path: Path, sweep: str, contention: dict[str, float] | None = None) -> dict[str, Any]:
    """One run (report + provenance) flattened into the fields the tables need; ``contention``
    holds the thresholds of :func:`machine_load.is_contended` (default: 0.5 cores, 5%)."""
    limits = {"max_other_cores": 0.5, "max_steal_fraction": 0.05, **(contention or {})}
    report = json.loads(path.read_text())
    prov_file = provenance_path(path)
    prov = json.loads(prov_file.read_text()) if prov_file.exists() else {}
    cell_id = path.name[: -len(".json")]
    params = prov.get("params") or parse_cell_id(cell_id)
    cfg = report.get("config") or {}
    econf = report.get("engine_config") or {}
    agg = report.get("aggregates") or {}
    hw = dict(report.get("hardware") or {})
    if prov.get("thread_env"):
        hw["thread_env"] = prov["thread_env"]
    # On a CPU the batch-invariant mode runs torch on one intra-op thread whatever the process
    # asked for (engine/builder.py): its cells are matched with the others on the thread count
    # the process asked for, every other hardware field as recorded.
    invariant = econf.get("batch_invariant", cfg.get("batch_invariant"))
    hw_match = dict(hw)
    if invariant and "torch_threads" in hw:
        hw_match["torch_threads"] = prov.get("torch_threads", cfg.get("torch_threads", hw["torch_threads"]))
    versions = dict(report.get("versions") or {})
    if prov.get("code_hash"):
        versions["llmserve_code_hash"] = prov["code_hash"]
    profile = report.get("profile") or {}
    warm = (report.get("warmup") or {}).get("num_requests", cfg.get("warmup_requests"))
    run = {
        "path": str(path), "sweep": sweep, "cell": cell_id.rsplit("_rep~", 1)[0],
        **{k: str(params.get(k, PARAM_DEFAULTS.get(k))) for k in PARAM_COLUMNS},
        "rep": str(params.get("rep", "0")),
        "slo": {"ttft_ms": agg.get("slo_ttft_ms"), "tpot_ms": agg.get("slo_tpot_ms")},
        "arrival_rate": (profile.get("arrival") or {}).get("rate"),
        "torch_threads": prov.get("torch_threads", hw.get("torch_threads")),
        # the mode the engine reported (None: no engine config, e.g. a crash stub)
        "batch_invariant": invariant,
        "status": report.get("status") or "failed",
        "error": report.get("error") or None,
        "num_requests": agg.get("num_requests"),
        "token_digest": report.get("token_digest"),
        "temperature": profile.get("temperature"),
        "created_at": report.get("created_at"),
        "git_revision": (report.get("git") or {}).get("revision"),
        "git_dirty": (report.get("git") or {}).get("dirty"),
        # Fields that must agree for runs to be compared (None = unknown, e.g. a crash stub).
        "match": OrderedDict([
            ("load profile", _profile_sans_rate(profile)),
            ("load profile name", profile.get("name")),
            ("seed", report.get("seed")),
            ("requests", (report.get("workload") or {}).get("num_requests", cfg.get("requests"))),
            ("model", cfg.get("model") or econf.get("model")),
            ("dtype", econf.get("dtype") or cfg.get("dtype")),
            ("warm-up requests", warm),
            ("software versions", json.dumps(versions, sort_keys=True) if versions else None),
            ("hardware", json.dumps(hw_match, sort_keys=True) if hw_match else None),
        ]),
        "profile": profile, "versions": versions, "hardware": hw,
        # the machine's load while the run ran (None: not recorded by this run)
        "machine_load": prov.get("machine_load"),
        "contended": is_contended(prov.get("machine_load"), limits["max_other_cores"],
                                  limits["max_steal_fraction"]),
    }
    for col, key in METRICS.items():
        v = agg.get(key)
        run[col] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None
    return run


# ---------------------------------------------------------------------------------------------
# Matching rules
# ---------------------------------------------------------------------------------------------
#: Matching fields that may differ between loads (the `load` column) but not within one.
PER_LOAD_FIELDS = ("load profile", "load profile name", "requests")


def check_modes(runs: list[dict[str, Any]]) -> None:
    """Raise :class:`MatchError` for a run whose report's batch-invariant mode is not the one
    its cell id names (a report without an engine config, e.g. a crash stub, is not checked)."""
    for r in runs:
        recorded = r["batch_invariant"]
        if recorded is not None and bool(recorded) != (r["invariant"] == "on"):
            raise MatchError(f"{r['path']}: the cell says invariant {r['invariant']}, its report "
                             f"says batch_invariant {bool(recorded)}")


def check_matching(runs: list[dict[str, Any]]) -> OrderedDict:
    """The common value of every matching field; raises :class:`MatchError` naming the field.

    The load profile and request count must agree among the runs of one load (the `load`
    column); everything else among all runs. A field that is unknown (None) in a run, e.g. the
    load profile of a run that failed before loading it, does not count as a difference.
    """
    common: OrderedDict = OrderedDict()
    if not runs:
        return common
    fields = [f for f in runs[0]["match"] if f not in PER_LOAD_FIELDS]
    common.update(_check_fields(runs, fields))
    by_load: OrderedDict[str, list] = OrderedDict()
    for r in runs:
        by_load.setdefault(r.get("load", "default"), []).append(r)
    for load, part in by_load.items():
        values = _check_fields(part, list(PER_LOAD_FIELDS))
        if load == next(iter(by_load)):
            common.update(values)
    return common


def _check_fields(runs: list[dict[str, Any]], fields: list[str]) -> OrderedDict:
    common: OrderedDict = OrderedDict()
    for field in fields:
        by_value: dict[Any, list[str]] = OrderedDict()
        for r in runs:
            v = r["match"][field]
            if v is not None:
                by_value.setdefault(v, []).append(Path(r["path"]).name)
        if len(by_value) > 1:
            key = _first_differing_key(list(by_value))
            lines = []
            for v, cells in by_value.items():
                shown = f"{key} = {json.loads(v).get(key)!r}" if key else str(v)
                shown = shown if len(shown) <= 240 else shown[:240] + "..."
                more = f" (+{len(cells) - 3} more)" if len(cells) > 3 else ""
                lines.append(f"  {shown}\n    in {', '.join(cells[:3])}{more}")
            hint = ("the runs were measured on different llmserve sources: rerun them on one "
                    "version (`snakemake --forceall results/checkpoint3`)"
                    if key == "llmserve_code_hash" else
                    "rerun the differing cells under the same conditions (e.g. `snakemake "
                    "--forcerun benchmark_<sweep>_rep<N>`), or keep them in separate profiles")
            raise MatchError(
                f"refusing to put runs side by side: {field!r} differs between runs"
                f"{f' (in {key!r})' if key else ''}:\n" + "\n".join(lines) + f"\nFix: {hint}.")
        common[field] = next(iter(by_value), None)
    return common


def _first_differing_key(values: list[Any]) -> str | None:
    """For JSON-object values, the first key whose value differs (e.g. ``cpu_model``)."""
    try:
        dicts = [json.loads(v) for v in values]
    except (TypeError, ValueError):
        return None
    if not all(isinstance(d, dict) for d in dicts):
        return None
    for key in sorted(set().union(*dicts)):
        if len({json.dumps(d.get(key), sort_keys=True) for d in dicts}) > 1:
            return key
    return None


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------
def _digest_group(r: dict[str, Any]) -> tuple:
    # Same prompts and output lengths (profile minus arrival rate, seed, request count), same
    # weights (model, dtype, linear backend): greedy decoding must give the same tokens.
    # The batch-invariant mode changes reduction orders, so its runs have their own control.
    m = r["match"]
    return (m["load profile"], m["seed"], m["requests"], m["model"], m["dtype"], r["linear"],
            r["invariant"])


def aggregate_cells(runs: list[dict[str, Any]], all_runs: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per cell (repetitions folded), in the order the cells were given."""
    naive_digest: dict[tuple, str] = {}
    batch1_digest: dict[tuple, str] = {}   # paged (batch 1) with the mode: the GPU's control
    for r in all_runs:
        if r["status"] != "ok" or not r["token_digest"]:
            continue
        if r["scheduler"] == "naive":
            naive_digest.setdefault(_digest_group(r), r["token_digest"])
        elif r["scheduler"] == "paged" and r["invariant"] == "on":
            batch1_digest.setdefault(_digest_group(r), r["token_digest"])
    cells: OrderedDict[str, list[dict]] = OrderedDict()
    for r in runs:
        cells.setdefault(r["cell"], []).append(r)
    rows = []
    for cell, reps in cells.items():
        ok = [r for r in reps if r["status"] == "ok"]
        first = reps[0]
        row: dict[str, Any] = {"sweep": first["sweep"], "cell": cell}
        row.update({k: first[k] for k in PARAM_COLUMNS})
        row["repetitions"] = len(reps)
        row["runs_ok"] = len(ok)
        row["status"] = ("ok" if len(ok) == len(reps) else "failed" if not ok
                         else f"partial ({len(ok)}/{len(reps)} ok)")
        row["num_requests"] = first["num_requests"]
        src = ok or reps  # request counts of failed runs too: how far did they get?
        done = [r["completed"] for r in src if r["completed"] is not None]
        row["completed_median"] = float(pd.Series(done).median()) if done else None
        for col in METRICS:
            if col == "completed":
                continue
            vals = pd.Series([r[col] for r in ok if r[col] is not None], dtype="float64")
            row[f"{col}_median"] = float(vals.median()) if len(vals) else None
            if col in RANGED:
                row[f"{col}_min"] = float(vals.min()) if len(vals) else None
                row[f"{col}_max"] = float(vals.max()) if len(vals) else None
        # run-to-run spread of the throughput: population standard deviation over the mean
        tput = pd.Series([r["output_throughput"] for r in ok if r["output_throughput"] is not None],
                         dtype="float64")
        row["output_throughput_cv"] = (float(tput.std(ddof=0) / tput.mean())
                                       if len(tput) >= 2 and tput.mean() else None)
        digests = sorted({r["token_digest"] for r in ok if r["token_digest"]})
        row["token_digest"] = digests[0] if len(digests) == 1 else ("; ".join(digests) or None)
        row["digest_agrees_with_naive"] = _digest_verdict(first, ok, digests, naive_digest, batch1_digest)
        recorded = [r for r in reps if r["contended"] is not None]
        row["runs_contended"] = sum(r["contended"] for r in recorded) if recorded else None
        for key, field in (("other_cores_max", "other_cores"), ("steal_max", "steal_fraction")):
            vals = [r["machine_load"][field] for r in recorded
                    if r["machine_load"].get(field) is not None]
            row[key] = max(vals) if vals else None
        if row["runs_contended"]:
            row["status"] += f", contended {row['runs_contended']}/{len(reps)}"
        errors = list(OrderedDict.fromkeys(r["error"] for r in reps if r["error"]))
        row["error"] = " | ".join(errors) or None
        rows.append(row)
    return pd.DataFrame(rows)


#: Verdict on a GPU without the batch-invariant mode: random bf16 weights give near-tied logits,
#: and the kernels' reduction order depends on the batch, so greedy tokens may legitimately differ.
NOT_BATCH_INVARIANT = "n/a: not batch-invariant"


#: Verdict of the batch-1 control of a batch-invariant cell on a GPU (no naive run in its mode).
BATCH1_REFERENCE = "reference (batch 1 with the mode)"


def _digest_verdict(first: dict, ok: list[dict], digests: list[str], naive: dict,
                    batch1: dict | None = None) -> str:
    if not ok:
        return "n/a (failed)"
    if str((first.get("hardware") or {}).get("device") or "").startswith("cuda") \
            and not first.get("batch_invariant"):
        return "reference" if first["scheduler"] == "naive" else NOT_BATCH_INVARIANT
    if len(digests) > 1:
        return "NO (repetitions differ)"
    if first["scheduler"] == "naive":
        return "reference"
    group, against = _digest_group(first), ""
    ref = naive.get(group)
    if ref is None and first["invariant"] == "on" and group in (batch1 or {}):
        # no naive run in the mode (the GPU: the naive control's reference forward has no
        # fixed-order kernels): the same workload at batch 1 with the mode is the control
        if first["scheduler"] == "paged":
            return BATCH1_REFERENCE
        ref, against = batch1[group], " (vs batch 1 with the mode)"
    if ref is None and first["invariant"] == "on":
        ref, against = naive.get(group[:-1] + ("off",)), " (vs naive with the mode off)"
    if ref is None:
        return "n/a (no naive run)"
    if digests and digests[0] == ref:
        return "yes" + against
    if against == " (vs batch 1 with the mode)":   # the mode's own control: a finding
        return "NO (differs from batch 1 with the mode)"
    if against:  # another mode's control: a difference is no finding
        return "n/a (no naive run with the mode; differs from the one without it)"
    incomplete = [r for r in ok if r["completed"] is not None and r["num_requests"]
                  and r["completed"] < r["num_requests"]]
    if incomplete:
        r = incomplete[0]
        return f"NO ({int(r['num_requests'] - r['completed'])} requests not completed)"
    return "NO"


def baseline_rows(df: pd.DataFrame, base: pd.DataFrame, **replace: str) -> list[pd.Series | None]:
    """For each row of ``df``, the row of ``base`` with the same parameters except those in
    ``replace`` (which take the given values), or None when ``base`` has none."""
    index = {tuple(r[k] for k in PARAM_COLUMNS): r for _, r in base.iterrows()}
    return [index.get(tuple(replace.get(k, r[k]) for k in PARAM_COLUMNS)) for _, r in df.iterrows()]


def _base_value(b: pd.Series | None, column: str) -> Any:
    return None if b is None else b[column]


def add_baselines(failure: pd.DataFrame, main: pd.DataFrame, default_rate: str,
                  default_blocks: str) -> pd.DataFrame:
    """Failure-regime rows vs the same configuration at the default rate and KV budget."""
    failure = failure.copy()
    base = baseline_rows(failure, main, rate=default_rate, blocks=default_blocks)
    failure["baseline_cell"] = [_base_value(b, "cell") for b in base]
    failure["output_throughput_vs_baseline"] = [
        _ratio(r.get("output_throughput_median"), _base_value(b, "output_throughput_median"))
        for (_, r), b in zip(failure.iterrows(), base)]
    failure["ttft_p95_vs_baseline"] = [
        _ratio(r.get("ttft_p95_ms_median"), _base_value(b, "ttft_p95_ms_median"))
        for (_, r), b in zip(failure.iterrows(), base)]
    return failure


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or pd.isna(a) or pd.isna(b) or b == 0:
        return None
    return float(a) / float(b)


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------
def _num(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:,.{digits}f}"


def _ranged(row: pd.Series, stem: str, digits: int = 1) -> str:
    med = row.get(f"{stem}_median")
    if med is None or pd.isna(med):
        return "–"
    lo, hi = row.get(f"{stem}_min"), row.get(f"{stem}_max")
    if row["runs_ok"] > 1 and lo is not None and hi is not None:
        return f"{_num(med, digits)} [{_num(lo, digits)}–{_num(hi, digits)}]"
    return _num(med, digits)


def _pct(v: Any) -> str:
    return "–" if v is None or pd.isna(v) else f"{100 * v:.1f}%"


def _esc(text: Any, limit: int = 160) -> str:
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return ""
    s = str(text).replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _requests(row: pd.Series) -> str:
    c, n = row.get("completed_median"), row.get("num_requests")
    if c is None or pd.isna(c) or n is None or pd.isna(n):
        return "–"
    return f"{int(c) if float(c).is_integer() else c}/{int(n)}"


def _chunk(v: str, scheduler: str = "") -> str:
    if scheduler == "naive":  # no KV cache, no prefill chunks
        return "–"
    return "off" if str(v) == "0" else str(v)


def _attn(row: pd.Series) -> str:
    return "–" if row["scheduler"] == "naive" else str(row["attn"])  # naive: no paged attention


def _invariant_label(runs: list[dict]) -> str:
    """Whether the runs carry the batch-invariant guarantee (``--batch-invariant``)."""
    on = sum(bool(r.get("batch_invariant")) for r in runs)
    if on == 0:
        return "off (a request's tokens may depend on what it was batched with)"
    if on == len(runs):
        return "on in every run (logits independent of batching)"
    return f"on in {on} of {len(runs)} runs"


def header_lines(title: str, profile_name: str, common: OrderedDict, runs: list[dict]) -> list[str]:
    """The run conditions every row shares (the matching fields), for the page header."""
    any_run = next((r for r in runs if r["profile"]), runs[0] if runs else None)
    prof = (any_run or {}).get("profile") or {}
    versions = next((r["versions"] for r in runs if r["versions"]), {})
    hw = next((r["hardware"] for r in runs if r["hardware"]), {})
    revs = sorted({(r["git_revision"] or "?")[:12] + ("+dirty" if r["git_dirty"] else "")
                   for r in runs})
    created = sorted(r["created_at"] for r in runs if r["created_at"])
    temp = prof.get("temperature")
    sw = ", ".join(f"{k} {v}" for k, v in versions.items() if v and k != "llmserve_code_hash")
    rates = sorted({_rate_label(r["rate"], r.get("arrival_rate")) for r in runs}, key=_rate_key)
    reps = sorted({int(r["rep"]) for r in runs})
    requests = sorted({int(r["match"]["requests"]) for r in runs if r["match"]["requests"] is not None})
    threads = sorted({str(r.get("torch_threads")) for r in runs if r.get("torch_threads") is not None})
    slo = next((r["slo"] for r in runs if r["slo"].get("ttft_ms") or r["slo"].get("tpot_ms")), {})
    lines = [
        f"# {title} — profile `{profile_name}`",
        "",
        f"**Arrival rate:** {', '.join(rates)} · **Requests per run:** "
        f"{', '.join(map(str, requests)) or '?'} · **Repetitions:** {len(reps)} "
        "(median [min–max] over them)",
        "",
        "Generated by `workflow/scripts/aggregate_checkpoint3.py` from the raw reports in `raw/`;",
        "do not edit. Columns and rules: `docs/benchmarking.md`. Every run below shares these",
        "conditions (the aggregation refuses to combine runs that differ in any of them):",
        "",
        f"- **Load profile:** `{prof.get('name')}` — "
        f"seed {common.get('seed')}, dataset {(prof.get('dataset') or {}).get('kind')}, "
        f"prompt_len {_lenspec(prof.get('prompt_len'))}, output_len {_lenspec(prof.get('output_len'))}, "
        f"arrival burstiness {(prof.get('arrival') or {}).get('burstiness')}, "
        f"ignore_eos {prof.get('ignore_eos')}, "
        f"temperature {temp} ({'greedy' if temp == 0 else 'sampling'})",
        f"- **Warm-up:** {common.get('warm-up requests')} request(s) before measuring, excluded from statistics",
        f"- **Model:** `{common.get('model')}`, dtype {common.get('dtype')}",
        f"- **Hardware:** {hw.get('device')} — {hw.get('device_name')}"
        + (f", {hw.get('cpu_count')} CPU cores" if hw.get("cpu_count") else "")
        + (f", torch threads {', '.join(threads)}" if threads else "")
        + (f", {hw.get('gpu_count')} x {hw.get('gpu_name')}" if hw.get("gpu_name") else ""),
        f"- **Software:** {sw}",
        f"- **llmserve code hash:** `{(versions.get('llmserve_code_hash') or '?')[:16]}`; "
        f"git {', '.join(revs) or '?'}",
        f"- **Runs:** {len(runs)} ({', '.join(created[:1] + created[-1:]) if created else '?'})",
        f"- **Batch-invariant mode:** {_invariant_label(runs)}",
    ]
    lines.append(f"- **Machine load during the runs:** {_load_line(runs)}")
    if slo:
        lines.append(f"- **Goodput SLOs:** TTFT <= {slo.get('ttft_ms')} ms and TPOT <= "
                     f"{slo.get('tpot_ms')} ms (DistServe's definition: completed requests per "
                     "second meeting both)")
    loads = OrderedDict((r["load"], r["profile"]) for r in runs if r["profile"])
    for name, lp in loads.items():
        if name != "default" or len(loads) > 1:
            lines.append(f"- **Load `{name}`:** `{lp.get('name')}` — prompt_len "
                         f"{_lenspec(lp.get('prompt_len'))}, output_len {_lenspec(lp.get('output_len'))}")
    return lines + [""]


def _load_line(runs: list[dict]) -> str:
    """The machine's load over the runs, and how many were contended (page header)."""
    rec = [r for r in runs if r.get("contended") is not None]
    if not rec:
        return ("not recorded by these runs (the pipeline records it since the runs were made; "
                "a rerun adds it)")
    other = [r["machine_load"]["other_cores"] for r in rec]
    steal = [r["machine_load"].get("steal_fraction") or 0.0 for r in rec]
    loads = [x for r in rec for x in (r["machine_load"].get("loadavg_start") or [None])[:1]
             + (r["machine_load"].get("loadavg_end") or [None])[:1] if x is not None]
    machine = (rec[0]["machine_load"].get("machine") or {})
    n = sum(r["contended"] for r in rec)
    text = (f"other processes used {min(other):.2f}–{max(other):.2f} cores (of "
            f"{machine.get('cpu_count', '?')}), stolen time at most {100 * max(steal):.1f}%, "
            f"1-min load average {min(loads, default=0):.2f}–{max(loads, default=0):.2f}; ")
    gpus = [g for r in rec for g in (r["machine_load"].get("gpu_end") or [])]
    if gpus:
        sm = [g.get("clocks.sm") for g in gpus if isinstance(g.get("clocks.sm"), float)]
        if sm:
            text += f"GPU SM clock {min(sm):.0f}–{max(sm):.0f} MHz at the cells' ends; "
    if n:
        return text + (f"**{n} of {len(runs)} runs contended** (their cells' status says so): "
                       "their numbers are slower than this machine measures when idle")
    return text + f"no run contended ({len(rec)} of {len(runs)} runs recorded)"


def _rate_label(cell_rate: str, profile_rate: Any) -> str:
    rate = profile_rate if cell_rate == "profile" else cell_rate
    if rate is None:
        return "?"
    if str(rate) in ("inf", "Infinity") or (isinstance(rate, float) and math.isinf(rate)):
        return "inf (offline burst: all at t = 0)"
    return f"{float(rate):g} req/s (Poisson)"


def _rate_key(label: str) -> float:
    try:
        return float(label.split()[0])
    except ValueError:
        return math.inf


def _lenspec(spec: dict | None) -> str:
    if not spec:
        return "?"
    d = spec.get("distribution")
    if d == "fixed":
        return f"fixed {spec.get('value')}"
    rng = f"[{spec.get('min')}, {spec.get('max')}]"
    return f"{d} {rng}" + (f" median {spec.get('median')}" if spec.get("median") else "")


def summary_markdown(df: pd.DataFrame, header: list[str], digest_groups: list[str]) -> str:
    lines = list(header)
    lines += ["## Results", "",
              "Median over successful repetitions, [min–max] when there are several. TTFT/TPOT in ms.",
              "",
              "| Scheduler | Policy | Batch | Chunk | Linear | Attn | Output tok/s | p95 TTFT ms "
              "| p95 TPOT ms | KV reduction vs contiguous | KV peak | Preempt | Requests | Status "
              "| Digest = naive | Error |",
              "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(
            f"| {r['scheduler']} | {r['policy']} | {r['batch']} | {_chunk(r['chunk'], r['scheduler'])} "
            f"| {r['linear']} | {_attn(r)} | {_ranged(r, 'output_throughput')} | {_ranged(r, 'ttft_p95_ms', 0)} "
            f"| {_ranged(r, 'tpot_p95_ms', 2)} | {_pct(r['kv_memory_reduction_median'])} "
            f"| {_pct(r['kv_usage_peak_median'])} | {_num(r['preemptions_median'], 0)} "
            f"| {_requests(r)} | {r['status']} | {r['digest_agrees_with_naive']} | {_esc(r['error'])} |")
    lines += ["", *digest_groups]
    return "\n".join(lines) + "\n"


def failure_markdown(df: pd.DataFrame, header: list[str], digest_groups: list[str]) -> str:
    lines = list(header)
    lines += ["## Failure regimes", "",
              "Past saturation (arrival rates above what the configuration sustains, `inf` = all at",
              "t = 0) and KV caches too small for the load (`blocks`: preemption by recompute,",
              "rejections). Ratios compare with the same configuration at the default rate and KV",
              "budget (`vs base`); failed cells and regressions stay in the table.",
              "",
              "| Scheduler | Policy | Batch | Chunk | Rate | Blocks | Output tok/s | vs base "
              "| p95 TTFT ms | vs base | p95 TPOT ms | Preempt | Recomputed tok | KV peak "
              "| Requests | Status | Digest = naive | Error |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(
            f"| {r['scheduler']} | {r['policy']} | {r['batch']} | {_chunk(r['chunk'], r['scheduler'])} "
            f"| {r['rate']} "
            f"| {r['blocks']} | {_ranged(r, 'output_throughput')} "
            f"| {_times(r['output_throughput_vs_baseline'])} | {_ranged(r, 'ttft_p95_ms', 0)} "
            f"| {_times(r['ttft_p95_vs_baseline'])} | {_ranged(r, 'tpot_p95_ms', 2)} "
            f"| {_num(r['preemptions_median'], 0)} | {_num(r['recomputed_tokens_median'], 0)} "
            f"| {_pct(r['kv_usage_peak_median'])} | {_requests(r)} | {r['status']} "
            f"| {r['digest_agrees_with_naive']} | {_esc(r['error'])} |")
    lines += ["", *digest_groups]
    return "\n".join(lines) + "\n"


def _times(v: Any) -> str:
    return "–" if v is None or pd.isna(v) else f"×{v:.2f}"


def digest_group_lines(df: pd.DataFrame) -> list[str]:
    """Which cells generated identical tokens (groups by digest, per linear backend)."""
    lines = ["## Output digests", "",
             "sha256 of all generated token ids in request order (`token_digest`). Cells with the",
             "same digest generated exactly the same tokens; under greedy decoding every scheduler,",
             "batch size, chunk size and attention backend should land in the naive control's group.",
             ""]
    for linear, part in df.groupby("linear", sort=False):
        groups: OrderedDict[str, list[str]] = OrderedDict()
        for _, r in part.iterrows():
            key = r["token_digest"] if isinstance(r["token_digest"], str) else "(no digest: failed)"
            label = (f"{r['scheduler']}/{r['policy']} b{r['batch']}"
                     + ("" if r["scheduler"] == "naive" else
                        f" chunk {_chunk(r['chunk'])} attn {r['attn']}") + (f" rate {r['rate']}" if r["rate"] != "profile" else "")
                     + (f" blocks {r['blocks']}" if r["blocks"] != "auto" else ""))
            groups.setdefault(key, []).append(label)
        lines.append(f"- linear backend `{linear}`:")
        for digest, labels in groups.items():
            shown = f"`{digest[:16]}`" if not digest.startswith("(") else digest
            lines.append(f"  - {shown}: {'; '.join(labels)}")
    return lines + [""]


# ---------------------------------------------------------------------------------------------
# The focused tables: headline, chunked prefill, rates
# ---------------------------------------------------------------------------------------------
SCHEDULER_NAMES = {"naive": "Naive (sequential, full-prefix recompute)", "paged": "Paged, batch 1",
                   "static": "Static batching", "continuous": "Continuous batching"}


def headline_frame(main: pd.DataFrame, batch: str, defaults: dict[str, str]) -> pd.DataFrame:
    """The naive control plus each batching scheduler at max batch ``batch``, default settings
    otherwise (fcfs, chunk off, default backends, rate and KV budget, the default load)."""
    d = main.copy()
    keep = pd.Series(True, index=d.index)
    for col in SLICE_COLUMNS:
        if col in defaults:
            keep &= (d[col] == defaults[col]) | ((d["scheduler"] == "naive") & (col in ("chunk", "attn", "policy")))
    keep &= (d["batch"] == str(batch)) | d["scheduler"].isin(["naive", "paged"])
    order = {"naive": 0, "paged": 1, "static": 2, "continuous": 3}
    out = d[keep].copy()
    out["_o"] = out["scheduler"].map(order)
    return out.sort_values("_o").drop(columns="_o")


#: A repeated cell whose throughput varies more than this (coefficient of variation) is noisy.
NOISY_CV = 0.10


def _cv(v) -> str:
    """A coefficient of variation as a percentage, marked noisy above :data:`NOISY_CV`."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return f"{v:.0%}" + (" noisy" if v > NOISY_CV else "")


def headline_markdown(df: pd.DataFrame, header: list[str], batch: str) -> str:
    lines = list(header) + [
        f"## Headline: schedulers at max batch size {batch}", "",
        "Median [min–max] over repetitions; naive runs one request at a time (batch 1). CV: the",
        f"output throughput's coefficient of variation over the repetitions (above {NOISY_CV:.0%}: noisy).", "",
        "| Scheduler | Output throughput | CV | p95 TTFT | p95 TPOT | Status |",
        "|---|---:|---:|---:|---:|---|"]
    for _, r in df.iterrows():
        lines.append(f"| {SCHEDULER_NAMES.get(r['scheduler'], r['scheduler'])} "
                     f"| {_ranged(r, 'output_throughput')} tok/s | {_cv(r.get('output_throughput_cv'))} "
                     f"| {_ranged(r, 'ttft_p95_ms', 0)} ms "
                     f"| {_ranged(r, 'tpot_p95_ms', 2)} ms | {r['status']} |")
    return "\n".join(lines) + "\n"


def chunked_markdown(df: pd.DataFrame, header: list[str], sweep: str = "chunked_prefill") -> str:
    source = ("Rows: the `chunked_prefill` sweep." if sweep == "chunked_prefill" else
              f"Rows: the chunk factor of the `{sweep}` sweep at the default linear backend "
              "(this profile has no separate chunked-prefill sweep).")
    lines = list(header) + [
        "## Chunked prefill: inter-token latency of running decodes", "",
        "Long prompts arrive while other requests decode. Without chunking a long prefill runs",
        "as one step and every running decode waits for it (the ITL tail); with chunking each",
        "step carries at most `chunk` prompt tokens per sequence. ITL pooled over all requests.",
        source, "",
        "| Scheduler | Batch | Chunk | Load | Output tok/s | p95 TTFT ms | p95 ITL ms | p99 ITL ms "
        "| p95 TPOT ms | Requests | Status | Digest = naive | Error |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(
            f"| {r['scheduler']} | {r['batch']} | {_chunk(r['chunk'], r['scheduler'])} | {r['load']} "
            f"| {_ranged(r, 'output_throughput')} | {_ranged(r, 'ttft_p95_ms', 0)} "
            f"| {_ranged(r, 'itl_p95_ms', 1)} | {_ranged(r, 'itl_p99_ms', 1)} "
            f"| {_ranged(r, 'tpot_p95_ms', 2)} | {_requests(r)} | {r['status']} "
            f"| {r['digest_agrees_with_naive']} | {_esc(r['error'])} |")
    return "\n".join(lines) + "\n"


def rates_markdown(df: pd.DataFrame, header: list[str]) -> str:
    lines = list(header) + [
        "## Latency against throughput over arrival rates, with goodput", "",
        "Open-loop Poisson arrivals at each rate (`inf` = offline burst). Goodput: completed",
        "requests per second that meet both SLOs above; SLO attainment: their share of all",
        "requests.", "",
        "| Scheduler | Batch | Rate req/s | Output tok/s | Requests/s | Goodput req/s | SLO attained "
        "| p50 TTFT ms | p95 TTFT ms | p95 TPOT ms | Requests | Status | Error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    d = df.copy()
    d["_r"] = d["rate"].map(lambda v: math.inf if v in ("inf", "profile") else float(v))
    for _, r in d.sort_values(["scheduler", "batch", "_r"], kind="stable").iterrows():
        lines.append(
            f"| {r['scheduler']} | {r['batch']} | {r['rate']} | {_ranged(r, 'output_throughput')} "
            f"| {_ranged(r, 'request_throughput', 2)} | {_ranged(r, 'goodput', 2)} "
            f"| {_ranged_pct(r, 'slo_attainment')} | {_ranged(r, 'ttft_p50_ms', 0)} "
            f"| {_ranged(r, 'ttft_p95_ms', 0)} | {_ranged(r, 'tpot_p95_ms', 2)} | {_requests(r)} "
            f"| {r['status']} | {_esc(r['error'])} |")
    return "\n".join(lines) + "\n"


def _ranged_pct(row: pd.Series, stem: str) -> str:
    med = row.get(f"{stem}_median")
    if med is None or pd.isna(med):
        return "–"
    lo, hi = row.get(f"{stem}_min"), row.get(f"{stem}_max")
    if row["runs_ok"] > 1 and lo is not None and hi is not None and not pd.isna(lo):
        return f"{100 * med:.0f}% [{100 * lo:.0f}–{100 * hi:.0f}%]"
    return f"{100 * med:.0f}%"


def invariant_frame(df: pd.DataFrame, every_cell: pd.DataFrame) -> pd.DataFrame:
    """The cells of ``df`` with the batch-invariant mode on, each with the same configuration's
    mode-off numbers beside it (``*_off`` columns, looked up in ``every_cell``, the cells of
    all sweeps) and the on/off ratios."""
    on = df[df["invariant"] == "on"].copy()
    base = baseline_rows(on, every_cell, invariant="off")
    for stem in ("output_throughput", "tpot_p95_ms", "ttft_p95_ms"):
        on[f"{stem}_off"] = [_base_value(b, f"{stem}_median") for b in base]
    on["throughput_on_vs_off"] = [_ratio(a, b) for a, b in
                                  zip(on["output_throughput_median"], on["output_throughput_off"])]
    on["tpot_p95_on_vs_off"] = [_ratio(a, b) for a, b in
                                zip(on["tpot_p95_ms_median"], on["tpot_p95_ms_off"])]
    return on


def invariant_markdown(df: pd.DataFrame, header: list[str], has_sweep: bool) -> str:
    lines = list(header) + [
        "## Batch-invariant mode: its cost and its guarantee", "",
        "`--batch-invariant` fixes every kernel's reduction order per row, so a sequence's logits",
        "do not depend on what it is batched with (docs/architecture.md). Each row: a configuration",
        "with the mode on, beside the same configuration with it off (median over repetitions).",
        "", "| Scheduler | Batch | Chunk | Output tok/s off | Output tok/s on | On / off "
        "| p95 TPOT ms off | p95 TPOT ms on | p95 TTFT ms on | Requests | Status | Digest = naive "
        "| Error |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    if not has_sweep:
        lines += ["", "(This profile has no `batch_invariant` sweep.)"]
    for _, r in df.iterrows():
        lines.append(
            f"| {r['scheduler']} | {r['batch']} | {_chunk(r['chunk'], r['scheduler'])} "
            f"| {_num(r['output_throughput_off'])} | {_ranged(r, 'output_throughput')} "
            f"| {_times(r['throughput_on_vs_off'])} | {_num(r['tpot_p95_ms_off'], 2)} "
            f"| {_ranged(r, 'tpot_p95_ms', 2)} | {_ranged(r, 'ttft_p95_ms', 0)} | {_requests(r)} "
            f"| {r['status']} | {r['digest_agrees_with_naive']} | {_esc(r['error'])} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
TABLES = ("summary", "headline", "chunked_prefill", "rates", "failure_regimes", "batch_invariant")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="matrix profile name (for the headers)")
    p.add_argument("--sweep", nargs="+", action="append", required=True, metavar=("NAME", "REPORT"),
                   help="a sweep's name then its raw JSON reports (repeat per sweep); "
                        "main -> summary + headline, chunked_prefill, rates, failure_regimes")
    p.add_argument("--defaults", default="{}", help="JSON of the matrix's default cell values")
    p.add_argument("--headline-batch", default="8", help="max batch size of the headline table")
    p.add_argument("--contention", default="{}",
                   help="JSON thresholds: max_other_cores, max_steal_fraction (a run above "
                        "either is contended)")
    p.add_argument("--out-dir", type=Path, required=True,
                   help="writes " + ", ".join(f"{t}.csv/.md" for t in TABLES))
    a = p.parse_args(argv)
    defaults = {k: str(v) for k, v in json.loads(a.defaults).items()}
    sweeps: OrderedDict[str, list[dict]] = OrderedDict()
    for name, *files in a.sweep:
        sweeps[name] = [load_run(Path(f), name, json.loads(a.contention)) for f in files]
    if "main" not in sweeps or not sweeps["main"]:
        print("error: the main sweep has no reports (--sweep main FILE...)", file=sys.stderr)
        return 1
    unique = OrderedDict((r["path"], r) for runs in sweeps.values() for r in runs)
    all_runs = list(unique.values())
    try:
        check_modes(all_runs)
        common = check_matching(all_runs)
    except MatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    frames = {name: aggregate_cells(runs, all_runs) for name, runs in sweeps.items() if runs}
    main_df = frames["main"]
    empty = pd.DataFrame(columns=main_df.columns)
    fail_df = frames.get("failure_regimes", empty)
    fail_df = add_baselines(fail_df, main_df, defaults.get("rate", "profile"),
                            defaults.get("blocks", "auto"))
    head_df = headline_frame(main_df, a.headline_batch, defaults)
    # The chunked-prefill table comes from its own sweep (long prompts arriving among decodes);
    # a profile without one (the GPU profile crosses chunk sizes in its main sweep) gets the
    # main sweep's chunk factor at the default linear backend instead.
    chunk_df, chunk_sweep = frames.get("chunked_prefill", empty), "chunked_prefill"
    if chunk_df.empty:
        lin = defaults.get("linear")
        chunk_df = main_df[main_df["linear"].astype(str) == lin] if lin else main_df
        chunk_sweep = "main"
    inv_df = invariant_frame(frames.get("batch_invariant", empty), pd.concat(frames.values()))
    out = a.out_dir
    out.mkdir(parents=True, exist_ok=True)

    def header(title: str, name: str) -> list[str]:
        runs = sweeps.get(name) or []
        return header_lines(title, a.profile, common, runs or all_runs)

    pages = {
        "summary": (main_df, summary_markdown(
            main_df, header("Checkpoint 3: batching, scheduling, batch size", "main"),
            digest_group_lines(main_df))),
        "headline": (head_df, headline_markdown(
            head_df, header("Checkpoint 3: headline", "main"), a.headline_batch)),
        "chunked_prefill": (chunk_df, chunked_markdown(
            chunk_df, header("Checkpoint 3: chunked prefill", chunk_sweep), chunk_sweep)),
        "rates": (frames.get("rates", empty), rates_markdown(
            frames.get("rates", empty), header("Checkpoint 3: arrival rates and goodput", "rates"))),
        "failure_regimes": (fail_df, failure_markdown(
            fail_df, header("Checkpoint 3: failure regimes", "failure_regimes"),
            digest_group_lines(fail_df) if len(fail_df) else [])),
        "batch_invariant": (inv_df, invariant_markdown(
            inv_df, header("Checkpoint 3: batch-invariant mode", "batch_invariant"),
            "batch_invariant" in frames)),
    }
    for name, (df, md) in pages.items():
        df.to_csv(out / f"{name}.csv", index=False, float_format="%.6g")
        (out / f"{name}.md").write_text(md)
    n_failed = sum(int((df["status"] != "ok").sum()) for df in frames.values())
    print(f"aggregated {len(all_runs)} runs into {sum(len(df) for df in frames.values())} cells "
          f"({n_failed} not ok) -> {', '.join(f'{out}/{n}.md' for n in pages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
