"""Plots of the checkpoint-3 tables (matplotlib, Agg backend, PNG).

* ``batch_scaling.png``: output throughput and p95 TTFT against the maximum batch size, one
  colour per scheduler (policy variants dashed), for the cells at the matrix defaults otherwise.
* ``ttft_cdf.png``: empirical CDF of per-request TTFT per scheduler at the largest batch size
  that more than one batching scheduler ran (naive, always batch 1, drawn as the control).
* ``chunked_prefill.png``: p95/p99 inter-token latency and p95 TTFT, chunked prefill off vs on.
* ``latency_throughput.png``: p95 TTFT and goodput against the achieved request rate over the
  arrival-rate sweep, one colour per scheduler.

Every point is the median over repetitions with bars from min to max; a failed cell is a red
cross on the x axis; every y axis starts at 0. A plot whose selection is empty raises
:class:`EmptySelection` (the rule fails) rather than writing a blank figure.

Usage (the pipeline's ``plots`` rule runs it)::

    python workflow/scripts/plot_checkpoint3.py --profile cpu --defaults '{"attn": "torch", ...}' \\
        --summary summary.csv --chunked chunked_prefill.csv --rates rates.csv --reports raw/*.json \\
        --batch-scaling plots/batch_scaling.png --ttft-cdf plots/ttft_cdf.png \\
        --chunked-plot plots/chunked_prefill.png --latency-throughput plots/latency_throughput.png
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
from matplotlib.patches import Patch  # noqa: E402
import pandas as pd  # noqa: E402
from matrix_columns import COLUMN_NAMES, SLICE_COLUMNS  # noqa: E402  (workflow/scripts/, next to this file)

# Deterministic PNG bytes for identical data: no creation time / software stamp in the file.
PNG_METADATA = {"Software": None}
#: One colour per scheduler, the same in every plot.
COLOURS = {"naive": "tab:gray", "paged": "tab:purple", "static": "tab:orange",
           "continuous": "tab:blue"}
POLICY_STYLE = {"fcfs": "-", "sjf": "--", "priority": ":"}
FAILED = dict(marker="x", color="red", markersize=10, mew=2.5, linestyle="none")
#: Columns read as text (matrix values are labels, e.g. batch "8", rate "inf").
STR_COLUMNS = {c: str for c in (*COLUMN_NAMES, "cell", "status")}


class EmptySelection(ValueError):
    """A plot's selection of rows is empty: the matrix or the filter is wrong."""


def _label(scheduler: str, policy: str) -> str:
    return scheduler if policy == "fcfs" else f"{scheduler}/{policy}"


def _require(df: pd.DataFrame, what: str) -> pd.DataFrame:
    if df.empty:
        raise EmptySelection(f"no rows for {what}: check the sweeps of the matrix and the "
                             "defaults passed with --defaults")
    return df


def baseline_slice(df: pd.DataFrame, defaults: dict[str, str]) -> pd.DataFrame:
    """Cells on the batch-size axis: every other column at the matrix default (naive, which
    has no chunking, paged attention or policy, at its normalised values).

    Raises:
        EmptySelection: no cell matches.
    """
    d = df.copy()
    keep = pd.Series(True, index=d.index)
    for col in SLICE_COLUMNS:
        if col in defaults and col in d:
            ok = d[col] == str(defaults[col])
            if col in ("chunk", "attn", "policy"):
                ok |= d["scheduler"] == "naive"
            keep &= ok
    return _require(d[keep], "the batch-size axis (cells at the matrix defaults)")


def _errorbar(ax, x, g: pd.DataFrame, stem: str, **kw) -> None:
    y = g[f"{stem}_median"].to_numpy(float)
    lo = y - g.get(f"{stem}_min", g[f"{stem}_median"]).fillna(g[f"{stem}_median"]).to_numpy(float)
    hi = g.get(f"{stem}_max", g[f"{stem}_median"]).fillna(g[f"{stem}_median"]).to_numpy(float) - y
    ax.errorbar(x, y, yerr=[lo, hi], capsize=3, **kw)


def _failed(ax, xs, label: str | None = "failed cell") -> None:
    xs = list(xs)
    if xs:
        ax.plot(xs, [0] * len(xs), label=label, clip_on=False, zorder=5, **FAILED)


def _save(fig, out: Path) -> None:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)


