#!/usr/bin/env python
"""INT8 linear at mid-sized M (decode batches of 16..128 rows): the default kind against
dequantize + cuBLAS and bf16 cuBLAS, Qwen2.5-1.5B shapes, row-major int8. Every result is
checked against fp32 first; CUDA-graph timing over > 200 MB of weight copies
(``scripts/cuda_timing.py``). Writes ``mid_m.json`` to ``--out`` and prints a table."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import graph_time_us  # noqa: E402

from llmserve.triton_kernels.int8_linear import Int8LinearConfig, choose_int8_config, int8_linear  # noqa: E402

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
        copies = max(1, math.ceil(200e6 / (n * k)))
        q = torch.randint(-127, 128, (copies, n, k), dtype=torch.int8, device=dev)
        s = torch.rand(copies, n, device=dev) * 1e-3 + 1e-4
        wb = torch.empty((max(1, math.ceil(200e6 / (2 * n * k))), n, k), dtype=torch.bfloat16,
                         device=dev).normal_(0, .02)
        for m in args.ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.double() @ (q[0].double() * s[0].double()[:, None]).T
            row = dict(shape=lab, K=k, N=n, M=m)
            row["cublas_bf16_us"] = graph_time_us([lambda i=i: F.linear(x, wb[i]) for i in range(wb.shape[0])],
                                                  max(wb.shape[0], 24), replays=12)
            for name, cfg in (("default", None), ("dequant", Int8LinearConfig(1, 1, 1, kind="dequant"))):
                c = cfg or choose_int8_config(m, n, k, dev)
                row[f"{name}_kind"] = c.kind
                y = int8_linear(x, q[0], s[0], config=cfg)
                err = ((y.double() - ref).norm() / ref.norm()).item()
                row[f"{name}_err"] = err
                row[f"{name}_us"] = (graph_time_us([lambda i=i: int8_linear(x, q[i], s[i], config=cfg)
                                                    for i in range(copies)], max(copies, 24), replays=12)
                                     if err < 1e-2 else None)
            rows.append(row)
            print(f"| {lab} | {m} | {row['cublas_bf16_us']:.2f} | {row['default_us']:.2f} ({row['default_kind']}) "
                  f"| {row['dequant_us']:.2f} |", flush=True)
    (args.out / "mid_m.json").write_text(json.dumps(dict(
        gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), command=" ".join(sys.argv),
        rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
