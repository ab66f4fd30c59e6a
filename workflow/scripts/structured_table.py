"""The structured-output cost table: constrained against free output throughput, per max batch size.

Each cell is one ``llmserve benchmark`` report (``workflow/rules/gpu.smk``): the same seeded
workload at a max batch size with (``schema~on``) and without (``schema~off``) a JSON schema,
over the configured repetitions. The table gives median [min-max] output throughput and p50
TPOT of both, the ratio of the medians, the coefficient of variation of each throughput (a row
over 10% is marked noisy) and the failed runs as rows. Where the reports carry the engine's
phase seconds (``host.step_seconds``), a second table gives host work, bitmask fills and the
wait for the device per engine step.

Usage (the pipeline's ``structured_table`` rule)::

    python workflow/scripts/structured_table.py --code-hash H --md table.md --json table.json raw/*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

NOISY_CV = 0.10


def parse_cell(path: Path) -> dict:
    """``batch~8_schema~on_rep~0.json`` -> ``{"batch": 8, "schema": "on", "rep": 0}``."""
    parts = dict(p.split("~", 1) for p in path.stem.split("_"))
    return {"batch": int(parts["batch"]), "schema": parts["schema"], "rep": int(parts["rep"])}


def spread(values: list[float], fmt: str = "{:,.1f}") -> str:
    """``median [min-max]`` of ``values`` (empty: an empty string)."""
    if not values:
        return ""
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def cv(values: list[float]) -> float | None:
    """Population standard deviation over mean; ``None`` under two values."""
    if len(values) < 2 or statistics.fmean(values) == 0:
        return None
    return statistics.pstdev(values) / statistics.fmean(values)


def load(reports: list[Path]) -> list[tuple[Path, dict]]:
    """Each raw report with its path (read once; the table and its header both use them)."""
    return [(path, json.loads(path.read_text())) for path in reports]


def per_step(rep: dict) -> dict:
    """One run's ms per engine step: the host's work (``host.step_seconds`` without its
    ``device_wait``), the host's wait for the device, and the grammar bitmask fills
    (``structured_output.engine.mask_seconds``, part of the host's work); None where the report
    lacks them."""
    steps = (rep.get("aggregates") or {}).get("num_steps")
    phases = (rep.get("host") or {}).get("step_seconds")
    mask = ((rep.get("structured_output") or {}).get("engine") or {}).get("mask_seconds")
    if not steps:
        return {"host": None, "wait": None, "mask": None}
    out = {"host": None, "wait": None, "mask": None if mask is None else mask / steps * 1e3}
    if isinstance(phases, dict) and "device_wait" in phases:
        out["wait"] = phases["device_wait"] / steps * 1e3
        out["host"] = (sum(phases.values()) - phases["device_wait"]) / steps * 1e3
    return out


def build(loaded: list[tuple[Path, dict]]) -> dict:
    """Rows per max batch size from the raw reports (:func:`load`)."""
    runs: dict[int, dict[str, list[dict]]] = {}
    for path, rep in loaded:
        cell = parse_cell(path)
        runs.setdefault(cell["batch"], {"off": [], "on": []})[cell["schema"]].append(rep)
    rows = []
    for batch in sorted(runs):
        row: dict = {"max_num_seqs": batch}
        for schema in ("off", "on"):
            ok = [r for r in runs[batch][schema] if r.get("status") == "ok"]
            agg = [r.get("aggregates") or {} for r in ok]
            tput = [a["output_throughput"] for a in agg if a.get("output_throughput") is not None]
            tpot = [a["tpot_ms_p50"] for a in agg if a.get("tpot_ms_p50") is not None]
            steps = [per_step(r) for r in ok]
            row[schema] = {
                "host_ms_per_step": [x["host"] for x in steps if x["host"] is not None],
                "device_wait_ms_per_step": [x["wait"] for x in steps if x["wait"] is not None],
                "mask_ms_per_step": [x["mask"] for x in steps if x["mask"] is not None],
                "runs": len(runs[batch][schema]), "ok": len(ok),
                "requests": agg[0].get("num_requests") if agg else None,
                "output_throughput": tput, "tpot_ms_p50": tpot, "cv": cv(tput),
                "errors": sorted({str(r.get("error")) for r in runs[batch][schema] if r.get("status") != "ok"}),
                "token_digests": sorted({r.get("token_digest") for r in ok if r.get("token_digest")}),
            }
        free, con = row["off"]["output_throughput"], row["on"]["output_throughput"]
        row["ratio"] = (statistics.median(con) / statistics.median(free)) if free and con else None
        rows.append(row)
    return {"rows": rows}


def setting(loaded: list[tuple[Path, dict]], profile: str) -> str:
    """Where the cells ran: model, hardware and the command, from the first report with a config."""
    for _, rep in loaded:
        hw, cfg = rep.get("hardware") or {}, rep.get("config") or {}
        if cfg:
            return (f"Model `{cfg.get('model')}` ({cfg.get('dtype')}) on {hw.get('device_name')} "
                    f"({hw.get('cpu_count')} host CPUs). Command: `snakemake results/gpu --cores 8 "
                    f"--resources gpu=1 --config profile={profile}` (the cells: the config's "
                    f"`structured` section).")
    return ""


def markdown(table: dict, code_hash: str, where: str = "") -> str:
    """The table as Markdown, with what it shows, where it ran and the engine's code hash."""
    lines = ["# Structured output: constrained against free decoding", "",
             f"The same seeded workload (`config/benchmark-structured.yaml`, greedy, `ignore_eos`) with "
             f"and without `--json-schema`, at each max batch size; median [min-max] over the "
             f"repetitions; ratio = constrained / free median output throughput; CV = standard "
             f"deviation / mean of output throughput (over {NOISY_CV:.0%}: noisy). Engine code hash "
             f"`{code_hash}`." + (f" {where}" if where else ""), "",
             "| max sequences | requests | free tok/s | constrained tok/s | ratio | free p50 TPOT ms "
             "| constrained p50 TPOT ms | CV free / constrained | runs ok | status |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    host_lines = ["", "Where a step's time goes (ms per engine step, median over the "
                  "repetitions): the host's work (the engine's `step_seconds` without "
                  "`device_wait`; the grammar's bitmask fills are part of it), and the host's "
                  "wait for the device. Where the wait is near zero the device waits for the "
                  "host, and host work added to a step (a grammar's) adds to its time.", "",
                  "| max sequences | host work, free | host work, constrained "
                  "| of it, bitmask fills | device wait, free | device wait, constrained |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in table["rows"]:
        off, on = r["off"], r["on"]
        cvs = " / ".join("" if c is None else f"{c:.0%}" + (" noisy" if c > NOISY_CV else "")
                         for c in (off["cv"], on["cv"]))
        errors = off["errors"] + on["errors"]
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['max_num_seqs']} | {off['requests'] or on['requests'] or ''} | "
                     f"{spread(off['output_throughput'])} | {spread(on['output_throughput'])} | {ratio} | "
                     f"{spread(off['tpot_ms_p50'], '{:.2f}')} | {spread(on['tpot_ms_p50'], '{:.2f}')} | {cvs} | "
                     f"{off['ok']}/{off['runs']} + {on['ok']}/{on['runs']} | "
                     f"{'ok' if not errors else 'failed: ' + '; '.join(errors)} |")
        med = {k: {sch: _median(r[sch][k]) for sch in ("off", "on")}
               for k in ("host_ms_per_step", "device_wait_ms_per_step", "mask_ms_per_step")}
        host_lines.append(f"| {r['max_num_seqs']} | {med['host_ms_per_step']['off']} | "
                          f"{med['host_ms_per_step']['on']} | {med['mask_ms_per_step']['on']} | "
                          f"{med['device_wait_ms_per_step']['off']} | "
                          f"{med['device_wait_ms_per_step']['on']} |")
    if any(r[sch]["host_ms_per_step"] for r in table["rows"] for sch in ("off", "on")):
        lines += host_lines
    return "\n".join(lines) + "\n"


def _median(values: list[float]) -> str:
    """``values``' median to 0.01 ms, or empty."""
    return f"{statistics.median(values):.2f}" if values else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code-hash", required=True, help="the engine code hash the cells ran on")
    p.add_argument("--md", type=Path, required=True, help="Markdown table to write")
    p.add_argument("--json", type=Path, required=True, help="JSON rows to write")
    p.add_argument("reports", nargs="+", type=Path, help="raw benchmark reports (JSON)")
    a = p.parse_args(argv)
    loaded = load(a.reports)
    table = build(loaded)
    table["code_hash"] = a.code_hash
    # the profile is the name of the folder the table goes to (results/structured/<profile>/)
    md = markdown(table, a.code_hash, setting(loaded, a.md.resolve().parent.name))
    a.md.write_text(md)
    a.json.write_text(json.dumps(table, indent=2) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