def plot_batch_scaling(df: pd.DataFrame, defaults: dict[str, str], profile: str, out: Path) -> None:
    d = baseline_slice(df, defaults).astype({"batch": int})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [("output_throughput", "output throughput (tok/s)"), ("ttft_p95_ms", "p95 TTFT (ms)")]
    failed_label = "failed cell"
    for ax, (stem, ylabel) in zip(axes, panels):
        for (sched, pol), g in d.groupby(["scheduler", "policy"], sort=False):
            g = g.sort_values("batch")
            ok = g[g[f"{stem}_median"].notna()]
            if not ok.empty:
                _errorbar(ax, ok["batch"], ok, stem, marker="o", color=COLOURS.get(sched),
                          linestyle=POLICY_STYLE.get(pol, "-") if len(ok) > 1 else "none",
                          label=_label(sched, pol))
            _failed(ax, g[g[f"{stem}_median"].isna()]["batch"], failed_label)
            if len(g[g[f"{stem}_median"].isna()]):
                failed_label = None
        ax.set_xscale("log", base=2)
        batches = sorted(d["batch"].unique())
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("max batch size")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"checkpoint 3 ({profile}): batching vs batch size "
                 "(median, bars min–max over repetitions)", fontsize=10)
    _save(fig, out)


def _ttfts(paths: list[Path]) -> list[float]:
    out: list[float] = []
    for path in paths:
        rep = json.loads(path.read_text())
        if rep.get("status") != "ok":
            continue
        out += [r["ttft_ms"] for r in rep.get("requests") or []
                if r.get("status") == "ok" and r.get("ttft_ms") is not None]
    return out


def plot_ttft_cdf(df: pd.DataFrame, defaults: dict[str, str], reports: list[Path], profile: str,
                  out: Path) -> None:
    d = baseline_slice(df, defaults).astype({"batch": int})
    batched = d[~d["scheduler"].isin(["naive", "paged"]) & d["ttft_p95_ms_median"].notna()]
    per_batch = batched.groupby("batch")["scheduler"].nunique()
    multi = per_batch[per_batch > 1]
    if len(multi):
        batch = int(multi.index.max())
    elif len(per_batch):
        batch = int(per_batch.index.max())
    else:
        batch = None
    chosen = d[((d["batch"] == batch) & (d["policy"] == "fcfs")) | d["scheduler"].isin(["naive"])]
    _require(chosen, "the TTFT CDF")
    by_cell: dict[str, list[Path]] = {}
    for p in reports:
        by_cell.setdefault(Path(p).name.rsplit("_rep~", 1)[0], []).append(Path(p))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drawn = 0
    for _, row in chosen.iterrows():
        ttfts = _ttfts(by_cell.get(row["cell"], []))
        if not ttfts:
            _failed(ax, [0], f"{row['scheduler']} (failed)")
            continue
        x = np.sort(np.asarray(ttfts, dtype=float))
        y = np.arange(1, len(x) + 1) / len(x)
        ax.step(np.r_[0, x], np.r_[0, y], where="post", color=COLOURS.get(row["scheduler"]),
                label=f"{_label(row['scheduler'], row['policy'])} (batch {row['batch']}, n={len(x)})")
        drawn += 1
    if not drawn:
        raise EmptySelection("the TTFT CDF: no completed request in the chosen cells")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"checkpoint 3 ({profile}): TTFT CDF at max batch size {batch} "
                 "(pooled over repetitions)", fontsize=10)
    _save(fig, out)


def plot_chunked(df: pd.DataFrame, profile: str, out: Path) -> None:
    d = _require(df.copy(), "the chunked-prefill plot (chunked_prefill.csv)")
    d["_c"] = d["chunk"].astype(int)
    d["_b"] = d["batch"].astype(int)
    d = d.sort_values(["scheduler", "_b", "_c"], kind="stable")
    # two short lines a bar group ("continuous b64" / "chunk off"), never wider than its slot
    labels = [f"{r['scheduler']}\nb{r['batch']}, chunk {'off' if r['_c'] == 0 else r['_c']}"
              for _, r in d.iterrows()]
    x = np.arange(len(d))
    panel_w = max(5.5, 1.05 * len(d))  # inches per panel: about one inch a bar group
    fig, axes = plt.subplots(1, 2, figsize=(2 * panel_w, 4.6))
    width = 0.38
    for ax, stems in zip(axes, [[("itl_p95_ms", "p95 ITL"), ("itl_p99_ms", "p99 ITL")],
                                [("ttft_p95_ms", "p95 TTFT")]]):
        for k, (stem, name) in enumerate(stems):
            off = (k - (len(stems) - 1) / 2) * width
            ok = d[f"{stem}_median"].notna().to_numpy()
            y = d[f"{stem}_median"].fillna(0).to_numpy(float)
            lo = y - d[f"{stem}_min"].fillna(d[f"{stem}_median"]).fillna(0).to_numpy(float)
            hi = d[f"{stem}_max"].fillna(d[f"{stem}_median"]).fillna(0).to_numpy(float) - y
            colours = [COLOURS.get(s) for s in d["scheduler"]]
            ax.bar(x[ok] + off, y[ok], width * 0.95, yerr=[lo[ok], hi[ok]], capsize=3,
                   color=colours if k == 0 else "none", edgecolor=colours,
                   hatch=None if k == 0 else "//")
            _failed(ax, (x[~ok] + off).tolist(), "failed cell" if (~ok).any() and k == 0 else None)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        # one entry per scheduler colour, and (left panel) what filled and hatched bars are
        handles = [Patch(facecolor=COLOURS.get(s), label=s)
                   for s in dict.fromkeys(d["scheduler"])]
        if len(stems) > 1:
            handles += [Patch(facecolor="lightgray", edgecolor="black", label=f"filled: {stems[0][1]}"),
                        Patch(facecolor="none", edgecolor="black", hatch="//",
                              label=f"hatched: {stems[1][1]}")]
        else:
            handles += [Patch(facecolor="lightgray", edgecolor="black", label=stems[0][1])]
        handles += [h for h in ax.get_legend_handles_labels()[0]]  # a failed cell, if any
        ax.legend(handles=handles, fontsize=8)
    axes[0].set_title("inter-token latency of running decodes", fontsize=9)
    axes[1].set_title("time to first token", fontsize=9)
    fig.suptitle(f"checkpoint 3 ({profile}): chunked prefill with long prompts "
                 "(median, bars min–max over repetitions)", fontsize=10)
    _save(fig, out)


