"""Does an earlier read of a weight leave it in L2 for the gate-up matrix-vector kernel? (one GPU)

A CUDA graph of [warm kernel over the first X MB of the gate rows and of the up rows] ->
[gate-up gemv of Qwen2.5-1.5B shape, batch 1, RMSNorm + SwiGLU], against the warm kernel
alone; the difference is the gemv's time given the warm. Weights rotate over 8 copies
(440 MB) so nothing is left in L2 from the previous replay. X = 0 runs no warm kernel.

Usage: python3 scripts/bench_l2_warm.py OUT.json [--mb 0 8 16 24] [--policy evict_last ...]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl
from cuda_timing import graph_time_us  # scripts/, next to this file
from llmserve.triton_kernels.gemv import gemv


@triton.jit
def _warm(a_ptr, b_ptr, n, out_ptr, BLOCK: tl.constexpr, POLICY: tl.constexpr):
    """Read ``a[0:n]`` and ``b[0:n]`` (so they are in L2 afterwards); the sum is stored only
    if it equals an impossible value, so the loads cannot be removed."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(a_ptr + offs, mask=offs < n, other=0.0, eviction_policy=POLICY).to(tl.float32)
        acc += tl.load(b_ptr + offs, mask=offs < n, other=0.0, eviction_policy=POLICY).to(tl.float32)
    s = tl.sum(acc)
    if s == 1.2345e-30:
        tl.store(out_ptr, s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mb", type=float, nargs="+", default=[0, 4, 8, 16, 24])
    ap.add_argument("--policy", nargs="+", default=["evict_last", ""])
    ap.add_argument("--replays", type=int, default=40)
    args = ap.parse_args()
    h, i, copies = 1536, 8960, 8
    dev = torch.device("cuda")
    ws = [(torch.randn(2 * i, h, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
    g = torch.ones(h, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, h, device=dev).to(torch.bfloat16)
    out = torch.empty(1, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def timed(fn) -> float:
        """Median us per copy of ``fn(w)`` over the 8 weight copies, in one CUDA graph."""
        return graph_time_us([lambda w=w: fn(w) for w in ws], reps=copies, replays=args.replays)

    def gate_up(w):
        gemv(x, w, prologue="rmsnorm", glu=True, norm_weight=g)

    rows = []
    base = timed(gate_up)
    rows.append({"mb": 0, "policy": None, "gemv_us": base, "warm_us": 0.0})
    print(json.dumps(rows[-1]), flush=True)
    for pol in args.policy:
        for mb in args.mb:
            if mb <= 0:
                continue
            n = int(mb * 2**20 / 2 / 2)           # bf16 elements of each of the two ranges
            n = min(n, i * h)

            def warm(w, n=n, pol=pol):
                _warm[(2 * sms,)](w, w[i:], n, out, BLOCK=2048, POLICY=pol, num_warps=4)

            both = timed(lambda w: (warm(w), gate_up(w)))
            alone = timed(warm)
            rows.append({"mb": mb, "policy": pol or "normal", "gemv_us": both - alone, "warm_us": alone,
                         "both_us": both})
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "shape": "1.5B gate-up 2x8960x1536 bf16",
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
