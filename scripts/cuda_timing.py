"""CUDA-graph timing shared by ``scripts/bench_gemv.py`` and ``scripts/bench_kernels.py``.

Many back-to-back calls are timed inside one CUDA graph, so launch overhead and clock ramp-up
do not dominate short kernels (docs/benchmarking.md). Imported by those scripts from this
directory; not a command of its own."""

from __future__ import annotations

import torch


def graph_time_us(fns, reps: int, replays: int = 15, warm_replays: int = 3) -> float:
    """Median microseconds per call of ``fns[i % len(fns)]()`` captured ``reps`` times in one
    CUDA graph.

    Every fn runs once on a side stream first (compiles, allocator warm-up), outside the
    capture; then the graph is replayed ``warm_replays`` times untimed and ``replays`` times
    timed with CUDA events. Rotate ``fns`` over input copies larger than the L2 so each call
    reads HBM.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    for _ in range(warm_replays):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    del g
    times.sort()
    return times[len(times) // 2]
