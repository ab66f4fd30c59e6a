"""``llmserve bench-kernels``: parity checks and timings of llmserve's Triton kernels.

Order: environment, measured copy bandwidth, parity (paged attention decode / prefill / mixed
against the PyTorch reference in fp32, INT8 linear against an fp32 dequantized matmul), then
timings:

* decode paged attention (Triton split-K with the engine's default decode options,
  ``FastPathConfig``, vs the PyTorch reference) at Qwen2.5-1.5B's head layout (12 query
  heads, 2 KV heads, head_dim 128, bf16, block_size 16), reported as achieved GB/s of the
  bytes that must move (K/V of every context position once, q and out), the floor (those
  bytes over the copy bandwidth) and the ratio to it, against the H200 reference bandwidth
  (4.24 TB/s) and the copy bandwidth measured in this run;
* prefill/chunk attention (Triton varlen vs the PyTorch reference and SDPA on contiguous
  tensors as a FlashAttention-class peer), in TFLOP/s;
* INT8 weight-only linear vs cuBLAS bf16 (``torch.nn.functional.linear``) at Qwen2.5-1.5B's
  MLP and QKV shapes for M = 1 .. 2048, with config sweeps of both kernels;
* the batch-invariant linear (:func:`~llmserve.kernels.invariant.invariant_linear`, the
  ``--batch-invariant`` mode's projections) vs cuBLAS bf16 at every Qwen2.5-1.5B projection
  shape and the LM head for M = 1 .. 2048, with a sweep of fixed tile configurations (one
  configuration serves every M of a weight, so each candidate is scored over all swept M).

Timing: CUDA graphs of R back-to-back calls rotating over C input sets whose total size is
> 2x the L2 (so every call reads from HBM), timed with CUDA events per replay after warm-up;
the median over replays divided by R is reported. Eager (no graph) medians are reported beside
the main points: they include Python launch overhead.

Writes ``kernels.json`` and ``kernels.md`` to ``results/kernels/<gpu>/`` (``--output``
overrides) and prints the Markdown last. ``--device cpu --quick`` is a smoke run of tiny shapes
in the Triton interpreter (start Python with ``TRITON_INTERPRET=1``): it checks parity and
exercises every code path; its timings are of no value, and the report says so.

Exit status: 0 when every parity check passed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import math
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from ..attention.metadata import AttentionMetadata
from ..attention.torch_backend import paged_attention_torch
from ..config import DECODE_SPLIT_POLICIES, FastPathConfig
from ..kernels._launch import interpreting
from ..kernels.invariant import invariant_linear, invariant_linear_config, invariant_paged_attention
from ..kernels.int8_linear import (
    Int8LinearConfig,
    _fit_split,
    choose_int8_config,
    int8_linear,
    int8_linear_reference,
    quantize_int8_per_channel,
)
from ..kernels.paged_attention import (
    _decode_config,
    choose_num_splits,
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_triton,
)
from ..kernels.paged_attention import (
    _num_sms as _attention_num_sms,
)

REF_BW = 4.24e12        # B/s, copy bandwidth of an H200 (torch copy of a 1 GiB bf16 buffer)
REF_FLOPS = 780e12      # FLOP/s, bf16 matmul on an H200 (8192^3 torch.matmul)
ROTATE_BYTES = 200e6    # input bytes rotated over: > 2x the 50-60 MB L2 of an H100/H200
QUICK_ROTATE_BYTES = 1e4
SECTIONS = ("decode", "int8", "prefill", "invariant")

# Process-wide state of one run: the device, the pre-compile worker this process is (None in
# the main process), the launch counter that shares launches out between workers, the rotation
# size and the start time of the log.
DEVICE = torch.device("cpu")
WARM: tuple[int, int] | None = None
_UNIT = 0
_ROTATE = ROTATE_BYTES
T0 = time.time()


def gpu_slug(name: str) -> str:
    """Directory name of a GPU: ``name`` lowercased, every run of characters other than
    letters and digits replaced by ``-``, a leading ``nvidia-`` dropped.

    >>> gpu_slug("NVIDIA H200")
    'h200'
    >>> gpu_slug("NVIDIA H100 80GB HBM3")
    'h100-80gb-hbm3'
    """
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if s.startswith("nvidia-"):
        s = s[len("nvidia-"):]
    return s or "unknown"


def log(*a) -> None:
    if WARM is None:
        print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def mine(key=None) -> bool:
    """Whether this process runs the next launch. Pre-compile workers (``WARM``) each take the
    launches whose compile ``key`` (the constexprs and specialisations that select a binary)
    hashes to them, so every binary is compiled once, in parallel, into Triton's on-disk cache;
    the main process (``WARM is None``) runs everything and finds every kernel compiled."""
    global _UNIT
    _UNIT += 1
    if WARM is None:
        return True
    h = zlib.crc32(repr(key).encode()) if key is not None else _UNIT
    return h % WARM[1] == WARM[0]


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def graph_time_us(fns, reps: int, replays: int = 15, warm_replays: int = 3) -> float:
    """Median microseconds per call of ``fns[i % len(fns)]()`` captured ``reps`` times in one
    CUDA graph (CUDA only).

    Many back-to-back calls are timed inside one graph, so launch overhead and clock ramp-up do
    not dominate short kernels. Every fn runs once on a side stream first (compiles, allocator
    warm-up), outside the capture; then the graph is replayed ``warm_replays`` times untimed
    and ``replays`` times timed with CUDA events. Rotate ``fns`` over input copies larger than
    the L2 so each call reads HBM. Also used by ``scripts/bench_gemv.py``.
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


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def time_graph(fns, reps: int, replays: int = 15) -> float:
    """Median microseconds per call (:func:`graph_time_us`); on CPU one wall-clock pass of
    ``reps`` calls; NaN in pre-compile workers (one call, untimed)."""
    if WARM is not None:
        fns[0]()
        _sync()
        return float("nan")
    if DEVICE.type != "cuda":
        t = time.perf_counter()
        for i in range(reps):
            fns[i % len(fns)]()
        return (time.perf_counter() - t) / reps * 1e6
    return graph_time_us(fns, reps, replays)


def time_eager(fns, iters: int = 50) -> float:
    """Median microseconds of single eager calls (rotating inputs), CUDA events."""
    if WARM is not None:
        return float("nan")
    for f in fns[:2]:
        f()
    if DEVICE.type != "cuda":
        return time_graph(fns, min(iters, 2))
    torch.cuda.synchronize()
    ts = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fns[i % len(fns)]()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def do_bench_us(fn) -> float:
    """Median microseconds of ``fn`` by ``triton.testing.do_bench`` (CUDA; eager)."""
    if WARM is not None:
        return float("nan")
    if DEVICE.type != "cuda":
        return time_graph([fn], 1)
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in B/s (bytes read + written); NaN on CPU."""
    if DEVICE.type != "cuda":
        return float("nan")
    n = 1 << 29  # 512 Mi bf16 elements, 1 GiB
    a = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    b = torch.empty_like(a)
    t = time.time()
    while time.time() - t < 0.3:  # let the clocks ramp up first (a cold GPU reads too low)
        b.copy_(a)
    torch.cuda.synchronize()
    us = time_graph([lambda a=a, b=b: b.copy_(a)], 5, 20)
    del a, b
    return 2 * n * 2 / (us * 1e-6)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``||out - ref|| / ||ref||`` in fp32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

def paged_inputs(seqs, bs, hq, hkv, d, dtype, copies=1, seed=0):
    """``copies`` disjoint input sets over one block pool. seqs: [(context, q_len)].
    Returns (k_cache, v_cache, [(query, meta)] * copies)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = [(c + bs - 1) // bs for c, _ in seqs]
    per_set = sum(nblk)
    pool = per_set * copies
    shape = (pool + 1, bs, hkv, d)
    k_cache = torch.empty(shape, dtype=dtype, device=DEVICE).normal_()
    v_cache = torch.empty(shape, dtype=dtype, device=DEVICE).normal_()
    q_lens = [ql for _, ql in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=DEVICE)
    sets = []
    for c in range(copies):
        ids = (torch.randperm(per_set, generator=g) + c * per_set).to(torch.int32)
        bt = torch.zeros(len(seqs), max(nblk), dtype=torch.int32)
        i = 0
        for s, nb in enumerate(nblk):
            bt[s, :nb] = ids[i:i + nb]
            i += nb
        bt = bt.to(DEVICE)
        q = torch.empty((sum(q_lens), hq, d), dtype=dtype, device=DEVICE).normal_()
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=DEVICE),  # unused
            query_start_loc=qsl, context_lens=ctx, block_tables=bt, max_query_len=max(q_lens),
            max_context_len=max(c for c, _ in seqs), block_size=bs,
            is_decode_only=all(x == 1 for x in q_lens))
        sets.append((q, meta))
    return k_cache, v_cache, sets