def plot_latency_throughput(df: pd.DataFrame, profile: str, out: Path) -> None:
    d = _require(df.copy(), "the latency-throughput plot (sweep rates)")
    d["_r"] = d["rate"].map(lambda v: np.inf if v in ("inf", "profile") else float(v))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series = 0
    for (sched, pol, batch), g in d.groupby(["scheduler", "policy", "batch"], sort=False):
        g = g.sort_values("_r")
        ok = g[g["request_throughput_median"].notna()]
        label = f"{_label(sched, pol)} b{batch}"
        style = dict(marker="o", color=COLOURS.get(sched), linestyle=POLICY_STYLE.get(pol, "-"))
        if not ok.empty:
            _errorbar(axes[0], ok["request_throughput_median"], ok, "ttft_p95_ms", label=label, **style)
            # the arrival rate beside each point, in the series' colour; series alternate above
            # and below their points, so two series ending at the same place keep apart
            above = series % 2 == 0
            for _, r in ok.iterrows():
                axes[0].annotate(f"{r['rate']}/s" if r["rate"] != "inf" else "offline",
                                 (r["request_throughput_median"], r["ttft_p95_ms_median"]),
                                 textcoords="offset points", xytext=(-6, 7) if above else (6, -11),
                                 ha="right" if above else "left", fontsize=7,
                                 color=COLOURS.get(sched))
            gp = ok[ok["goodput_median"].notna()]
            if not gp.empty:
                _errorbar(axes[1], gp["request_throughput_median"], gp, "goodput", label=label, **style)
        series += 1
        failed = g[g["request_throughput_median"].isna()]
        for ax in axes:
            _failed(ax, [0] * len(failed), "failed cell" if len(failed) else None)
    lim = float(np.nanmax(d["request_throughput_median"].to_numpy(float))) if d[
        "request_throughput_median"].notna().any() else 1.0
    axes[1].plot([0, lim], [0, lim], color="black", alpha=0.3, linewidth=1,
                 label="goodput = throughput (every request within SLO)")
    axes[0].margins(y=0.08)
    axes[0].set_xlim(right=1.12 * lim)  # room for the rate labels right of the last points
    axes[0].set_ylabel("p95 TTFT (ms)")
    axes[1].set_ylabel("goodput (requests/s within both SLOs)")
    for ax in axes:
        ax.set_xlabel("achieved request throughput (requests/s)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"checkpoint 3 ({profile}): latency against throughput over arrival rates "
                 "(median, bars min–max over repetitions)", fontsize=10)
    _save(fig, out)


def _read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, dtype=STR_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--defaults", default="{}", help="JSON of the matrix's default cell values")
    p.add_argument("--summary", type=Path, required=True, help="summary.csv of the aggregation")
    p.add_argument("--chunked", type=Path, required=True, help="chunked_prefill.csv")
    p.add_argument("--rates", type=Path, required=True, help="rates.csv")
    p.add_argument("--reports", nargs="+", type=Path, required=True, help="raw JSON reports (main sweep)")
    p.add_argument("--batch-scaling", type=Path, required=True)
    p.add_argument("--ttft-cdf", type=Path, required=True)
    p.add_argument("--chunked-plot", type=Path, required=True)
    p.add_argument("--latency-throughput", type=Path, required=True)
    a = p.parse_args(argv)
    defaults = {k: str(v) for k, v in json.loads(a.defaults).items()}
    df = _read(a.summary)
    plot_batch_scaling(df, defaults, a.profile, a.batch_scaling)
    plot_ttft_cdf(df, defaults, a.reports, a.profile, a.ttft_cdf)
    plot_chunked(_read(a.chunked), a.profile, a.chunked_plot)
    plot_latency_throughput(_read(a.rates), a.profile, a.latency_throughput)
    print(f"wrote {a.batch_scaling}, {a.ttft_cdf}, {a.chunked_plot}, {a.latency_throughput}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
