#!/usr/bin/env python
"""Time a curated list of matrix-vector (``gemv``) launch configurations on the GPU, each with
and without ``red`` (runs of adjacent K columns summed before they reach the fp32 accumulator,
``GemvConfig.red``), on the decode projections of one Qwen2.5 model, and write the fastest
configuration of each shape as a gemv table variant for an engine A/B
(``LLMSERVE_GEMV_TABLE``, see ``scripts/ab_decode_env.py``).

Why: with one fp32 accumulator (and, with the RMSNorm prologue, one sum-of-squares register)
per weight element of the tile, the accumulators, not the weights in flight, set a program's
registers; fewer registers per program means more programs per SM, so more weight bytes in
flight per SM, which is what a bandwidth-bound matrix-vector product needs.

Timing as ``bench_gemv.py`` (which this imports): CUDA graphs of back-to-back calls rotating
over > 200 MB of weights, here launched with programmatic dependent launch like the engine's
decode path; every configuration is checked against the fp32 reference first.

Usage: python3 scripts/bench_gemv_red.py --out DIR [--model 1.5b] [--table-out VARIANT.json]
Writes ``DIR/gemv_red.json`` and ``DIR/gemv_red.md``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemv as bg  # noqa: E402  (scripts/, next to this file)
from gemv_table_variant import write_variant  # noqa: E402

from llmserve.triton_kernels import gemv as gm  # noqa: E402
from llmserve.triton_kernels.gemv import GemvConfig  # noqa: E402

# (block_n, block_k, num_warps) tried per projection, each with red 1 and 8
TILES = {
    "gate_up": [(2, 256, 2), (4, 256, 2), (2, 512, 2), (4, 512, 2), (2, 512, 4), (4, 512, 4), (8, 256, 4),
                (1, 512, 1), (2, 256, 1), (8, 512, 4), (4, 1024, 4)],
    "down": [(1, 1024, 4), (2, 1024, 4), (1, 2048, 4), (2, 2048, 8), (4, 1024, 8), (2, 512, 2), (4, 512, 4),
             (1, 2048, 8), (2, 1024, 8), (1, 4096, 8), (4, 2048, 8)],
    "o": [(4, 2048, 8), (2, 2048, 4), (4, 1024, 4), (8, 1024, 8), (2, 1024, 2), (1, 2048, 4), (8, 2048, 8)],
    "lm_head": [(4, 512, 2), (8, 512, 4), (4, 1024, 4), (8, 256, 2), (8, 512, 2), (4, 512, 4)],
}
PROLOGUE_KEY = {"gate_up": "rmsnorm+glu", "down": "none", "o": "none", "lm_head": "none"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="1.5b")
    p.add_argument("--reds", type=int, nargs="+", default=[1, 8])
    p.add_argument("--table-out", type=Path, help="write a gemv table variant with the fastest "
                                                   "configuration of each shape")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(0)
    res = dict(env=dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                        command="python3 scripts/bench_gemv_red.py " + " ".join(sys.argv[1:])), rows=[])
    variant = {}
    for c in bg.cases([a.model]):
        proj = c[2]
        if proj not in TILES:
            continue
        case = bg.Case(c, bg.ROTATE)
        rows_w = case.rows
        nbytes = rows_w * case.k * 2
        shipped = gm.choose_gemv_config(case.m, case.n, case.k, case.w.dtype, dev,
                                        case.pro + ("+glu" if case.glu else ""))
        tiles = list(dict.fromkeys([(shipped.block_n, shipped.block_k, shipped.num_warps)] + TILES[proj]))
        best = None
        for bn, bk, nw in tiles:
            for red in a.reds:
                row = dict(proj=proj, K=case.k, N=case.n, cfg=[bn, bk, nw, 1, 0, red], us=None, error=None,
                           shipped=(bn, bk, nw, red) == (shipped.block_n, shipped.block_k, shipped.num_warps,
                                                          shipped.red))
                try:
                    cfg = GemvConfig(bn, bk, nw, 1, 0, red)
                    err = case.check(cfg)
                    row["rel_err"] = err
                    if err >= 1e-2:
                        row["error"] = f"relative error {err:.2e} >= 1e-2"
                    else:
                        row["us"] = bg.time_graph(case.fns(cfg, pdl=True), case.reps)
                        row["tbps"] = nbytes / row["us"] / 1e6
                except Exception as ex:  # noqa: BLE001 - kept as a row
                    row["error"] = f"{type(ex).__name__}: {ex}"[:300]
                res["rows"].append(row)
                bg.log(proj, row["cfg"], "-" if row["us"] is None else f"{row['us']:.2f} us "
                       f"{row['tbps']:.2f} TB/s", row["error"] or "")
                if row["us"] is not None and (best is None or row["us"] < best["us"]):
                    best = row
        if best is not None:
            key = gm.table_key(gpu, "float", PROLOGUE_KEY[proj], case.m, case.k, case.n)
            variant[key] = best["cfg"]
        del case
        torch.cuda.empty_cache()
    res["best"] = variant
    (a.out / "gemv_red.json").write_text(json.dumps(res, indent=1))
    lines = ["# gemv configurations with and without `red` (PDL, back to back)", "",
             f"- {gpu}, torch {torch.__version__}, triton {triton.__version__}, {res['env']['date']}",
             f"- command: `{res['env']['command']}`", "",
             "| proj | K | N | cfg (bn, bk, warps, stages, pps, red) | us | TB/s | shipped | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        us, tbps = ("-", "-") if r["us"] is None else (f"{r['us']:.2f}", f"{r['tbps']:.2f}")
        lines.append(f"| {r['proj']} | {r['K']} | {r['N']} | {r['cfg']} | {us} | {tbps} | "
                     f"{'yes' if r['shipped'] else ''} | {r['error'] or ''} |")
    (a.out / "gemv_red.md").write_text("\n".join(lines) + "\n")
    if a.table_out:
        write_variant(variant, a.table_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