def attn_bytes(seqs, hq, hkv, d, elt) -> int:
    """Bytes that must move: K and V of every visible context position once, q and out."""
    kv = sum(c for c, _ in seqs) * hkv * d * 2 * elt
    qo = sum(q for _, q in seqs) * hq * d * 2 * elt
    return kv + qo


def attn_flops(seqs, hq, d) -> float:
    """QK^T and PV FLOPs of causal attention (2 * 2 * D per visible (query, key) pair)."""
    pairs = 0
    for c, ql in seqs:
        # query j (0-based in chunk) sees c - ql + j + 1 keys
        pairs += ql * (c - ql) + ql * (ql + 1) // 2
    return 4.0 * d * hq * pairs


# ---------------------------------------------------------------------------------------------
# parity
# ---------------------------------------------------------------------------------------------

def parity(cfg) -> list[dict]:
    rows = []
    dtype = cfg.dtype
    hq, hkv, d, bs = cfg.hq, cfg.hkv, cfg.d, 16
    cases = {
        "decode": [(c, 1) for c in cfg.parity_decode_ctx],
        "prefill+chunk": cfg.parity_prefill,
        "mixed": cfg.parity_mixed,
    }
    for name, seqs in cases.items():
        kc, vc, sets = paged_inputs(seqs, bs, hq, hkv, d, dtype)
        q, meta = sets[0]
        variants = [("default", lambda q=q, kc=kc, vc=vc, meta=meta: paged_attention_triton(
            q, kc, vc, meta, d ** -0.5, **cfg.decode_options))]
        if name == "decode":
            variants += [(f"splits={ns} fused_reduce={fu}",
                          lambda ns=ns, fu=fu, q=q, kc=kc, vc=vc, meta=meta: paged_attention_decode(
                              q, kc, vc, meta, d ** -0.5, num_splits=ns, fused_reduce=fu, **cfg.decode_options))
                         for ns in (1, 5) for fu in (False, True) if not (ns == 1 and fu)]
        if name == "mixed":
            variants.append(("prefill kernel only", lambda q=q, kc=kc, vc=vc, meta=meta: paged_attention_prefill(
                q, kc, vc, meta, d ** -0.5)))
        ref = None
        for vname, fn in variants:
            if not mine(("attn", name, vname)):
                continue
            if WARM is not None:
                fn()
                continue
            if ref is None:
                ref = paged_attention_torch(q.float(), kc.float(), vc.float(), meta, d ** -0.5)
                e_torch = rel_err(paged_attention_torch(q, kc, vc, meta, d ** -0.5), ref)
            errs = []
            for _ in range(2):  # twice: fused reductions must leave their counters re-armed
                out = fn()
                errs.append(rel_err(out, ref) if bool(torch.isfinite(out).all()) else float("inf"))
            e = max(errs)
            ok = e < 2e-2
            rows.append(dict(kernel="paged_attention", case=f"{name} [{vname}]", rel_err=e,
                             torch_ref_rel_err=e_torch, ok=ok))
            log(f"parity attention {name} [{vname}]: rel err {e:.2e} (torch bf16 path {e_torch:.2e}) "
                f"{'OK' if ok else 'FAIL'}")
        del kc, vc, sets
    rows += _invariant_parity(cfg)
    for (k, n) in cfg.int8_shapes:
        w_q, scale = quantize_int8_per_channel(torch.randn(n, k, device=DEVICE) * 0.02)
        for m in cfg.parity_int8_m:
            x = torch.randn(m, k, device=DEVICE).to(dtype)
            c0 = choose_int8_config(m, n, k, DEVICE)
            variants = [("default", c0)]
            if c0.split_k > 1 and c0.kind != "dequant":
                variants.append(("fused_reduce toggled",
                                 Int8LinearConfig(**{**_cfg_dict(c0), "fused_reduce": not c0.fused_reduce})))
            if m <= 16:
                if m <= 4:
                    variants.append(("vec", Int8LinearConfig(1, 2, 256, num_warps=4, num_stages=1, kind="vec")))
                variants.append(("mma plain BM=16 split", Int8LinearConfig(16, 64, 128, split_k=3, fused_reduce=True)))
            else:
                variants.append(("dequant+cuBLAS", Int8LinearConfig(1, 1, 1, kind="dequant")))
                variants.append(("mma swap 128x128x64", Int8LinearConfig(128, 128, 64, swap_ab=True, num_warps=8,
                                                                        num_stages=4)))
            for vname, cc in variants:
                if not mine(_i8key(m, cc)):
                    continue
                if WARM is not None:
                    int8_linear(x, w_q, scale, config=cc)
                    continue
                ref = int8_linear_reference(x.float(), w_q, scale)
                errs = []
                for _ in range(2):
                    y = int8_linear(x, w_q, scale, config=cc)
                    errs.append(rel_err(y, ref) if bool(torch.isfinite(y).all()) else float("inf"))
                e = max(errs)
                ok = e < 1e-2
                rows.append(dict(kernel="int8_linear", case=f"M={m} K={k} N={n} [{vname}]", rel_err=e, ok=ok))
                log(f"parity int8 M={m} K={k} N={n} [{vname}]: rel err {e:.2e} {'OK' if ok else 'FAIL'}")
    return rows


def _i8key(m: int, c: Int8LinearConfig):
    d = _cfg_dict(c)
    d.pop("split_k")
    return ("i8", m, c.split_k > 1, tuple(d.values()))


def _cfg_dict(c: Int8LinearConfig) -> dict:
    return {f: getattr(c, f) for f in Int8LinearConfig.__slots__}


# ---------------------------------------------------------------------------------------------
# attention timings
# ---------------------------------------------------------------------------------------------

def _sms() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count if DEVICE.type == "cuda" else 4


