#!/usr/bin/env python
"""Sweep and time the matrix-vector kernel (``llmserve.kernels.gemv``) on a GPU, and
retune its launch table ``gemv_configs.json`` for that GPU.

Usage (on the GPU, from the repository root)::

    python3 scripts/bench_gemv.py --out artifacts/gemv          # report only
    python3 scripts/bench_gemv.py --table engine/llmserve/triton_kernels/gemv_configs.json
    python3 scripts/bench_gemv.py --only 1.5b 1.5b-int8         # some models

For each projection of Qwen2.5-0.5B/1.5B/7B as the engine's decode path calls it (bf16, fused
RMSNorm prologue, SwiGLU and residual epilogues; M = 1), the LM head, and the plain INT8
linear shapes of Qwen2.5-1.5B (M = 1; set M_BF16 / M_INT8 for more): a two-phase sweep of launch
configurations (phase 1: tile shapes x warps without pipelining; phase 2: 2 pipeline stages
for the three best), every configuration checked against an fp32 reference before it is
timed, against the unfused kernels it replaces (cuBLAS ``F.linear`` plus the fused elementwise
kernels) or, for INT8, the bf16 cuBLAS matmul. ``--table`` writes the best configuration of
each case in the format ``choose_gemv_config`` reads.

Timing: CUDA graphs of R back-to-back calls rotating over weight copies totalling > 200 MB (so
every call reads HBM), CUDA events per replay, median over replays / R. Bandwidth is
weight bytes / time against the 4.24 TB/s copy bandwidth measured on an H200
(docs/performance.md).

Writes ``gemv.json`` and ``gemv.md`` to ``--out``. A table entry is keyed by GPU name, so a
retuned table keeps the entries of other GPUs. Kernels timed back to back can rank
configurations differently from whole decode steps: check a retuned table with
``llmserve bench-compare --parts decode`` before and after.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from llmserve.bench.kernels import graph_time_us
from llmserve.kernels._launch import pdl_available
from llmserve.kernels.fused import add_rmsnorm, silu_and_mul
from llmserve.kernels.gemv import GemvConfig, choose_gemv_config, gemv, gemv_reference, table_key
from llmserve.kernels.int8_linear import int8_linear, pack_int8_planes, quantize_int8_per_channel

REF_BW = 4.24e12
ROTATE = 200e6
DEV = torch.device("cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 1

# Qwen2.5 projection shapes (K, N) as the engine's gemv path calls them: QKV with the RMSNorm
# prologue and bias, O with the residual epilogue, gate-up with the RMSNorm prologue and the
# SwiGLU epilogue (N = intermediate size, 2N weight rows), down with the residual epilogue.
# value: (prologue, residual, bias, glu)
LAYER = {"qkv": ("rmsnorm", False, True, False), "o": ("none", True, False, False),
         "gate_up": ("rmsnorm", False, False, True), "down": ("none", True, False, False)}
MODELS = {"0.5b": {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 4864), "down": (4864, 896)},
          "1.5b": {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 8960), "down": (8960, 1536)},
          "7b": {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 18944), "down": (18944, 3584)}}
LM_HEAD = {"0.5b": (896, 151936), "1.5b": (1536, 151936), "7b": (3584, 152064)}
INT8_SHAPES = [("int8 gate/up", 1536, 8960), ("int8 down", 8960, 1536), ("int8 qkv", 1536, 2048)]
# M = 2 and 4 measured slower than cuBLAS on the MLP shapes (H200), so the engine takes this
# path at M = 1 only and the default sweep covers M = 1.
M_BF16: dict[str, tuple[int, ...]] = {}
M_INT8 = (1,)
PAIRS = [(bn, bk) for bn in (1, 2, 4, 8) for bk in (128, 256, 512, 1024, 2048, 4096)
         if 256 <= bn * bk <= 8192]
WARPS = (2, 4, 8)
# int8 byte planes (weight kind "int8p"): block_k counts 32-bit words (4 columns)
PAIRS_P = [(bn, bk) for bn in (1, 2, 4, 8) for bk in (64, 128, 256, 512) if 64 <= bn * bk <= 2048]
WARPS_P = (1, 2, 4)
M_INT8P = (1, 2, 4)
STAGES2 = (2,)
PERSISTENT = (4, 8, 16, 32)  # programs per SM tried for the three best configurations


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


T0 = time.time()


def time_graph(fns, reps: int) -> float:
    return graph_time_us(fns, reps, replays=12)


def weights(k: int, n: int, int8: bool | str, copies: int):
    """``copies`` weights ``[n, k]``: bf16, int8 (``int8=True``) or int8 byte planes
    (``int8="planes"``: int32 ``[n, k / 4]``) with per-row scales."""
    if int8:
        w = torch.randint(-127, 128, (copies, n, k), dtype=torch.int8, device=DEV)
        sc = torch.rand(copies, n, device=DEV) * 1e-3 + 1e-4
        if int8 == "planes":
            w = torch.stack([pack_int8_planes(w[i]) for i in range(copies)])
        return w, sc
    return torch.empty((copies, n, k), dtype=torch.bfloat16, device=DEV).normal_(0, 0.02), None


def cases(only=None):
    """(label, model, proj, K, N, int8, M, prologue, residual, bias, glu) of every swept case
    (``only``: model names, "int8" (the plain INT8 linear shapes of Qwen2.5-1.5B) and/or
    "<model>-int8" (the engine's fused decode projections with Triton INT8 weights) to keep)."""
    out = []
    for model, projs in MODELS.items():
        for proj, (k, n) in projs.items():
            for m in M_BF16.get(model, (1,)):
                out.append((f"{model} {proj}", model, proj, k, n, False, m, *LAYER[proj]))
        for proj, (k, n) in projs.items():
            out.append((f"{model} {proj} int8", f"{model}-int8", proj, k, n, True, 1, *LAYER[proj]))
        for proj, (k, n) in projs.items():
            out.append((f"{model} {proj} int8p", f"{model}-int8p", proj, k, n, "planes", 1, *LAYER[proj]))
    for model, (k, n) in LM_HEAD.items():
        out.append((f"{model} lm_head", model, "lm_head", k, n, False, 1, "none", False, False, False))
    for lab, k, n in INT8_SHAPES:
        for m in M_INT8:
            out.append((lab, "int8", "plain", k, n, True, m, "none", False, False, False))
        for m in M_INT8P:
            out.append((lab + " planes", "int8p", "plain", k, n, "planes", m, "none", False, False, False))
    return [c for c in out if not only or c[1] in only]


class Case:
    """Inputs of one case and callables for the gemv under a config and its unfused baseline."""

    def __init__(self, c, rotate: float):
        self.lab, self.model, self.proj, self.k, self.n, self.int8, self.m, self.pro, self.res, \
            self.has_bias, self.glu = c
        k, n, m = self.k, self.n, self.m
        elt = 1 if self.int8 else 2
        self.rows = 2 * n if self.glu else n                 # weight rows read
        self.copies = max(1, math.ceil(rotate / (self.rows * k * elt))) if rotate else 1
        self.w, self.sc = weights(k, self.rows, self.int8, self.copies)
        self.x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        self.g = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
        self.bias = torch.randn(n, device=DEV, dtype=torch.bfloat16) if self.has_bias else None
        self.r = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
        self.res_in = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        self.reps = max(self.copies, 24)

    def kw(self, i):
        return dict(scale=self.sc[i] if self.int8 else None, bias=self.bias,
                    residual=self.r if self.res else None, out=self.r if self.res else None,
                    prologue=self.pro, norm_weight=self.g if self.pro == "rmsnorm" else None, glu=self.glu)

    def fns(self, cfg, pdl: bool = False):
        return [lambda i=i: gemv(self.x, self.w[i], config=cfg, pdl=pdl, **self.kw(i))
                for i in range(self.copies)]

    def check(self, cfg) -> float:
        kw = self.kw(0)
        kw.pop("out")
        kw["residual"] = self.r.clone() if self.res else None
        y = gemv(self.x, self.w[0], config=cfg, **kw)
        ref = gemv_reference(self.x.float(), self.w[0] if self.int8 else self.w[0].float(), **kw)
        return rel_err(y, ref)

    def baseline(self):
        """The unfused kernels this call replaces in the engine (cuBLAS + fused elementwise)."""
        if self.int8:                       # bf16 cuBLAS on the same shape (the 1.5x target)
            wb = torch.empty((max(1, math.ceil(ROTATE / (2 * self.n * self.k))), self.n, self.k),
                             dtype=torch.bfloat16, device=DEV).normal_(0, 0.02)
            return [lambda i=i: F.linear(self.x, wb[i]) for i in range(wb.shape[0])], wb
        w, eps = self.w, 1e-6
        if self.glu:
            return [lambda i=i: silu_and_mul(F.linear(add_rmsnorm(self.x, self.g, eps, self.res_in)[0], w[i]))
                    for i in range(self.copies)], None
        if self.pro == "rmsnorm":
            return [lambda i=i: F.linear(add_rmsnorm(self.x, self.g, eps, self.res_in)[0], w[i], self.bias)
                    for i in range(self.copies)], None
        return [lambda i=i: F.linear(self.x, w[i], self.bias) for i in range(self.copies)], None


def all_configs(planes: bool = False):
    if planes:
        return [GemvConfig(bn, bk, w, 1) for bn, bk in PAIRS_P for w in WARPS_P]
    return [GemvConfig(bn, bk, w, s) for bn, bk in PAIRS for w in WARPS for s in (1,) + STAGES2]


def _precompile(args):
    wid, nw, only = args
    i = 0
    seen = set()
    for c in cases(only):
        case = Case(c, 0)
        key = (c[5], c[6], c[7], c[8], c[9], c[10]) + tuple(c[3] % b == 0 for b in (2048, 1024, 512, 256, 128))
        if key in seen:          # same kernel binaries as an earlier case
            continue
        seen.add(key)
        for cfg in all_configs(c[5] == "planes"):
            i += 1
            if i % nw != wid:
                continue
            try:
                case.fns(cfg)[0]()
            except Exception:  # noqa: BLE001 - the main run reports it
                pass
        del case
    torch.cuda.synchronize()
    return wid


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def time_config(case: Case, cfg: GemvConfig) -> dict:
    """One sweep row of ``case`` under ``cfg``: ``us`` is None, with ``error`` saying why, when
    the configuration failed its parity check or its launch (e.g. out of registers)."""
    out = dict(cfg=cfg.as_list(), us=None, rel_err=None, error=None)
    try:
        out["rel_err"] = case.check(cfg)
        if out["rel_err"] < 1e-2:
            out["us"] = time_graph(case.fns(cfg), case.reps)
        else:
            out["error"] = f"relative error {out['rel_err']:.2e} >= 1e-2 against fp32"
    except Exception as ex:  # noqa: BLE001 - kept as a row
        out["error"] = f"{type(ex).__name__}: {ex}"[:300]
    return out


def run_case(c, sweep: bool) -> dict:
    case = Case(c, ROTATE)
    k, n, m = case.k, case.n, case.m
    elt = 1 if case.int8 else 2

    def t_cfg(cfg) -> dict:
        return time_config(case, cfg)

    bfns, _keep = case.baseline()
    base = time_graph(bfns, max(len(bfns), 24))
    row = dict(case=case.lab, model=case.model, proj=case.proj, K=k, N=n, M=m, glu=case.glu,
               weight="int8p" if case.int8 == "planes" else "int8" if case.int8 else "bf16", prologue=case.pro, residual=case.res,
               bias=case.has_bias, baseline_us=base,
               baseline="cuBLAS bf16 F.linear" if case.int8 else
               ("add_rmsnorm + cuBLAS + silu_and_mul" if case.glu else
                {"rmsnorm": "add_rmsnorm + cuBLAS", "none": "cuBLAS"}[case.pro]))
    if case.int8:  # the int8_linear default for this shape
        row["int8_linear_us"] = time_graph([lambda i=i: int8_linear(case.x, case.w[i], case.sc[i])
                                            for i in range(case.copies)], case.reps)
    dflt = choose_gemv_config(m, n, k, case.w.dtype, DEV, case.pro + ("+glu" if case.glu else ""))
    d = t_cfg(dflt)
    row["default_config"], row["default_us"], row["default_error"] = d["cfg"], d["us"], d["error"]
    # the same calls back to back with programmatic dependent launch (the engine's decode path):
    # each call reads its first weight tile while the previous one drains
    row["default_pdl_us"] = (time_graph(case.fns(dflt, pdl=True), case.reps)
                             if d["us"] is not None and pdl_available(DEV) else None)
    if row["default_pdl_us"] is not None and case.int8:
        row["pdl_speedup_vs_cublas"] = base / row["default_pdl_us"]
    tried = [d]
    if sweep:
        p1 = ([t_cfg(cfg) for cfg in all_configs(True)] if case.int8 == "planes" else
              [t_cfg(GemvConfig(bn, bk, nw, 1)) for bn, bk in PAIRS for nw in WARPS])
        tried += p1
        for r in sorted((r for r in p1 if r["us"] is not None), key=lambda r: r["us"])[:3]:
            bn, bk, nw, _ = r["cfg"][:4]
            tried += [t_cfg(GemvConfig(bn, bk, nw, st)) for st in STAGES2]
            # persistent grids: at most p programs an SM, each looping over row blocks
            tried += [t_cfg(GemvConfig(bn, bk, nw, 1, pps)) for pps in PERSISTENT
                      if pps * SMS < -(-case.n // bn)]
        row["sweep"] = tried
    ok = [r for r in tried if r["us"] is not None]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    row["best_config"], row["best_us"] = (best["cfg"], best["us"]) if best else (None, None)
    row["floor_us"] = case.rows * k * elt / REF_BW * 1e6
    if best:
        row["best_weight_tbps"] = case.rows * k * elt / best["us"] / 1e6
        row["best_frac_ref_bw"] = row["best_weight_tbps"] * 1e12 / REF_BW
        row["speedup"] = base / best["us"]
        log(f"{case.lab} M={m} {row['weight']} {case.pro}{' +res' if case.res else ''}: baseline "
            f"({row['baseline']}) {base:.2f} us, default {_f(row['default_us'])} {row['default_config']}, "
            f"best {best['us']:.2f} us {best['cfg']} ({row['best_weight_tbps']:.2f} TB/s), {row['speedup']:.2f}x")
    else:
        row["error"] = "every configuration failed (see sweep)"
        log(f"{case.lab} M={m}: every configuration failed")
    del case, bfns, _keep
    return row


def _f(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(res) -> str:
    e = res["env"]
    out = ["# Matrix-vector kernel (gemv) on the GPU", "",
           f"- {e['gpu']}, torch {e['torch']}, triton {e['triton']}, {e['date']}",
           f"- command: `{e['command']}`",
           "- times: median of CUDA-graph replays / calls per replay, weights rotated over > 200 MB;",
           "  TB/s = weight bytes / time (reference copy bandwidth 4.24 TB/s; a pure read stream can",
           "  exceed it). Baseline: the unfused kernels the fused call replaces in the engine, or for",
           "  int8 rows the bf16 cuBLAS matmul of the same shape (target >= 1.5x).", "",
           "| case | M | weight | fused ops | baseline | baseline us | gemv best us | best cfg (BN,BK,warps,stages) "
           "| weight TB/s | % of 4.24 | speed-up | default cfg us | default + PDL us | int8_linear default us "
           "| error |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["cases"]:
        if "prologue" not in r:  # the case itself failed (kept as a row)
            out.append(f"| {r['case']} | {r.get('M')} | | | | | | | | | | | | | error: {r['error']} |")
            continue
        ops = "+".join(x for x in (r["prologue"] if r["prologue"] != "none" else "",
                                   "bias" if r["bias"] else "", "residual" if r["residual"] else "",
                                   "swiglu" if r.get("glu") else "") if x) or "-"
        pct = None if r["best_us"] is None else 100 * r["best_frac_ref_bw"]
        out.append(f"| {r['case']} | {r['M']} | {r['weight']} | {ops} | {r['baseline']} | {_f(r['baseline_us'])} | "
                   f"{_f(r['best_us'])} | {r['best_config']} | {_f(r.get('best_weight_tbps'))} | "
                   f"{_f(pct, 0)}% | {_f(r.get('speedup'))}x | {_f(r['default_us'])} | "
                   f"{_f(r.get('default_pdl_us'))} | {_f(r.get('int8_linear_us'))} | {r.get('error') or ''} |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("artifacts/gemv"))
    p.add_argument("--workers", type=int, default=14)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--table", type=Path, help="merge the tuned configurations into this JSON table")
    p.add_argument("--only", nargs="+", help="models to run (0.5b 1.5b 7b int8 0.5b-int8 1.5b-int8 "
                                             "7b-int8, int8p and <model>-int8p for byte planes); "
                                             "default all")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    env = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
               date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               command="python3 scripts/bench_gemv.py " + " ".join(sys.argv[1:]))
    if not a.no_sweep and a.workers:
        with mp.get_context("spawn").Pool(a.workers) as pool:
            list(pool.imap_unordered(_precompile, [(i, a.workers, a.only) for i in range(a.workers)]))
        log("pre-compiled")
    res = dict(env=env, cases=[])

    def save():
        (a.out / "gemv.json").write_text(json.dumps(res, indent=1))
        (a.out / "gemv.md").write_text(markdown(res))
        if a.table:
            old = json.loads(a.table.read_text()) if a.table.exists() else {}
            configs = dict(old.get("configs", {}))
            configs.update({table_key(gpu, {"bf16": "float"}.get(r["weight"], r["weight"]), r["prologue"] + ("+glu" if r["glu"] else ""),
                                      r["M"], r["K"], r["N"]):
                            r["best_config"] for r in res["cases"] if r.get("best_us") is not None})
            sources = [x for x in old.get("sources", [old["source"]] if "source" in old else [])]
            if env not in sources:                     # once per run, not once per saved case
                sources.append(env)
            a.table.write_text(json.dumps(dict(sources=sources, configs=configs), indent=1,
                                          sort_keys=True) + "\n")

    for c in cases(a.only):
        try:
            res["cases"].append(run_case(c, sweep=not a.no_sweep))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: kept as a row with the error
            res["cases"].append(dict(case=c[0], M=c[6], error=f"{type(e).__name__}: {e}"[:300]))
            log(f"{c[0]} M={c[6]} failed: {e}")
        save()
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
