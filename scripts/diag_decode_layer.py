"""Diagnostics of the one-launch decode layer on the GPU (temporary)."""
import glob, os, subprocess, sys
import torch
sys.path.insert(0, "tests")
os.environ["LLMSERVE_DECODE_LAYER_GRID"] = sys.argv[1] if len(sys.argv) > 1 else ""
import test_decode_layer as t
from llmserve.triton_kernels import decode_layer as dl
for seqs, splits in ([(1, 1)], None), ([(40, 1)], 2), ([(9, 1), (4, 1), (33, 1)], 4):
    try:
        t.test_decode_layer_matches_five_kernels(seqs, splits, 6, 2)
        print("grid", os.environ["LLMSERVE_DECODE_LAYER_GRID"] or "auto", seqs, "OK", flush=True)
    except AssertionError as e:
        print("grid", os.environ["LLMSERVE_DECODE_LAYER_GRID"] or "auto", seqs, "FAIL", str(e).splitlines()[:4], flush=True)
print("occupancy cache", {k[2]: v for k, v in dl._OCCUPANCY.items()})

import triton, triton.language as tl
from llmserve.triton_kernels.decode_layer import _grid_barrier


@triton.jit
def _bench_barriers(bar_ptr, NB: tl.constexpr):
    nprog = tl.num_programs(0)
    for i in range(NB):
        _grid_barrier(bar_ptr, (i + 1) * nprog)
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(bar_ptr + 1, 0)


if len(sys.argv) > 2:
    bar = torch.zeros(2, dtype=torch.int32, device="cuda")
    for grid in (132, 264):
        for nb in (0, 64):
            for _ in range(3):
                _bench_barriers[(grid,)](bar, NB=nb, num_warps=4)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                _bench_barriers[(grid,)](bar, NB=nb, num_warps=4)
            e.record(); torch.cuda.synchronize()
            print("barrier bench grid", grid, "barriers", nb, "us/launch", s.elapsed_time(e) * 1000 / 20, "bar", bar.tolist(), flush=True)
