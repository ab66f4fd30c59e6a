"""Did this run reproduce the tracked results? Headline numbers against the committed ones, and
each stated conclusion (the config's ``claims``) judged on this run's tables.

The tracked values are git's committed copy of the same tables (``git show REV:PATH``, REV
HEAD by default), so they stay readable after a rerun has overwritten the working files, on
any clone. Outside a git checkout, or for a file never committed, the verdict says there is
nothing to compare with and still judges the conclusions.

Outputs, in ``--out-dir``:

* ``verdicts.md``: a one-line summary (how many conclusions hold, how many headline numbers
  fall inside the tracked repetitions' range and how many more inside the tolerance around it,
  whether runs were contended; "Reproduced" when every conclusion holds and every number is
  inside the tolerance), the headline
  comparison and the conclusions, each with this run's value and the tracked one.
* ``verdicts.csv``: the same rows, every number.
* ``report.rst``: the report's first page (the workflow description includes it): the
  summary, this run's headline table and both verdict tables.

A claim (validated by ``workflow/schemas/config.schema.yaml``) is either a comparison::

    {text: ..., table: summary, metric: output_throughput,
     row: {scheduler: continuous, batch: 8}, than: {scheduler: static, batch: 8}, at_least: 1.0}

(``row``'s median over ``than``'s must be >= ``at_least``, or <= ``at_most``; each selector
must match exactly one row of the table), or a check of one column on every row::

    {text: ..., table: summary, column: digest_agrees_with_naive, all_in: [yes, reference]}

Usage (the pipeline's ``verdicts`` rule)::

    python workflow/scripts/verdicts.py --profile cpu --tables results/checkpoint3/cpu \\
        --claims '[...]' --out-dir results/checkpoint3/cpu [--rev HEAD]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from matrix_columns import COLUMN_NAMES  # noqa: E402  (workflow/scripts/, next to this file)

#: Headline metrics: CSV stem, label, unit, whether higher is better.
HEADLINE_METRICS = (("output_throughput", "output throughput", "tok/s", True),
                    ("ttft_p95_ms", "p95 TTFT", "ms", False),
                    ("tpot_p95_ms", "p95 TPOT", "ms", False))
SCHEDULER_NAMES = {"naive": "Naive", "paged": "Paged", "static": "Static batching",
                   "continuous": "Continuous batching"}
#: Columns read as text (matrix values are labels: batch "8", rate "inf").
TEXT = {c: str for c in (*COLUMN_NAMES, "cell", "status", "digest_agrees_with_naive")}


def _git_path(path: Path) -> tuple[str, str]:
    """``(repository top, path relative to it)``; raises ``CalledProcessError`` / ``OSError``
    outside a git checkout, ``ValueError`` for a path outside the repository."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                         cwd=path.parent if path.parent.exists() else None).stdout.strip()
    return top, path.resolve().relative_to(Path(top).resolve()).as_posix()


def committed_table(path: Path, rev: str = "HEAD") -> tuple[pd.DataFrame | None, str]:
    """The table ``path`` as committed at ``rev`` and a label of where it came from: the commit
    that brought that content (the last one at or before ``rev`` that changed the file), so
    the label names the tracked run whenever the verdicts are written.

    Returns (None, reason) when git or the committed file is not there.
    """
    try:
        top, rel = _git_path(path)
        commit = subprocess.run(["git", "log", "-1", "--format=%h", "--abbrev=12", rev, "--", rel],
                                capture_output=True, text=True, check=True, cwd=top).stdout.strip()
        text = subprocess.run(["git", "show", f"{rev}:{rel}"], capture_output=True, text=True,
                              check=True, cwd=top).stdout
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None, f"no committed copy of {path.name} (not a git checkout, or never committed)"
    return pd.read_csv(io.StringIO(text), dtype=TEXT), f"git {commit}"


