#!/usr/bin/env python
"""Experiment: does x in fragment order (a chunk's 8 tokens as 512 contiguous bytes, so a
warp's x load touches 4 cache lines instead of 8) make ``int8_frag_linear`` faster?

For each 1.5B shape and M, the configuration the PDL table picks (and ``--cand`` extras) is
timed as PDL chains with x row-major and with x pre-permuted into fragment order (the
permutation made once, outside the timing), in alternated rounds, with the loads alone
(``_read_only``) too; cuBLAS bf16 of the same shape in the same run. Writes ``xorder.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_frag import SHAPES, cases, cfg_from_list, median  # noqa: E402
from bench_int8_planes import cublas_us, rel_err, run_header  # noqa: E402
from cuda_timing import graph_time_us  # noqa: E402

from llmserve.triton_kernels.int8_frag import choose_frag_config, int8_frag_linear  # noqa: E402


def frag_order(x: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` bf16 -> ``[tiles, K/32, 8, 32]``: token ``8 t + g``, columns ``32 c .. 32 c + 31``
    at ``[t, c, g]`` (tokens past M zero)."""
    m, k = x.shape
    t = 1 if m <= 8 else 2
    xp = torch.zeros(8 * t, k, dtype=x.dtype, device=x.device)
    xp[:m] = x
    return xp.view(t, 8, k // 32, 32).permute(0, 2, 1, 3).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 8, 12, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cand", nargs="*", default=[], metavar="SHAPE:TILES:w,u,s,b,pf,st,l2,fold[,tma]")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    extra = {}
    for c in args.cand:
        lab, tiles, v = c.split(":")
        extra.setdefault((lab, int(tiles)), []).append(cfg_from_list([int(t) for t in v.split(",")]))
    rows = []
    for lab, k, n, m, q, s, wb, fr, x, ref in cases(SHAPES["1.5b"], args.ms, dev):
        xf = frag_order(x)
        cfgs = [choose_frag_config(m, n, k, dev, pdl=True)] + extra.get((lab, 1 if m <= 8 else 2), [])
        row = dict(shape=lab, K=k, N=n, M=m, cublas_bf16_us=[], res=[])
        for c in cfgs:
            r = dict(cfg=str(c), err_rows=None, err_frag=None, rows_us=[], frag_us=[], rows_ro_us=[], frag_ro_us=[])
            r["err_rows"] = rel_err(int8_frag_linear(x, fr[0], s[0], config=c, pdl=True), ref)
            r["err_frag"] = rel_err(int8_frag_linear(x, fr[0], s[0], config=c, pdl=True, _x_frag=xf), ref)
            row["res"].append(r)
        copies = fr.shape[0]
        for _ in range(args.rounds):
            row["cublas_bf16_us"].append(cublas_us(x, wb))
            for c, r in zip(cfgs, row["res"]):
                for key, xin, ro in (("rows_us", None, False), ("frag_us", xf, False),
                                     ("rows_ro_us", None, True), ("frag_ro_us", xf, True)):
                    r[key].append(graph_time_us(
                        [lambda i=i: int8_frag_linear(x, fr[i], s[i], config=c, pdl=True, _read_only=ro, _x_frag=xin)
                         for i in range(copies)], max(copies, 24), replays=12))
        cb = median(row["cublas_bf16_us"])
        for r in row["res"]:
            print(f"{lab} M={m} {r['cfg']}: cuBLAS {cb:.2f}  rows {median(r['rows_us']):.2f} ({cb / median(r['rows_us']):.2f}x)"
                  f"  frag-x {median(r['frag_us']):.2f} ({cb / median(r['frag_us']):.2f}x)  loads alone rows "
                  f"{median(r['rows_ro_us']):.2f} frag-x {median(r['frag_ro_us']):.2f}  err {r['err_rows']:.1e}/{r['err_frag']:.1e}",
                  flush=True)
        rows.append(row)
        (args.out / "xorder.json").write_text(json.dumps(dict(**run_header(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
