"""Prefix-caching sweep helpers (workflow/rules/prefix.smk).

    prefix_sweep.py profile --profile cpu --settings '{"base_profile": ..., "profile_overrides": {...}}' \
        --output results/prefix/cpu/load_profile.yaml
    prefix_sweep.py report --out-dir results/prefix/cpu results/prefix/cpu/raw/*.json

``profile`` writes the base load profile named by the ``prefix`` section of the pipeline
config (the rule passes ``base_profile`` and ``profile_overrides`` as JSON) with its overrides
merged key by key (validated by llmserve's own profile checker). ``report`` reads the benchmark
JSON reports (``raw/workload~<w>_caching~<on|off>_rate~<r>_rep~<n>.json``, each with the
``.provenance.json`` that ``workflow/scripts/run_cells.py`` wrote beside it) and writes
``table.csv`` / ``table.md``: one row per workload, caching and arrival rate, each statistic
(TTFT p50/p95/p99, TPOT p50, output throughput, prefix-cache hit rate) as the median over the
successful repetitions with [min–max], the coefficient of variation of p50 TTFT (over 10%:
noisy), the prefix cache's queries, hits, cached and evicted blocks, and the output digests; the
header names the engine code hash the runs recorded. With one repetition a row shows the single
run. Cells of the config's ``invariant_check`` (``..._invariant~on_rep~<n>``: caching on and off
with ``--batch-invariant``) are rows of their own after the sweep's; the "Caching on against
off" section says for each pair whether both generated the same outputs.
``plots/ttft_cdf.png`` is the TTFT CDF with and without caching (a panel per workload, a line
style per rate, every repetition's requests pooled; the sweep's rows only) and
``plots/hit_rate.png`` the hit rate (median, min–max as error bars).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml
# median [min–max], the CV and its noisy mark: the same helpers as the checkpoint-3 and
# structured-output tables (workflow/scripts/, next to this file)
from aggregate_checkpoint3 import NOISY_CV, _cv, _load_line, _num, _ranged, _ratio, provenance_path  # noqa: E402
from machine_load import is_contended  # noqa: E402
from matrix_columns import parse_cell_id  # noqa: E402
from structured_table import cv  # noqa: E402

#: Statistics over the repetitions: column stem -> key of report["aggregates"].
STATS = {"ttft_p50_ms": "ttft_ms_p50", "ttft_p95_ms": "ttft_ms_p95", "ttft_p99_ms": "ttft_ms_p99",
         "tpot_p50_ms": "tpot_ms_p50", "output_throughput": "output_throughput",
         "hit_rate": "prefix_cache_hit_rate"}
#: Prefix-cache counters (their median over the repetitions; seeded, so normally equal).
COUNTERS = {"queries": "prefix_cache_queries", "hits": "prefix_cache_hits",
            "cached_blocks": "prefix_cache_cached_blocks", "evicted_blocks": "prefix_cache_evicted_blocks"}
COLUMNS = (["workload", "caching", "arrival_rate", "batch_invariant", "order", "repetitions", "runs_ok", "status",
            "num_requests", "num_completed"]
           + [f"{stem}_{k}" for stem in STATS for k in ("median", "min", "max")]
           + ["ttft_p50_cv", "noisy"] + list(COUNTERS) + ["token_digests", "code_hashes", "error"])


def write_profile(profile: str, settings: dict, output: Path, digest: str = "") -> None:
    """Write ``settings["base_profile"]`` with ``settings["profile_overrides"]`` merged into it;
    the first line names ``digest`` (the pipeline's digest of the settings, by which it sees a
    profile derived from other settings).

    Raises:
        ValueError: the merged profile fails llmserve's profile validation.
    """
    from llmserve.bench.workload import load_profile, validate_profile

    cfg = settings
    base, _ = load_profile(cfg["base_profile"])
    for key, value in (cfg.get("profile_overrides") or {}).items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    prof = validate_profile(base, source=f"the prefix settings of profile {profile}")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("# Derived by workflow/scripts/prefix_sweep.py from the prefix settings of "
                      f"profile {profile}" + (f" (settings {digest})" if digest else "") + "\n"
                      + yaml.safe_dump(prof, sort_keys=False))


def load_run(path: Path, contention: dict | None = None) -> dict:
    """One run: its cell (from the file name), report fields and provenance; ``contention``
    holds the thresholds of :func:`machine_load.is_contended` (default: 0.5 cores, 5%)."""
    limits = {"max_other_cores": 0.5, "max_steal_fraction": 0.05, **(contention or {})}
    cell = parse_cell_id(path.name[: -len(".json")])
    r = json.loads(path.read_text())
    prov_file = provenance_path(path)
    prov = json.loads(prov_file.read_text()) if prov_file.exists() else {}
    agg = r.get("aggregates") or {}
    load = prov.get("machine_load")
    proc = prov.get("process") or {}
    order = None     # the cell's place in its repetition's process: (1-based place, cells)
    if isinstance(proc.get("position"), int) and isinstance(proc.get("cells_in_group"), int):
        order = (proc["position"] + 1, proc["cells_in_group"])
    return {"workload": cell["workload"], "caching": cell["caching"], "arrival_rate": float(cell["rate"]),
            "batch_invariant": cell.get("invariant") == "on", "order": order, "group": proc.get("group"),
            "rep": int(cell["rep"]), "status": r.get("status") or "failed", "error": r.get("error"),
            "report": r, "agg": agg, "token_digest": r.get("token_digest"),
            "code_hash": prov.get("code_hash") or r.get("code_hash"),
            "machine_load": load,
            "contended": is_contended(load, limits["max_other_cores"], limits["max_steal_fraction"]),
            "ttfts": [q["ttft_ms"] for q in r.get("requests") or [] if q.get("ttft_ms") is not None]}


def _values(runs: list[dict], key: str) -> list[float]:
    return [float(x["agg"][key]) for x in runs if isinstance(x["agg"].get(key), (int, float))]


def fold(runs: list[dict]) -> list[dict]:
    """One row per (workload, caching, arrival rate, batch-invariant mode): the statistics over
    its repetitions (the mode's rows after the others)."""
    cells: dict[tuple, list[dict]] = {}
    for x in runs:
        cells.setdefault((x["workload"], x["caching"], x["arrival_rate"], x["batch_invariant"]), []).append(x)
    rows = []
    for (workload, caching, rate, invariant), reps in sorted(
            cells.items(), key=lambda kv: (kv[0][3], kv[0][0], kv[0][2], kv[0][1] != "on")):
        ok = [x for x in reps if x["status"] == "ok"]
        row = {"workload": workload, "caching": caching, "arrival_rate": rate, "batch_invariant": invariant,
               "repetitions": len(reps), "runs_ok": len(ok),
               "status": ("ok" if len(ok) == len(reps) else "failed" if not ok
                          else f"partial ({len(ok)}/{len(reps)} ok)")}
        for key in ("num_requests", "num_completed"):
            vals = _values(ok or reps, key)
            row[key] = int(statistics.median(vals)) if vals else None
        for stem, key in STATS.items():
            vals = _values(ok, key)
            row[f"{stem}_median"] = statistics.median(vals) if vals else None
            row[f"{stem}_min"] = min(vals) if vals else None
            row[f"{stem}_max"] = max(vals) if vals else None
        row["ttft_p50_cv"] = cv(_values(ok, "ttft_ms_p50"))
        row["noisy"] = row["ttft_p50_cv"] is not None and row["ttft_p50_cv"] > NOISY_CV
        for name, key in COUNTERS.items():
            vals = _values(ok, key)
            row[name] = statistics.median(vals) if vals else None
        contended = sum(bool(x["contended"]) for x in reps)
        if contended:
            row["status"] += f", contended {contended}/{len(reps)}"
        places = sorted({x["order"] for x in reps if x["order"]})
        row["order"] = " / ".join(f"{k} of {n}" for k, n in places) or None
        row["token_digests"] = " ".join(sorted({x["token_digest"] for x in ok if x["token_digest"]}))
        row["all_digested"] = bool(ok) and len(ok) == len(reps) and all(x["token_digest"] for x in ok)
        row["code_hashes"] = " ".join(sorted({x["code_hash"] for x in reps if x["code_hash"]}))
        row["error"] = " | ".join(dict.fromkeys(str(x["error"]) for x in reps if x["error"]))
        row["ttfts"] = sorted(t for x in ok for t in x["ttfts"])
        rows.append(row)
    return rows


def _csv_value(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    text = str(v)
    return f'"{text}"' if "," in text or '"' in text else text


def _digest(row: dict) -> str:
    """The output digests of a row's runs, shortened (one when every repetition agrees)."""
    return " / ".join(d[:10] for d in row["token_digests"].split()) or "–"


def markdown(rows: list[dict], runs: list[dict], profile: str = "cpu") -> str:
    """The sweep's table as Markdown: where and how it ran, then a row a cell."""
    command = ("snakemake --cores 1 prefix" if profile == "cpu" else
               f"snakemake prefix --cores 4 --resources gpu=1 --config profile={profile}")
    first = next((x["report"] for x in runs if x["report"].get("config")), {})
    hw, cfg = first.get("hardware") or {}, first.get("config") or {}
    reps = sorted({x["rep"] for x in runs})
    hashes = sorted({x["code_hash"] for x in runs if x["code_hash"]})
    single = len(reps) == 1
    groups = {x["group"] for x in runs}
    processes = ("all in one process (a cell's repetitions on one engine)"
                 if len(groups) == 1 and None not in groups else "one process each")
    spread = ("one run a cell (the config's `repetitions: 1`): each figure is that run, and no CV"
              if single else
              f"{len(reps)} repetitions, {processes}: median [min–max] over the successful "
              f"ones; CV = standard deviation / mean of p50 TTFT over them (above {NOISY_CV:.0%}: noisy)")
    lines = [
        f"# Prefix-caching sweep — model `{cfg.get('model')}` on `{cfg.get('device')}`", "",
        (f"{hw.get('gpu_name')} ({hw.get('cpu_model')}, {hw.get('cpu_count')} host CPUs); "
         if hw.get("gpu_name") else f"{hw.get('cpu_model') or hw.get('device_name')}, {hw.get('cpu_count')} CPUs; ") +
        f"{cfg.get('requests')} measured requests a cell, profile `{first.get('profile_path')}`; "
        f"{spread}. Engine code hash `{', '.join(h[:16] for h in hashes) or '?'}`. Command: "
        f"`{command}` (settings: the config's `prefix` section). Queries and hits "
        "are prompt tokens at admission; equal output digests mean equal outputs. TTFT and TPOT in ms. "
        + ("On the CPU's readable path caching on and off agree." if str(cfg.get("device", "cpu")) == "cpu" else
           "On the GPU the digests of caching on and off, and of repetitions, may differ without the "
           "batch-invariant mode: random bf16 weights, and a cached prefix's KV was computed in another "
           "step shape, so near-tied greedy tokens can flip; the rows marked `--batch-invariant` run "
           "the mode, where they must not."), "",
        f"Machine load during the runs: {_load_line(runs)}. Order: a cell's place among the cells "
        "its process runs (an earlier cell can pay first-use costs that a later one "
        "does not).", "",
        "| workload | caching | rate (/s) | order | runs ok | p50 TTFT | CV p50 TTFT | p95 TTFT | p99 TTFT "
        "| p50 TPOT | output tok/s | hit rate | queries | hits | cached blocks | evicted blocks "
        "| output digest | status |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | --- | --- |"]
    for r in rows:
        cv_cell = "1 run" if r["repetitions"] == 1 else (_cv(r["ttft_p50_cv"]) or "–")
        status = r["status"] + (f": {r['error'][:160]}" if r["error"] else "")
        lines.append(
            f"| {_workload(r)} | {r['caching']} | {r['arrival_rate']:g} | {r['order'] or '–'} "
            f"| {r['runs_ok']}/{r['repetitions']} "
            f"| {_ranged(r, 'ttft_p50_ms')} | {cv_cell} | {_ranged(r, 'ttft_p95_ms')} "
            f"| {_ranged(r, 'ttft_p99_ms')} | {_ranged(r, 'tpot_p50_ms', 2)} "
            f"| {_ranged(r, 'output_throughput')} | {_ranged(r, 'hit_rate', 3)} | "
            + "".join(f"{_num(r[k], 0)} | " for k in COUNTERS)
            + f"`{_digest(r)}` | {status} |")
    lines += effect_lines(rows)
    return "\n".join(lines) + "\n"


def _workload(row: dict) -> str:
    """The workload column: the workload, marked when the row ran with --batch-invariant."""
    return row["workload"] + (", `--batch-invariant`" if row["batch_invariant"] else "")


def _times(a, b) -> str:
    """``a / b`` as ``1.23x`` (aggregate_checkpoint3's ratio), or a dash where either is missing."""
    r = _ratio(a, b)
    return "–" if r is None else f"{r:.2f}x"


def effect_lines(rows: list[dict]) -> list[str]:
    """What caching bought, per workload and rate: p50 / p95 TTFT without over with caching and
    output throughput with over without (ratios of the medians; > 1 is caching's gain)."""
    by = {(r["workload"], r["arrival_rate"], r["batch_invariant"], r["caching"]): r for r in rows}
    pairs = [(w, rate, inv) for (w, rate, inv, c) in by if c == "on" and (w, rate, inv, "off") in by]
    if not pairs:
        return []
    out = ["", "## Caching on against off", "",
           "Ratios of the medians above: TTFT off / on and output throughput on / off (above 1: "
           "caching is faster; a workload without shared prefixes shows what a miss costs). Same "
           "outputs: whether caching on and off generated the same tokens (one output digest, "
           "the same, in every repetition of both; – where a repetition failed).", "",
           "| workload | rate (/s) | hit rate | p50 TTFT off / on | p95 TTFT off / on | output tok/s on / off "
           "| same outputs |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for w, rate, inv in pairs:
        on, off = by[(w, rate, inv, "on")], by[(w, rate, inv, "off")]
        out.append(f"| {_workload(on)} | {rate:g} | {_num(on['hit_rate_median'], 3)} "
                   f"| {_times(off['ttft_p50_ms_median'], on['ttft_p50_ms_median'])} "
                   f"| {_times(off['ttft_p95_ms_median'], on['ttft_p95_ms_median'])} "
                   f"| {_times(on['output_throughput_median'], off['output_throughput_median'])} "
                   f"| {same_outputs(on, off)} |")
    return out


def same_outputs(on: dict, off: dict) -> str:
    """``yes`` when every repetition of the caching-on and -off rows ran and gave the same
    output digest, ``no`` when digests differ (between on and off, or between repetitions),
    ``–`` when a repetition failed or has no digest (nothing to decide)."""
    if not (on["all_digested"] and off["all_digested"]):
        return "–"
    a, b = set(on["token_digests"].split()), set(off["token_digests"].split())
    return "yes" if len(a) == 1 and a == b else "no"


def report(out_dir: Path, files: list[Path], contention: dict | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(f, contention) for f in files]
    rows = fold(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "table.csv", "w") as fh:
        fh.write(",".join(COLUMNS) + "\n")
        for r in rows:
            fh.write(",".join(_csv_value(r[k]) for k in COLUMNS) + "\n")
    (out_dir / "table.md").write_text(markdown(rows, runs, Path(out_dir).resolve().name))

    plots = out_dir / "plots"
    plots.mkdir(exist_ok=True)
    rows = [r for r in rows if not r["batch_invariant"]]   # the plots show the sweep itself
    if not rows:                       # only check cells: the plots say so instead of failing
        for name in ("ttft_cdf.png", "hit_rate.png"):
            fig, ax = plt.subplots(figsize=(5, 3.4))
            ax.text(0.5, 0.5, "no sweep cells (only the batch-invariant check)", ha="center", va="center")
            ax.set_axis_off()
            fig.savefig(plots / name, dpi=110)
            plt.close(fig)
        return
    workloads = sorted({r["workload"] for r in rows})
    rates = sorted({r["arrival_rate"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for i, rate in enumerate(rates):
            for caching, color in (("on", "tab:blue"), ("off", "tab:red")):
                t = next((r["ttfts"] for r in rows if (r["workload"], r["caching"], r["arrival_rate"])
                          == (w, caching, rate)), [])
                if t:
                    ax.step(t, [(j + 1) / len(t) for j in range(len(t))], where="post", color=color,
                            linestyle=("-", "--", ":", "-.")[i % 4],
                            label=f"caching {caching}, {rate:g}/s")
        ax.set_title(w)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plots / "ttft_cdf.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.4))
    on = [r for r in rows if r["caching"] == "on"]
    labels = [f"{r['workload']}\n{r['arrival_rate']:g}/s" for r in on]
    med = [r["hit_rate_median"] or 0.0 for r in on]
    err = [[m - (r["hit_rate_min"] if r["hit_rate_min"] is not None else m) for m, r in zip(med, on)],
           [(r["hit_rate_max"] if r["hit_rate_max"] is not None else m) - m for m, r in zip(med, on)]]
    ax.bar(range(len(on)), med, yerr=err if any(map(any, err)) else None, capsize=3, color="tab:blue")
    ax.set_xticks(range(len(on)), labels, fontsize=7)
    ax.set_ylabel("prefix-cache hit rate (tokens)" + ("" if all(r["runs_ok"] <= 1 for r in on)
                                                       else ", median [min–max]"))
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(plots / "hit_rate.png", dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("profile")
    a.add_argument("--profile", required=True, help="the pipeline profile (for the header)")
    a.add_argument("--settings", required=True, help="JSON: base_profile, profile_overrides")
    a.add_argument("--settings-digest", default="", help="written into the first line")
    a.add_argument("--output", required=True, type=Path)
    b = sub.add_parser("report")
    b.add_argument("--out-dir", required=True, type=Path)
    b.add_argument("--contention", default="{}",
                   help="JSON: max_other_cores, max_steal_fraction (the config's `contention`)")
    b.add_argument("files", nargs="+", type=Path)
    args = p.parse_args()
    if args.cmd == "profile":
        write_profile(args.profile, json.loads(args.settings), args.output, args.settings_digest)
    else:
        report(args.out_dir, args.files, json.loads(args.contention))


if __name__ == "__main__":
    main()
