#!/usr/bin/env python
"""Wave-quantization probe for ``int8_frag_linear``: the same K with N chosen so the grid
holds 2.5 .. 5.3 programs an SM (one 16-channel block a program), timed as PDL chains beside
bf16 cuBLAS of the same shape.

Question (results/kernels/NOTES.md, session 18): Qwen2.5-1.5B gate/up has 560 blocks on 132
SMs (4.24 an SM: 32 SMs run 5, 100 run 4). If a program's time is set by its SM's share of
the grid rather than by HBM as a whole, time grows in steps at whole programs an SM, and a
balanced split (stream-K) would cut up to ~15%; if it is set by bytes, time is linear in N.

Writes ``waves.json`` / ``waves.md`` to ``--out``. Every call is checked against fp64 first.
Usage: python3 scripts/bench_int8_frag_waves.py --out DIR [--k 1536] [--ms 2 8 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_frag import cases, cfg_from_list, frag_us  # noqa: E402
from bench_int8_planes import cublas_us, rel_err, run_header  # noqa: E402

from llmserve.triton_kernels._launch import num_sms  # noqa: E402
from llmserve.triton_kernels.int8_frag import int8_frag_linear  # noqa: E402

CONFIGS = {8: [[2, 8, 1, 1, 1, 1, 1, 1], [4, 4, 1, 1, 1, 1, 0, 0], [4, 2, 1, 1, 1, 1, 1, 1]],
           16: [[2, 8, 1, 1, 0, 1, 1, 0], [2, 4, 1, 1, 1, 1, 1, 0]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--per-sm", type=float, nargs="+", default=[2.5, 3.0, 3.5, 4.0, 4.24, 4.5, 5.0, 5.3])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    sms = num_sms(dev, cpu_default=132)
    rows = []
    shapes = [(f"N={round(per * sms) * 16}", args.k, round(per * sms) * 16) for per in args.per_sm]
    for _, k, n, m, q, s, wb, fr, x, ref in cases(shapes, args.ms, dev):
        nb = n // 16
        row = dict(K=k, N=n, M=m, blocks=nb, per_sm=nb / sms, cublas_us=cublas_us(x, wb), frag=[])
        for c in CONFIGS[8 if m <= 8 else 16]:
            cfg = cfg_from_list(c)
            err = rel_err(int8_frag_linear(x, fr[0], s[0], config=cfg, pdl=True), ref)
            us = frag_us(x, fr, s, cfg, True) if err < 1e-2 else None
            row["frag"].append(dict(cfg=c, err=err, us=us))
        rows.append(row)
        print(f"N={n} ({nb / sms:.2f}/SM) M={m}: cuBLAS {row['cublas_us']:.2f} "
              + " ".join(f"{f['us']:.2f}" if f["us"] else "err" for f in row["frag"]), flush=True)
        (args.out / "waves.json").write_text(json.dumps(dict(**run_header(), sms=sms, rows=rows), indent=1))
    lines = ["| N | programs an SM | M | cuBLAS bf16 us | fragment us (configs of bench_int8_frag rows) | best us a block-per-SM |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ok = [f["us"] for f in r["frag"] if f["us"]]
        best = f"{min(ok) / r['per_sm']:.3f}" if ok else "-"
        lines.append(f"| {r['N']} | {r['per_sm']:.2f} | {r['M']} | {r['cublas_us']:.2f} | "
                     + ", ".join(f"{f['us']:.2f}" if f["us"] else "err" for f in r["frag"]) + f" | {best} |")
    (args.out / "waves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
