"""Plot a ``llmserve quantize-eval`` report: quality vs matched decode throughput vs stored bytes.

One PNG (matplotlib, Agg backend) with two panels:

* left: quality (``kl`` = mean KL(p16 || pq) in nats, symlog axis; or ``ppl`` = perplexity) against
  output tok/s of the matched workload; bubble area proportional to stored bytes, each bubble
  annotated with mode, MB and the bytes ratio to the baseline;
* right: stored MB per mode (bars), failed modes hatched.

Failed modes are never dropped: they are listed under the plot with their first error, and
drawn wherever they have numbers. The report's model name, device, baseline dtype and note
(random weights -> perplexity means nothing) are in the title/footer.

Usage::

    python workflow/scripts/plot_quantization.py results/quantization.json --output plot.png [--metric kl|ppl]

From Snakemake (``script:`` directive): ``input[0]`` is the report JSON, ``output[0]`` the PNG,
optional ``params.metric``.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# Deterministic PNG bytes for identical data: no software stamp in the file.
PNG_METADATA = {"Software": None}
METRICS = {"kl": ("kl_mean", "mean KL(p16 || pq) (nats, symlog)"),
           "ppl": ("perplexity", "perplexity")}
COLORS = {"fp16": "tab:blue", "int8": "tab:orange", "int4": "tab:green", "triton-int8": "tab:red"}


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a quantize-eval JSON report.

    Raises:
        ValueError: the file has no ``modes`` list.
    """
    rep = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(rep.get("modes"), list):
        raise ValueError(f"{path}: not a quantize-eval report (no 'modes' list)")
    return rep


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def plot_quantization(report: dict[str, Any] | str | Path, output: str | Path,
                      metric: str = "kl") -> Path:
    """Draw the report (dict or JSON path) into ``output`` (PNG); returns the path.

    Raises:
        ValueError: unknown ``metric`` (supported: ``kl``, ``ppl``), or the report has no modes
            (an empty plot would hide a broken evaluation).
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    rep = report if isinstance(report, dict) else load_report(report)
    key, ylabel = METRICS[metric]
    rows = rep["modes"]
    if not rows:
        raise ValueError("the quantize-eval report lists no modes: nothing to plot")
    fig, (ax, axb) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [3, 2]})

    max_bytes = max((_num(r.get("stored_bytes")) or 0.0) for r in rows) or 1.0
    xs, ys = [], []
    for r in rows:
        x, y, b = _num(r.get("throughput_tok_s")), _num(r.get(key)), _num(r.get("stored_bytes"))
        if x is None or y is None:
            continue
        ys.append(y)
        size = 200 + 1800 * (b or 0.0) / max_bytes
        color = COLORS.get(r["mode"], "tab:gray")
        xs.append(x)
        ax.scatter([x], [y], s=size, alpha=0.45, color=color, edgecolors="black",
                   linewidths=1.5 if r.get("status") == "ok" else 0.8,
                   hatch=None if r.get("status") == "ok" else "//")
        ratio = _num(r.get("bytes_ratio"))
        label = f"{r['mode']}" + (" (failed)" if r.get("status") != "ok" else "")
        label += f"\n{b / 1e6:.1f} MB" if b is not None else ""
        label += f" ({ratio:.2f}x)" if ratio is not None else ""
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(12, 8), fontsize=8)
    # Limits with room for the largest bubble (radius about 25 points) on every side: the
    # 16-bit baseline sits at KL 0 on the bottom edge and usually at the largest throughput.
    ax.set_xlim(0, 1.25 * max(xs) if xs else 1.0)
    if metric == "kl":
        pos = [y for y in ys if y > 0]
        linthresh = (min(pos) / 2) if pos else 1e-6
        ax.set_yscale("symlog", linthresh=linthresh)
        # symlog: one linear decade below 0 and one decade above the largest KL
        ax.set_ylim(-linthresh, 10 * max(ys + [linthresh]))
    else:
        lo, hi = min(ys, default=0.0), max(ys, default=1.0)
        pad = 0.25 * (hi - lo or abs(hi) or 1.0)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("matched decode throughput (output tok/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, which="both")
    ax.set_title("quality vs throughput (bubble area ~ stored bytes)", fontsize=10)

    names = [r["mode"] for r in rows]
    mb = [(_num(r.get("stored_bytes")) or 0.0) / 1e6 for r in rows]
    bars = axb.bar(names, mb, color=[COLORS.get(n, "tab:gray") for n in names], alpha=0.7,
                   edgecolor="black")
    for bar, r in zip(bars, rows):
        if r.get("status") != "ok":
            bar.set_hatch("//")
        if r.get("stored_bytes") is None:
            axb.annotate("n/a", (bar.get_x() + bar.get_width() / 2, 0), ha="center",
                         va="bottom", fontsize=8)
    axb.set_ylim(bottom=0)
    axb.set_ylabel("stored MB (params + persistent buffers)")
    axb.set_title("model size per mode (hatched = failed)", fontsize=10)
    axb.grid(True, axis="y", alpha=0.3)

    model = rep.get("model", {})
    dev = rep.get("device", {})
    device = dev.get("gpu_name") or dev.get("requested") or "?"
    base = rep.get("baseline", {}).get("compute_dtype", "?")
    fig.suptitle(f"quantize-eval: {model.get('name', '?')} on {device} (baseline {base})", fontsize=11)

    footer = []
    for r in rows:
        if r.get("status") != "ok":
            footer.append(f"FAILED {r['mode']}: {(r.get('error') or 'unknown error')[:160]}")
        elif _num(r.get("throughput_tok_s")) is None or _num(r.get(key)) is None:
            footer.append(f"{r['mode']}: not on the left panel (no throughput or {key})")
    if rep.get("note"):
        footer.append("note: " + rep["note"])
    text = "\n".join(textwrap.fill(line, 170) for line in footer)
    n_lines = text.count("\n") + 1 if text else 0
    fig.text(0.01, 0.01, text, fontsize=7, va="bottom", ha="left", family="monospace")
    fig.tight_layout(rect=(0, min(0.5, 0.03 + 0.022 * n_lines), 1, 0.95))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path, help="quantize-eval JSON")
    p.add_argument("--output", type=Path, required=True, help="PNG path")
    p.add_argument("--metric", choices=sorted(METRICS), default="kl")
    a = p.parse_args(argv)
    out = plot_quantization(a.report, a.output, a.metric)
    print(f"wrote {out}")
    return 0


if "snakemake" in globals():  # run by Snakemake's script: directive
    _sm = globals()["snakemake"]
    plot_quantization(_sm.input[0], _sm.output[0], metric=getattr(_sm.params, "metric", "kl"))
elif __name__ == "__main__":
    sys.exit(main())
