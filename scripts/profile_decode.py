"""Kernel-level profile of one graph-replayed decode step (GPU): where the step's time goes.

Usage: python3 scripts/profile_decode.py --preset qwen2.5-1.5b --batch 1 --context 128
Prints the CUDA kernels of a replayed decode step, grouped by name, with total time per step.
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from llmserve.bench_compare import llmserve_engine
from llmserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    eng = llmserve_engine(args.preset, max_num_seqs=max(8, args.batch), max_model_len=2048, num_blocks=4096)
    prompts = [list(range(100 + i, 100 + i + args.context)) for i in range(args.batch)]
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(4):
        eng.step()
    g = eng.runner.cuda_graphs
    graph = g.last_graph                                # the graph these steps replayed
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        r = rows.setdefault(e.name, [0, 0.0])
        r[0] += 1
        r[1] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    total = sum(v[1] for v in rows.values()) / args.replays
    table = sorted(((v[1] / args.replays, v[0] // args.replays, k) for k, v in rows.items()), reverse=True)
    print(f"preset {args.preset} batch {args.batch} context {args.context}: kernel time per step {total / 1e3:.3f} ms")
    for us, n, name in table[:30]:
        print(f"{us:9.1f} us  x{n:4d}  {us / max(n, 1):7.2f} us/each  {name[:110]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"total_us": total, "kernels": [{"us": a, "count": b, "name": c} for a, b, c in table]}, f, indent=1)


if __name__ == "__main__":
    main()