def replaced_rev(path: Path, rev: str = "HEAD") -> str | None:
    """The revision just before the last commit at or before ``rev`` that changed ``path`` (a
    file or a folder), or None (not a git checkout, nothing committed there, a root commit, a
    shallow clone without that history). With the run's ``raw/`` folder as ``path``: the
    tracked run that the one committed at ``rev`` replaced."""
    try:
        top, rel = _git_path(path)
        last = subprocess.run(["git", "log", "-1", "--format=%H", rev, "--", rel], capture_output=True,
                              text=True, check=True, cwd=top).stdout.strip()
        if not last:
            return None
        parent = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{last}^"], capture_output=True,
                                text=True, check=True, cwd=top).stdout.strip()
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None
    return parent or None


def committed_tables(tables_dir: Path, rev: str = "HEAD") -> tuple[dict[str, pd.DataFrame | None], str]:
    """Every table of :data:`TABLES` as committed at ``rev`` (:func:`committed_table`; None
    where absent) and the headline's label."""
    old, source = {}, ""
    for name in TABLES:
        old[name], where = committed_table(tables_dir / f"{name}.csv", rev)
        if name == "headline":
            source = where
    return old, source


def is_committed_run(new: dict[str, pd.DataFrame | None], committed: dict[str, pd.DataFrame | None]) -> bool:
    """Whether this run's tables (``new``) are the ``committed`` ones: the headline and every
    other table this run has equal their committed copies (a rerun of one sweep changes its
    table and not the headline, and is judged against them)."""
    if new.get("headline") is None:
        return False
    return all(table is None or (committed.get(name) is not None and committed[name].equals(table))
               for name, table in new.items())


def _read(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path, dtype=TEXT) if path.exists() else None


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "–"
    digits = 0 if abs(v) >= 1000 else 1 if abs(v) >= 10 else 2
    return f"{v:,.{digits}f}" + (f" {unit}" if unit else "")


def headline_rows(new: pd.DataFrame, old: pd.DataFrame | None,
                  tolerance: float = 0.0) -> list[dict[str, Any]]:
    """Each headline number of this run beside the tracked median and [min–max].

    A number reproduces when it falls inside the tracked repetitions' [min, max] widened on each
    side by ``tolerance`` times the tracked median (0.1: 10%). The band is for run-to-run spread
    between sittings of one machine, which exceeds the spread of the repetitions within one
    sitting on a shared host; a number outside it did not reproduce."""
    rows = []
    for _, r in new.iterrows():
        ref = None
        if old is not None:
            match = old[old["scheduler"] == r["scheduler"]]
            ref = match.iloc[0] if len(match) else None
        for stem, label, unit, higher in HEADLINE_METRICS:
            value = _num(r.get(f"{stem}_median"))
            med, lo, hi = ((_num(ref.get(f"{stem}_{k}")) for k in ("median", "min", "max"))
                           if ref is not None else (None, None, None))
            within = in_range = None
            if value is None:
                verdict = "no value (failed)"
            elif med is None:
                verdict = "nothing tracked to compare with"
            else:
                # a tracked table without its spread: the median is the whole range
                lo, hi = (med, med) if lo is None or hi is None else (lo, hi)
                band = tolerance * abs(med)
                in_range = bool(lo <= value <= hi)
                within = bool(lo - band <= value <= hi + band)
                if in_range:
                    verdict = "within the tracked range"
                else:
                    change = value / med - 1 if med else math.copysign(math.inf, value - med)
                    better = (change > 0) == higher
                    pct = f"{abs(change) * 100:.0f}%" if math.isfinite(change) else "far"
                    tol = f"{tolerance * 100:g}%"
                    where = (f"inside the {tol} tolerance" if within else
                             f"outside its range{f' and the {tol} tolerance' if tolerance else ''}")
                    verdict = f"{pct} {'better' if better else 'worse'} than the tracked median, {where}"
            rows.append({"kind": "headline", "what": f"{SCHEDULER_NAMES.get(r['scheduler'], r['scheduler'])}: {label}",
                         "unit": unit, "this_run": value, "tracked": med, "tracked_min": lo,
                         "tracked_max": hi, "verdict": verdict, "within": within,
                         "in_range": in_range})
    return rows


