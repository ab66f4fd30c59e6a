#!/usr/bin/env python
"""Sweep the matrix-vector kernel (``gemv.py``) on INT8 weights at M = 2..4 with ``red``
(issue #6: INT8 at M = 1..16 >= 1.5x cuBLAS bf16).

Why: at M = 2 and 4 the CUDA-core kernel does only 2-4 multiply-adds per weight element, far
below the H200's FMA rate, yet its byte-plane form took 9.1-9.4 us for the 1.5B gate/up
shape at M = 2 against 6.6 at M = 1 (``results/kernels/int8_planes_final/lib``). Its tile
holds one fp32 accumulator per (row of x, weight element), so registers grow with M; ``red``
(``GemvConfig.red``, session 12: runs of adjacent K columns summed before the accumulator)
shrinks them, and was never swept for INT8 or for M > 1.

For each Qwen2.5-1.5B shape (gate/up, down, qkv), M and layout (row-major int8, byte planes):
cuBLAS bf16 (``F.linear``), ``int8_linear``'s default, then every configuration below, each
checked against the fp32 reference first (rows with an error are kept). Timing as
``bench_gemv.py`` (CUDA graphs of back-to-back calls rotating over > 200 MB of weights,
no PDL, as ``int8_linear`` launches). Writes ``vec_red.json`` and ``vec_red.md`` to ``--out``.

Usage: python3 scripts/bench_int8_vec_red.py --out DIR [--ms 2 4] [--quick]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemv as bg  # noqa: E402  (scripts/, next to this file)
from bench_int8_planes import run_header  # noqa: E402

from llmserve.triton_kernels.gemv import GemvConfig  # noqa: E402
from llmserve.triton_kernels.int8_linear import choose_int8_config, int8_linear  # noqa: E402

SHAPES = [(lab.removeprefix("int8 "), k, n) for lab, k, n in bg.INT8_SHAPES]  # gate/up, down, qkv


def configs(planes: bool, quick: bool) -> list[GemvConfig]:
    """Row-major int8: block_k in columns (= bytes), red up to the 16 a thread loads at once;
    byte planes: block_k in 32-bit words, red up to 4 words."""
    if quick:
        return [GemvConfig(1, 32, 1, 1, 0, r) for r in (1, 4)]
    if planes:
        return [GemvConfig(bn, bk, nw, 1, 0, red) for bn in (1, 2, 4) for bk in (64, 128, 256, 512)
                if 64 <= bn * bk <= 2048 for nw in (1, 2, 4) for red in (1, 4)]
    return [GemvConfig(bn, bk, nw, 1, 0, red) for bn in (1, 2, 4) for bk in (256, 512, 1024, 2048)
            if 256 <= bn * bk <= 8192 for nw in (1, 2, 4) for red in (1, 4, 16)]


def case(lab, k, n, planes, m):
    return (lab, "int8p" if planes else "int8", "plain", k, n, "planes" if planes else True, m,
            "none", False, False, False)


def _precompile(args):
    wid, nw, ms, quick = args
    i = 0
    for lab, k, n in SHAPES:
        for planes in (False, True):
            for m in ms:
                c = bg.Case(case(lab, k, n, planes, m), 0)
                for cfg in configs(planes, quick):
                    i += 1
                    if i % nw == wid:
                        try:
                            c.fns(cfg)[0]()
                        except Exception:  # noqa: BLE001 - the timed pass reports it
                            pass
    torch.cuda.synchronize()
    return wid


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--quick", action="store_true", help="two configurations a case (smoke test)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.workers > 1:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            pool.map(_precompile, [(w, args.workers, args.ms, args.quick) for w in range(args.workers)])
        print(f"[{time.time() - t0:6.1f}s] precompiled", flush=True)
    rows = []
    for lab, k, n in SHAPES:
        for m in args.ms:
            row = dict(shape=lab, K=k, N=n, M=m)
            for planes in (False, True):
                c = bg.Case(case(lab, k, n, planes, m), bg.ROTATE)
                if not planes:
                    bfns, _keep = c.baseline()
                    row["cublas_bf16_us"] = bg.time_graph(bfns, max(len(bfns), 24))
                    del bfns, _keep
                name = "planes" if planes else "rowmajor"
                dflt = choose_int8_config(m, n, k, torch.device("cuda"), planes=planes)
                row[f"{name}_default"] = dict(
                    config=f"{dflt.kind} {dflt.block_m}x{dflt.block_n}x{dflt.block_k} split {dflt.split_k} "
                           f"w{dflt.num_warps}",
                    us=bg.time_graph([lambda i=i: int8_linear(c.x, c.w[i], c.sc[i]) for i in range(c.copies)],
                                     c.reps))
                res = [bg.time_config(c, cfg) for cfg in configs(planes, args.quick)]
                row[name] = res
                ok = sorted((r for r in res if r["us"] is not None), key=lambda r: r["us"])
                row[f"{name}_best"] = ok[0] if ok else None
                row[f"{name}_best_red1"] = next((r for r in ok if r["cfg"][5:6] in ([], [1])), None)
                del c
            cb = row["cublas_bf16_us"]

            def best(r):
                return f"{r['us']:.2f} {r['cfg']} ({cb / r['us']:.2f}x)" if r else "every configuration failed"

            print(f"[{time.time() - t0:6.1f}s] {lab} M={m}: cuBLAS {cb:.2f}, defaults "
                  f"{row['rowmajor_default']['us']:.2f} / {row['planes_default']['us']:.2f}, best row-major "
                  f"{best(row['rowmajor_best'])}, planes {best(row['planes_best'])}", flush=True)
            rows.append(row)
            (args.out / "vec_red.json").write_text(json.dumps(dict(**run_header(), rows=rows), indent=1))
    lines = ["| shape | M | cuBLAS bf16 us | default row-major / planes us | best row-major us (cfg) | best planes us "
             "(cfg) | best red 1 row-major / planes us | speed-up of the best |", "|---|---|---|---|---|---|---|---|"]
    def cell(b, with_cfg=True):
        return "-" if b is None else f"{b['us']:.2f}" + (f" {b['cfg']}" if with_cfg else "")

    for r in rows:
        rb, pb, cb = r["rowmajor_best"], r["planes_best"], r["cublas_bf16_us"]
        ok = [b["us"] for b in (rb, pb) if b]
        lines.append(f"| {r['shape']} | {r['M']} | {cb:.2f} | {r['rowmajor_default']['us']:.2f} / "
                     f"{r['planes_default']['us']:.2f} | {cell(rb)} | {cell(pb)} | "
                     f"{cell(r['rowmajor_best_red1'], False)} / {cell(r['planes_best_red1'], False)} | "
                     + (f"{cb / min(ok):.2f}x |" if ok else "- |"))
    (args.out / "vec_red.md").write_text(f"{run_header()}\n\ncfg = [block_n, block_k, warps, stages, "
                                         "programs_per_sm, red] (block_k in columns, words for planes)\n\n"
                                         + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
