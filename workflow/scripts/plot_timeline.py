"""Per-request timelines of traced benchmark cells (matplotlib, Agg backend, PNG).

One figure per entry of the config's ``timelines``: one panel per cell, stacked on a shared x
axis (seconds since the measured phase began), one row per request in order of arrival, and
the request's life drawn as contiguous horizontal bars (:func:`llmserve.core.trace.request_spans`):
queued (light grey), prefill (orange; a recompute after a preemption hatched black on orange), decode
(blue) and preempted (red, waiting to be recomputed). A rejected request is a black cross at its
rejection. Each panel's title is the cell in words with its number of requests and preemptions;
the figure's title names the profile and the engine code hash the cells' provenance files
record. A failed cell keeps its panel: it says that the cell failed and why, over whatever part
of the trace the run wrote.

What to look for: static batching holds the next batch queued until the longest member of the
current one ends; continuous batching refills a row's slot as soon as a request ends; chunked
prefill spreads a long prompt's prefill over several steps while the other rows keep decoding;
under KV pressure, red spans and the recompute after them.

Usage (the pipeline's ``timeline_<name>`` rules run it)::

    python workflow/scripts/plot_timeline.py --profile cpu --figure batching \\
        --defaults '{"scheduler": "continuous", ...}' --raw results/checkpoint3/cpu/raw \\
        --cells CELL_ID [CELL_ID ...] --output results/checkpoint3/cpu/plots/timeline_batching.png

reads ``<raw>/<cell>.trace.jsonl.gz`` (written by ``llmserve benchmark --trace``),
``<raw>/<cell>.json`` (the report: status and error) and ``<raw>/<cell>.provenance.json`` (the
code hash) of every cell.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from matrix_columns import COLUMN_NAMES, cell_params  # noqa: E402  (workflow/scripts/, next to this file)

from llmserve.core.trace import read_trace, request_spans  # noqa: E402  (the engine on PYTHONPATH)

__all__ = ["CellTimeline", "load_cell", "cell_words", "plot_timeline", "main"]

# Deterministic PNG bytes for identical data: no creation time / software stamp in the file.
PNG_METADATA = {"Software": None}
#: Bar colour of each span kind ("recompute": a prefill span after a preemption).
SPAN_COLOURS = {"queued": "#d4d4d4", "prefill": "tab:orange", "recompute": "tab:orange",
                "decode": "tab:blue", "preempted": "tab:red"}
#: A recompute is a prefill (orange) hatched in black, so it stands apart from the red before it.
SPAN_HATCH = {"recompute": "xxxx"}
SPAN_LABELS = {"queued": "queued", "prefill": "prefill", "recompute": "recompute after preemption",
               "decode": "decode", "preempted": "preempted (KV blocks taken)"}
SCHEDULER_WORDS = {"naive": "naive (one request at a time)", "paged": "paged (batch 1)",
                   "static": "static batching", "continuous": "continuous batching"}
#: Columns the naive control ignores (the matrix normalises them), never named in its words.
NAIVE_IGNORES = ("policy", "batch", "chunk", "attn", "blocks")
#: Layout: figure width, and a panel's height as a fixed part plus a part per request row.
FIG_WIDTH_IN = 11.0
PANEL_BASE_IN, PANEL_ROW_IN, PANEL_MIN_IN = 0.75, 0.045, 1.5


@dataclass
class CellTimeline:
    """What one panel shows: the cell, its trace's events, and how its run ended."""

    cell: str
    events: list[dict] = field(default_factory=list)
    status: str = "ok"
    error: str | None = None
    code_hash: str | None = None


def load_cell(raw: Path, cell: str) -> CellTimeline:
    """The trace, report status and code hash of ``cell`` under ``raw``.

    A missing or unreadable file does not raise: the panel then says what is missing (a failed
    cell's trace may be empty or absent; its report holds the error).
    """
    out = CellTimeline(cell)
    problems = []
    try:
        report = json.loads((raw / f"{cell}.json").read_text())
        out.status = str(report.get("status") or "failed")
        out.error = report.get("error")
    except (OSError, ValueError) as e:
        out.status, problems = "failed", [f"no readable report ({type(e).__name__})"]
    try:
        out.code_hash = json.loads((raw / f"{cell}.provenance.json").read_text()).get("code_hash")
    except (OSError, ValueError):
        pass
    try:
        out.events = read_trace(raw / f"{cell}.trace.jsonl.gz")
    except (OSError, ValueError, EOFError) as e:
        problems.append(f"no readable trace ({type(e).__name__}: {e})")
    if problems:
        out.error = "; ".join(([out.error] if out.error else []) + problems)
        if out.status == "ok":
            out.status = "failed"
    return out