def _select(df: pd.DataFrame, selector: dict[str, Any]) -> pd.DataFrame:
    keep = pd.Series(True, index=df.index)
    for col, want in selector.items():
        want = "on" if want is True else "off" if want is False else want
        want = str(int(want)) if isinstance(want, float) and want.is_integer() else str(want)
        keep &= df[col].astype(str) == want
    return df[keep]


def judge(claim: dict[str, Any], tables: dict[str, pd.DataFrame | None]) -> dict[str, Any]:
    """One claim on one set of tables: ``{"holds": True|False|None, "value": ..., "detail": ...}``
    (None: it cannot be judged, e.g. a failed cell or a missing table)."""
    df = tables.get(claim["table"])
    if df is None or df.empty:
        return {"holds": None, "value": None, "detail": f"no {claim['table']} table"}
    if "all_in" in claim:
        col = claim["column"]
        values = df[col].astype(str).tolist()
        bad = [v for v in values if v not in claim["all_in"]]
        return {"holds": not bad, "value": None,
                "detail": f"{len(values) - len(bad)} of {len(values)} rows" + (
                    f"; not: {', '.join(sorted(set(bad)))}" if bad else "")}
    a, b = _select(df, claim["row"]), _select(df, claim["than"])
    if len(a) != 1 or len(b) != 1:
        return {"holds": None, "value": None,
                "detail": f"the selectors match {len(a)} and {len(b)} rows (need one each)"}
    stem = claim["metric"]
    x, y = _num(a.iloc[0].get(f"{stem}_median")), _num(b.iloc[0].get(f"{stem}_median"))
    if x is None or not y:
        return {"holds": None, "value": None, "detail": "a compared cell has no value"}
    ratio = x / y
    if "at_least" in claim:
        holds, bound = ratio >= claim["at_least"], f">= {claim['at_least']:g}"
    else:
        holds, bound = ratio <= claim["at_most"], f"<= {claim['at_most']:g}"
    return {"holds": bool(holds), "value": ratio,
            "detail": f"{_fmt(x)} / {_fmt(y)} = ×{ratio:.2f} (needs {bound})"}


TABLES = ("headline", "summary", "chunked_prefill", "rates", "failure_regimes", "batch_invariant")


def contention_line(tables: dict[str, pd.DataFrame | None]) -> str:
    """How many of the runs behind the tables ran beside other work."""
    counted = runs = 0
    recorded = False
    seen = set()
    for name in ("summary", "chunked_prefill", "rates", "failure_regimes", "batch_invariant"):
        df = tables.get(name)
        if df is None or "runs_contended" not in df:
            continue
        for _, r in df.iterrows():
            if r["cell"] in seen:
                continue
            seen.add(r["cell"])
            n = _num(r.get("runs_contended"))
            runs += int(_num(r.get("repetitions")) or 0)
            if n is not None:
                recorded = True
                counted += int(n)
    if not recorded:
        return "the machine's load was not recorded by these runs"
    if counted:
        return (f"**{counted} of {runs} runs ran on a busy machine** (contended: their status "
                "says so); numbers that moved may be the machine's, not the engine's")
    return f"no run was contended ({runs} runs; the machine was otherwise idle)"


