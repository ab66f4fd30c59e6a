#!/usr/bin/env python
"""INT8 linear at mid-sized M (decode batches of 16..128 rows): the default kind against
dequantize + cuBLAS and bf16 cuBLAS, Qwen2.5-1.5B shapes, row-major int8. Every result is
checked against fp32 first; CUDA-graph timing over > 200 MB of weight copies
(``scripts/cuda_timing.py``). Writes ``mid_m.json`` to ``--out`` and prints a table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_planes import cublas_us, int8_us, reference, run_header, shape_weights  # noqa: E402

from llmserve.triton_kernels.int8_linear import Int8LinearConfig, choose_int8_config  # noqa: E402

SHAPES = [("gate/up", 1536, 8960), ("down", 8960, 1536), ("qkv", 1536, 2048)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[16, 32, 64, 128])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    rows = []
    print("| shape | M | cuBLAS bf16 us | default us (kind) | dequant + cuBLAS us |")
    print("|---|---|---|---|---|")
    for lab, k, n in SHAPES:
        _, q, s, wb = shape_weights(k, n, dev)
        for m in args.ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = reference(x, q[0], s[0])
            row = dict(shape=lab, K=k, N=n, M=m, cublas_bf16_us=cublas_us(x, wb))
            for name, cfg in (("default", None), ("dequant", Int8LinearConfig(1, 1, 1, kind="dequant"))):
                row[f"{name}_kind"] = (cfg or choose_int8_config(m, n, k, dev)).kind
                row[f"{name}_err"], row[f"{name}_us"] = int8_us(x, q, s, ref, config=cfg)
            rows.append(row)
            print(f"| {lab} | {m} | {row['cublas_bf16_us']:.2f} | {row['default_us']:.2f} ({row['default_kind']}) "
                  f"| {row['dequant_us']:.2f} |", flush=True)
    (args.out / "mid_m.json").write_text(json.dumps(dict(**run_header(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
