"""Plots of the checkpoint-3 summary (matplotlib, Agg backend, PNG).

* ``batch_scaling.png``: output throughput and p95 TTFT against the maximum batch size, one
  line per scheduler/policy (median over repetitions, bars = min..max), for the cells with
  chunked prefill off, the ``torch`` linear and attention backends and the default load.
* ``ttft_cdf.png``: empirical CDF of per-request TTFT for each scheduler/policy at the largest
  batch size that more than one scheduler ran (naive, always batch 1, is drawn as the control),
  pooled over repetitions, completed requests only.

Usage (the pipeline's ``plots`` rule runs it)::

    python workflow/scripts/plot_checkpoint3.py --profile cpu --summary summary.csv \\
        --reports raw/*.json --batch-scaling plots/batch_scaling.png --ttft-cdf plots/ttft_cdf.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

# Deterministic PNG bytes for identical data: no creation time / software stamp in the file.
PNG_METADATA = {"Software": None}


def _label(scheduler: str, policy: str) -> str:
    return scheduler if scheduler in ("naive", "paged", "static") and policy == "fcfs" else f"{scheduler}/{policy}"


def baseline_slice(df: pd.DataFrame) -> pd.DataFrame:
    """Cells on the batch-size axis: no chunking, torch backends, default load."""
    d = df.astype({"batch": int, "chunk": int}).copy()
    keep = (d["chunk"] == 0) & (d["linear"] == "torch") & (d["attn"] == "torch")
    keep &= (d["rate"] == "profile") & (d["blocks"] == "auto")
    return d[keep]


def plot_batch_scaling(df: pd.DataFrame, profile: str, out: Path) -> None:
    d = baseline_slice(df)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [("output_throughput", "output throughput (tok/s)"), ("ttft_p95_ms", "p95 TTFT (ms)")]
    for ax, (stem, ylabel) in zip(axes, panels):
        for (sched, pol), g in d.groupby(["scheduler", "policy"], sort=False):
            g = g.sort_values("batch")
            ok = g[g[f"{stem}_median"].notna()]
            if ok.empty:
                continue
            y = ok[f"{stem}_median"].to_numpy(float)
            lo = y - ok[f"{stem}_min"].fillna(ok[f"{stem}_median"]).to_numpy(float)
            hi = ok[f"{stem}_max"].fillna(ok[f"{stem}_median"]).to_numpy(float) - y
            ax.errorbar(ok["batch"], y, yerr=[lo, hi], marker="o", capsize=3,
                        label=_label(sched, pol), linestyle="-" if len(ok) > 1 else "none")
            failed = g[g[f"{stem}_median"].isna()]
            for b in failed["batch"]:
                ax.axvline(b, color="red", alpha=0.2, linewidth=6)
        ax.set_xscale("log", base=2)
        batches = sorted(d["batch"].unique())
        if batches:
            ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("max batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"checkpoint 3 ({profile}): batching vs batch size "
                 "(median, bars min–max; red band = failed cell)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)


def plot_ttft_cdf(df: pd.DataFrame, reports: list[Path], profile: str, out: Path) -> None:
    d = baseline_slice(df)
    batched = d[~d["scheduler"].isin(["naive", "paged"]) & d["ttft_p95_ms_median"].notna()]
    per_batch = batched.groupby("batch")["scheduler"].nunique()
    multi = per_batch[per_batch > 1]
    batch = int(multi.index.max()) if len(multi) else (int(per_batch.index.max()) if len(per_batch) else None)
    chosen = d[(d["batch"] == batch) | d["scheduler"].isin(["naive"])] if batch is not None else d
    by_cell = {Path(p).name.rsplit("_rep~", 1)[0]: [] for p in reports}
    for p in reports:
        by_cell[Path(p).name.rsplit("_rep~", 1)[0]].append(Path(p))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for _, row in chosen.iterrows():
        ttfts = []
        for path in by_cell.get(row["cell"], []):
            rep = json.loads(path.read_text())
            if rep.get("status") != "ok":
                continue
            ttfts += [r["ttft_ms"] for r in rep.get("requests") or []
                      if r.get("status") == "ok" and r.get("ttft_ms") is not None]
        if not ttfts:
            continue
        x = np.sort(np.asarray(ttfts, dtype=float))
        y = np.arange(1, len(x) + 1) / len(x)
        ax.step(x, y, where="post",
                label=f"{_label(row['scheduler'], row['policy'])} (batch {row['batch']}, n={len(x)})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"checkpoint 3 ({profile}): TTFT CDF at max batch size {batch}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--summary", type=Path, required=True, help="summary.csv of the aggregation")
    p.add_argument("--reports", nargs="+", type=Path, required=True, help="raw JSON reports (main sweep)")
    p.add_argument("--batch-scaling", type=Path, required=True)
    p.add_argument("--ttft-cdf", type=Path, required=True)
    a = p.parse_args(argv)
    df = pd.read_csv(a.summary, dtype={"scheduler": str, "policy": str, "linear": str, "attn": str,
                                       "rate": str, "blocks": str, "cell": str})
    plot_batch_scaling(df, a.profile, a.batch_scaling)
    plot_ttft_cdf(df, a.reports, a.profile, a.ttft_cdf)
    print(f"wrote {a.batch_scaling} and {a.ttft_cdf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