def write(profile: str, tables_dir: Path, claims: list[dict[str, Any]], out: Path,
          rev: str = "HEAD", tolerance: float = 0.0) -> dict[str, Any]:
    """Write verdicts.md, verdicts.csv and report.rst; returns the summary counts.

    This run is judged against the tables committed at ``rev``. When they are this run's own
    tables (:func:`is_committed_run`: the tracked run, its tables rebuilt on a fresh clone or
    after a ``publish`` was committed), it is judged against the run they replaced instead: the
    revision before the last commit that changed the run's ``raw/`` reports (the headline's
    if ``raw/`` is not tracked), so the verdict a run got when it was published is the one
    every rebuild of it writes again, byte for byte. A shallow clone lacks that history and
    judges the run against itself."""
    new = {name: _read(tables_dir / f"{name}.csv") for name in TABLES}
    old, source = committed_tables(tables_dir, rev)
    if is_committed_run(new, old):
        # the run that brought the raw reports (a commit that only reformats tables is no run)
        before = replaced_rev(tables_dir / "raw", rev) or replaced_rev(tables_dir / "headline.csv", rev)
        if before:
            old, source = committed_tables(tables_dir, before)
    head = (headline_rows(new["headline"], old["headline"], tolerance)
            if new["headline"] is not None else [])
    claim_rows = []
    for c in claims:
        now, then = judge(c, new), judge(c, old) if old.get(c["table"]) is not None else None
        claim_rows.append({"kind": "conclusion", "what": c["text"], "unit": "",
                           "this_run": now["value"], "tracked": then["value"] if then else None,
                           "verdict": {True: "holds", False: "does not hold",
                                       None: "cannot judge"}[now["holds"]],
                           "detail": now["detail"], "holds": now["holds"]})
    n_hold = sum(r["holds"] is True for r in claim_rows)
    within = [r["within"] for r in head if r["within"] is not None]
    in_range = [r["in_range"] for r in head if r["in_range"] is not None]
    identical = (old["headline"] is not None and new["headline"] is not None
                 and old["headline"].equals(new["headline"]))
    contention = contention_line(new)
    reproduced = n_hold == len(claim_rows) and all(within)
    summary = (f"**{'Reproduced' if reproduced else 'Not reproduced'}** on this run: "
               f"{n_hold} of {len(claim_rows)} stated conclusions hold; {sum(in_range)} of "
               f"{len(in_range)} headline numbers fall inside the tracked repetitions' range"
               + (f", {sum(within) - sum(in_range)} more inside its {tolerance * 100:g}% tolerance"
                  if tolerance else "")
               + f" (tracked values: {source}"
               + ("; this run is the tracked one" if identical else "") + f"); {contention}.")

    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(head + claim_rows).drop(columns=["within", "in_range", "holds"], errors="ignore").to_csv(
        out / "verdicts.csv", index=False, float_format="%.6g")
    md = [f"# Checkpoint 3: does this run reproduce the tracked results? — profile `{profile}`", "",
          "Generated by `workflow/scripts/verdicts.py` from this run's tables and git's committed",
          "copy of them; the conclusions are the config's `claims`. Do not edit.", "",
          summary, "", "## Headline numbers against the tracked run", "",
          "| Number | This run | Tracked median [min–max] | Verdict |", "|---|---:|---:|---|"]
    for r in head:
        tracked = ("–" if r["tracked"] is None else
                   f"{_fmt(r['tracked'])} [{_fmt(r['tracked_min'])}–{_fmt(r['tracked_max'])}]")
        md.append(f"| {r['what']} ({r['unit']}) | {_fmt(r['this_run'])} | {tracked} | {r['verdict']} |")
    md += ["", "## Stated conclusions", "",
           "| Conclusion | Verdict | This run | Tracked |", "|---|---|---|---:|"]
    for r in claim_rows:
        tracked = "–" if r["tracked"] is None else f"×{r['tracked']:.2f}"
        md.append(f"| {r['what']} | {r['verdict']} | {r['detail']} | {tracked} |")
    (out / "verdicts.md").write_text("\n".join(md) + "\n")
    (out / "report.rst").write_text(_rst(profile, summary, new["headline"], head, claim_rows))
    return {"claims": len(claim_rows), "hold": n_hold, "within": sum(within),
            "in_range": sum(in_range), "numbers": len(within), "reproduced": reproduced}


