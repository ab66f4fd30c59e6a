"""Kernel-level profile of one graph-replayed decode step (GPU): where the step's time goes.

Usage: python3 scripts/profile_decode.py --preset qwen2.5-1.5b --batch 1 --context 128
Prints the CUDA kernels of a replayed decode step, grouped by name, with total time per step.

``--engine-steps N`` profiles N real engine steps instead (one request decoding, asynchronous
scheduling as configured) and prints what the device runs *between* two graphs' LM heads:
the sampler, the copies in and out, the graph's own first kernels, and the idle gaps.

``--timeline`` also prints where the step's *wall* time goes when kernels overlap (programmatic
dependent launch lets a kernel start before its predecessor ends, so summed kernel durations
overcount): for the kernels of one replay in stream order, each kernel's marginal time is its
end minus the latest end before it (the critical path it adds), grouped by name and, on the
matrix-vector decode path, by position in the layer.
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
    ap.add_argument("--timeline", action="store_true", help="marginal (end-to-end) time per kernel")
    ap.add_argument("--engine-steps", type=int, default=0, help="profile this many engine steps instead")
    args = ap.parse_args()
    eng = llmserve_engine(args.preset, max_num_seqs=max(8, args.batch), max_model_len=2048, num_blocks=4096)
    if args.engine_steps:
        result = engine_steps(eng, args.batch, args.context, args.engine_steps)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return
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
    result = {"total_us": total, "kernels": [{"us": a, "count": b, "name": c} for a, b, c in table]}
    if args.timeline:
        result["timeline"] = timeline(prof, args.replays)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def cuda_events(prof) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of the profile's CUDA kernels and copies, in start order."""
    return sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA"), key=lambda t: t[0])


def engine_steps(eng, batch: int, context: int, n: int) -> dict:
    """Device activity between consecutive LM heads (the longest matrix-vector kernel of each
    step) over ``n`` engine steps of ``batch`` requests at about ``context`` tokens: every
    kernel and copy in that window with its start relative to the LM head's end and its
    duration (µs), for the middle window, and the window's mean length over all of them."""
    for i in range(batch):
        eng.add_request(list(range(100 + i, 100 + i + context)), SamplingParams(max_tokens=n + 40, ignore_eos=True))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            eng.step()
        torch.cuda.synchronize()
    ev = cuda_events(prof)
    # LM heads: the longest matrix-vector kernels (a 7B gate-up also takes tens of us, so the
    # cut is relative to the longest one, not absolute)
    longest = max((e0 - s0 for s0, e0, name in ev if name == "_gemv_kernel"), default=0.0)
    heads = [i for i, (s0, e0, name) in enumerate(ev) if name == "_gemv_kernel" and e0 - s0 > 0.6 * longest]
    windows = []
    for a, b in zip(heads, heads[1:]):
        first = next((j for j in range(a + 1, b) if ev[j][2] == "_gemv_kernel"), b)  # next step's QKV
        t0 = ev[a][1]
        windows.append(dict(period_us=ev[b][1] - t0, to_first_layer_us=ev[first][0] - t0,
                            events=[[name[:90], round(s0 - t0, 2), round(e0 - s0, 2)]
                                    for s0, e0, name in ev[a + 1:first + 1]]))
    if not windows:
        raise SystemExit("no two LM heads found in the profiled steps")
    mid = windows[len(windows) // 2]
    print(f"{len(windows)} step windows: LM head end -> next step's first layer kernel "
          f"{sum(w['to_first_layer_us'] for w in windows) / len(windows):.1f} us mean, "
          f"LM head to LM head {sum(w['period_us'] for w in windows) / len(windows):.1f} us mean")
    for name, start, dur in mid["events"]:
        print(f"  +{start:8.2f} us  {dur:7.2f} us  {name}")
    return {"windows": windows}


def timeline(prof, replays: int) -> dict:
    """Marginal time per kernel name: a kernel's end minus the latest end among the four kernels
    started before it, over the kernels of the middle replays in start order (µs), plus each
    kernel's own duration and its start relative to that end (negative: it started early,
    overlapping its predecessor)."""
    ev = cuda_events(prof)
    if replays < 4 or len(ev) < replays:
        raise SystemExit("--timeline needs --replays >= 4 and CUDA kernel events in every replay")
    if len(ev) % replays:
        print(f"warning: {len(ev)} events over {replays} replays: steps are not aligned")
    per = len(ev) // replays
    lo, hi = per * (replays // 4), per * (replays // 4 + replays // 2)   # middle half of replays
    nrep = (hi - lo) / per
    # the latest end among the (up to) four kernels started before kernel i
    prev_end = [max((e for _, e, _ in ev[max(0, i - 4):i]), default=ev[i][0]) for i in range(len(ev))]
    rows: dict[str, list[float]] = {}
    for i in range(lo, hi):
        s0, e0, name = ev[i]
        r = rows.setdefault(name, [0, 0.0, 0.0, 0.0])
        r[0] += 1
        r[1] += e0 - prev_end[i]               # marginal: end-to-end
        r[2] += e0 - s0                        # own duration
        r[3] += s0 - prev_end[i]               # start relative to the predecessor's end
    step = (ev[hi - 1][1] - ev[lo - 1][1]) / nrep if lo else float("nan")
    # per position in a layer: the kernels around each attention kernel of the matrix-vector
    # path (QKV gemv, _decode_kernel, then three gemvs); other kernel mixes are not labelled
    pos: dict[str, list[float]] = {}
    for i in range(lo, hi):
        if ev[i][2] != "_decode_kernel" or i < 1 or i + 3 >= len(ev) \
                or any(ev[i + o][2] != "_gemv_kernel" for o in (-1, 1, 2, 3)):
            continue
        for off, label in ((-1, "qkv(+norm,rope,kv write)"), (0, "attention"), (1, "o(+residual)"),
                           (2, "gate-up(+norm,silu)"), (3, "down(+residual)")):
            j = i + off
            r = pos.setdefault(label, [0, 0.0, 0.0])
            r[0] += 1
            r[1] += ev[j][1] - prev_end[j]
            r[2] += ev[j][1] - ev[j][0]
    layer = {k: dict(marginal_us=v[1] / v[0], own_us=v[2] / v[0], count=v[0]) for k, v in pos.items()}
    for k, v in layer.items():
        print(f"  layer position {k:28s} marginal {v['marginal_us']:6.2f} us  own {v['own_us']:6.2f} us")
    out = []
    for name, (n, marg, dur, start) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        out.append(dict(name=name, count_per_step=n / nrep, marginal_us_per_step=marg / nrep,
                        marginal_us_each=marg / n, duration_us_each=dur / n, start_vs_prev_end_us=start / n))
        print(f"{marg / nrep:9.1f} us/step  x{n / nrep:5.1f}  marginal {marg / n:6.2f} us  own {dur / n:6.2f} us  "
              f"start-vs-prev-end {start / n:+6.2f} us  {name[:80]}")
    print(f"step (end to end, middle replays): {step:.1f} us")
    raw = [[n, round(a - ev[lo][0], 3), round(b - ev[lo][0], 3)] for a, b, n in ev[lo:lo + per]]
    return {"step_us": step, "kernels": out, "layer_positions": layer, "one_step": raw}


if __name__ == "__main__":
    main()
