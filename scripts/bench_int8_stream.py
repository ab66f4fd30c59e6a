#!/usr/bin/env python
"""Sweep and time the persistent stream-K INT8 kernel (``int8_linear`` kind ``"stream"``) on a GPU.

Question (issue #6): can weight-only INT8 beat bf16 cuBLAS by >= 1.5x at M = 2..16 on the
Qwen2.5-1.5B shapes (gate/up K=1536 N=8960, down K=8960 N=1536, qkv K=1536 N=2048)? The
shipped tensor-core kind ("mma") streams about 1.5 TB/s of int8; the stream kind keeps one
software pipeline per program running across tile boundaries and gives every SM the same
number of weight bytes (``llmserve.triton_kernels.int8_linear._stream_launch``).

For each shape and M in (1, 2, 4, 8, 16): bf16 cuBLAS ``F.linear``, the library default
(``choose_int8_config``), and up to 40 stream configurations (orientation, block_n, block_k,
stages, warps, programs per SM, TMA weight loads). Every configuration is first compiled and
checked in a fresh worker process (a kernel that faults cannot poison this process's CUDA
context), then checked again here against an fp64 reference (relative error < 1e-2) before
it is timed; failures stay as rows with their error. Timing: CUDA graphs of back-to-back
calls rotating over > 200 MB of weights (``scripts/cuda_timing.py``), helpers shared with
``scripts/bench_int8_planes.py``. Writes ``stream.json`` and ``stream.md`` to ``--out``.

    python3 scripts/bench_int8_stream.py --out DIR [--quick] [--ms 2 8 16] [--workers 14]
    python3 scripts/bench_int8_stream.py --out DIR --dry-run [--aot]   # no GPU needed

``--dry-run`` lists and validates the configurations; with ``--aot`` it also compiles each for
sm_90 with the local Triton (no GPU; ``TRITON_INTERPRET`` forced off) and reports shared
memory and the instructions used (cp.async / TMA / wgmma / mma.sync).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

if "--aot" in sys.argv:  # compile for sm_90 without a GPU: kernels must not be interpreted
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_planes import (  # noqa: E402  (scripts/, next to this file)
    SHAPES,
    cublas_us,
    int8_us,
    rel_err,
    run_header,
    shape_weights,
)

from llmserve.triton_kernels.int8_linear import (  # noqa: E402
    Int8LinearConfig,
    _stream_launch,
    check_stream_config,
    choose_int8_config,
    int8_linear,
)

MS = (1, 2, 4, 8, 16)
SPEEDUP_GOAL = 1.5
REF_BW = 4.24e12  # measured H200 copy bandwidth (DESIGN.md)


def S(bn: int, bk: int, stages: int, warps: int = 4, pps: int = 1, swap: bool = False,
      tma: bool = False) -> Int8LinearConfig:
    """A stream configuration (BLOCK_M = 16)."""
    return Int8LinearConfig(16, bn, bk, swap_ab=swap, num_warps=warps, num_stages=stages, kind="stream",
                            programs_per_sm=pps, tma=tma)


# 40 configurations, the same for every shape (one compile each: M is not specialised and the
# 1.5B shapes' K are multiples of every block_k). Chosen so that the weight bytes in flight per
# SM, (stages - 1) x block_n x block_k x programs/SM, span ~16-100 KB (Little's law at 4.2 TB/s
# and ~1 us latency wants ~32 KB per SM) and shared memory fits two programs an SM where
# pps = 2. Swap-AB uses block_n >= 16 x warps so the weight tile can be a wgmma A operand.
CONFIGS = [
    # weight tile = MMA B operand (mma.sync at 16 rows), pointer loads (cp.async)
    S(32, 256, 4), S(32, 256, 4, pps=2), S(32, 256, 5), S(32, 256, 6), S(32, 128, 4, pps=2),
    S(32, 128, 6), S(64, 128, 4), S(64, 128, 4, pps=2), S(64, 128, 6), S(64, 256, 3), S(64, 256, 4),
    S(64, 64, 6, pps=2), S(128, 128, 3, warps=8), S(128, 64, 5),
    # ... with TMA weight loads
    S(32, 256, 4, tma=True), S(32, 256, 4, pps=2, tma=True), S(64, 128, 4, tma=True),
    S(64, 256, 4, tma=True), S(64, 128, 6, pps=2, tma=True), S(128, 128, 4, warps=8, tma=True),
    # weight tile = MMA A operand (swap-AB: y.T = w @ x.T; wgmma with A from registers)
    S(64, 128, 4, swap=True), S(64, 128, 4, pps=2, swap=True), S(64, 128, 6, swap=True),
    S(64, 256, 3, swap=True), S(64, 256, 4, swap=True), S(64, 256, 4, pps=2, swap=True),
    S(64, 64, 6, pps=2, swap=True), S(128, 128, 3, warps=8, swap=True), S(128, 128, 4, warps=8, swap=True),
    S(128, 64, 5, warps=8, swap=True), S(128, 256, 3, warps=8, swap=True),
    # ... with TMA weight loads
    S(64, 128, 4, swap=True, tma=True), S(64, 128, 4, pps=2, swap=True, tma=True),
    S(64, 256, 4, swap=True, tma=True), S(64, 256, 5, swap=True, tma=True),
    S(128, 128, 4, warps=8, swap=True, tma=True), S(128, 256, 3, warps=8, swap=True, tma=True),
    S(128, 128, 4, warps=8, pps=2, swap=True, tma=True), S(64, 64, 6, pps=2, swap=True, tma=True),
    # swap-AB with a 32-row weight tile (too small for wgmma: mma.sync), for comparison
    S(32, 256, 4, swap=True),
]
QUICK = [S(32, 256, 4), S(64, 128, 4, pps=2), S(64, 128, 4, swap=True), S(64, 128, 4, tma=True),
         S(64, 128, 4, swap=True, tma=True)]


def cfg_name(c: Int8LinearConfig) -> str:
    return (f"{'swap' if c.swap_ab else 'plain'} {c.block_n}x{c.block_k} s{c.num_stages} w{c.num_warps} "
            f"pps{max(1, c.programs_per_sm)}{' tma' if c.tma else ''}")


def smem_estimate(c: Int8LinearConfig) -> int:
    """Shared memory bytes of the pipeline buffers: ``num_stages - 1`` buffers of a weight int8
    tile plus an x bf16 tile (Triton 3.9's sm_90 compile of these kernels used this plus
    2-24 KB, see ``--dry-run --aot``)."""
    return max(1, c.num_stages - 1) * (c.block_n * c.block_k + c.block_m * c.block_k * 2)


def validate(cfgs: list[Int8LinearConfig]) -> None:
    """Fields valid (``check_stream_config``), no duplicates, shared memory fits the H200's
    227 KB a block and, for two programs an SM, half of its 228 KB an SM."""
    seen = set()
    for c in cfgs:
        check_stream_config(c)
        key = cfg_name(c)
        if key in seen:
            raise ValueError(f"duplicate configuration {key}")
        seen.add(key)
        if (smem_estimate(c) + 24 * 1024) * max(1, c.programs_per_sm) > 227 * 1024:
            raise ValueError(f"{key}: ~{smem_estimate(c)} B of shared memory x {c.programs_per_sm} programs "
                             "exceed an H200 SM")


def compiled_info(kernel) -> dict:
    """Registers, spills, shared bytes of a compiled Triton kernel, and whether its main loop
    was software-pipelined (asynchronous copies in the TTGIR)."""
    info = {}
    for name in ("n_regs", "n_spills"):
        if getattr(kernel, name, None) is not None:
            info[name] = int(getattr(kernel, name))
    md = getattr(kernel, "metadata", None)
    if md is not None and getattr(md, "shared", None) is not None:
        info["shared"] = int(md.shared)
    ttgir = (getattr(kernel, "asm", None) or {}).get("ttgir")
    if ttgir:
        info["pipelined"] = ("async_copy_global_to_local" in ttgir
                             or "async_tma_copy_global_to_local" in ttgir)
        info["wgmma"] = "warp_group_dot" in ttgir
    return info


def _check_worker(args):
    """Compile and check one configuration in a fresh process on every shape (M = 2 and 16):
    returns ``(index, None or error, compiled-kernel info per shape)``."""
    idx, cfg = args
    infos = {}
    try:
        dev = torch.device("cuda")
        for lab, k, n in SHAPES:
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
            s = torch.rand(n, device=dev) * 1e-3 + 1e-4
            for m in (2, 16):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = x.double() @ (q.double() * s.double()[:, None]).T
                err = rel_err(int8_linear(x, q, s, config=cfg), ref)
                if not err < 1e-2:
                    return idx, f"relative error {err:.2e} (K={k} N={n} M={m})", infos
            y = torch.empty((2, n), device=dev, dtype=torch.bfloat16)
            try:
                infos[lab] = compiled_info(_stream_launch(x[:2], q, s, None, y, cfg))
            except Exception as ex:  # noqa: BLE001 - diagnostics only
                infos[lab] = {"info_error": f"{type(ex).__name__}: {ex}"[:200]}
        torch.cuda.synchronize()
        return idx, None, infos
    except Exception as ex:  # noqa: BLE001 - reported as the configuration's error
        return idx, f"{type(ex).__name__}: {ex}"[:300], infos


def precheck(cfgs: list[Int8LinearConfig], workers: int, timeout_s: float
             ) -> tuple[dict[int, str], dict[int, dict]]:
    """Compile + check every configuration in worker processes (one process a configuration,
    so a faulting kernel takes only its own CUDA context down); Triton's disk cache then serves
    the timed pass. Returns ``({index: error}`` for the failures, ``{index: {shape: compiled
    kernel info}})``."""
    errors: dict[int, str] = {}
    infos: dict[int, dict] = {}
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, maxtasksperchild=1) as pool:
        pending = {i: pool.apply_async(_check_worker, ((i, c),)) for i, c in enumerate(cfgs)}
        deadline = time.time() + timeout_s
        for i, res in pending.items():
            try:
                _, err, infos[i] = res.get(timeout=max(1.0, deadline - time.time()))
            except mp.TimeoutError:
                err = f"compile/check did not finish within {timeout_s:.0f} s"
            except Exception as ex:  # noqa: BLE001 - a worker that died
                err = f"worker failed: {type(ex).__name__}: {ex}"[:300]
            if err:
                errors[i] = err
        pool.terminate()
    return errors, infos


def aot_compile(cfg: Int8LinearConfig) -> dict:
    """Compile the stream kernel for sm_90 with the local Triton (no GPU needed): shared bytes
    and which memory/MMA instructions the PTX uses."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from llmserve.triton_kernels.int8_linear import _int8_stream_kernel

    const = dict(HAS_BIAS=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 SWAP_AB=cfg.swap_ab, EVEN_K=True, STAGES=cfg.num_stages, USE_TMA=cfg.tma, FP32_MATH=False,
                 MAX_CONTRIB=4, ASM_BARRIER=True, ONE_M=True)
    sig = {"x_ptr": "*bf16", "w_ptr": "*i8",
           "w_desc": f"tensordesc<i8[{cfg.block_n}, {cfg.block_k}]>" if cfg.tma else "*i8",
           "s_ptr": "*fp32", "bias_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
           **{name: "constexpr" for name in const}}
    aligned = [0, 1, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13] + ([] if cfg.tma else [2])
    src = ASTSource(_int8_stream_kernel, sig, constexprs=const,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    # pipelined: the loads of later iterations are issued asynchronously inside the main loop
    pipelined = "async_copy_global_to_local" in ttgir or "async_tma_copy_global_to_local" in ttgir
    return dict(shared=k.metadata.shared, pipelined=pipelined, cp_async="cp.async." in ptx,
                tma="cp.async.bulk.tensor" in ptx, wgmma="wgmma" in ptx, mma_sync="mma.sync" in ptx)


def dry_run(cfgs: list[Int8LinearConfig], aot: bool, workers: int) -> int:
    validate(cfgs)
    print(f"{len(cfgs)} stream configurations (valid), {len(SHAPES)} shapes x M {MS}:")
    results = []
    if aot:
        with mp.get_context("spawn").Pool(max(1, workers)) as pool:
            results = pool.map(_aot_worker, cfgs)
    bad = 0
    for i, c in enumerate(cfgs):
        line = f"  {i:2d} {cfg_name(c):32s} ~{smem_estimate(c) // 1024:3d} KB pipeline buffers"
        if aot:
            r = results[i]
            if "error" in r:
                bad += 1
                line += f"  sm_90 compile FAILED: {r['error']}"
            else:
                used = ",".join(name for name in ("cp_async", "tma", "wgmma", "mma_sync") if r[name])
                line += f"  sm_90: {r['shared'] // 1024} KB shared, {used}"
                if not r["pipelined"]:
                    bad += 1
                    line += "  NOT PIPELINED"
        print(line)
    return 1 if bad else 0


def _aot_worker(cfg):
    try:
        return aot_compile(cfg)
    except Exception as ex:  # noqa: BLE001 - reported
        return dict(error=f"{type(ex).__name__}: {ex}"[:300])


def time_rows(cfgs, ms, pre_errors, budget_s, out: Path, t0: float, dev: torch.device | None = None,
              infos: dict[int, dict] | None = None) -> list[dict]:
    """Time cuBLAS, the default and every configuration that passed the pre-check, for each
    shape and M; ``stream.json`` is rewritten after each row (partial results survive)."""
    dev = dev or torch.device("cuda")
    rows = []
    for lab, k, n in SHAPES:
        copies, q, s, wb = shape_weights(k, n, dev)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.double() @ (q[0].double() * s[0].double()[:, None]).T
            row = dict(shape=lab, K=k, N=n, M=m, copies=copies, cublas_bf16_us=cublas_us(x, wb))
            dc = choose_int8_config(m, n, k, dev)
            row["default_config"] = (f"{dc.kind} {dc.block_m}x{dc.block_n}x{dc.block_k} split {dc.split_k} "
                                     f"w{dc.num_warps} s{dc.num_stages}")
            row["default_err"], row["default_us"] = int8_us(x, q, s, ref)
            res = []
            for i, c in enumerate(cfgs):
                r = dict(name=cfg_name(c), cfg=asdict(c), us=None, err=None, error=pre_errors.get(i),
                         compiled=(infos or {}).get(i, {}).get(lab))
                if r["error"] is None and time.time() - t0 > budget_s:
                    r["error"] = f"skipped: past the {budget_s:.0f} s time budget"
                if r["error"] is None:
                    try:
                        r["err"], r["us"] = int8_us(x, q, s, ref, config=c)
                        if r["us"] is None:
                            r["error"] = f"relative error {r['err']:.2e}"
                    except Exception as ex:  # noqa: BLE001 - kept as a row
                        r["error"] = f"{type(ex).__name__}: {ex}"[:300]
                res.append(r)
            row["stream"] = res
            ok = [r for r in res if r["us"] is not None]
            row["best"] = min(ok, key=lambda r: r["us"]) if ok else None
            rows.append(row)
            b = row["best"]
            print(f"[{time.time() - t0:6.1f}s] {lab} M={m}: cuBLAS {row['cublas_bf16_us']:.2f} us, default "
                  f"{row['default_us'] or float('nan'):.2f} ({row['default_config']}), best stream "
                  + (f"{b['us']:.2f} ({b['name']}, {row['cublas_bf16_us'] / b['us']:.2f}x)" if b else "-")
                  + f", {sum(1 for r in res if r['error'])} failed/skipped", flush=True)
            (out / "stream.json").write_text(json.dumps(dict(**run_header(), rows=rows), indent=1))
    return rows


def write_md(rows: list[dict], out: Path) -> str:
    lines = [("| shape | M | cuBLAS bf16 us | default int8 us | best stream us | default vs cuBLAS "
              "| stream vs cuBLAS | >= 1.5x | stream int8 TB/s | best stream config |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, d, b = r["cublas_bf16_us"], r["default_us"], r["best"]
        dd = f"{d:.2f}" if d else "-"
        ds = f"{c / d:.2f}x" if d else "-"
        if b:
            tbs = r["N"] * r["K"] / (b["us"] * 1e-6) / 1e12
            lines.append(f"| {r['shape']} | {r['M']} | {c:.2f} | {dd} | {b['us']:.2f} | {ds} | {c / b['us']:.2f}x "
                         f"| {'yes' if c / b['us'] >= SPEEDUP_GOAL else 'no'} | {tbs:.2f} "
                         f"({tbs * 1e12 / REF_BW:.0%} of copy) | {b['name']} |")
        else:
            lines.append(f"| {r['shape']} | {r['M']} | {c:.2f} | {dd} | - | {ds} | - | no | - | (none passed) |")
    # Per shape: the configurations with the best mean time over M = 2..16 (one config a shape?)
    lines += ["", "Best configurations a shape by mean time over M >= 2 (us at each M):", ""]
    for lab, _, _ in SHAPES:
        rs = [r for r in rows if r["shape"] == lab and r["M"] >= 2]
        if not rs:
            continue
        names = [x["name"] for x in rs[0]["stream"]]
        scored = []
        for j, name in enumerate(names):
            ts = [r["stream"][j]["us"] for r in rs]
            if all(t is not None for t in ts):
                scored.append((sum(ts) / len(ts), name, ts))
        scored.sort()
        ms = ", ".join(str(r["M"]) for r in rs)
        cub = ", ".join(f"{r['cublas_bf16_us']:.2f}" for r in rs)
        lines.append(f"- {lab} (M = {ms}; cuBLAS {cub}):")
        for mean, name, ts in scored[:5]:
            lines.append(f"  - {name}: mean {mean:.2f}; " + ", ".join(f"{t:.2f}" for t in ts))
    errs = sorted({x["error"] for r in rows for x in r["stream"] if x["error"]})
    if errs:
        lines += ["", "Errors (configurations kept as rows in stream.json):", ""]
        lines += [f"- {e}" for e in errs[:20]]
    text = "\n".join(lines) + "\n"
    (out / "stream.md").write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS))
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK)} configurations (< 90 s)")
    ap.add_argument("--workers", type=int, default=14, help="parallel compile/check processes")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="stop timing new configurations after this many seconds (rows say skipped)")
    ap.add_argument("--dry-run", action="store_true", help="list and validate the configurations; no GPU")
    ap.add_argument("--aot", action="store_true", help="with --dry-run: compile each for sm_90 (no GPU)")
    args = ap.parse_args()
    cfgs = QUICK if args.quick else CONFIGS
    if args.dry_run:
        return dry_run(cfgs, args.aot, args.workers)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (use --dry-run [--aot] on CPU)", file=sys.stderr)
        return 2
    validate(cfgs)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    pre, infos = precheck(cfgs, args.workers, timeout_s=180.0) if args.workers > 0 else ({}, {})
    print(f"[{time.time() - t0:6.1f}s] compiled and checked {len(cfgs)} configurations, {len(pre)} failed"
          + "".join(f"\n    {cfg_name(cfgs[i])}: {e}" for i, e in sorted(pre.items())), flush=True)
    for i, c in enumerate(cfgs):
        print(f"    {cfg_name(c):32s} {json.dumps(infos.get(i, {}))}", flush=True)
    rows = time_rows(cfgs, args.ms, pre, args.budget_s, args.out, t0, infos=infos)
    print(write_md(rows, args.out))
    print(f"[{time.time() - t0:6.1f}s] wrote {args.out / 'stream.json'} and {args.out / 'stream.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