def _rst_table(header: list[str], rows: list[list[str]], widths: str) -> list[str]:
    out = [".. list-table::", "   :header-rows: 1", f"   :widths: {widths}", ""]
    for cells in [header, *rows]:
        out.append(f"   * - {cells[0]}")
        out += [f"     - {c}" for c in cells[1:]]
    return out + [""]


def _rst_text(md: str) -> str:
    """Markdown bold (``**x**``) as reStructuredText strong emphasis (the same markup)."""
    return md.replace("`", "``").replace("````", "``")


def _rst(profile: str, summary: str, headline: pd.DataFrame | None, head: list[dict],
         claims: list[dict]) -> str:
    title = f"llmserve checkpoint 3: results and verdicts (profile {profile})"
    lines = [title, "=" * len(title), "", _rst_text(summary), ""]
    if headline is not None:
        lines += ["Headline", "--------", "",
                  "Median [min–max] over repetitions, from ``headline.md``.", ""]
        rows = []
        for _, r in headline.iterrows():
            def rng(stem: str, unit: str) -> str:
                med, lo, hi = (_num(r.get(f"{stem}_{k}")) for k in ("median", "min", "max"))
                return "–" if med is None else f"{_fmt(med)} [{_fmt(lo)}–{_fmt(hi)}] {unit}"
            rows.append([SCHEDULER_NAMES.get(r["scheduler"], r["scheduler"]),
                         rng("output_throughput", "tok/s"), rng("ttft_p95_ms", "ms"),
                         rng("tpot_p95_ms", "ms"), str(r["status"])])
        lines += _rst_table(["Scheduler", "Output throughput", "p95 TTFT", "p95 TPOT", "Status"],
                            rows, "22 22 22 18 16")
    lines += ["Stated conclusions", "------------------", ""]
    lines += _rst_table(["Conclusion", "Verdict", "This run", "Tracked"],
                        [[r["what"], r["verdict"], r["detail"],
                          "–" if r["tracked"] is None else f"×{r['tracked']:.2f}"] for r in claims],
                        "46 14 28 12")
    lines += ["Headline numbers against the tracked run", "----------------------------------------", ""]
    lines += _rst_table(["Number", "This run", "Tracked median [min–max]", "Verdict"],
                        [[f"{r['what']} ({r['unit']})", _fmt(r["this_run"]),
                          "–" if r["tracked"] is None else
                          f"{_fmt(r['tracked'])} [{_fmt(r['tracked_min'])}–{_fmt(r['tracked_max'])}]",
                          r["verdict"]] for r in head], "34 16 26 24")
    lines += ["Every table and plot this target builds is in the menu: **Results** (verdicts, "
              "headline, summary and the focused tables), **Plots** and **Prefix caching**, each "
              "with a caption saying what it shows and what to look at. Methodology and columns: "
              "``docs/benchmarking.md``.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--tables", type=Path, required=True, help="folder of this run's table CSVs")
    p.add_argument("--claims", default="[]", help="JSON list of claims (the config's `claims`)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--rev", default="HEAD", help="git revision of the tracked tables")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="a headline number reproduces inside the tracked [min, max] widened by this "
                        "fraction of the tracked median on each side (default 0.1, the config's "
                        "reproduce_tolerance; 0: the range alone)")
    a = p.parse_args(argv)
    if not (0 <= a.tolerance < 1):   # also refuses nan
        p.error(f"--tolerance must be in [0, 1), got {a.tolerance}")
    s = write(a.profile, a.tables, json.loads(a.claims), a.out_dir, a.rev, a.tolerance)
    print(f"{s['hold']}/{s['claims']} conclusions hold, {s['in_range']}/{s['numbers']} headline "
          f"numbers within the tracked range, {s['within']}/{s['numbers']} within the tolerance"
          f" -> {a.out_dir}/verdicts.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
