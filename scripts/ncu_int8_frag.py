#!/usr/bin/env python
"""Launch one ``int8_frag_linear`` configuration a few times, for Nsight Compute to profile.

Usage (on the GPU machine; ncu profiles the last launch):
    ncu --clock-control none -k regex:_int8_frag_kernel -s 3 -c 1 --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        python3 scripts/ncu_int8_frag.py --shape gate/up --m 16 --cfg 2 8 1 1 0 1 0 1 [--pdl]

``--cfg``: warps, unroll, split, blocks, prefetch, stages, l2_prefetch, fold[, tma] (as the rows of
``bench_int8_frag.py`` store it). Random int8 weights of the Qwen2.5-1.5B shape, bf16 x.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_frag import SHAPES, cfg_from_list  # noqa: E402

from llmserve.triton_kernels.int8_frag import int8_frag_linear, pack_int8_fragments  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gate/up")
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--cfg", type=int, nargs="+", required=True)
    ap.add_argument("--pdl", action="store_true")
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    shapes = {lab: (k, n) for group in SHAPES.values() for lab, k, n in group}
    k, n = shapes[args.shape]
    torch.manual_seed(0)
    f = pack_int8_fragments(torch.randint(-127, 128, (n, k), dtype=torch.int8)).cuda()
    s = torch.rand(n, device="cuda") / 64
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    cfg = cfg_from_list(args.cfg)
    for _ in range(args.launches):
        y = int8_frag_linear(x, f, s, config=cfg, pdl=args.pdl)
    torch.cuda.synchronize()
    print(args.shape, args.m, cfg, float(y.float().abs().mean()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