def bench_decode(cfg, bw_meas) -> tuple[list[dict], list[dict]]:
    rows, sweep = [], []
    t_sec = time.time()
    hq, hkv, d, bs, dtype = cfg.hq, cfg.hkv, cfg.d, 16, cfg.dtype
    elt = torch.finfo(dtype).bits // 8
    scale = d ** -0.5
    for (b, ctx) in cfg.decode_points:
        seqs = [(ctx, 1)] * b
        nbytes = attn_bytes(seqs, hq, hkv, d, elt)
        copies = max(1, math.ceil(_ROTATE / nbytes))
        kc, vc, sets = paged_inputs(seqs, bs, hq, hkv, d, dtype, copies=copies)
        reps = max(copies, cfg.min_reps)
        opts = cfg.decode_options
        fns = [lambda q=q, m=m, kc=kc, vc=vc: paged_attention_decode(q, kc, vc, m, scale, **opts)
               for q, m in sets]
        splits = decode_splits_used(b, hkv, ctx, d, elt, opts)
        if mine(("dec-default", b, ctx, splits > 1)):
            us = time_graph(fns, reps)
            row = dict(batch=b, context=ctx, impl="triton", num_splits=splits,
                       split_policy=opts["split_policy"], us=us, **_bw_fields(nbytes, us, bw_meas))
            if (b, ctx) == cfg.decode_main:
                row["eager_us"] = time_eager(fns)
            rows.append(row)
            log(f"decode B={b} ctx={ctx}: triton {us:.1f} us, {row['gbps']:.0f} GB/s "
                f"({100 * row['frac_ref_bw']:.0f}% of 4.24 TB/s), splits={splits}")
        if (b, ctx) in cfg.decode_torch_points and WARM is None:
            tfns = [lambda q=q, m=m, kc=kc, vc=vc: paged_attention_torch(q, kc, vc, m, scale) for q, m in sets[:2]]
            tus = time_eager(tfns, iters=10)
            rows.append(dict(batch=b, context=ctx, impl="torch_reference", us=tus,
                             **_bw_fields(nbytes, tus, bw_meas)))
            log(f"decode B={b} ctx={ctx}: torch reference {tus:.1f} us ({nbytes / tus / 1e3:.0f} GB/s)")
        if (b, ctx) == cfg.decode_main and cfg.sweep:
            for bn, warps, stages in cfg.decode_sweep_cfgs:
                for ns in cfg.decode_sweep_splits:
                    for fused in (False, True):
                        if (ns == 1 and fused) or not mine(("dec", bn, warps, stages, ns > 1, fused)) \
                                or time.time() - t_sec > cfg.sweep_seconds['decode']:
                            continue
                        f2 = [lambda q=q, m=m, kc=kc, vc=vc, ns=ns, bn=bn, warps=warps, stages=stages,
                              fused=fused: paged_attention_decode(
                            q, kc, vc, m, scale, num_splits=ns, block_n=bn, num_warps=warps,
                            num_stages=stages, fused_reduce=fused, **opts) for q, m in sets]
                        rec = dict(block_n=bn, num_warps=warps, num_stages=stages, num_splits=ns,
                                   fused_reduce=fused)
                        try:
                            us2 = time_graph(f2, reps)
                        except Exception as e:  # noqa: BLE001 - a config that fails to compile
                            sweep.append(dict(rec, error=str(e)[:200]))
                            continue
                        sweep.append(dict(rec, us=us2, **_bw_fields(nbytes, us2, bw_meas)))
            best = min((s for s in sweep if "us" in s), key=lambda s: s["us"], default=None)
            log(f"decode sweep best: {best}")
        del kc, vc, sets, fns
    return rows, sweep


def bench_prefill(cfg) -> tuple[list[dict], list[dict]]:
    rows, sweep = [], []
    t_sec = time.time()
    hq, hkv, d, bs, dtype = cfg.hq, cfg.hkv, cfg.d, 16, cfg.dtype
    scale = d ** -0.5
    for pi, (name, seqs) in enumerate(cfg.prefill_points):
        flops = attn_flops(seqs, hq, d)
        kc, vc, sets = paged_inputs(seqs, bs, hq, hkv, d, dtype, copies=2)
        fns = [lambda q=q, m=m, kc=kc, vc=vc: paged_attention_triton(q, kc, vc, m, scale, **cfg.decode_options)
               for q, m in sets]
        if mine(("prefill-default", name)):
            us = time_graph(fns, cfg.prefill_reps, 10)
            rows.append(dict(case=name, impl="triton", us=us, tflops=flops / us / 1e6,
                             frac_ref_flops=flops / (us * 1e-6) / REF_FLOPS))
            log(f"prefill {name}: triton {us:.1f} us, {flops / us / 1e6:.0f} TFLOP/s")
        if cfg.sweep and pi == 0:
            for bm, bn, warps, stages in cfg.prefill_sweep_cfgs:
                if not mine(("pf", bm, bn, warps, stages)) or time.time() - t_sec > cfg.sweep_seconds['prefill']:
                    continue
                f2 = [lambda q=q, m=m, kc=kc, vc=vc, bm=bm, bn=bn, warps=warps, stages=stages:
                      paged_attention_prefill(q, kc, vc, m, scale, block_m=bm, block_n=bn,
                                                               num_warps=warps, num_stages=stages)
                      for q, m in sets]
                rec = dict(case=name, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                try:
                    u = time_graph(f2, cfg.prefill_reps, 10)
                except Exception as e:  # noqa: BLE001
                    sweep.append(dict(rec, error=str(e)[:200]))
                    continue
                sweep.append(dict(rec, us=u, tflops=flops / u / 1e6))
                log(f"  prefill sweep {rec}: {u:.1f} us")
        if cfg.prefill_torch and WARM is None:
            tfns = [lambda q=q, m=m, kc=kc, vc=vc: paged_attention_torch(q, kc, vc, m, scale) for q, m in sets]
            tus = time_eager(tfns, iters=4)
            rows.append(dict(case=name, impl="torch_reference", us=tus, tflops=flops / tus / 1e6))
            log(f"prefill {name}: torch reference {tus:.1f} us")
        # SDPA peer on contiguous tensors (fresh prefill of equal-length sequences only)
        if WARM is None and all(c == ql for c, ql in seqs) and len({c for c, _ in seqs}) == 1:
            b, t = len(seqs), seqs[0][0]
            qd = torch.randn(b, hq, t, d, device=DEVICE, dtype=dtype)
            kd = torch.randn(b, hkv, t, d, device=DEVICE, dtype=dtype)
            vd = torch.randn(b, hkv, t, d, device=DEVICE, dtype=dtype)
            try:
                sus = do_bench_us(lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, enable_gqa=True))
                rows.append(dict(case=name, impl="torch_sdpa_contiguous", us=sus, tflops=flops / sus / 1e6))
                log(f"prefill {name}: SDPA (contiguous, GQA) {sus:.1f} us")
            except Exception as e:  # noqa: BLE001 - older torch without enable_gqa
                log(f"SDPA peer failed: {e}")
        del kc, vc, sets
    return rows, sweep


