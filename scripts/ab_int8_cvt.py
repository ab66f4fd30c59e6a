"""A/B of the int8 -> float conversion inside the INT8 weight-only kernels (issue #6), on the GPU.

For each Qwen2.5 projection shape and M in 1..16 it times, in one process and interleaved over
``--rounds`` rounds: cuBLAS bf16 (``F.linear``), ``int8_linear`` with ``LLMSERVE_INT8_CVT=cast``
(the plain ``.to()`` conversion) and with ``=magic`` (integer and fp32 adds, see
``gemv.int8_to_f32``). Every int8 call is first checked against the fp32 reference. With
``--sweep`` it also times a small grid of ``mma`` tile configurations with the magic
conversion (the best tile may move when the conversion gets cheaper). Timing: CUDA-graph
replays of calls rotated over weight copies larger than the L2 (``scripts/cuda_timing.py``).

Writes ``<out>.json`` and ``<out>.md``; failures (compile errors, parity failures) are kept as
rows with the error.

    python scripts/ab_int8_cvt.py --out results/kernels/int8_cvt_run1 [--sweep]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import graph_time_us  # noqa: E402

from llmserve.triton_kernels.int8_linear import (  # noqa: E402
    Int8LinearConfig,
    choose_int8_config,
    int8_linear,
    int8_linear_reference,
)

ROTATE = 256 << 20
SHAPES = {  # name: (K, N)
    "1.5b qkv": (1536, 2048), "1.5b gate": (1536, 8960), "1.5b down": (8960, 1536),
    "7b qkv": (3584, 4608), "7b gate": (3584, 18944), "7b down": (18944, 3584),
}


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def timed(fns, reps):
    try:
        return graph_time_us(fns, reps), None
    except Exception as e:  # noqa: BLE001 - kept as a row
        return float("nan"), f"{type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sweep", action="store_true")
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows, sweep = [], []
    t0 = time.time()
    for name in a.shapes:
        k, n = SHAPES[name]
        cq = max(2, math.ceil(ROTATE / (n * k)))
        cb = max(2, math.ceil(ROTATE / (2 * n * k)))
        w_q = torch.randint(-127, 128, (cq, n, k), dtype=torch.int8, device=dev)
        sc = torch.rand(cq, n, device=dev) * 1e-3 + 1e-4
        w_b = torch.empty((cb, n, k), dtype=torch.bfloat16, device=dev).normal_(0, 0.02)
        for m in a.ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ref = int8_linear_reference(x.float(), w_q[0], sc[0])
            cfg = choose_int8_config(m, n, k, dev)
            res = {"cublas": [], "cast": [], "magic": []}
            errs, fails = {}, {}
            for mode in ("cast", "magic"):
                os.environ["LLMSERVE_INT8_CVT"] = mode
                try:
                    errs[mode] = rel_err(int8_linear(x, w_q[0], sc[0]), ref)
                except Exception as e:  # noqa: BLE001
                    fails[mode] = f"{type(e).__name__}: {str(e)[:200]}"
            for _ in range(a.rounds):
                us, _e = timed([lambda i=i: F.linear(x, w_b[i]) for i in range(cb)], max(cb, 20))
                res["cublas"].append(us)
                for mode in ("cast", "magic"):
                    if mode in fails:
                        continue
                    os.environ["LLMSERVE_INT8_CVT"] = mode
                    us, e = timed([lambda i=i: int8_linear(x, w_q[i], sc[i]) for i in range(cq)], max(cq, 20))
                    if e:
                        fails[mode] = e
                    res[mode].append(us)
            med = {kk: (sorted(v)[len(v) // 2] if v else float("nan")) for kk, v in res.items()}
            row = dict(shape=name, M=m, K=k, N=n, kind=cfg.kind,
                       config=[cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages],
                       cublas_us=med["cublas"], cast_us=med["cast"], magic_us=med["magic"],
                       cast_speedup=med["cublas"] / med["cast"], magic_speedup=med["cublas"] / med["magic"],
                       rel_err=errs, errors=fails, all_us=res)
            rows.append(row)
            print(f"{name} M={m} {cfg.kind}: cuBLAS {med['cublas']:.2f} us | cast {med['cast']:.2f} "
                  f"({row['cast_speedup']:.2f}x) | magic {med['magic']:.2f} ({row['magic_speedup']:.2f}x) "
                  f"err {errs} {fails or ''}", flush=True)
            if a.sweep and m in (4, 16) and name.startswith("1.5b"):
                os.environ["LLMSERVE_INT8_CVT"] = "magic"
                best = None
                for bn in (32, 64, 128):
                    for bk in (128, 256):
                        for warps in (4, 8):
                            for stages in (3, 4):
                                for split in (1, 2, 4, 8, 16):
                                    if k // split < 2 * bk or (n // bn) * split > 4 * 132 or (n // bn) * split < 66:
                                        continue
                                    c = Int8LinearConfig(16, bn, bk, split_k=split, num_warps=warps,
                                                         num_stages=stages, fused_reduce=True)
                                    try:
                                        e = rel_err(int8_linear(x, w_q[0], sc[0], config=c), ref)
                                        if not e < 1e-2:
                                            raise RuntimeError(f"parity rel err {e:.3g}")
                                        us = graph_time_us([lambda i=i, c=c: int8_linear(x, w_q[i], sc[i], config=c)
                                                            for i in range(cq)], max(cq, 20), replays=7)
                                        r = dict(shape=name, M=m, bn=bn, bk=bk, warps=warps, stages=stages,
                                                 split=split, us=us, speedup=med["cublas"] / us)
                                        if best is None or us < best["us"]:
                                            best = r
                                    except Exception as ex:  # noqa: BLE001
                                        r = dict(shape=name, M=m, bn=bn, bk=bk, warps=warps, stages=stages,
                                                 split=split, error=f"{type(ex).__name__}: {str(ex)[:160]}")
                                    sweep.append(r)
                print(f"  sweep best {name} M={m}: {best}", flush=True)
        del w_q, w_b, sc
        torch.cuda.empty_cache()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, date=_dt.datetime.now().isoformat(timespec="seconds"),
               command="python " + " ".join(sys.argv), seconds=time.time() - t0)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(dict(env=env, rows=rows, sweep=sweep), indent=1))
    md = [f"# INT8 conversion A/B ({env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']})",
          "", f"Command: `{env['command']}`. Median of {a.rounds} interleaved rounds, CUDA-graph replays, "
          "weights rotated over 256 MB.", "",
          "| shape | M | kind | cuBLAS bf16 us | int8 cast us | x | int8 magic us | x | rel err magic |",
          "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        md.append(f"| {r['shape']} | {r['M']} | {r['kind']} | {r['cublas_us']:.2f} | {r['cast_us']:.2f} | "
                  f"{r['cast_speedup']:.2f} | {r['magic_us']:.2f} | {r['magic_speedup']:.2f} | "
                  f"{r['rel_err'].get('magic', float('nan')):.1e} |")
    bests = {}
    for s in sweep:
        if "us" in s:
            key = (s["shape"], s["M"])
            if key not in bests or s["us"] < bests[key]["us"]:
                bests[key] = s
    if bests:
        md += ["", "Sweep (magic conversion, BLOCK_M 16), best per shape:", "",
               "| shape | M | bn | bk | warps | stages | split | us | x cuBLAS |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for (sh, m), s in sorted(bests.items()):
            md.append(f"| {sh} | {m} | {s['bn']} | {s['bk']} | {s['warps']} | {s['stages']} | {s['split']} | "
                      f"{s['us']:.2f} | {s['speedup']:.2f} |")
    a.out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
