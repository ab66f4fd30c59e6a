#!/usr/bin/env python
"""Experiment: cache hints of ``int8_frag_linear``'s loads (private ``_cache``: bit 0 weights
``ld.global.cg``, i.e. not allocated in L1, instead of L1/L2 evict_first; bit 1 x with L1
evict_last). The PDL-table configuration of each 1.5B shape and M, as PDL chains, all four
modes alternated in each round, with the loads alone too. Writes ``cache.json``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_frag import SHAPES, cases, median  # noqa: E402
from bench_int8_planes import cublas_us, rel_err, run_header  # noqa: E402
from cuda_timing import graph_time_us  # noqa: E402

from llmserve.triton_kernels.int8_frag import choose_frag_config, int8_frag_linear  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 8, 12, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["1.5b"], choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    rows = []
    for lab, k, n, m, q, s, wb, fr, x, ref in cases([s for g in args.shapes for s in SHAPES[g]], args.ms, dev):
        c = choose_frag_config(m, n, k, dev, pdl=True)
        row = dict(shape=lab, K=k, N=n, M=m, cfg=str(c), cublas_bf16_us=[], modes={})
        for mode in range(4):
            err = rel_err(int8_frag_linear(x, fr[0], s[0], config=c, pdl=True, _cache=mode), ref)
            row["modes"][mode] = dict(err=err, us=[], ro_us=[])
        copies = fr.shape[0]
        for _ in range(args.rounds):
            row["cublas_bf16_us"].append(cublas_us(x, wb))
            for mode in range(4):
                for key, ro in (("us", False), ("ro_us", True)):
                    row["modes"][mode][key].append(graph_time_us(
                        [lambda i=i: int8_frag_linear(x, fr[i], s[i], config=c, pdl=True, _read_only=ro, _cache=mode)
                         for i in range(copies)], max(copies, 24), replays=12))
        cb = median(row["cublas_bf16_us"])
        print(f"{lab} M={m} {c}: cuBLAS {cb:.2f} | " + " | ".join(
            f"mode {mo}: {median(r['us']):.2f} ({cb / median(r['us']):.2f}x), loads {median(r['ro_us']):.2f}, "
            f"err {r['err']:.1e}" for mo, r in row["modes"].items()), flush=True)
        rows.append(row)
        (args.out / "cache.json").write_text(json.dumps(dict(**run_header(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