def _invariant_parity(cfg) -> list[dict]:
    """Parity of the batch-invariant kernels: the linear against an fp32 matmul, with every row
    of an ``M``-row product bitwise equal to the same row computed alone (the property the
    mode rests on); the attention against the fp32 reference on decode, prefill and mixed
    steps, with the decode rows bitwise equal to the same rows in a step of their own."""
    rows = []
    dtype = cfg.dtype
    for name, (n, k) in cfg.invariant_shapes[:2]:
        w = torch.randn(n, k, device=DEVICE).mul_(0.02).to(dtype)
        for m in cfg.parity_int8_m:
            if not mine(("inv-parity", name, m)):
                continue
            x = torch.randn(m, k, device=DEVICE).to(dtype)
            y = invariant_linear(x, w)
            if WARM is not None:
                invariant_linear(x[-1:], w)
                continue
            e = rel_err(y, x.float() @ w.float().T)
            same = all(torch.equal(invariant_linear(x[i:i + 1], w)[0], y[i]) for i in {0, m // 2, m - 1})
            ok = e < 1e-2 and same
            rows.append(dict(kernel="invariant_linear", case=f"{name} M={m} K={k} N={n} [rows alone: "
                             f"{'same bits' if same else 'DIFFER'}]", rel_err=e, ok=ok))
            log(f"parity invariant linear {name} M={m}: rel err {e:.2e}, rows alone same bits: {same}")
    hq, hkv, d, bs = cfg.hq, cfg.hkv, cfg.d, 16
    decode = [(c, 1) for c in cfg.parity_decode_ctx]
    for case, seqs in (("decode", decode), ("prefill+chunk", cfg.parity_prefill),
                       ("mixed", cfg.parity_mixed)):
        if not mine(("inv-attn", case)):
            continue
        kc, vc, sets = paged_inputs(seqs, bs, hq, hkv, d, dtype)
        q, meta = sets[0]
        out = invariant_paged_attention(q, kc, vc, meta, d ** -0.5)
        if WARM is not None:
            continue
        e = rel_err(out, paged_attention_torch(q.float(), kc.float(), vc.float(), meta, d ** -0.5))
        # the first sequence's rows again, as a step of their own: the same bits
        q0 = int(meta.query_start_loc[1])
        meta0 = AttentionMetadata(meta.slot_mapping[:q0], meta.query_start_loc[:2], meta.context_lens[:1],
                                  meta.block_tables[:1], q0, int(meta.context_lens[0]), bs, q0 == 1)
        same = torch.equal(invariant_paged_attention(q[:q0], kc, vc, meta0, d ** -0.5), out[:q0])
        ok = e < 2e-2 and same
        note = f" [first sequence alone: {'same bits' if same else 'DIFFER'}]"
        rows.append(dict(kernel="invariant_attention", case=case + note, rel_err=e, ok=ok))
        log(f"parity invariant attention {case}: rel err {e:.2e}{note}")
        del kc, vc, sets
    return rows


# ---------------------------------------------------------------------------------------------
# batch-invariant linear timings
# ---------------------------------------------------------------------------------------------

def _inv_cfg_key(c: dict) -> str:
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}")


def bench_invariant(cfg) -> tuple[list[dict], list[dict]]:
    """The batch-invariant linear at its configuration (:func:`invariant_linear_config`) against
    cuBLAS bf16 for every shape and M of ``cfg``; with ``cfg.sweep``, every candidate tile
    configuration at ``cfg.invariant_sweep_m``, checked against an fp32 matmul and bit for bit
    against the configured product of the same rows (``bitwise``: what lets the configuration
    follow M; the rows are the first M of a fixed ``max(invariant_sweep_m)``-row input, whose
    configured product is the reference), not only timed."""
    rows, sweep = [], []
    t_sec = time.time()
    dtype = cfg.dtype
    for name, (n, k) in cfg.invariant_shapes:
        copies = max(1, math.ceil(_ROTATE / (2 * n * k)))
        w = torch.empty((copies, n, k), dtype=dtype, device=DEVICE).normal_(0, 0.02)
        for m in cfg.invariant_m:
            base = invariant_linear_config(n, k, DEVICE.type == "cpu", m)
            x = torch.empty((m, k), dtype=dtype, device=DEVICE).normal_()
            reps = max(copies, cfg.min_reps) if m <= 64 else max(copies, min(8, cfg.min_reps))
            i_fns = [lambda i=i, x=x, w=w: invariant_linear(x, w[i]) for i in range(copies)]
            b_fns = [lambda i=i, x=x, w=w: F.linear(x, w[i]) for i in range(copies)]
            if mine(("inv", name, m)):
                us_i = time_graph(i_fns, reps)
                us_b = time_graph(b_fns, reps)
                rows.append(dict(weight=name, M=m, K=k, N=n, invariant_us=us_i, cublas_bf16_us=us_b,
                                 ratio=us_i / us_b, config=_inv_cfg_key(base)))
                log(f"invariant linear {name} M={m}: {us_i:.2f} us, cuBLAS bf16 {us_b:.2f} us "
                    f"(x{us_i / us_b:.2f}) cfg={_inv_cfg_key(base)}")
            if not (cfg.sweep and m in cfg.invariant_sweep_m):
                continue
            ref = None
            if WARM is None:     # the configured product of the largest swept M, its first m rows
                g = torch.Generator(device=DEVICE).manual_seed(n * 31 + k)
                x_all = torch.randn((max(cfg.invariant_sweep_m), k), generator=g, device=DEVICE).to(dtype)
                x = x_all[:m].contiguous()
                same_ref = invariant_linear(x_all, w[0])[:m]
                del x_all
            for bm, bn, bk, warps, stages in cfg.invariant_sweep_cfgs:
                cand = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                key = _inv_cfg_key(cand)
                if not mine(("inv-sweep", key)) or time.time() - t_sec > cfg.sweep_seconds["invariant"]:
                    continue
                kw = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                f2 = [lambda i=i, x=x, w=w, kw=kw: invariant_linear(x, w[i], **kw) for i in range(copies)]
                rec = dict(weight=name, M=m, K=k, N=n, config=key)
                try:
                    u = time_graph(f2, reps)
                    e = float("nan")
                    if WARM is None:
                        if ref is None:
                            ref = x.float() @ w[0].float().T
                        got = invariant_linear(x, w[0], **kw)
                        e = rel_err(got, ref)
                        rec["bitwise"] = bool(torch.equal(got, same_ref))
                except Exception as ex:  # noqa: BLE001 - a candidate that does not fit is a row
                    sweep.append(dict(rec, error=str(ex)[:300]))
                    continue
                sweep.append(dict(rec, us=u, rel_err=e, ok=not (e > 1e-2)))
        del w
    return rows, sweep


def invariant_sweep_scores(sweep: list[dict]) -> list[dict]:
    """Per weight, each swept configuration's geometric-mean time over the swept M, relative to
    the best time a complete candidate reached at each M (1.0: best everywhere); candidates that
    failed, were wrong or were not reached (the sweep's deadline) at any M are left out.
    Sorted by weight, then score."""
    ok = [s for s in sweep if "us" in s and s.get("ok", True)]
    out = []
    for name, group in itertools.groupby(sorted(ok, key=lambda s: s["weight"]), key=lambda s: s["weight"]):
        group = list(group)
        ms = sorted({s["M"] for s in sweep if s.get("weight") == name})
        times = {key: {s["M"]: s["us"] for s in group if s["config"] == key}
                 for key in sorted({s["config"] for s in group})}
        complete = {key: t for key, t in times.items() if set(t) == set(ms)}
        if not complete:
            continue
        best = {m: min(t[m] for t in complete.values()) for m in ms}
        for key, t in complete.items():
            score = math.exp(sum(math.log(t[m] / best[m]) for m in ms) / len(ms))
            out.append(dict(weight=name, config=key, score=score, us={str(m): t[m] for m in ms}))
    return sorted(out, key=lambda r: (r["weight"], r["score"]))


# ---------------------------------------------------------------------------------------------
# INT8 timings
# ---------------------------------------------------------------------------------------------

def int8_candidates(cfg, m: int, n: int, k: int, sms: int) -> list[Int8LinearConfig]:
    """Sweep candidates: the matrix-vector kind (M <= 4; ``scripts/bench_gemv.py`` sweeps it in
    depth), tensor-core swap-AB and plain tiles with split-K (fused reduction), and for large M
    plain/swap tiles and dequantize + cuBLAS."""
    out = []
    if m <= 64:
        if m <= 4:
            for bn, bk, warps in cfg.int8_gemv_cfgs:
                out.append(Int8LinearConfig(1, bn, bk, num_warps=warps, num_stages=1, kind="vec"))
        bm16 = max(16, triton.next_power_of_2(m))
        for swap, bn, bk, stages in cfg.int8_mma_small_cfgs:
            for mult in (1, 2):
                split = _fit_split(m, n, k, bm16, bn, bk, mult * sms)
                out.append(Int8LinearConfig(bm16, bn, bk, split_k=split, swap_ab=swap, num_warps=4,
                                            num_stages=stages, fused_reduce=True))
    else:
        for swap, bm, bn, bk, warps, stages in cfg.int8_large_cfgs:
            out.append(Int8LinearConfig(bm, bn, bk, swap_ab=swap, num_warps=warps, num_stages=stages))
        out.append(Int8LinearConfig(1, 1, 1, kind="dequant"))
    return out


def bench_int8(cfg, bw_meas) -> tuple[list[dict], list[dict]]:
    rows, sweep = [], []
    t_sec = time.time()
    dtype = cfg.dtype
    sms = _sms()
    for (k, n) in cfg.int8_shapes:
        copies_q = max(1, math.ceil(_ROTATE / (n * k)))
        copies_b = max(1, math.ceil(_ROTATE / (2 * n * k)))
        w_q = torch.randint(-127, 128, (copies_q, n, k), dtype=torch.int8, device=DEVICE)
        sc = torch.rand(copies_q, n, device=DEVICE) * 1e-3 + 1e-4
        w_b = torch.empty((copies_b, n, k), dtype=dtype, device=DEVICE).normal_(0, 0.02)
        for m in cfg.int8_m:
            x = torch.empty((m, k), dtype=dtype, device=DEVICE).normal_()
            c = choose_int8_config(m, n, k, DEVICE)
            reps = max(copies_q, cfg.min_reps) if m <= 64 else max(copies_q, min(8, cfg.min_reps))
            q_fns = [lambda i=i, x=x, w_q=w_q, sc=sc: int8_linear(x, w_q[i], sc[i]) for i in range(copies_q)]
            b_fns = [lambda i=i, x=x, w_b=w_b: F.linear(x, w_b[i]) for i in range(copies_b)]
            if mine(_i8key(m, c)):
                us_q = time_graph(q_fns, reps)
                us_b = time_graph(b_fns, max(copies_b, cfg.min_reps) if m <= 64
                                  else max(copies_b, min(8, cfg.min_reps)))
                bytes_q = n * k + 2 * m * k + 2 * m * n + 4 * n
                bytes_b = 2 * n * k + 2 * m * k + 2 * m * n
                flops = 2.0 * m * n * k
                floor_q = max(bytes_q / REF_BW, flops / REF_FLOPS) * 1e6
                floor_meas = max(bytes_q / bw_meas, flops / REF_FLOPS) * 1e6
                row = dict(M=m, K=k, N=n, int8_us=us_q, cublas_bf16_us=us_b, speedup=us_b / us_q,
                           int8_gbps=bytes_q / us_q / 1e3, int8_frac_ref_bw=bytes_q / (us_q * 1e-6) / REF_BW,
                           cublas_gbps=bytes_b / us_b / 1e3, int8_tflops=flops / us_q / 1e6,
                           cublas_tflops=flops / us_b / 1e6, int8_floor_us=floor_q,
                           int8_floor_meas_us=floor_meas, int8_x_floor=us_q / floor_meas,
                           int8_frac_meas_bw=bytes_q / (us_q * 1e-6) / bw_meas, config=_cfg_dict(c))
                if m in (1, 2048):
                    row["int8_eager_us"] = time_eager(q_fns)
                    row["cublas_eager_us"] = time_eager(b_fns)
                rows.append(row)
                log(f"int8 M={m} K={k} N={n}: int8 {us_q:.2f} us ({row['int8_gbps']:.0f} GB/s), "
                    f"cuBLAS bf16 {us_b:.2f} us -> speedup {us_b / us_q:.2f}x  cfg={row['config']}")
            else:
                us_b = float("nan")
            if cfg.sweep and m in cfg.int8_sweep_m and (k, n) in cfg.int8_sweep_shapes:
                if WARM is None and math.isnan(us_b):
                    us_b = time_graph(b_fns, max(copies_b, cfg.min_reps))
                cands = int8_candidates(cfg, m, n, k, sms)
                seen = set()
                ref0 = None
                for cc in cands:
                    if cc in seen:
                        continue
                    seen.add(cc)
                    if not mine(_i8key(m, cc)) or time.time() - t_sec > cfg.sweep_seconds['int8']:
                        continue
                    f2 = [lambda i=i, cc=cc, x=x, w_q=w_q, sc=sc: int8_linear(x, w_q[i], sc[i], config=cc)
                          for i in range(copies_q)]
                    try:
                        u = time_graph(f2, reps)
                        e = float("nan")
                        if WARM is None:  # every candidate is checked, not only timed
                            if ref0 is None:
                                ref0 = int8_linear_reference(x.float(), w_q[0], sc[0])
                            e = rel_err(int8_linear(x, w_q[0], sc[0], config=cc), ref0)
                    except Exception as ex:  # noqa: BLE001
                        sweep.append(dict(M=m, K=k, N=n, config=_cfg_dict(cc), error=str(ex)[:300]))
                        continue
                    sweep.append(dict(M=m, K=k, N=n, config=_cfg_dict(cc), us=u, speedup=us_b / u, rel_err=e,
                                      ok=not (e > 1e-2)))
                best = min((s for s in sweep if s.get("M") == m and s.get("K") == k and "us" in s
                            and s.get("ok", True)), key=lambda s: s["us"], default=None)
                log(f"  int8 sweep best M={m} K={k} N={n}: {best}")
        del w_q, w_b, sc
    return rows, sweep


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# bandwidth and split bookkeeping
# ---------------------------------------------------------------------------------------------

def _bw_fields(nbytes: int, us: float, bw_meas: float) -> dict:
    """Achieved GB/s of ``nbytes`` in ``us`` microseconds, the fractions of the reference
    (:data:`REF_BW`) and measured copy bandwidths, the floors (``nbytes`` over each bandwidth,
    us) and the ratio of the time to the measured-bandwidth floor (``x_floor``)."""
    floor_meas = nbytes / bw_meas * 1e6
    return dict(gbps=nbytes / us / 1e3, frac_ref_bw=nbytes / (us * 1e-6) / REF_BW,
                frac_meas_bw=nbytes / (us * 1e-6) / bw_meas, bytes=nbytes,
                floor_us=nbytes / REF_BW * 1e6, floor_meas_us=floor_meas, x_floor=us / floor_meas)


def decode_splits_used(batch: int, hkv: int, ctx: int, d: int, elt: int, opts: dict) -> int:
    """Split count :func:`paged_attention_decode` launches for ``batch`` sequences of context
    ``ctx`` with the decode options ``opts`` and no explicit ``num_splits`` (the launcher's own
    rule, restated for the report)."""
    on_cpu = DEVICE.type != "cuda"
    sms = _attention_num_sms(DEVICE)
    bn = _decode_config(d, on_cpu, batch * hkv, ctx, elt, wide_tile=opts["wide_tile"],
                        stages=opts["stages"])["BLOCK_N"]
    tiles = triton.cdiv(max(ctx, 1), bn)
    if opts["split_policy"] == "legacy":
        ns = min(tiles, max(1, triton.cdiv(4 * sms, max(1, batch * hkv))), 128)
    else:
        ns = choose_num_splits(batch, hkv, ctx, bn, sms, d)
    ns = max(1, min(ns, tiles, triton.cdiv(tiles, opts["min_tiles"])))
    return triton.cdiv(tiles, triton.cdiv(tiles, ns))


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _f(v: float, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(res: dict) -> str:
    """The Markdown report of a result dict (the content of ``kernels.json``)."""
    e = res["env"]
    out = ["# llmserve Triton kernel benchmark", ""]
    if e["quick"] or e["device"] == "cpu":
        out += [f"> Smoke run ({'Triton interpreter on CPU' if e['device'] == 'cpu' else 'tiny shapes'}, "
                "`--quick`): the parity rows are checks; the timings, bandwidths and ratios are of no "
                "value as performance numbers.", ""]
    out += [f"- device: {e['gpu']} ({e['sms']} SMs), torch {e['torch']}, triton {e['triton']}, "
            f"python {e['python']}, {e['date']}",
            f"- command: `{e['command']}`" + (f"; engine code hash `{e['code_hash']}`"
                                                 if e.get("code_hash") else ""),
            f"- copy bandwidth measured in this run: {_f(e['copy_bw_tbps'], '.2f')} TB/s (reference: "
            f"{REF_BW / 1e12:.2f} TB/s, an H200); timings are medians of CUDA-graph replays with inputs "
            f"rotated over >= {e['rotate_bytes'] / 1e6:.0f} MB; compile warm-up "
            f"{e.get('precompile_s', 0):.0f} s",
            f"- decode options (FastPathConfig): {e['decode_options']}", ""]
    out += ["## Parity (against the fp32 reference, relative L2 error)", "", "| kernel | case | rel err | ok |",
            "| --- | --- | --- | --- |"]
    for r in res["parity"]:
        out.append(f"| {r['kernel']} | {r['case']} | {r['rel_err']:.2e} | {'yes' if r['ok'] else 'NO'} |")
    c = res["shapes"]
    out += ["", f"## Decode paged attention ({c['hq']} q heads, {c['hkv']} KV heads, D={c['d']}, {c['dtype']}, "
            "block 16)", "",
            "| batch | context | impl | splits | us | GB/s | % of ref BW | floor us (measured BW) | x floor |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["decode"]:
        out.append(f"| {r['batch']} | {r['context']} | {r['impl']} | {r.get('num_splits', '')} | {r['us']:.1f} | "
                   f"{r['gbps']:.0f} | {100 * r['frac_ref_bw']:.1f} | {_f(r['floor_meas_us'], '.2f')} | "
                   f"{_f(r['x_floor'], '.2f')} |")
    ds = sorted((s for s in res.get("decode_sweep", []) if "us" in s), key=lambda s: s["us"])[:5]
    if ds:
        out += ["", "Decode sweep at the main point, best 5:", ""]
        for s in ds:
            out.append(f"- BLOCK_N={s['block_n']} warps={s['num_warps']} stages={s['num_stages']} "
                       f"splits={s['num_splits']} fused={s['fused_reduce']}: {s['us']:.1f} us "
                       f"({100 * s['frac_ref_bw']:.1f}% of ref BW)")
    if res.get("prefill"):
        out += ["", "## Prefill / chunk attention", "", "| case | impl | us | TFLOP/s |", "| --- | --- | --- | --- |"]
        for r in res["prefill"]:
            out.append(f"| {r['case']} | {r['impl']} | {r['us']:.1f} | {r['tflops']:.0f} |")
    if res.get("int8"):
        out += ["", "## INT8 weight-only linear vs cuBLAS bf16", "",
                "| M | K | N | int8 us | cuBLAS bf16 us | speedup | int8 GB/s | % of ref BW | x floor | config |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["int8"]:
            cc = r["config"]
            cs = (f"{cc.get('kind', 'mma')} {cc['block_m']}x{cc['block_n']}x{cc['block_k']} s{cc['split_k']}"
                  f"{' swap' if cc['swap_ab'] else ''}{' fused' if cc.get('fused_reduce') else ''}")
            out.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['int8_us']:.2f} | {r['cublas_bf16_us']:.2f} | "
                       f"{r['speedup']:.2f}x | {r['int8_gbps']:.0f} | {100 * r['int8_frac_ref_bw']:.1f} | "
                       f"{_f(r['int8_x_floor'], '.2f')} | {cs} |")
    isw = [s for s in res.get("int8_sweep", []) if "us" in s and s.get("ok", True)]
    bad = [s for s in res.get("int8_sweep", []) if "error" in s or not s.get("ok", True)]
    if bad:
        out += ["", f"INT8 sweep: {len(bad)} candidates failed or were wrong (see kernels.json)"]
    if isw:
        out += ["", "INT8 sweep, best per shape:", ""]
        for key in sorted({(s["M"], s["K"], s["N"]) for s in isw}):
            b = min((s for s in isw if (s["M"], s["K"], s["N"]) == key), key=lambda s: s["us"])
            out.append(f"- M={key[0]} K={key[1]} N={key[2]}: {b['us']:.2f} us ({b['speedup']:.2f}x) {b['config']}")
    if res.get("invariant"):
        out += ["", "## Batch-invariant linear vs cuBLAS bf16", "",
                "The tile configuration of `invariant_linear_config` for each weight and M: what the "
                "`--batch-invariant` mode's projections cost against the library GEMM.", "",
                "| weight | M | K | N | invariant us | cuBLAS bf16 us | ratio | config |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["invariant"]:
            out.append(f"| {r['weight']} | {r['M']} | {r['K']} | {r['N']} | {r['invariant_us']:.2f} | "
                       f"{r['cublas_bf16_us']:.2f} | x{r['ratio']:.2f} | {r['config']} |")
    checked = [s for s in res.get("invariant_sweep", []) if "bitwise" in s]
    if checked:
        differ = sorted({f"{s['weight']} {s['config']} at M={s['M']}" for s in checked if not s["bitwise"]})
        out += ["", f"Batch-invariant linear sweep, bit for bit against the configured product of the "
                f"same rows (taken from the largest swept M): {len(checked) - len(differ)} of "
                f"{len(checked)} (weight, configuration, M) equal"
                + (": every configuration gives the same bits." if not differ else
                   "; different: " + "; ".join(differ[:12]) + ("; ..." if len(differ) > 12 else ""))]
    scores = invariant_sweep_scores(res.get("invariant_sweep", []))
    if scores:
        out += ["", "Batch-invariant linear sweep, best 3 fixed configurations a weight (score: geometric "
                "mean over the swept M of time / the best time at that M):", ""]
        for name in sorted({r["weight"] for r in scores}):
            for r in [r for r in scores if r["weight"] == name][:3]:
                times = ", ".join(f"M={m} {u:.1f} us" for m, u in r["us"].items())
                out.append(f"- {name}: {r['config']} score {r['score']:.2f} ({times})")
    out += ["", "## Targets", ""]
    for k, v in res["targets"].items():
        out.append(f"- {k}: {v}")
    out += ["", "Floors: the bytes that must move over the copy bandwidth (INT8: or the FLOPs over "
            f"{REF_FLOPS / 1e12:.0f} TFLOP/s, whichever is longer); x floor = time / floor at the bandwidth "
            "measured in this run."]
    return "\n".join(out) + "\n"


def targets(res) -> dict:
    """Pass/miss of the kernel targets (full runs only; a quick run reports parity alone)."""
    t = {}
    if res["env"]["quick"]:
        t["parity"] = "all ok" if all(r["ok"] for r in res["parity"]) else "FAILURES"
        return t
    main = [r for r in res["decode"] if r["impl"] == "triton" and r["batch"] == 64 and r["context"] == 2048]
    if main:
        f = main[0]["frac_ref_bw"]
        t["decode B=64 ctx=2048 >= 60% of 4.24 TB/s"] = f"{100 * f:.1f}% -> {'met' if f >= 0.6 else 'MISSED'}"
    small = [r for r in res["int8"] if r["M"] <= 16]
    if small:
        worst = min(small, key=lambda r: r["speedup"])
        t["int8 M<=16 >= 1.5x cuBLAS bf16"] = (
            f"min {worst['speedup']:.2f}x (M={worst['M']} K={worst['K']} N={worst['N']}) -> "
            f"{'met' if worst['speedup'] >= 1.5 else 'MISSED'}")
    big = [r for r in res["int8"] if r["M"] >= 2048]
    if big:
        worst = max(big, key=lambda r: r["int8_us"] / r["cublas_bf16_us"])
        ratio = worst["int8_us"] / worst["cublas_bf16_us"]
        t["int8 M=2048 within 1.3x of cuBLAS bf16"] = (
            f"worst {ratio:.2f}x slower (K={worst['K']} N={worst['N']}) -> {'met' if ratio <= 1.3 else 'MISSED'}")
    t["parity"] = "all ok" if all(r["ok"] for r in res["parity"]) else "FAILURES"
    return t



class Cfg:
    """Shapes, sweep candidates and repetitions of one run: the full set (Qwen2.5-1.5B's
    attention head layout and linear shapes, bf16) or, ``quick``, tiny shapes (fp16 on CPU,
    where the interpreter's bf16 arithmetic is wrong) with 2 calls a timing."""

    def __init__(self, quick: bool, sweep: bool, deadline: float, decode_options: dict, cpu: bool):
        self.sweep = sweep
        self.decode_options = decode_options
        # seconds of each section after which no further sweep point is started
        self.sweep_seconds = dict(decode=0.25 * deadline, int8=0.45 * deadline, prefill=0.1 * deadline,
                                  invariant=0.2 * deadline)
        if quick:
            self.dtype = torch.float16 if cpu else torch.bfloat16
            self.min_reps, self.prefill_reps = 2, 1
            self.hq, self.hkv, self.d = 12, 2, 32
            self.parity_decode_ctx = [1, 16, 17]
            self.parity_prefill = [(20, 20), (40, 9)]
            self.parity_mixed = [(5, 1), (20, 4)]
            self.parity_int8_m = [1, 20]
            self.int8_shapes = [(64, 48)]
            self.decode_points = [(2, 40)]
            self.decode_main = (2, 40)
            self.decode_torch_points = [(2, 40)]
            self.decode_sweep_cfgs = [(16, 1, 1)]
            self.decode_sweep_splits = [2]
            self.prefill_points = [("fresh 1x32", [(32, 32)])]
            self.prefill_sweep_cfgs = [(16, 16, 1, 1)]
            self.prefill_torch = True
            self.int8_m = [1, 20]
            self.int8_sweep_m = [1]
            self.int8_sweep_shapes = [(64, 48)]
            self.int8_gemv_cfgs = [(2, 32, 1)]
            self.int8_mma_small_cfgs = [(True, 32, 32, 1)]
            self.int8_large_cfgs = []
            self.invariant_shapes = [("proj", (48, 64)), ("wide", (80, 40))]
            self.invariant_m = [1, 20]
            self.invariant_sweep_m = [1, 20]
            self.invariant_sweep_cfgs = [(16, 16, 16, 1, 1), (16, 32, 16, 1, 1)]
            return
        self.dtype = torch.bfloat16
        self.min_reps, self.prefill_reps = 20, 4
        self.hq, self.hkv, self.d = 12, 2, 128
        self.parity_decode_ctx = [1, 15, 16, 17, 255, 256, 257, 2048, 3001]
        self.parity_prefill = [(512, 512), (1000, 211), (300, 300), (17, 17)]
        self.parity_mixed = [(2048, 1), (600, 100), (33, 1), (1, 1), (129, 128)]
        self.parity_int8_m = [1, 4, 16, 2048]
        self.int8_shapes = [(1536, 8960), (8960, 1536), (1536, 2048)]
        self.decode_points = [(1, 2048), (16, 2048), (64, 512), (64, 2048), (64, 8192), (256, 2048)]
        self.decode_main = (64, 2048)
        self.decode_torch_points = [(16, 2048), (64, 2048)]
        self.decode_sweep_cfgs = [(64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 4, 2)]
        self.decode_sweep_splits = [2, 3, 4, 5]
        self.prefill_points = [("fresh 4x2048", [(2048, 2048)] * 4),
                               ("chunk 512 on 1536 prefix x4", [(2048, 512)] * 4),
                               ("mixed 1x512 chunk + 63 decodes ctx 1024", [(1024, 512)] + [(1024, 1)] * 63)]
        self.prefill_sweep_cfgs = [(128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 4, 2), (128, 32, 4, 3)]
        self.prefill_torch = True
        self.int8_m = [1, 2, 4, 8, 16, 32, 64, 256, 2048]
        self.int8_sweep_m = [1, 4, 16, 256, 2048]
        self.int8_sweep_shapes = [(1536, 8960), (8960, 1536), (1536, 2048)]
        self.int8_gemv_cfgs = [(2, 256, 2), (2, 512, 4), (1, 1024, 4), (4, 256, 4), (2, 512, 2)]
        self.int8_mma_small_cfgs = [(True, 32, 512, 4), (True, 64, 256, 4), (True, 16, 512, 4),
                                    (False, 32, 256, 4), (False, 64, 256, 4), (False, 64, 128, 4),
                                    (False, 128, 128, 4)]
        # batch-invariant linear: (name, (N, K)) of Qwen2.5-1.5B's packed projections and LM head
        self.invariant_shapes = [("qkv", (2048, 1536)), ("o", (1536, 1536)), ("gate_up", (17920, 1536)),
                                 ("down", (1536, 8960)), ("lm_head", (151936, 1536))]
        self.invariant_m = [1, 8, 64, 256, 2048]
        self.invariant_sweep_m = [8, 128, 512, 2048]
        # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), each <= 128 KB of shared memory; the
        # configurations invariant_linear_config picks are among them
        self.invariant_sweep_cfgs = [(64, 16, 64, 4, 4), (64, 16, 128, 4, 6), (64, 32, 128, 4, 6),
                                     (64, 64, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
                                     (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (16, 64, 256, 4, 3)]
        self.int8_large_cfgs = [(False, 128, 128, 64, 8, 4), (False, 64, 128, 64, 4, 4),
                                (False, 128, 128, 64, 4, 4), (True, 128, 128, 64, 8, 4),
                                (True, 64, 128, 64, 4, 4), (True, 128, 128, 64, 8, 3),
                                (True, 128, 256, 64, 8, 3)]


@dataclass(frozen=True, slots=True)
class KernelBenchOptions:
    """Options of one ``llmserve bench-kernels`` run.

    Attributes:
        device: ``cuda``, ``cuda:N`` or ``cpu`` (``cpu`` needs ``quick`` and the Triton
            interpreter, ``TRITON_INTERPRET=1`` set before Python starts).
        quick: tiny shapes, 2 calls a timing (a smoke run; its timings mean nothing).
        sweep: also sweep launch configurations (decode, prefill, INT8).
        sweep_deadline: seconds of sweeping in all (25% decode, 45% INT8, 10% prefill, 20% the
            batch-invariant linear), > 0.
        workers: processes that pre-compile the kernels in parallel on a GPU, in [0, 64]
            (0: none).
        skip: sections left out, a subset of :data:`SECTIONS`.
        decode_splits: split policy of the decode kernel (``FastPathConfig.decode_splits``).
        output: directory of ``kernels.json`` / ``kernels.md``; ``None``:
            ``results/kernels/<gpu_slug>`` (``cpu`` on CPU).
        code_hash: the engine's code hash to record in the report (the pipeline's), or None.

    Raises:
        ValueError: an option outside its range, naming it.
    """

    device: str = "cuda"
    quick: bool = False
    sweep: bool = True
    sweep_deadline: float = 150.0
    workers: int = 0
    skip: frozenset = frozenset()
    decode_splits: str = FastPathConfig().decode_splits
    output: str | None = None
    code_hash: str | None = None

    def __post_init__(self) -> None:
        try:
            dev = torch.device(self.device)
        except (RuntimeError, ValueError):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if dev.type == "cpu" and not self.quick:
            raise ValueError("device cpu runs only the smoke shapes: add --quick (the full shapes take "
                             "hours in the Triton interpreter)")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device} was requested but CUDA is not available; use "
                             "--device cpu --quick for the smoke run")
        if not (isinstance(self.sweep_deadline, (int, float)) and self.sweep_deadline > 0):
            raise ValueError(f"sweep_deadline must be > 0 seconds, got {self.sweep_deadline!r}")
        if type(self.workers) is not int or not 0 <= self.workers <= 64:
            raise ValueError(f"workers must be an integer in [0, 64], got {self.workers!r}")
        unknown = set(self.skip) - set(SECTIONS)
        if unknown:
            raise ValueError(f"skip must name sections among {list(SECTIONS)}, got {sorted(unknown)}")
        if self.decode_splits not in DECODE_SPLIT_POLICIES:
            raise ValueError(f"decode_splits must be one of {list(DECODE_SPLIT_POLICIES)}, "
                             f"got {self.decode_splits!r}")

    def decode_options(self) -> dict:
        """Keyword options of the decode kernel: the engine's defaults (``FastPathConfig``)
        with this run's split policy."""
        fp = FastPathConfig(decode_splits=self.decode_splits)
        return {"split_policy": fp.decode_splits, "stages": fp.decode_stages,
                "min_tiles": fp.decode_min_tiles, "fused_max_splits": fp.decode_fused_max_splits,
                "wide_tile": fp.decode_wide_tile, "early_pages": fp.decode_early_pages,
                "prefetch_kv": fp.decode_prefetch_kv}


def run_all(cfg: Cfg, bw_meas: float, res: dict, skip, save) -> None:
    """The whole measurement sequence (also what each pre-compile worker walks through)."""
    global _UNIT
    _UNIT = 0
    res["parity"] = parity(cfg)
    save()
    if "decode" not in skip:
        res["decode"], res["decode_sweep"] = bench_decode(cfg, bw_meas)
        save()
    if "int8" not in skip:
        res["int8"], res["int8_sweep"] = bench_int8(cfg, bw_meas)
        save()
    if "prefill" not in skip:
        res["prefill"], res["prefill_sweep"] = bench_prefill(cfg)
        save()
    if "invariant" not in skip:
        res["invariant"], res["invariant_sweep"] = bench_invariant(cfg)
        save()


def _warm_worker(args) -> str:
    """Pre-compile worker: walk the run, launching only this worker's units once."""
    global WARM, DEVICE, _ROTATE
    wid, nw, device, quick, sweep, skip, decode_options = args
    WARM = (wid, nw)
    DEVICE = torch.device(device)
    _ROTATE = 0
    try:
        run_all(Cfg(quick, sweep, 1e9, decode_options, cpu=False), REF_BW, {}, skip, lambda: None)
        _sync()
        return f"worker {wid}: ok"
    except Exception as e:  # noqa: BLE001 - reported, the main run compiles what is missing
        return f"worker {wid}: {type(e).__name__}: {e}"[:300]


def default_output(device: torch.device) -> Path:
    """``results/kernels/<gpu_slug>`` for a CUDA device, ``results/kernels/cpu`` otherwise."""
    return Path("results/kernels") / (gpu_slug(torch.cuda.get_device_name(device))
                                      if device.type == "cuda" else "cpu")


def run(opts: KernelBenchOptions, command: str = "llmserve bench-kernels") -> tuple[dict, Path]:
    """Run the checks and timings of ``opts``, writing ``kernels.json`` and ``kernels.md`` after
    every section (a crash keeps what was measured).

    Returns:
        ``(result dict, output directory)``; the dict has ``env``, ``shapes``, ``parity``,
        ``decode``, ``decode_sweep``, ``prefill``, ``prefill_sweep``, ``int8``, ``int8_sweep``,
        ``invariant``, ``invariant_sweep``, ``targets`` (times in us, bandwidths in GB/s or TB/s as named).

    Raises:
        ValueError: CPU tensors without the Triton interpreter.
    """
    global DEVICE, WARM, _ROTATE, T0
    DEVICE = torch.device(opts.device)
    WARM = None
    cpu = DEVICE.type == "cpu"
    if cpu and not interpreting():
        raise ValueError("--device cpu runs the kernels in the Triton interpreter: start Python with "
                         "TRITON_INTERPRET=1 (e.g. TRITON_INTERPRET=1 llmserve bench-kernels --device cpu "
                         "--quick)")
    if DEVICE.type == "cuda" and DEVICE.index is not None:
        torch.cuda.set_device(DEVICE)
    _ROTATE = QUICK_ROTATE_BYTES if opts.quick else ROTATE_BYTES
    T0 = time.time()
    decode_options = opts.decode_options()
    cfg = Cfg(opts.quick, opts.sweep, opts.sweep_deadline, decode_options, cpu)
    out = Path(opts.output) if opts.output else default_output(DEVICE)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    env = dict(device=DEVICE.type, quick=opts.quick,
               gpu="cpu (Triton interpreter)" if cpu else torch.cuda.get_device_name(DEVICE),
               sms=0 if cpu else _sms(), torch=torch.__version__, triton=triton.__version__,
               date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               python=sys.version.split()[0], command=command, rotate_bytes=_ROTATE,
               decode_options=decode_options, sweep=opts.sweep, code_hash=opts.code_hash)
    if not cpu and opts.workers > 0:
        import multiprocessing as mp
        t = time.time()
        with mp.get_context("spawn").Pool(opts.workers) as pool:
            work = [(i, opts.workers, opts.device, opts.quick, cfg.sweep, set(opts.skip), decode_options)
                    for i in range(opts.workers)]
            for msg in pool.imap_unordered(_warm_worker, work):
                log(msg)
        env["precompile_s"] = time.time() - t
        log(f"pre-compiled in {env['precompile_s']:.1f} s with {opts.workers} workers")
    T0 = time.time()  # sweep deadlines count from here
    env["copy_bw_tbps"] = copy_bandwidth() / 1e12
    bw_meas = REF_BW if cpu else env["copy_bw_tbps"] * 1e12
    log(f"env: {env}")
    res = dict(env=env, shapes=dict(hq=cfg.hq, hkv=cfg.hkv, d=cfg.d, dtype=str(cfg.dtype).replace("torch.", ""),
                                    block_size=16),
               parity=[], decode=[], decode_sweep=[], prefill=[], prefill_sweep=[], int8=[], int8_sweep=[],
               invariant=[], invariant_sweep=[])

    def save() -> None:
        res["targets"] = targets(res)
        (out / "kernels.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "kernels.md").write_text(markdown(res))

    run_all(cfg, bw_meas, res, set(opts.skip), save)
    save()
    return res, out


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

def add_bench_kernels_subparser(sub) -> None:
    """Register ``llmserve bench-kernels`` on an ``argparse`` subparsers object."""
    p = sub.add_parser("bench-kernels", help="parity checks and timings of the Triton kernels on a GPU",
                       description=__doc__)
    p.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu (cpu: with --quick, in the "
                   "Triton interpreter; start with TRITON_INTERPRET=1)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, 2 calls a timing: a smoke run whose timings mean nothing")
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the config sweeps")
    p.add_argument("--sweep-deadline", type=float, default=150.0,
                   help="seconds of sweeping in all (25%% decode, 45%% int8, 10%% prefill, 20%% the "
                        "batch-invariant linear; default 150)")
    p.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                   help="processes that pre-compile the kernels in parallel on a GPU (0: none)")
    p.add_argument("--skip", default="", help=f"comma list of sections to skip: {','.join(SECTIONS)}")
    p.add_argument("--decode-splits", default=FastPathConfig().decode_splits, choices=list(DECODE_SPLIT_POLICIES),
                   help="split policy of the decode attention kernel (FastPathConfig.decode_splits)")
    p.add_argument("--code-hash", default=None,
                   help="the engine's code hash, recorded in the report (the pipeline passes it)")
    p.add_argument("--output", "--out", dest="output", default=None,
                   help="output directory (default: results/kernels/<gpu>, e.g. results/kernels/h200)")
    p.set_defaults(func=_main)


def _command_line(o: KernelBenchOptions) -> str:
    """The command that repeats a run of ``o`` (default flags left out)."""
    parts = ["llmserve bench-kernels", f"--device {o.device}"]
    if o.quick:
        parts.append("--quick")
    if not o.sweep:
        parts.append("--no-sweep")
    if o.sweep_deadline != 150.0:
        parts.append(f"--sweep-deadline {o.sweep_deadline:g}")
    if o.skip:
        parts.append("--skip " + ",".join(sorted(o.skip)))
    if o.decode_splits != FastPathConfig().decode_splits:
        parts.append(f"--decode-splits {o.decode_splits}")
    if o.output:
        parts.append(f"--output {o.output}")
    return " ".join(parts)


def _main(args: argparse.Namespace) -> int:
    opts = KernelBenchOptions(device=args.device, quick=args.quick, sweep=args.sweep,
                              sweep_deadline=args.sweep_deadline, workers=args.workers,
                              skip=frozenset(filter(None, args.skip.split(","))),
                              decode_splits=args.decode_splits, output=args.output,
                              code_hash=args.code_hash)
    res, out = run(opts, command=_command_line(opts))
    print(markdown(res))
    print(f"wrote {out / 'kernels.json'} and {out / 'kernels.md'}")
    return 0 if all(r["ok"] for r in res["parity"]) else 1
