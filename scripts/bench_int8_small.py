#!/usr/bin/env python
"""Sweep the ``"small"`` kind of the weight-only INT8 linear (``int8_linear``, 2 <= M <= 16) on
a GPU against bf16 cuBLAS, for the issue #6 target (>= 1.5x cuBLAS bf16 at M = 2..16).

For each Qwen2.5-1.5B shape (K, N) in gate/up (1536, 8960), down (8960, 1536), qkv (1536, 2048)
and M in 16, 4 (full candidate grid) then 8, 2 (the best few of 16 and 4), it times

* cuBLAS bf16: ``F.linear(x, w_bf16)`` on the same shape;
* the current default of ``int8_linear`` (``choose_int8_config``; ``"mma"`` at these M), and at
  M <= 4 the matrix-vector kind (``"vec"``, gemv.py), and per shape the M = 1 default (the
  bar: the target is being as fast at M = 16 as at M = 1);
* candidates of the ``"small"`` kind: ``block_n x block_k x num_warps`` (the TILES list) x a
  split-K giving about 2, 4, 8 or 16 programs per SM, ``num_stages = 1`` (register prefetch); then
  ``num_stages`` 2 and 3 (Triton's shared-memory pipeliner) for the best three of each M.

Every configuration is first checked against the fp32 reference (``int8_linear_reference``,
relative L2 error < 1e-2, run twice so the split-K arrival counters must have been re-armed);
a failing or crashing configuration is kept as a row with its error text, never dropped.

Timing (medians, microseconds a call), weights rotated over copies totalling >= 200 MB (and at
least 8 copies) so every call reads the weight from HBM, not from the 50-60 MB L2:

* ``graph_us`` (the ranking number, like the engine): R = max(20, copies) back-to-back calls
  captured in one CUDA graph, replayed (3 warm, 15 timed, CUDA events), divided by R
  (``scripts/cuda_timing.py``);
* ``eager_us``: CUDA events around single calls (10 warm-up, 60 timed, synchronised each), so
  it includes the host launch path.

Candidates are compiled before timing by a pool of spawned processes (Triton's on-disk cache
is shared; about 70 distinct binaries), then about 400 rows are timed at ~20 ms each: an
estimated 1-3 minutes on one H200 (not yet run there). ``--budget-s`` (default 210) stops
timing further candidates, kept as skipped rows, if it runs long.

Output in ``--out``: ``int8_small.json`` (everything) and ``int8_small.md`` (GPU, versions,
date; best configuration per (shape, M) with us, speed-up vs cuBLAS and GB/s; the best five of
each (shape, M); failures; a suggested ``LLMSERVE_INT8_SMALL_CONFIG``).

Usage (GPU): ``python3 scripts/bench_int8_small.py --out $OUT``.
``--dry-run``: a tiny shape in Triton's interpreter on CPU (fp32 activations), a few
candidates, no meaningful timings: checks that the script runs end to end.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before Triton is imported: kernels are defined for the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: cuda_timing
from cuda_timing import graph_time_us  # noqa: E402

from llmserve.triton_kernels.gemv import choose_gemv_config  # noqa: E402
from llmserve.triton_kernels.int8_linear import (  # noqa: E402
    SMALL_ENV,
    Int8LinearConfig,
    choose_int8_config,
    int8_linear,
    int8_linear_reference,
    small_config,
)

SHAPES = [("gate/up", 1536, 8960), ("down", 8960, 1536), ("qkv", 1536, 2048)]  # (name, K, N)
M_FULL = (16, 4)        # the whole grid
M_TOP = (8, 2)          # the best TOP of the M_FULL runs (union) only
TOP = 4
# (block_n, block_k, num_warps): weight tile of 2-16 KB, 1-8 KB of it per warp
TILES = [(16, 128, 1), (16, 256, 1), (16, 256, 2), (16, 512, 2), (16, 512, 4),
         (32, 128, 1), (32, 128, 2), (32, 256, 2), (32, 256, 4),
         (64, 128, 2), (64, 128, 4), (64, 256, 4)]
PROGRAMS_PER_SM = (2, 4, 8, 16)  # split-K targets (deduplicated per shape)
STAGES2 = (2, 3)                # tried for the best three of each M_FULL run
ROTATE = 200e6                  # bytes of weight copies (> 3x the L2)
MIN_COPIES = 8
TOL = 1e-2                      # relative L2 error vs the fp32 reference (bf16 activations)
T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------------------------
# configurations
# ---------------------------------------------------------------------------------------------

def _split_for(n: int, k: int, bn: int, bk: int, pps: int, sms: int) -> int:
    """Split-K giving about ``pps`` programs per SM (at most 32 splits, each at least one
    BLOCK_K step), after rounding each split to whole BLOCK_K steps."""
    split = max(1, min(triton.cdiv(pps * sms, triton.cdiv(n, bn)), k // bk, 32))
    steps = triton.cdiv(triton.cdiv(k, split), bk)
    return triton.cdiv(k, steps * bk)


def grid(m: int, n: int, k: int, sms: int, device) -> list[Int8LinearConfig]:
    """The ``num_stages = 1`` candidate grid of one shape (deduplicated)."""
    out, seen = [], set()
    for bn, bk, warps in TILES:
        if bk > triton.next_power_of_2(k):
            continue
        for pps in PROGRAMS_PER_SM:
            split = _split_for(n, k, bn, bk, pps, sms)
            cfg = small_config(m, n, k, device, bn, bk, split, warps, 1)
            if cfg not in seen:
                seen.add(cfg)
                out.append(cfg)
    return out


def cfg_dict(c: Int8LinearConfig) -> dict:
    return {f: getattr(c, f) for f in Int8LinearConfig.__slots__}


def env_entry(c: Int8LinearConfig) -> str:
    """The ``LLMSERVE_INT8_SMALL_CONFIG`` fields of a small configuration."""
    return f"{c.block_n},{c.block_k},{c.split_k},{c.num_warps},{c.num_stages}"


def label(c: Int8LinearConfig) -> str:
    if c.kind == "small":
        return f"small bn{c.block_n} bk{c.block_k} split{c.split_k} w{c.num_warps} s{c.num_stages}"
    if c.kind == "vec":
        return f"vec bn{c.block_n} bk{c.block_k} w{c.num_warps} s{c.num_stages}"
    if c.kind == "mma":
        return (f"mma {c.block_m}x{c.block_n}x{c.block_k} split{c.split_k} w{c.num_warps} "
                f"s{c.num_stages}{' swap' if c.swap_ab else ''}{' fused' if c.fused_reduce else ''}")
    return c.kind


def vec_config(m: int, n: int, k: int, device) -> Int8LinearConfig:
    g = choose_gemv_config(m, n, k, torch.int8, device)
    return Int8LinearConfig(1, g.block_n, g.block_k, num_warps=g.num_warps, num_stages=g.stages,
                            kind="vec", programs_per_sm=g.programs_per_sm)


# ---------------------------------------------------------------------------------------------
# inputs and timing
# ---------------------------------------------------------------------------------------------

class Shape:
    """Rotated int8 and bf16 weight copies of one (K, N) and the activations of each M."""

    def __init__(self, name: str, k: int, n: int, device, dtype, rotate: float, min_copies: int):
        self.name, self.k, self.n, self.device, self.dtype = name, k, n, device, dtype
        g = torch.Generator(device=device).manual_seed(k * 7 + n)
        self.cq = max(min_copies, math.ceil(rotate / (n * k)))
        self.cb = max(min_copies, math.ceil(rotate / (2 * n * k)))
        self.wq = torch.randint(-127, 128, (self.cq, n, k), dtype=torch.int8, generator=g, device=device)
        self.sc = torch.rand(self.cq, n, generator=g, device=device) * 1e-3 + 1e-4
        self.wb = (torch.randn(self.cb, n, k, generator=g, device=device) * 0.02).to(dtype)
        self.x = {}

    def xs(self, m: int) -> torch.Tensor:
        if m not in self.x:
            g = torch.Generator(device=self.device).manual_seed(m)
            self.x[m] = torch.randn(m, self.k, generator=g, device=self.device).to(self.dtype)
        return self.x[m]

    def int8_fns(self, m: int, cfg):
        x = self.xs(m)
        return [lambda i=i: int8_linear(x, self.wq[i], self.sc[i], config=cfg) for i in range(self.cq)]

    def cublas_fns(self, m: int):
        x = self.xs(m)
        return [lambda i=i: F.linear(x, self.wb[i]) for i in range(self.cb)]

    def bytes_int8(self, m: int) -> int:
        return self.n * self.k + 2 * m * self.k + 2 * m * self.n + 4 * self.n


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check(sh: Shape, m: int, cfg) -> float:
    """Relative L2 error against the fp32 reference, the worse of two calls (the second finds
    the split-K arrival counters re-armed or fails). Before each call a NaN-filled block of the
    output's size is freed, so the allocator most likely hands it to the output: a missed store
    shows up as a non-finite output (error inf)."""
    x = sh.xs(m)
    ref = int8_linear_reference(x.float(), sh.wq[0], sh.sc[0])
    errs = []
    for _ in range(2):
        poison = torch.full((m, sh.n), float("nan"), dtype=x.dtype, device=x.device)
        del poison
        y = int8_linear(x, sh.wq[0], sh.sc[0], config=cfg)
        errs.append(rel_err(y, ref) if bool(torch.isfinite(y).all()) else float("inf"))
    return max(errs)


def eager_us(fns, warm: int = 10, iters: int = 60) -> float:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():  # dry run
        t = time.perf_counter()
        for f in fns[:2]:
            f()
        return (time.perf_counter() - t) / min(2, len(fns)) * 1e6
    for i in range(warm):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    ts = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fns[i % len(fns)]()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def graph_us(fns) -> float:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return eager_us(fns)
    return graph_time_us(fns, reps=max(20, len(fns)), replays=15, warm_replays=3)


def measure(sh: Shape, m: int, cfg, ref_us: float | None) -> dict:
    """One row: parity first, then both timings; ``error`` instead of times when it fails."""
    row = dict(shape=sh.name, K=sh.k, N=sh.n, M=m, config=cfg_dict(cfg), label=label(cfg),
               env=env_entry(cfg) if cfg.kind == "small" else None,
               rel_err=None, graph_us=None, eager_us=None, speedup=None, gbps=None, error=None)
    try:
        row["rel_err"] = e = check(sh, m, cfg)
        if not e < TOL:
            row["error"] = f"relative error {e:.3e} >= {TOL} against the fp32 reference"
            return row
        fns = sh.int8_fns(m, cfg)
        row["graph_us"] = us = graph_us(fns)
        row["eager_us"] = eager_us(fns)
        row["gbps"] = sh.bytes_int8(m) / us / 1e3
        if ref_us:
            row["speedup"] = ref_us / us
    except Exception as ex:  # noqa: BLE001 - e.g. out of resources: kept with its text
        row["error"] = f"{type(ex).__name__}: {ex}"[:400]
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            try:
                torch.cuda.synchronize()
            except Exception as ex2:  # noqa: BLE001 - a sticky CUDA error: later rows fail too
                row["error"] += f" | then {type(ex2).__name__}: {ex2}"[:200]
    return row


# ---------------------------------------------------------------------------------------------
# pre-compilation (spawned workers share Triton's on-disk cache)
# ---------------------------------------------------------------------------------------------

def _compile_worker(args):
    """Launch each of ``jobs`` (``(K, N, M, cfg)``) once on small inputs of the same shape and
    dtype, so its binary lands in the cache; errors are left for the main run to record."""
    jobs, dtype_name = args
    dev = torch.device("cuda")
    dtype = getattr(torch, dtype_name)
    for k, n, m, cfg in jobs:
        try:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
            s = torch.rand(n, device=dev) + 0.5
            int8_linear(x, w, s, config=cfg)
        except Exception:  # noqa: BLE001, S110 - the main run records the error
            pass
    torch.cuda.synchronize()
    return len(jobs)


def precompile(jobs: list, workers: int, dtype) -> None:
    if workers <= 0 or not jobs or os.environ.get("TRITON_INTERPRET") == "1":
        return
    t = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile_worker, [(c, str(dtype).split(".")[-1]) for c in chunks if c])
    log(f"pre-compiled {len(jobs)} launches in {time.time() - t:.1f} s on {workers} processes")


# ---------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------

def _ok(rows):
    return sorted((r for r in rows if r["graph_us"] is not None), key=lambda r: r["graph_us"])


def run_m(sh: Shape, out: dict, m: int, cands: list, phase: str, device, budget_s: float) -> list:
    """Time ``cands`` at ``m`` rows (baselines first, once per M); returns that M's good rows,
    fastest first. Candidates already measured at ``m`` are not repeated."""
    pm = out["per_m"].setdefault(m, dict(M=m, rows=[]))
    if "cublas_graph_us" not in pm:
        fb = sh.cublas_fns(m)
        pm["cublas_graph_us"] = ref = graph_us(fb)
        pm["cublas_eager_us"] = eager_us(fb)
        pm["default"] = measure(sh, m, choose_int8_config(m, sh.n, sh.k, device), ref)
        if m <= 4:
            pm["vec"] = measure(sh, m, vec_config(m, sh.n, sh.k, device), ref)
        d = pm["default"]
        log(f"{sh.name} M={m}: cuBLAS bf16 {ref:.2f} us (eager {pm['cublas_eager_us']:.2f}); "
            f"default {d['label']}: {d['graph_us']} us {d['error'] or ''}")
    done = {json.dumps(r["config"], sort_keys=True) for r in pm["rows"]}
    for c in cands:
        if json.dumps(cfg_dict(c), sort_keys=True) in done:
            continue
        if time.time() - T0 > budget_s:
            r = dict(shape=sh.name, K=sh.k, N=sh.n, M=m, config=cfg_dict(c), label=label(c),
                     env=env_entry(c), rel_err=None, graph_us=None, eager_us=None, speedup=None,
                     gbps=None, error="skipped: time budget")
        else:
            r = measure(sh, m, c, pm["cublas_graph_us"])
        r["phase"] = phase
        pm["rows"].append(r)
    best = _ok(pm["rows"])
    if best:
        b = best[0]
        log(f"{sh.name} M={m} [{phase}] best {b['label']}: {b['graph_us']:.2f} us "
            f"({b['speedup']:.2f}x cuBLAS, {b['gbps']:.0f} GB/s); "
            f"{sum(r['error'] is not None for r in pm['rows'])} failed of {len(pm['rows'])}")
    return best


def all_m_best(out: dict) -> dict | None:
    """Of the configurations measured at every M, the one with the best worst-case speed-up."""
    ms = sorted(out["per_m"])
    by_cfg: dict[str, dict] = {}
    for m in ms:
        for r in out["per_m"][m]["rows"]:
            if r["speedup"] is not None:
                by_cfg.setdefault(r["env"], {})[m] = r["speedup"]
    full = {e: v for e, v in by_cfg.items() if len(v) == len(ms)}
    if not full:
        return None
    e = max(full, key=lambda e: min(full[e].values()))
    return dict(env=e, min_speedup=min(full[e].values()), speedup_by_m=full[e])


def with_stages(c: Int8LinearConfig, stages: int) -> Int8LinearConfig:
    return Int8LinearConfig(**{**cfg_dict(c), "num_stages": stages})


def sweep(a, device, dtype, sms: int, res: list, save) -> None:
    """Append one result per shape to ``res``, calling ``save()`` after each (a crash late in
    the run keeps the shapes before it)."""
    shapes, m_full, m_top = SHAPES, M_FULL, M_TOP
    if a.dry_run:
        shapes, m_full, m_top = [("tiny", 96, 80)], (3,), (2,)
    grids = {(k, n): grid(16, n, k, sms, device) for _, k, n in shapes}
    if a.dry_run:
        grids = {key: g[:3] for key, g in grids.items()}
    # every binary a run may need (the grid, its num_stages variants, the baselines), compiled
    # in parallel before anything is timed
    jobs, keys = [], set()
    for (k, n), g in grids.items():
        for c in g:
            for st in (1,) + STAGES2:
                key = (c.block_n, c.block_k, c.num_warps, st, c.split_k > 1, k % c.block_k == 0)
                if key not in keys:         # N, K only matter through these (and % 16 == 0)
                    keys.add(key)
                    jobs.append((k, n, 16, with_stages(c, st)))
    jobs += [(k, n, m, choose_int8_config(m, n, k, device)) for _, k, n in shapes for m in (1,) + m_full + m_top]
    precompile(jobs, a.workers, dtype)
    for name, k, n in shapes:
        if time.time() - T0 > a.budget_s:
            log(f"time budget spent: {name} skipped")
            res.append(dict(shape=name, K=k, N=n, skipped="time budget"))
            save()
            continue
        sh = Shape(name, k, n, device, dtype, a.rotate, a.min_copies)
        out = dict(shape=name, K=k, N=n, int8_copies=sh.cq, bf16_copies=sh.cb, per_m={})
        out["m1_default"] = m1 = measure(sh, 1, choose_int8_config(1, n, k, device), None)
        log(f"{name} K={k} N={n}: M=1 default {m1['label']}: {m1['graph_us']} us {m1['error'] or ''}")
        ranked = {m: run_m(sh, out, m, grids[(k, n)], "grid", device, a.budget_s) for m in m_full}
        stage_cands = []    # pipeliner variants of the best three at each fully swept M
        for m in m_full:
            for r in ranked[m][:3]:
                for st in STAGES2:
                    c = with_stages(Int8LinearConfig(**r["config"]), st)
                    if c not in stage_cands:
                        stage_cands.append(c)
        ranked = {m: run_m(sh, out, m, stage_cands, "stages", device, a.budget_s) for m in m_full}
        top = []
        for m in m_full:
            for r in ranked[m][:TOP]:
                c = Int8LinearConfig(**r["config"])
                if c not in top:
                    top.append(c)
        for m in m_top:
            run_m(sh, out, m, top, "top", device, a.budget_s)
        out["all_m_best"] = all_m_best(out)
        res.append(out)
        save()
        del sh
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _f(v, d: int = 2) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def markdown(res: dict) -> str:
    e = res["env"]
    out = ["# INT8 weight-only linear, kind \"small\" (2 <= M <= 16) vs cuBLAS bf16", "",
           f"- GPU: {e['gpu']} ({e['sms']} SMs), torch {e['torch']}, triton {e['triton']}, {e['date']}",
           f"- command: `{e['command']}`; wall time {e.get('wall_s', 0):.0f} s",
           ("- us: median per call of R back-to-back calls in one CUDA graph (R = max(20, copies)), "
            "weights rotated over >= 200 MB; eager: CUDA events around single synchronised calls. "
            "Speed-up = cuBLAS bf16 graph us / int8 graph us (target >= 1.5). GB/s: int8 weight + "
            "activation + output bytes / us."), "",
           "## Best per (shape, M)", "",
           ("| shape | K | N | M | cuBLAS bf16 us | best small us | speed-up | GB/s | eager us | best config "
            "(env fields) | default us (config) | vec us | M=1 default us |"),
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in res["shapes"]:
        if "per_m" not in s:
            out.append(f"| {s['shape']} | {s['K']} | {s['N']} | - | skipped: {s.get('skipped')} |")
            continue
        for m in sorted(s["per_m"]):
            pm = s["per_m"][m]
            best = _ok(pm["rows"])
            b = best[0] if best else {}
            d = pm["default"]
            v = pm.get("vec") or {}
            out.append(f"| {s['shape']} | {s['K']} | {s['N']} | {m} | {_f(pm['cublas_graph_us'])} | "
                       f"{_f(b.get('graph_us'))} | {_f(b.get('speedup'))}x | {_f(b.get('gbps'), 0)} | "
                       f"{_f(b.get('eager_us'))} | {b.get('env', '-')} | {_f(d['graph_us'])} "
                       f"({d['label']}{'; ' + d['error'] if d['error'] else ''}) | {_f(v.get('graph_us'))} | "
                       f"{_f(s['m1_default']['graph_us'])} |")
    out += ["", "## Suggested LLMSERVE_INT8_SMALL_CONFIG", "",
            "Per shape, the configuration measured at every M with the best worst-case speed-up:", ""]
    entries = []
    for s in res["shapes"]:
        ab = s.get("all_m_best")
        if ab:
            entries.append(f"{s['K']}x{s['N']}:{ab['env']}")
            out.append(f"- {s['shape']} ({s['K']}x{s['N']}): `{ab['env']}`, speed-ups "
                       + ", ".join(f"M={m}: {v:.2f}x" for m, v in sorted(ab["speedup_by_m"].items())))
    if entries:
        out += ["", f"`{SMALL_ENV}=\"{';'.join(entries)}\"`"]
    out += ["", "## Best five per (shape, M)", ""]
    for s in res["shapes"]:
        for m in sorted(s.get("per_m", {})):
            rows = _ok(s["per_m"][m]["rows"])[:5]
            out.append(f"- {s['shape']} M={m}: " + "; ".join(
                f"{r['env']} {r['graph_us']:.2f} us ({r['speedup']:.2f}x, eager {r['eager_us']:.1f})"
                for r in rows))
    fails = [r for s in res["shapes"] for pm in s.get("per_m", {}).values()
             for r in pm["rows"] + [pm["default"]] + ([pm["vec"]] if pm.get("vec") else [])
             if r["error"]]
    out += ["", f"## Failed or skipped configurations ({len(fails)})", ""]
    for r in fails:
        out.append(f"- {r['shape']} M={r['M']} {r['label']}: {r['error']}")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("artifacts/int8_small"))
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes that pre-compile the candidates (0: compile while timing)")
    p.add_argument("--budget-s", type=float, default=210.0,
                   help="stop timing new candidates after this many seconds (kept as skipped rows)")
    p.add_argument("--rotate", type=float, default=ROTATE, help="bytes of weight copies to rotate over")
    p.add_argument("--min-copies", type=int, default=MIN_COPIES)
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shape in the Triton interpreter on CPU: checks the script, times nothing")
    a = p.parse_args()
    if os.environ.get(SMALL_ENV):
        log(f"note: {SMALL_ENV}={os.environ[SMALL_ENV]!r} changes the 'default' rows")
    if a.dry_run:
        device, dtype, sms = torch.device("cpu"), torch.float32, 4
        a.rotate, a.min_copies, a.workers = 0, 2, 0
        gpu = "cpu (Triton interpreter, dry run)"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        gpu = torch.cuda.get_device_name(0)
    a.out.mkdir(parents=True, exist_ok=True)
    env = dict(gpu=gpu, sms=sms, torch=torch.__version__, triton=triton.__version__,
               date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               command="python3 scripts/bench_int8_small.py " + " ".join(sys.argv[1:]),
               tiles=TILES, programs_per_sm=PROGRAMS_PER_SM, stages2=STAGES2, tol=TOL)
    res = dict(env=env, shapes=[])

    def save() -> str:
        env["wall_s"] = time.time() - T0
        (a.out / "int8_small.json").write_text(json.dumps(res, indent=1))
        md = markdown(res)
        (a.out / "int8_small.md").write_text(md)
        return md

    sweep(a, device, dtype, sms, res["shapes"], save)
    print(save())
    return 0


if __name__ == "__main__":
    sys.exit(main())
