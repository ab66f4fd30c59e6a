"""Prefix-caching sweep helpers (workflow/rules/prefix.smk).

    prefix_sweep.py profile --profile cpu --settings '{"base_profile": ..., "profile_overrides": {...}}' \
        --output results/prefix/cpu/load_profile.yaml
    prefix_sweep.py report --out-dir results/prefix/cpu results/prefix/cpu/raw/*.json

``profile`` writes the base load profile named by the ``prefix`` section of the pipeline
config (the rule passes ``base_profile`` and ``profile_overrides`` as JSON) with its overrides
merged key by key (validated by llmserve's own profile checker). ``report`` reads the benchmark JSON
reports and writes ``table.csv`` / ``table.md`` (one row per cell: workload, caching, arrival
rate, TTFT p50/p95, TPOT p50, throughput, prefix-cache queries/hits/hit rate, cached and
evicted blocks) and ``plots/ttft_cdf.png`` (TTFT CDF with and without caching, a panel per
workload, a line style per rate) and ``plots/hit_rate.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

COLUMNS = ("workload", "caching", "arrival_rate", "status", "num_requests", "num_completed",
           "ttft_ms_p50", "ttft_ms_p95", "tpot_ms_p50", "output_throughput",
           "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
           "prefix_cache_cached_blocks", "prefix_cache_evicted_blocks", "token_digest")


def write_profile(profile: str, settings: dict, output: Path) -> None:
    """Write ``settings["base_profile"]`` with ``settings["profile_overrides"]`` merged into it.

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
                      f"profile {profile}\n"
                      + yaml.safe_dump(prof, sort_keys=False))


def _row(path: Path) -> tuple[dict, list[float]]:
    r = json.loads(path.read_text())
    cfg, agg = r.get("config") or {}, r.get("aggregates") or {}
    row = {"workload": (r.get("profile") or {}).get("workload", {}).get("kind") or cfg.get("workload"),
           "caching": "on" if cfg.get("enable_prefix_caching") else "off",
           "arrival_rate": cfg.get("arrival_rate"), "status": r.get("status"),
           "token_digest": r.get("token_digest")}
    row.update({k: agg.get(k) for k in COLUMNS if k not in row})
    ttfts = sorted(q["ttft_ms"] for q in r.get("requests") or [] if q.get("ttft_ms") is not None)
    return row, ttfts


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def report(out_dir: Path, files: list[Path]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cdfs = [], {}
    for f in files:
        row, ttfts = _row(f)
        rows.append(row)
        cdfs[(row["workload"], row["caching"], row["arrival_rate"])] = ttfts
    rows.sort(key=lambda r: (r["workload"], r["arrival_rate"] or 0, r["caching"] != "on"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "table.csv", "w") as fh:
        fh.write(",".join(COLUMNS) + "\n")
        for r in rows:
            fh.write(",".join(_fmt(r[k]) for k in COLUMNS) + "\n")
    first = json.loads(files[0].read_text()) if files else {}
    hw, cfg = first.get("hardware") or {}, first.get("config") or {}
    md = [f"Prefix-caching sweep: model `{cfg.get('model')}` on `{cfg.get('device')}` "
          f"({hw.get('cpu_model') or hw.get('device_name')}, {hw.get('cpu_count')} CPUs), "
          f"{cfg.get('requests')} measured requests a cell, profile `{first.get('profile_path')}`; "
          "command: `snakemake --cores 1 prefix` (settings: the config's `prefix` section). Queries and "
          "hits are prompt tokens at admission; identical token digests mean identical outputs.", "",
          "| " + " | ".join(COLUMNS[:-1]) + " |", "|" + " --- |" * (len(COLUMNS) - 1)]
    md += ["| " + " | ".join(_fmt(r[k]) for k in COLUMNS[:-1]) + " |" for r in rows]
    (out_dir / "table.md").write_text("\n".join(md) + "\n")

    plots = out_dir / "plots"
    plots.mkdir(exist_ok=True)
    workloads = sorted({r["workload"] for r in rows})
    rates = sorted({r["arrival_rate"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for i, rate in enumerate(rates):
            for caching, color in (("on", "tab:blue"), ("off", "tab:red")):
                t = cdfs.get((w, caching, rate)) or []
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
    ax.bar(range(len(on)), [r["prefix_cache_hit_rate"] or 0.0 for r in on], color="tab:blue")
    ax.set_xticks(range(len(on)), labels, fontsize=7)
    ax.set_ylabel("prefix-cache hit rate (tokens)")
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
    a.add_argument("--output", required=True, type=Path)
    b = sub.add_parser("report")
    b.add_argument("--out-dir", required=True, type=Path)
    b.add_argument("files", nargs="+", type=Path)
    args = p.parse_args()
    if args.cmd == "profile":
        write_profile(args.profile, json.loads(args.settings), args.output)
    else:
        report(args.out_dir, args.files)


if __name__ == "__main__":
    main()
