#!/usr/bin/env python
"""Tune the matrix-vector (``gemv``) table inside whole batch-1 decode steps, one shape at a time.

Isolated kernel timings (``bench_gemv.py``, ``bench_gemv_red.py``) do not carry over one to one
into the engine (each kernel there starts while its predecessor drains, and shares the GPU with
the attention), so this script measures the candidates where they run:

1. every candidate configuration of every listed shape as a table variant (the base table with
   that one entry replaced), all measured with ``scripts/ab_decode_env.py`` in one process,
   interleaved over ``--rounds`` rounds (median ms between tokens of a 256-step greedy decode);
2. the fastest candidate of each shape (by its median over the rounds; the base entry competes
   too) composed into one table, then the packaged table, the base and the composed table
   measured again, interleaved.

Usage: python3 scripts/tune_gemv_engine.py --out DIR --candidates CANDS.json [--base TABLE]
           [--preset qwen2.5-1.5b] [--rounds 3] [--final-rounds 3]
``CANDS.json``: ``{"<kind>|<prologue>|<M>|<K>|<N>": [[bn, bk, warps, stages(, pps(, red))], ...]}``
(keys as ``gemv.table_key`` without the GPU name). Writes ``DIR/phase1.json``,
``DIR/phase2.json``, ``DIR/tables/*.json``, ``DIR/tuned.json`` (the composed table) and
``DIR/summary.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gemv_table_variant import write_variant  # noqa: E402  (scripts/, next to this file)


def run_ab(out: Path, settings: list[str], preset: str, rounds: int) -> dict:
    """``ab_decode_env.py`` over ``settings``; its rows (a failed setting is a row with an error).

    Raises:
        RuntimeError: the A/B process failed or wrote no result file (a stale file from an
            earlier run is removed first, so it is never read instead)."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "ab_decode_env.py"), str(out), "--presets", preset,
           "--rounds", str(rounds), "--settings", *settings]
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited with {proc.returncode}"
                           + ("" if out.exists() else f" and wrote no {out}"))
    return json.loads(out.read_text())


def medians(res: dict) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for r in res["rows"]:
        if r.get("step_ms") is not None:
            by.setdefault(r["setting"], []).append(r["step_ms"])
    return {k: statistics.median(v) for k, v in by.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--candidates", type=Path, required=True)
    ap.add_argument("--base", type=Path, help="table to start from (default: the packaged one)")
    ap.add_argument("--gpu", default="NVIDIA H200")
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--final-rounds", type=int, default=3)
    a = ap.parse_args()
    (a.out / "tables").mkdir(parents=True, exist_ok=True)
    from llmserve.triton_kernels.gemv import _DEFAULT_TABLE
    base_path = a.base or Path(_DEFAULT_TABLE)
    base = json.loads(base_path.read_text())
    base_copy = write_variant({}, a.out / "tables" / "base.json", base_path)
    cands = json.loads(a.candidates.read_text())
    from llmserve.triton_kernels.gemv import GemvConfig
    for key, lst in cands.items():       # a malformed entry would be skipped by the table
        for cfg in lst:                  # reader and silently measure the fallback rule instead
            try:
                GemvConfig(*cfg)
            except (TypeError, ValueError) as e:
                raise SystemExit(f"candidate {cfg!r} of {key!r} is not a GemvConfig: {e}") from None
    settings = [f"LLMSERVE_GEMV_TABLE={base_copy}"]
    which: dict[str, tuple[str, list[int]]] = {}
    for i, (key, lst) in enumerate(cands.items()):
        full = f"{a.gpu}|{key}"
        for j, cfg in enumerate(lst):
            if base["configs"].get(full) == cfg:
                continue
            p = write_variant({full: cfg}, a.out / "tables" / f"k{i}_c{j}.json", base_path)
            s = f"LLMSERVE_GEMV_TABLE={p}"
            settings.append(s)
            which[s] = (full, cfg)
    med1 = medians(run_ab(a.out / "phase1.json", settings, a.preset, a.rounds))
    base_ms = med1.get(settings[0])
    best: dict[str, tuple[float, list[int]]] = {}
    for s, (full, cfg) in which.items():
        ms = med1.get(s)
        if ms is None or base_ms is None:
            continue
        if ms < best.get(full, (base_ms, None))[0]:
            best[full] = (ms, cfg)
    chosen = {k: v[1] for k, v in best.items()}
    tuned = write_variant(chosen, a.out / "tuned.json", base_path)
    final = ["", f"LLMSERVE_GEMV_TABLE={base_copy}", f"LLMSERVE_GEMV_TABLE={tuned}"]
    med2 = medians(run_ab(a.out / "phase2.json", final, a.preset, a.final_rounds))
    summary = dict(preset=a.preset, base=str(base_path), base_median_ms=base_ms,
                   phase1={which[s][0] + " = " + json.dumps(which[s][1]): ms for s, ms in med1.items()
                           if s in which},
                   chosen={k: dict(cfg=v[1], median_ms=v[0]) for k, v in best.items()},
                   phase2={("packaged" if s == "defaults" else "base" if s == final[1] else "tuned"): ms
                           for s, ms in med2.items()})
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