def cell_words(cell: str, defaults: dict[str, str], varying: set[str] = frozenset()) -> str:
    """A cell in words: its scheduler and max batch, then every column that is off the defaults
    or that differs between the figure's cells (``varying``)."""
    c = cell_params(cell)
    words = [SCHEDULER_WORDS.get(c["scheduler"], c["scheduler"])]
    if c["scheduler"] not in ("naive", "paged"):
        words.append(f"max batch {c['batch']}")
    for k in COLUMN_NAMES:
        if k in ("scheduler", "batch") or (c["scheduler"] == "naive" and k in NAIVE_IGNORES):
            continue
        if c[k] != defaults.get(k) or k in varying:
            words.append(_column_words(k, c[k]))
    return ", ".join(words)


def _column_words(column: str, value: str) -> str:
    if column == "chunk":
        return "chunked prefill off" if value == "0" else f"prefill chunk {value} tokens"
    if column == "blocks":
        return "KV blocks: memory budget" if value == "auto" else f"{value} KV blocks"
    if column == "rate":
        return {"inf": "all requests at t = 0", "profile": "the load profile's arrival rate"}.get(
            value, f"{value} requests/s")
    if column == "invariant":
        return "batch-invariant" if value == "on" else "not batch-invariant"
    return f"{column} {value}"


def _request_order(events: list[dict]) -> list[str]:
    """Request ids by arrival (ties, e.g. an offline burst at t = 0, by the id's number)."""
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}   # a request without an `arrived` event (rejected): its first
    for e in events:
        rid, t = e["request_id"], float(e["t"])
        if e["event"] == "arrived":
            arrived[rid] = t
        first[rid] = min(t, first.get(rid, t))
    first.update(arrived)

    def number(rid: str) -> tuple:
        m = re.search(r"(\d+)$", str(rid))
        return (int(m.group(1)) if m else -1, str(rid))

    return sorted(first, key=lambda rid: (first[rid], number(rid)))


def _panel_counts(events: list[dict]) -> dict[str, int]:
    kinds: dict[str, set] = {"requests": set(), "finished": set(), "rejected": set()}
    preemptions = 0
    for e in events:
        kinds["requests"].add(e["request_id"])
        if e["event"] in ("finished", "rejected"):
            kinds[e["event"]].add(e["request_id"])
        preemptions += e["event"] == "preempted"
    n = len(kinds["requests"])
    return {"requests": n, "preemptions": preemptions, "rejected": len(kinds["rejected"]),
            "unfinished": n - len(kinds["finished"]) - len(kinds["rejected"])}


def _panel_title(tl: CellTimeline, words: str) -> str:
    if not tl.events:   # nothing to count: a cell that failed before its measured phase
        return f"{words} — " + ("FAILED" if tl.status != "ok" else "no trace events")
    c = _panel_counts(tl.events)
    parts = [f"{c['requests']} requests", f"{c['preemptions']} preemption"
             + ("" if c["preemptions"] == 1 else "s")]
    if c["rejected"]:
        parts.append(f"{c['rejected']} rejected")
    if c["unfinished"] > 0:
        parts.append(f"{c['unfinished']} unfinished")
    parts.append(f"last event {max(float(e['t']) for e in tl.events):.2f} s")
    return f"{words} — " + ", ".join(parts) + (" — FAILED" if tl.status != "ok" else "")


