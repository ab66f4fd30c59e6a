#!/usr/bin/env python
"""INT8 weight-only linear at M = 1..16 with the weights as ready-made MMA fragments
(``triton_kernels/int8_frag.py``) against bf16 cuBLAS and the shipped ``int8_linear``.

Question (issue #6, results/kernels/NOTES.md sessions 10 and 14): Triton's own tensor-core
path streams about 1.5 TB/s of int8 at M = 2..16 (1.1-1.3x cuBLAS bf16); the target is 1.5x.
Does a kernel whose 16-byte loads are the MMA operands (inline-PTX ``mma.sync``, no shared
memory) stream int8 at the matrix-vector kernel's rate for every M up to 16?

Every configuration is checked against an fp64 reference (relative error < 1e-2, the bf16
output's rounding is ~2e-3) before it is timed; failures are kept as rows. Timing: CUDA
graphs of back-to-back calls rotating over > 200 MB of weights (``scripts/cuda_timing.py``).
Writes ``frag.json`` and ``frag.md`` to ``--out``.

Usage: python3 scripts/bench_int8_frag.py --out DIR [--ms 1 2 4 8 16] [--shapes 1.5b 7b 0.5b]
       [--quick] [--read-only] [--defaults ROUNDS] [--l2] [--pdl]

``--l2``: sweep configurations with ``l2_prefetch`` (the program's weights requested into L2
first); ``--pdl``: time the sweep with programmatic dependent launch (each call's weight
requests overlap the previous call's tail). ``--defaults`` times the default configuration
alone, with the L2 prefetch, with PDL, and with both.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_planes import cublas_us, int8_us, reference, rel_err, run_header, shape_weights  # noqa: E402
from cuda_timing import graph_time_us  # noqa: E402

from llmserve.triton_kernels.int8_frag import (  # noqa: E402
    FragConfig,
    choose_frag_config,
    int8_frag_linear,
    pack_int8_fragments,
)
from llmserve.triton_kernels.int8_linear import choose_int8_config, int8_linear  # noqa: E402

SHAPES = {"1.5b": [("gate/up", 1536, 8960), ("down", 8960, 1536), ("qkv", 1536, 2048)],
          "7b": [("7B gate/up", 3584, 18944), ("7B down", 18944, 3584), ("7B qkv", 3584, 4608)],
          "0.5b": [("0.5B gate/up", 896, 4864), ("0.5B down", 4864, 896), ("0.5B qkv", 896, 1152)]}


def configs(quick: bool, l2: bool = False, pdl: bool = False, splits: tuple[int, ...] = (1, 6),
            fold: bool = False, tma: bool = False) -> list[FragConfig]:
    if tma:  # TMA weight copies in Triton's pipeline, and as controls the PDL table's kinds of winners
        return ([FragConfig(w, u, s, 1, pf, st, False, fo, True)
                 for w, u, s, st, fo, pf in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), splits, (1, 2, 3, 4, 6),
                                                              (False, True), (False, True))
                 if w * u <= 32 and st * w * u <= 96]
                + [FragConfig(2, 8, s, prefetch=True, fold=True) for s in splits]
                + [FragConfig(4, 4, s, prefetch=True) for s in splits] + [FragConfig(2, 8, s) for s in splits])
    if fold:  # the fold sweep: one accumulator a tile (more blocks and unroll fit) and, as controls, without
        return [FragConfig(w, u, s, b, st == 0, max(1, st), bool(l2p), fo)
                for w, u, s, b, st, l2p, fo in itertools.product((2, 4, 8), (1, 2, 4, 8), splits, (1, 2, 4), (0, 1, 4),
                                                                 (0, 1), (False, True))
                if w * u <= 32 and u * b <= 16 and (fo or (b == 1 and u >= 2))]
    if pdl and not l2 and not quick:  # the PDL sweep: register prefetch or not, cp.async, L2 prefetch or not
        return [FragConfig(w, u, s, b, st == 0, max(1, st), bool(l2p)) for w, u, s, b, st, l2p in
                itertools.product((2, 4, 8), (2, 4, 8), splits, (1, 2, 4), (0, 1, 4), (0, 1))
                if u * b <= 8 and w * u <= 32 and (st <= 1 or b * w * u <= 32)]
    if quick:
        return [FragConfig(4, 4, 1, l2_prefetch=l2), FragConfig(4, 2, 2, 2, True, l2_prefetch=l2),
                FragConfig(2, 4, 2, 1, False, 3, l2_prefetch=l2)]
    if l2:  # weights come from L2: no cp.async pipeline, fewer splits
        return [FragConfig(w, u, s, 1, pf, 1, True) for w, u, s, pf in
                itertools.product((2, 4, 8), (2, 4, 8), (1, 3, 6), (False, True)) if w * u <= 32]
    return [FragConfig(w, u, s, b, st == 0, max(1, st)) for w, u, s, b, st in
            itertools.product((2, 4, 8), (2, 4, 8), (1, 2, 4, 6), (1, 2), (0, 1, 3, 4, 5))
            if u * b <= 8 and w * u <= 32 and (st <= 1 or b * w * u <= 32)]


def cfg_list(c: FragConfig) -> list[int]:
    """A configuration as the JSON rows store it: warps, unroll, split, blocks, prefetch,
    stages, l2_prefetch, fold, tma."""
    return [c.num_warps, c.unroll, c.split_k, c.blocks, int(c.prefetch), c.stages, int(c.l2_prefetch), int(c.fold),
            int(c.tma)]


def cfg_from_list(v: list[int]) -> FragConfig:
    """Inverse of :func:`cfg_list`. Rows of older runs have 7 or 8 entries (no fold, no tma);
    run31/run32 rows have a 10th, ``persistent``, of a reverted kernel: refused unless 0.

    Raises:
        ValueError: fewer than 7 entries, or a nonzero 10th."""
    if len(v) < 7 or (len(v) > 9 and v[9]):
        raise ValueError(f"not a configuration row of this script: {v!r}")
    return FragConfig(*v[:4], bool(v[4]), v[5], bool(v[6]), *(bool(f) for f in v[7:9]))


def kernel_resources() -> list[dict]:
    """Registers and spilled bytes a thread of every compiled ``_int8_frag_kernel`` variant
    (Triton's ``CompiledKernel.n_regs`` / ``n_spills``), keyed by its constexprs; empty where
    this Triton keeps its caches elsewhere."""
    from llmserve.triton_kernels.int8_frag import _int8_frag_kernel
    out = []
    try:
        names = _int8_frag_kernel.arg_names
        for caches in _int8_frag_kernel.device_caches.values():
            for k in caches[0].values():
                const = {names[key[0]]: v for key, v in k.src.constants.items()
                         if isinstance(key, tuple) and names[key[0]].isupper() and not names[key[0]].startswith(("ASM", "CONS"))}
                # n_regs / n_spills exist once the binary was loaded (launched in this process)
                out.append(dict(const, n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None)))
    except Exception as ex:  # noqa: BLE001 - a diagnostic
        out.append(dict(error=f"{type(ex).__name__}: {ex}"[:200]))
    return out


def frag_us(x: torch.Tensor, fr: torch.Tensor, s: torch.Tensor, config: FragConfig, pdl: bool,
            read_only: bool = False) -> float:
    """Microseconds a call of ``int8_frag_linear`` with ``config``: a CUDA graph of back-to-back
    calls rotating over the weight copies ``fr`` / ``s`` (every call reads HBM)."""
    copies = fr.shape[0]
    return graph_time_us([lambda i=i: int8_frag_linear(x, fr[i], s[i], config=config, pdl=pdl, _read_only=read_only)
                          for i in range(copies)], max(copies, 24), replays=12)


def median(v: list[float]) -> float:
    """The middle element (upper median) of ``v``, as every table of this script reports."""
    return sorted(v)[len(v) // 2]


def cases(shapes, ms: list[int], dev: torch.device):
    """For each shape and M: ``(label, K, N, M, q, s, wb, frags, x, fp64 reference)``, the
    weights (enough copies to rotate over > 200 MB; ``frags.shape[0]`` of them) made once a
    shape."""
    for lab, k, n in shapes:
        copies, q, s, wb = shape_weights(k, n, dev)
        fr = torch.stack([pack_int8_fragments(q[i]) for i in range(copies)])
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            yield lab, k, n, m, q, s, wb, fr, x, reference(x, q[0], s[0])


def _precompile(args):
    """Worker: call every (shape, tiles, config) once so the timed pass finds the binaries."""
    wid, nw, shapes, ms, cfgs, pdl = args
    i = 0
    for _, k, n in shapes:
        f = pack_int8_fragments(torch.randint(-127, 128, (n, k), dtype=torch.int8)).cuda()
        s = torch.rand(n, device="cuda")
        for m in sorted({8 if m <= 8 else 16 for m in ms}):  # M is not specialized
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for c in cfgs:
                i += 1
                if i % nw == wid:
                    try:
                        int8_frag_linear(x, f, s, config=c, pdl=pdl)
                    except Exception:  # noqa: BLE001 - the timed pass reports it
                        pass
    torch.cuda.synchronize()
    return wid


def defaults(out: Path, shapes, ms: list[int], rounds: int) -> None:
    """The default configuration (:func:`choose_frag_config`) against bf16 cuBLAS and the
    shipped ``int8_linear`` (row-major int8, its own defaults), and the default with the L2
    prefetch (``l2``), with PDL (``pdl``), with both (``l2_pdl``), and the configuration chosen
    for PDL calls (``pdl_table``: ``choose_frag_config(..., pdl=True)``) with PDL, all alternated
    ``rounds`` times in one process; medians. Writes ``defaults.json`` / ``defaults.md``."""
    dev = torch.device("cuda")
    rows = []
    for lab, k, n, m, q, s, wb, fr, x, ref in cases(shapes, ms, dev):
        c = choose_frag_config(m, n, k, dev)
        cl2 = dataclasses.replace(c, l2_prefetch=True)
        cp = choose_frag_config(m, n, k, dev, pdl=True)
        variants = {"frag": (c, False), "l2": (cl2, False), "pdl": (c, True), "l2_pdl": (cl2, True),
                    "pdl_table": (cp, True)}
        row = dict(shape=lab, K=k, N=n, M=m, frag_config=cfg_list(c), pdl_config=cfg_list(cp), cublas=[], shipped=[],
                   **{key: [] for key in variants})
        for key, (cv, pv) in variants.items():
            row[f"{key}_err"] = rel_err(int8_frag_linear(x, fr[0], s[0], config=cv, pdl=pv), ref)
        cfg = choose_int8_config(m, n, k, dev)
        row["shipped_config"] = f"{cfg.kind} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} split {cfg.split_k}"
        row["shipped_err"] = rel_err(int8_linear(x, q[0], s[0]), ref)
        for _ in range(rounds):
            row["cublas"].append(cublas_us(x, wb))
            row["shipped"].append(int8_us(x, q, s, ref)[1])
            for key, (cv, pv) in variants.items():
                row[key].append(frag_us(x, fr, s, cv, pv))
        for key in ("cublas", "shipped", *variants):
            row[f"{key}_us"] = median(row[key])
        rows.append(row)
        print(f"{lab} M={m}: cuBLAS {row['cublas_us']:.2f}, shipped {row['shipped_us']:.2f} "
              f"({row['shipped_config']}), frag {row['frag_us']:.2f} {row['frag_config']} "
              f"({row['cublas_us'] / row['frag_us']:.2f}x), +l2 {row['l2_us']:.2f}, +pdl {row['pdl_us']:.2f}, "
              f"+l2+pdl {row['l2_pdl_us']:.2f} ({row['cublas_us'] / row['l2_pdl_us']:.2f}x), "
              f"PDL table {row['pdl_table_us']:.2f} ({row['cublas_us'] / row['pdl_table_us']:.2f}x), "
              f"errors {max(row[f'{v}_err'] for v in variants):.1e}", flush=True)
        (out / "defaults.json").write_text(json.dumps(dict(**run_header(), rows=rows), indent=1))
    lines = ["| shape | M | cuBLAS bf16 us | shipped int8 us | speed-up | fragments us | speed-up | fragments int8 GB/s "
             "| + L2 prefetch us | speed-up | + PDL us | speed-up | + both us | speed-up | PDL table us | speed-up "
             "| config (warps, unroll, split, blocks, prefetch, stages, l2, fold, tma) | PDL table config |", "|---" * 18 + "|"]
    for r in rows:
        c = r["cublas_us"]
        lines.append(f"| {r['shape']} | {r['M']} | {c:.2f} | {r['shipped_us']:.2f} | {c / r['shipped_us']:.2f}x | "
                     f"{r['frag_us']:.2f} | {c / r['frag_us']:.2f}x | {r['N'] * r['K'] / r['frag_us'] / 1e3:.0f} | "
                     + " | ".join(f"{r[f'{v}_us']:.2f} | {c / r[f'{v}_us']:.2f}x" for v in ("l2", "pdl", "l2_pdl", "pdl_table"))
                     + f" | {tuple(r['frag_config'])} | {tuple(r['pdl_config'])} |")
    (out / "defaults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _speed(cublas: float, us: float | None, sep: str = " ") -> str:
    """``"us<sep>speed-upx"``, or ``"wrong result"`` for an untimed configuration."""
    return f"{us:.2f}{sep}{cublas / us:.2f}x" if us is not None else f"wrong result{sep}-"


def compare(out: Path, shapes, ms: list[int], rounds: int, cands: list[str]) -> None:
    """Candidate configurations (``SHAPE:TILES:w,u,s,b,pf,st,l2,fold[,tma]``) against the default
    for PDL calls (:func:`choose_frag_config` with ``pdl=True``) and bf16 cuBLAS, every call launched with PDL, alternated
    ``rounds`` times in one process; medians. A configuration whose result is off (relative
    error > 1e-2) is kept untimed. Writes ``compare.json`` / ``compare.md``."""
    dev = torch.device("cuda")
    by = {}
    for c in cands:
        lab, tiles, cfg = c.split(":")
        by.setdefault((lab, int(tiles)), []).append(cfg_from_list([int(v) for v in cfg.split(",")]))
    rows = []
    for lab, k, n, m, q, s, wb, fr, x, ref in cases(shapes, ms, dev):
        cfgs = [choose_frag_config(m, n, k, dev, pdl=True)] + by.get((lab, 1 if m <= 8 else 2), [])
        row = dict(shape=lab, K=k, N=n, M=m, configs=[cfg_list(c) for c in cfgs], cublas=[],
                   err=[rel_err(int8_frag_linear(x, fr[0], s[0], config=c, pdl=True), ref) for c in cfgs],
                   us=[[] for _ in cfgs])
        wrong = [e > 1e-2 for e in row["err"]]  # not timed: kept with its error, us = None
        for _ in range(rounds):
            row["cublas"].append(cublas_us(x, wb))
            for j, c in enumerate(cfgs):
                if wrong[j]:
                    continue
                row["us"][j].append(frag_us(x, fr, s, c, True))
        row["cublas_us"] = median(row["cublas"])
        row["median_us"] = [median(v) if v else None for v in row["us"]]
        rows.append(row)
        print(f"{lab} M={m}: cuBLAS {row['cublas_us']:.2f}; "
              + "; ".join(f"{tuple(c)} {_speed(row['cublas_us'], u)}"
                          for c, u in zip(row["configs"], row["median_us"])), flush=True)
        (out / "compare.json").write_text(json.dumps(dict(**run_header(), rows=rows), indent=1))
    lines = ["| shape | M | cuBLAS bf16 us | default (PDL) us | speed-up | candidates (PDL): config us speed-up |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cublas_us"]
        lines.append(f"| {r['shape']} | {r['M']} | {c:.2f} | {_speed(c, r['median_us'][0], ' | ')} | "
                     + "; ".join(f"{tuple(cf)} {_speed(c, u)}" for cf, u in zip(r["configs"][1:], r["median_us"][1:]))
                     + " |")
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=["1.5b"], choices=sorted(SHAPES))
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--read-only", action="store_true",
                    help="also time the 3 best configurations' loads alone (no conversion, no MMA)")
    ap.add_argument("--l2", action="store_true", help="sweep configurations with the L2 prefetch")
    ap.add_argument("--splits", type=int, nargs="+", default=None,
                    help="split-K values of the --pdl sweep (default 1 6, split-K only where K >= 4096; "
                         "given: every value on every shape)")
    ap.add_argument("--pdl", action="store_true",
                    help="time the sweep with programmatic dependent launch (196 configurations with and without "
                         "the L2 prefetch; split-K only where K >= 4096)")
    ap.add_argument("--fold", action="store_true",
                    help="sweep FragConfig.fold (one accumulator a tile) over warps, unroll 1-8, blocks 1-4, the "
                         "prefetch modes and the L2 prefetch, with unfolded one-block configurations as controls; "
                         "writes kernels.json (registers and spills of every compiled variant)")
    ap.add_argument("--tma", action="store_true",
                    help="sweep FragConfig.tma (weights by TMA into shared memory, 1-6 pipeline stages; x in the "
                         "pipeline or, with prefetch, a step ahead in registers) with a few register-prefetch "
                         "configurations as controls")
    ap.add_argument("--defaults", type=int, default=0, metavar="ROUNDS",
                    help="instead of the sweep: the default configuration vs cuBLAS and int8_linear, "
                         "ROUNDS alternated rounds")
    ap.add_argument("--compare", type=int, default=0, metavar="ROUNDS",
                    help="instead of the sweep: the default and --cand configurations, all with PDL, vs cuBLAS, "
                         "ROUNDS alternated rounds")
    ap.add_argument("--cand", nargs="+", default=[], metavar="SHAPE:TILES:w,u,s,b,pf,st,l2,fold[,tma]")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    shapes = [s for name in args.shapes for s in SHAPES[name]]
    if args.defaults:
        defaults(args.out, shapes, args.ms, args.defaults)
        return 0
    if args.compare:
        compare(args.out, shapes, args.ms, args.compare, args.cand)
        return 0
    cfgs = configs(args.quick, args.l2, args.pdl, tuple(args.splits or (1, 6)), args.fold, args.tma)
    t0 = time.time()
    if args.workers > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(args.workers) as pool:
            pool.map(_precompile, [(w, args.workers, shapes, args.ms, cfgs, args.pdl) for w in range(args.workers)])
        print(f"[{time.time() - t0:6.1f}s] precompiled {len(cfgs)} configurations", flush=True)
    rows = []
    for lab, k, n, m, q, s, wb, fr, x, ref in cases(shapes, args.ms, dev):
        row = dict(shape=lab, K=k, N=n, M=m, cublas_bf16_us=cublas_us(x, wb))
        cfg = choose_int8_config(m, n, k, dev)
        row["shipped_config"] = f"{cfg.kind} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} split {cfg.split_k}"
        row["shipped_err"], row["shipped_us"] = int8_us(x, q, s, ref)
        res = []
        for c in cfgs:
            if (n // 16) % c.blocks or ((args.pdl or args.fold or args.tma) and not args.splits and c.split_k > 1 and k < 4096):
                continue
            if args.fold and c.split_k > 1 and n // 16 // c.blocks >= 264:  # >= 2 programs an SM unsplit
                continue
            r = dict(cfg=cfg_list(c), us=None, err=None, error=None, pdl=args.pdl)
            try:
                r["err"] = rel_err(int8_frag_linear(x, fr[0], s[0], config=c, pdl=args.pdl), ref)
                if r["err"] > 1e-2:
                    r["error"] = f"relative error {r['err']:.2e}"
                else:
                    r["us"] = frag_us(x, fr, s, c, args.pdl)
            except Exception as ex:  # noqa: BLE001 - kept as a row
                r["error"] = f"{type(ex).__name__}: {ex}"[:300]
            res.append(r)
        row["frag"] = res
        if args.read_only:  # the same loads without conversion and MMAs, for the 3 best
            for r in sorted([r for r in res if r["us"] is not None], key=lambda r: r["us"])[:3]:
                c = cfg_from_list(r["cfg"])
                r["read_only_us"] = frag_us(x, fr, s, c, args.pdl, read_only=True)
        ok = [r for r in res if r["us"] is not None]
        bad = [r for r in res if r["error"]]
        if ok:
            row["frag_best"] = min(ok, key=lambda r: r["us"])
        rows.append(row)
        b = row.get("frag_best")
        print(f"[{time.time() - t0:6.1f}s] {lab} M={m}: cuBLAS {row['cublas_bf16_us']:.2f}, shipped "
              f"{row['shipped_us']:.2f} ({row['shipped_config']}), frag "
              + (f"{b['us']:.2f} {b['cfg']} ({row['cublas_bf16_us'] / b['us']:.2f}x)" if b else "none")
              + (f", loads alone {b['read_only_us']:.2f}" if b and "read_only_us" in b else "")
              + (f"; {len(bad)} failed, first: {bad[0]['cfg']} {bad[0]['error']}" if bad else ""), flush=True)
        (args.out / "frag.json").write_text(json.dumps(dict(**run_header(), rows=rows), indent=1))
    if args.fold or args.tma:
        (args.out / "kernels.json").write_text(json.dumps(kernel_resources(), indent=0))
    lines = ["| shape | M | cuBLAS bf16 us | shipped int8 us | speed-up | frag us (warps, unroll, split, blocks, prefetch, stages, l2, fold, tma) | speed-up "
             "| frag int8 GB/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, a, b = r["cublas_bf16_us"], r["shipped_us"], r.get("frag_best")
        lines.append(f"| {r['shape']} | {r['M']} | {c:.2f} | {a:.2f} | {c / a:.2f}x | "
                     + (f"{b['us']:.2f} {tuple(b['cfg'])} | {c / b['us']:.2f}x | {r['N'] * r['K'] / b['us'] / 1e3:.0f} |"
                        if b else "- | - | - |"))
    (args.out / "frag.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
