"""Does an L2 prefetch issued by one kernel make a later matrix-vector kernel faster? (GPU)

Per call, captured in a CUDA graph and rotated over weight copies larger than the L2:
  1. a tiny gemv that prefetches the first X MB of the next gate-up weight into L2
     (``gemv(..., prefetch=...)``), 2. ``torch.cuda._sleep`` (HBM idle, the prefetch lands),
  3. the Qwen2.5-1.5B gate-up gemv (RMSNorm prologue, SwiGLU epilogue) over that weight.
The difference to X = 0 is what the prefetched bytes save (negative: faster), and the time of
step 3 alone bounds the best case. Also the same with the prefetch and the gemv back to back
(no sleep): the cost when the prefetch competes with the kernel that needs HBM.

Usage: python3 scripts/bench_l2_prefetch.py OUT.json
"""
from __future__ import annotations

import json
import os
import sys

import torch
from cuda_timing import graph_time_us

from llmserve.triton_kernels.gemv import gemv


def main() -> None:
    out_path = sys.argv[1]
    dev = "cuda"
    k, n2 = 1536, 2 * 8960
    copies = 6                                           # 6 x 55 MB: beyond the 50 MB L2
    ws = [torch.randn(n2, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    g = torch.ones(k, device=dev, dtype=torch.bfloat16)
    tiny = torch.randn(64, k, device=dev, dtype=torch.bfloat16)
    cycles = int(os.environ.get("SLEEP_CYCLES", "20000"))   # ~11 us at 1.8 GHz
    rows = []

    def gate_up(i):
        return gemv(x, ws[i], prologue="rmsnorm", norm_weight=g, glu=True)

    for hint in ("last", "normal"):
        os.environ["LLMSERVE_L2_PREFETCH_HINT"] = hint
        for mb in (0, 4, 8, 16, 24, 32, 40):
            nbytes = mb << 20
            for sleep in (True, False):
                def call(i, nbytes=nbytes, sleep=sleep):
                    nxt = ws[i].view(-1).view(torch.uint8)[:nbytes] if nbytes else None
                    gemv(x, tiny, prefetch=nxt)
                    if sleep:
                        torch.cuda._sleep(cycles)
                    gate_up(i)
                us = graph_time_us([lambda i=i: call(i) for i in range(copies)], 24)
                row = dict(hint=hint, prefetch_mb=mb, sleep=sleep, us=us)
                rows.append(row)
                print(json.dumps(row), flush=True)
    base_sleep = graph_time_us([lambda: torch.cuda._sleep(cycles)], 24)
    base_tiny = graph_time_us([lambda: gemv(x, tiny)], 24)
    base_gu = graph_time_us([lambda i=i: gate_up(i) for i in range(copies)], 24)
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, sleep_cycles=cycles,
               sleep_alone_us=base_sleep, tiny_gemv_us=base_tiny, gate_up_alone_us=base_gu, rows=rows)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