def _draw_panel(ax, tl: CellTimeline, words: str) -> set[str]:
    """Draw one cell; returns the span kinds (and "rejected") it drew, for the legend."""
    order = _request_order(tl.events)
    row = {rid: i for i, rid in enumerate(order)}
    spans = request_spans(tl.events)
    bars: dict[str, tuple[list, list, list]] = {k: ([], [], []) for k in SPAN_COLOURS}
    for rid, ss in spans.items():
        prev = None
        for s in ss:
            kind = "recompute" if s.kind == "prefill" and prev == "preempted" else s.kind
            prev = s.kind
            ys, lefts, widths = bars[kind]
            ys.append(row[rid])
            lefts.append(s.start)
            widths.append(max(s.end - s.start, 0.0))
    drawn = set()
    for kind, (ys, lefts, widths) in bars.items():
        if ys:
            ax.barh(ys, widths, left=lefts, height=0.82, color=SPAN_COLOURS[kind], linewidth=0,
                    hatch=SPAN_HATCH.get(kind), edgecolor="black")  # hatch colour = edge colour
            drawn.add(kind)
    rejected = [(float(e["t"]), row[e["request_id"]]) for e in tl.events if e["event"] == "rejected"]
    if rejected:
        ax.plot([t for t, _ in rejected], [y for _, y in rejected], "x", color="black", ms=4, mew=1.2)
        drawn.add("rejected")
    n = max(len(order), 1)
    ax.set_ylim(n - 0.5, -0.5)  # first arrival at the top
    if order:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=True, min_n_ticks=2))
    else:
        ax.set_yticks([])
    ax.set_ylabel("request\n(arrival order)", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(axis="x", color="0.9", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(_panel_title(tl, words), fontsize=9, loc="left")
    if tl.status != "ok" or not tl.events:
        why = (f"cell failed: {tl.error or 'no error recorded'}" if tl.status != "ok"
               else "the trace has no events")
        ax.text(0.5, 0.5, "\n".join(textwrap.wrap(why, 110)[:4]), transform=ax.transAxes,
                ha="center", va="center", fontsize=9, color="darkred",
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "darkred", "alpha": 0.9})
    return drawn


def _hash_words(cells: list[CellTimeline]) -> str:
    hashes = sorted({c.code_hash[:12] for c in cells if c.code_hash})
    if not hashes:
        return "llmserve code hash unknown"
    return "llmserve code " + ", ".join(hashes)


def plot_timeline(cells: list[CellTimeline], defaults: dict[str, str], profile: str, figure: str,
                  output: Path) -> None:
    """Write the figure of ``cells`` (one panel each, in order) to ``output`` (PNG).

    Raises:
        ValueError: ``cells`` is empty.
    """
    if not cells:
        raise ValueError(f"timeline {figure!r}: no cells to draw")
    params = [cell_params(c.cell) for c in cells]
    varying = {k for k in COLUMN_NAMES if len({p[k] for p in params}) > 1}
    heights = [max(PANEL_MIN_IN, PANEL_BASE_IN + PANEL_ROW_IN * _panel_counts(c.events)["requests"])
               for c in cells]
    fig, axes = plt.subplots(len(cells), 1, sharex=True, squeeze=False, layout="constrained",
                             figsize=(FIG_WIDTH_IN, sum(heights) + 1.1),
                             gridspec_kw={"height_ratios": heights})
    drawn: set[str] = set()
    for ax, tl in zip(axes[:, 0], cells):
        drawn |= _draw_panel(ax, tl, cell_words(tl.cell, defaults, varying))
    bottom = axes[-1, 0]
    bottom.set_xlabel("seconds since the measured phase began")
    bottom.set_xlim(left=0)
    handles = [Patch(facecolor=SPAN_COLOURS[k], hatch=SPAN_HATCH.get(k), edgecolor="black",
                     linewidth=0, label=SPAN_LABELS[k]) for k in SPAN_COLOURS
               if k in drawn or k in ("queued", "prefill", "decode", "preempted")]
    if "rejected" in drawn:
        handles.append(Line2D([], [], marker="x", color="black", linestyle="none", label="rejected"))
    fig.suptitle(f"Request timelines: {figure.replace('_', ' ')} — profile {profile}, {_hash_words(cells)}",
                 fontsize=11)
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="the profile's name (figure title)")
    p.add_argument("--figure", required=True, help="the figure's name in the config's timelines")
    p.add_argument("--defaults", required=True, help="JSON: the matrix defaults, as cell-id values")
    p.add_argument("--raw", type=Path, required=True, help="folder of the cells' raw files")
    p.add_argument("--cells", nargs="+", required=True, help="cell ids, one panel each, in order")
    p.add_argument("--output", type=Path, required=True, help="PNG to write")
    a = p.parse_args(argv)
    cells = [load_cell(a.raw, c) for c in a.cells]
    plot_timeline(cells, json.loads(a.defaults), a.profile, a.figure, a.output)
    for c in cells:
        n = _panel_counts(c.events)
        print(f"{c.cell}: {c.status}, {n['requests']} requests, {n['preemptions']} preemptions,"
              f" {len(c.events)} events")
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
