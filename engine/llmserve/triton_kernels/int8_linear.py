"""Weight-only INT8 linear layer in Triton: ``y = x @ (w_int8 * scale[:, None]).T + bias``.

Weight format: ``w_int8`` is ``[N, K]`` int8, row-major — the same orientation as
``nn.Linear.weight`` (out_features x in_features), so a state-dict transform quantizes each
weight in place without transposing — or the same values as *byte planes*, int32
``[N, K / 4]`` (:func:`~llmserve.quantization.pack_int8_planes`), which every kernel kind here
but ``"stream"`` also reads. ``scale`` is ``[N]`` (fp32, fp16 or bf16): symmetric per-output-channel scales, ``w ~= w_int8 * scale[:, None]`` with ``w_int8`` in ``[-127, 127]``.

The fused kernels read int8 tiles, convert them in registers (every int8 value is exact in
bf16/fp16), accumulate in fp32 and apply the per-channel scale (and bias) once in the epilogue —
the scale factors out of the K sum: ``sum_k x[m,k] * q[n,k] * s[n] = s[n] * sum_k x[m,k] * q[n,k]``.

Four kernel kinds (:class:`Int8LinearConfig.kind`); the first three are chosen per shape by
:func:`choose_int8_config` from H200 measurements (``results/kernels/NOTES.md``), the fourth
(``"stream"``) only through an explicit ``config`` until the H200 has measured it:

* ``"vec"`` (decode, M <= 4; the default at M = 1): the matrix-vector kernel of ``gemv.py``
  (one or two weight rows a program, fp32 element-wise accumulation reduced over K once, the
  per-channel scale in the epilogue); 1.42-1.60x faster than bf16 cuBLAS on Qwen2.5-1.5B
  shapes at M = 1. It replaced an earlier CUDA-core kernel of this file (8 rows a program,
  split-K; 1.15-1.32x), whose measurements stay in ``results/kernels/h200_run*``.
* ``"mma"`` (decode, M <= 64): tensor-core tiles (``BLOCK_M`` >= 16) with the int8 tile
  converted in registers; split-K over K when there are few output tiles, with the partials
  summed by the last split to finish (``fused_reduce``) or by a small reduction kernel. An
  optional "swap AB" orientation computes ``y.T = w @ x.T`` (measured slower on Hopper).
* ``"stream"`` (decode, M <= 16; experimental, issue #6): a persistent stream-K tensor-core
  kernel (:func:`_stream_launch`). One program (or two) an SM walks an equal share of the
  flattened (output tile, K step) iterations in a single software-pipelined loop, so the
  weight stream never pauses at tile boundaries and there is no ragged last wave; tiles cut
  by a share boundary are summed by their last contributor. Row-major int8 only.
* ``"dequant"`` (prefill, M > 64): one pass int8 -> ``x.dtype`` weights, then cuBLAS. The fused
  tile kernel measured 1.7-2.1x slower than bf16 cuBLAS at M >= 256 (a guess, not profiled: the
  converted operand goes back through shared memory before each wgmma, stalling the pipeline);
  dequantize + cuBLAS costs 1.12-1.19x. vLLM's AWQ path makes the same trade for >= 256 tokens.

On CPU tensors (Triton interpreter) tiles are cast to fp32 before the product and small
configurations of the same kinds are chosen, so CPU tests reach every kind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quantization import (  # the layout (pure torch), re-exported
    pack_int8_planes,
    unpack_int8_planes,
)
from ._launch import num_sms, zeroed_counters
from .gemv import GEMV_MAX_M, GemvConfig, _plane_bytes, choose_gemv_config, gemv

__all__ = ["Int8LinearConfig", "choose_int8_config", "int8_linear", "int8_linear_reference",
           "pack_int8_planes", "quantize_int8_per_channel", "unpack_int8_planes"]


@triton.jit
def _int8_epilogue(acc, rm, rn, rn_ld, tile_id, pid_k, M, N, s_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                   stride_ym, stride_yn, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                   FUSED_REDUCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store an fp32 ``acc [BLOCK_M, BLOCK_N]`` tile: scale (+ bias) and cast, or (split-K) store
    the partial and, with FUSED_REDUCE, let the last split of the tile reduce all partials."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        ws = ws_ptr + (pid_k.to(tl.int64) * M + rm[:, None]) * N + rn[None, :]
        tl.store(ws, acc, mask=mask)
        if FUSED_REDUCE:
            # The last split of this output tile to finish sums all partials (in split order,
            # so the result is deterministic) and writes y; then it re-arms the tile counter.
            # Stores above are released by the barrier + acq_rel atomic (the "semaphore"
            # pattern of split-K / stream-K GEMMs); partials are re-read from L2 (.cg).
            num_splits = tl.num_programs(1)
            tl.debug_barrier()
            count = tl.atomic_add(cnt_ptr + tile_id, 1)
            if count == num_splits - 1:
                tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(0, num_splits):
                    part = ws_ptr + (s * M + rm[:, None].to(tl.int64)) * N + rn[None, :]
                    tot += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                y = tot * tl.load(s_ptr + rn_ld).to(tl.float32)[None, :]
                if HAS_BIAS:
                    y += tl.load(bias_ptr + rn_ld).to(tl.float32)[None, :]
                y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
                tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile_id, 0)
    else:
        y = acc * tl.load(s_ptr + rn_ld).to(tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn_ld).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mma_step(acc, x, w, SWAP_AB: tl.constexpr, FP32_MATH: tl.constexpr):
    """``acc += x @ w.T`` (``[BM, BN]``; ``[BN, BM]`` with ``SWAP_AB``) for an integer weight
    tile ``w [BN, BK]``, converted to x's dtype (exact for int8 values) or fp32."""
    if FP32_MATH:
        xf = x.to(tl.float32)
        wf = w.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(wf, tl.trans(xf), acc, input_precision="ieee")   # [BN, BM]
        else:
            acc = tl.dot(xf, tl.trans(wf), acc, input_precision="ieee")   # [BM, BN]
    else:
        wf = w.to(x.dtype)
        if SWAP_AB:
            acc = tl.dot(wf, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(wf), acc)
    return acc


@triton.jit(do_not_specialize=["M", "k_per_split"])  # M varies per step: no recompiles
def _int8_linear_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
                        EVEN_K: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                        FP32_MATH: tl.constexpr, PLANES: tl.constexpr = False):
    """Tensor-core tile kernel (``kind="mma"``). With ``PLANES`` the weight is int8 byte planes
    (int32 words; ``K``, ``k_per_split`` and ``BLOCK_K`` count words) and each K step makes
    four products, one a plane. On the H200 this is 15-25% slower than row-major int8 at
    M = 2..16 (``results/kernels/int8_planes_run2/lib``); reading the planes' bytes as a
    permuted row-major matrix with x gathered in that order was 2-5x slower still
    (``int8_planes_run3/lib``), and one product a step over the four planes reordered
    plane-major in registers 1.3x slower (``int8_planes_run4/lib_cat``), so byte planes pay
    off only where the matrix-vector kind serves the call."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles share each weight column tile while it sits in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_ld = rm % M  # wrapped: loads stay in bounds without masks; stores are masked
    rn_ld = rn % N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_k = tl.max_contiguous(tl.multiple_of(k_lo + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    x_ptrs = x_ptr + rm_ld[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + rn_ld[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk  # [BN, BK]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            kmask = (k0 - k_lo + offs_k) < k_hi
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0)
        if PLANES:  # byte plane j pairs with x's columns j * K + k (K counts words)
            for j in tl.static_range(4):
                if EVEN_K:
                    x = tl.load(x_ptrs + j * K * stride_xk)
                else:
                    x = tl.load(x_ptrs + j * K * stride_xk, mask=kmask[None, :], other=0.0)
                acc = _mma_step(acc, x, _plane_bytes(w, j), SWAP_AB, FP32_MATH)
        else:
            if EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
            acc = _mma_step(acc, x, w, SWAP_AB, FP32_MATH)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]
    _int8_epilogue(acc, rm, rn, rn_ld, pid, pid_k, M, N, s_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                   stride_ym, stride_yn, HAS_BIAS, SPLIT, FUSED_REDUCE, BLOCK_M, BLOCK_N)


@triton.jit
def _stream_index(pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """Output-row and output-column indices of tile ``(pid_m, pid_n)``, shaped like the
    accumulator: ``[BM, 1]`` and ``[1, BN]``, or ``[1, BM]`` and ``[BN, 1]`` with ``SWAP_AB``
    (so neither orientation needs a transpose before its stores)."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP_AB:
        mm = rm[None, :]
        nn = rn[:, None]
    else:
        mm = rm[:, None]
        nn = rn[None, :]
    return mm, nn


@triton.jit
def _stream_channel(ptr, pid_n, N, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """Tile ``pid_n``'s per-output-channel values (scale or bias) in fp32, shaped to broadcast
    against the accumulator: ``[1, BN]``, or ``[BN, 1]`` with ``SWAP_AB``."""
    rn_ld = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)   # clamped: in bounds
    if SWAP_AB:
        v = tl.load(ptr + rn_ld[:, None])
    else:
        v = tl.load(ptr + rn_ld[None, :])
    return v.to(tl.float32)


@triton.jit
def _stream_store(acc, sc, bi, pid_m, pid_n, M, N, y_ptr, stride_ym, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """``y[tile] = acc * sc (+ bi)`` in y's dtype, for a finished fp32 tile sum; ``sc``/``bi``
    from :func:`_stream_channel`."""
    mm, nn = _stream_index(pid_m, pid_n, BLOCK_M, BLOCK_N, SWAP_AB)
    out = acc * sc
    if HAS_BIAS:
        out += bi
    tl.store(y_ptr + mm.to(tl.int64) * stride_ym + nn, out.to(y_ptr.dtype.element_ty),
             mask=(mm < M) & (nn < N))


@triton.jit
def _stream_ws_offsets(slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """Offsets of workspace slot ``slot`` (one fp32 ``[BM, BN]`` tile, m-major), shaped like the
    accumulator."""
    mm, nn = _stream_index(0, 0, BLOCK_M, BLOCK_N, SWAP_AB)
    return slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + mm * BLOCK_N + nn


@triton.jit
def _cta_barrier(pid, ASM_BARRIER: tl.constexpr):
    """Barrier of all threads of the program (``__syncthreads``). ``tl.debug_barrier`` inside a
    loop keeps Triton's software pipeliner from pipelining that loop (seen with Triton 3.9 for
    sm_90: no ``cp.async`` left in the stream kernel's loop), so on the GPU it is inline PTX
    (``ASM_BARRIER``); the interpreter has no inline assembly."""
    if ASM_BARRIER:
        tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, $1;", "=r,r", [pid], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.debug_barrier()


@triton.jit
def _stream_fixup(acc, sc, bi, tile, pid_m, pid_n, pid, k_steps, total, M, N, y_ptr, ws_ptr, cnt_ptr,
                  stride_ym,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SWAP_AB: tl.constexpr, MAX_CONTRIB: tl.constexpr, ASM_BARRIER: tl.constexpr):
    """Store this program's partial sum ``acc`` of a cut ``tile`` in workspace slot
    ``tile + pid`` and count it in; the last of the tile's contributors to arrive sums all
    partials in program order (deterministic), writes y and re-arms the tile's counter.
    The sum is unrolled over ``MAX_CONTRIB`` (>= the tile's contributor count) masked loads,
    so the caller's loop has no inner loop (Triton's pipeliner skips loops that contain
    loops) and all loads are in flight at once."""
    num_progs = tl.num_programs(0)
    woffs = _stream_ws_offsets(tile, BLOCK_M, BLOCK_N, SWAP_AB)            # slot `tile`; + q slots
    tl.store(ws_ptr + woffs + pid * (BLOCK_M * BLOCK_N), acc)
    # Contributors: the programs owning the tile's first and last iterations, and all between
    # (owner(i) = ((i + 1) * P - 1) // total inverts start(p) = p * total // P).
    p_first = ((tile * k_steps + 1) * num_progs - 1) // total
    p_last = ((tile + 1) * k_steps * num_progs - 1) // total
    # The barrier and the acq_rel atomic publish the partial of every thread (the "semaphore"
    # of split-K and stream-K GEMMs, as in _int8_epilogue); partials are re-read from L2 (.cg).
    _cta_barrier(pid, ASM_BARRIER)
    count = tl.atomic_add(cnt_ptr + tile, 1)
    if count == p_last - p_first:
        tot = tl.zeros_like(acc)
        for c in tl.static_range(MAX_CONTRIB):
            q = p_first + c
            live = (woffs * 0 + q) <= p_last                         # (a tensor mask: interpreter)
            tot += tl.load(ws_ptr + woffs + q.to(tl.int64) * (BLOCK_M * BLOCK_N), mask=live,
                           other=0.0, cache_modifier=".cg")
        _stream_store(tot, sc, bi, pid_m, pid_n, M, N, y_ptr, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N,
                      SWAP_AB)
        tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit(do_not_specialize=["M"])  # M varies per step: no recompiles
def _int8_stream_kernel(x_ptr, w_ptr, w_desc, s_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K,
                        stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
                        STAGES: tl.constexpr, USE_TMA: tl.constexpr, FP32_MATH: tl.constexpr,
                        MAX_CONTRIB: tl.constexpr, ASM_BARRIER: tl.constexpr, ONE_M: tl.constexpr):
    """Persistent stream-K tensor-core kernel (``kind="stream"``; see :func:`_stream_launch`).

    The work is the flattened sequence of ``total = tiles * k_steps`` (output tile, K step)
    iterations, tile-major; program ``p`` of ``P`` owns iterations ``[p * total // P,
    (p + 1) * total // P)`` and runs them in one software-pipelined loop, so ``STAGES`` weight
    tiles stay in flight across tile boundaries. At most two of its tiles are cut by a range
    boundary: the last one (``tail`` segment: the tile's first k steps) and the first one
    (``head`` segment: its last k steps). The loop visits the tail segment, then the head
    segment, then the whole tiles in between: every cut tile's partials are then ready early
    and its last contributor reduces it (:func:`_stream_fixup`) while the other programs still
    stream, instead of every program ending on an atomic round trip and a reduction."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    k_steps = tl.cdiv(K, BLOCK_K)
    total = num_pid_m * tl.cdiv(N, BLOCK_N) * k_steps            # host checks P * total < 2^31
    start = pid * total // num_progs
    end = (pid + 1) * total // num_progs                         # > start: the host caps P <= total
    first_tile = start // k_steps
    last_tile = (end - 1) // k_steps
    head_cut = first_tile * k_steps < start
    head_len = tl.where(head_cut, tl.minimum(end, (first_tile + 1) * k_steps) - start, 0)
    tail_start = tl.maximum(start, last_tile * k_steps)
    # a range inside one tile is all head segment
    tail_cut = ((last_tile + 1) * k_steps > end) & ((last_tile != first_tile) | (head_cut == 0))
    tail_len = tl.where(tail_cut, end - tail_start, 0)
    cut_len = tail_len + head_len
    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in tl.range(0, end - start, num_stages=STAGES):
        # visit order: tail segment, head segment, whole tiles (the last two are contiguous)
        it = tl.where(j < tail_len, tail_start + j, start + j - tail_len)
        tile = it // k_steps
        ks = it - tile * k_steps
        if ONE_M:                         # M <= BLOCK_M (decode): no divisions for the row tile
            pid_m = 0
            pid_n = tile
        else:                             # m fastest: the row tiles of one weight tile adjoin
            pid_m = tile % num_pid_m
            pid_n = tile // num_pid_m
        k0 = tl.multiple_of(ks * BLOCK_K, BLOCK_K)
        offs_k = k0 + rk
        rm = pid_m * BLOCK_M + lm
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + offs_k[None, :]             # [BM, BK]
        if USE_TMA:       # out-of-range rows and columns read as zeros
            w = w_desc.load([pid_n * BLOCK_N, k0])                                           # [BN, BK]
        else:
            rn_ld = tl.minimum(pid_n * BLOCK_N + ln, N - 1)
            w_ptrs = w_ptr + rn_ld[:, None].to(tl.int64) * stride_wn + offs_k[None, :]      # [BN, BK]
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0)
        # rows >= M are masked (zero-filled without a memory access: at M = 2 the x tile costs
        # 2 rows of L2 traffic, not 16)
        if EVEN_K:
            x = tl.load(x_ptrs, mask=(rm < M)[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=(rm < M)[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = _mma_step(acc, x, w, SWAP_AB, FP32_MATH)
        # The tile's scale (and bias), read every step so that the pipeliner prefetches them
        # with the weights (a few hundred bytes, L2 hits): a load in the epilogue branch would
        # stall each tile end for a full memory latency with no new loads issued.
        sc = _stream_channel(s_ptr, pid_n, N, BLOCK_N, SWAP_AB)
        if HAS_BIAS:
            bi = _stream_channel(bias_ptr, pid_n, N, BLOCK_N, SWAP_AB)
        else:
            bi = sc
        cut_end = (j == tail_len - 1) | ((j == cut_len - 1) & (head_len > 0))
        whole_end = (j >= cut_len) & (ks == k_steps - 1)
        if cut_end | whole_end:
            if whole_end:                       # the whole tile ran here: scale, bias, store
                _stream_store(acc, sc, bi, pid_m, pid_n, M, N, y_ptr, stride_ym, HAS_BIAS,
                              BLOCK_M, BLOCK_N, SWAP_AB)
            else:                               # cut by a range boundary: partial + fixup
                _stream_fixup(acc, sc, bi, tile, pid_m, pid_n, pid, k_steps, total, M, N, y_ptr, ws_ptr,
                              cnt_ptr, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N, SWAP_AB, MAX_CONTRIB,
                              ASM_BARRIER)
            acc = tl.zeros_like(acc)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_on,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PLANES: tl.constexpr = False):
    """``out[n, k] = w[n, k] * scale[n]`` in the output dtype (``kind="dequant"``); with
    ``PLANES`` ``w`` is int8 byte planes, ``K`` and the grid's K blocks count words."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0)
    sc = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rn[:, None].to(tl.int64) * stride_on + rk[None, :]
    if PLANES:
        for j in tl.static_range(4):
            out = _plane_bytes(w, j).to(tl.float32) * sc[:, None]
            tl.store(out_ptrs + j * K, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        out = w.to(tl.float32) * sc[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(ws_ptr, s_ptr, bias_ptr, y_ptr, M, N, num_splits, stride_ym,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, num_splits):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    m = offs // N
    y = acc * tl.load(s_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class Int8LinearConfig:
    """Tile configuration of :func:`int8_linear` (see :func:`choose_int8_config`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    swap_ab: bool = False
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    fused_reduce: bool = False  # split-K: last split reduces (no second launch) vs reduce kernel
    kind: str = "mma"  # "mma" (tensor cores), "vec" (gemv.py, M <= 4), "dequant", "stream"
    # block_k: weight columns a step; with byte planes, "vec" passes it to gemv as words and
    # "mma" steps max(16, block_k // 4) words (the same bytes)
    programs_per_sm: int = 0  # "vec": GemvConfig.programs_per_sm; "stream": grid / SMs (0 = 1)
    tma: bool = False  # "stream": weight tiles through a TMA tensor descriptor (CUDA, Hopper+)


INT8_KINDS = ("mma", "vec", "dequant", "stream")


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


def check_stream_config(cfg: Int8LinearConfig) -> None:
    """Validate the fields a ``kind="stream"`` configuration uses (``ValueError`` naming the
    field and the allowed range). ``swap_ab`` is the orientation: the weight tile as the MMA's
    A operand (``True``, ``y.T = w @ x.T``) or as its B operand (``False``, ``y = x @ w.T``)."""
    if not _pow2(cfg.block_m) or cfg.block_m < 16:
        raise ValueError(f"stream: block_m must be a power of two >= 16 (the smallest tensor-core "
                         f"tile), got {cfg.block_m}")
    for name in ("block_n", "block_k"):
        v = getattr(cfg, name)
        if not _pow2(v) or not 16 <= v <= 1024:
            raise ValueError(f"stream: {name} must be a power of two in [16, 1024], got {v}")
    if not isinstance(cfg.num_stages, int) or not 1 <= cfg.num_stages <= 8:
        raise ValueError(f"stream: num_stages must be in [1, 8], got {cfg.num_stages}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"stream: num_warps must be 1, 2, 4, 8 or 16, got {cfg.num_warps}")
    if not isinstance(cfg.programs_per_sm, int) or not 0 <= cfg.programs_per_sm <= 8:
        raise ValueError(f"stream: programs_per_sm must be in [0, 8] (0 means 1), got {cfg.programs_per_sm}")
    if cfg.tma and (cfg.block_n > 256 or cfg.block_k > 256):
        raise ValueError(f"stream: a TMA box has at most 256 elements a dimension, got block_n="
                         f"{cfg.block_n}, block_k={cfg.block_k} with tma=True")


def _tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed per-tile arrival counters for the fused split-K reduction."""
    return zeroed_counters("int8_linear", device, n)


def _num_sms(device: torch.device) -> int:
    return num_sms(device, cpu_default=4)


def _fit_split(m: int, n: int, k: int, bm: int, bn: int, bk: int, target: int,
               max_split: int = 32) -> int:
    """Split-K factor so that ``tiles * split >= target`` programs, each split at least two
    ``bk`` steps long; returned after rounding each split to whole ``bk`` steps."""
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = max(1, min(triton.cdiv(target, tiles), max_split, k // (2 * bk)))
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    return triton.cdiv(k, k_per)


def choose_int8_config(m: int, n: int, k: int, device: torch.device, planes: bool = False) -> Int8LinearConfig:
    """Shape-keyed configuration (no autotuning: deterministic and CUDA-graph safe).

    Picked from the H200 sweep in ``results/kernels/`` (Qwen2.5-1.5B shapes, bf16; speed-ups
    over cuBLAS bf16 in parentheses):

    * ``m == 1``: the ``gemv.py`` matrix-vector kernel (``"vec"``) with its tuned or rule-based
      configuration (gate/up 7.1 us, 1.42x; down 7.8 us, 1.56x; qkv 3.5 us, 1.57x).
    * ``m <= 64`` otherwise: tensor-core tiles ``BLOCK_M = max(16, next_pow2(m))`` with the
      weight tile as the MMA's B operand (plain orientation measured faster than swap-AB):
      ``k <= 4096``: 32x256 weight tiles, split-K only to reach one program per SM (gate/up
      M=4/16 9.2-9.3 us, 1.1x); ``k > 4096``: 64x128 tiles, split-K to two programs per SM with
      the in-kernel (fused) reduction (down M=1/4/16 9.8-10.6 us, 1.15-1.26x).
    * ``m > 64``, and ``m = 64`` with ``k <= 4096``: dequantize to ``x.dtype`` then cuBLAS
      (M=2048: 1.12-1.19x the bf16 time; the fused tile kernels measured 1.7-2.1x, at M=256
      too; at M=64, Qwen2.5-1.5B gate/up 18.4 vs 21.3 us and qkv 8.9 vs 11.1 for the tiles).
    * CPU (Triton interpreter): the same kinds with small tiles, so tests cover every path.

    ``planes``: the weight is int8 byte planes (:func:`pack_int8_planes`; ``k`` still counts
    columns). The matrix-vector kernel then also serves ``m = 2`` for ``k <= 4096`` and
    ``m <= 4`` for weights up to 4 M elements, where it measured faster than the tensor-core
    kind on the H200 (``results/kernels/int8_planes_run1``: qkv M = 2 4.3 vs 6.5 us, M = 4
    5.5 vs 6.4; gate/up M = 2 9.4 vs 10.8).
    """
    vec = m == 1 or (planes and device.type == "cuda" and m <= GEMV_MAX_M
                     and ((m == 2 and k <= 4096) or n * k <= 4 * 1024 * 1024))
    if vec:  # block_n / block_k / num_warps / num_stages of the gemv.py launch
        g = choose_gemv_config(m, n, k, torch.int32 if planes else torch.int8, device)
        return Int8LinearConfig(1, g.block_n, g.block_k, num_warps=g.num_warps, num_stages=g.stages,
                                kind="vec", programs_per_sm=g.programs_per_sm)
    if device.type != "cuda":
        if m <= 64:
            split = 2 if k >= 64 else 1
            return Int8LinearConfig(16 if m <= 16 else 32, 32, 32, split_k=split, num_warps=1,
                                    num_stages=1, fused_reduce=True)
        return Int8LinearConfig(1, 1, 1, kind="dequant")
    sms = _num_sms(device)
    # k <= 4096 at M = 64: dequantize + cuBLAS measured faster than the 64-row tensor-core tile
    # (gate/up 18.4 vs 21.3 us, qkv 8.9 vs 11.1; at M = 32 the tiles win, 12.5 vs 18.1 and 7.7
    # vs 8.8; results/kernels/int8_mid_m_run1); k > 4096 (down) keeps the tiles (18.9 vs 20.9).
    if m < 64 or (m == 64 and k > 4096):
        bm = max(16, triton.next_power_of_2(m))
        if k <= 4096:
            split = _fit_split(m, n, k, bm, 32, 256, sms)
            return Int8LinearConfig(bm, 32, 256, split_k=split, num_warps=4, num_stages=4,
                                    fused_reduce=True)
        split = _fit_split(m, n, k, bm, 64, 128, 2 * sms)
        return Int8LinearConfig(bm, 64, 128, split_k=split, num_warps=4, num_stages=4, fused_reduce=True)
    return Int8LinearConfig(1, 1, 1, kind="dequant")


def _check_int8_inputs(x, w_int8, scale, bias) -> tuple[int, int]:
    """Validate :func:`int8_linear`'s arguments (``ValueError``); returns ``(N, K)`` (``K`` in
    columns, also for byte planes)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a float16/bfloat16/float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(w_int8, torch.Tensor) or w_int8.dtype not in (torch.int8, torch.int32) \
            or w_int8.dim() != 2:
        raise ValueError("w_int8 must be a 2-D int8 tensor [N, K] (out_features x in_features) or its "
                         "byte planes, int32 [N, K / 4] (pack_int8_planes), got "
                         f"{getattr(w_int8, 'dtype', type(w_int8))} {tuple(getattr(w_int8, 'shape', ()))}")
    n, k = w_int8.shape
    if w_int8.dtype == torch.int32:
        k *= 4
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x's last dim ({x.shape[-1] if x.dim() else None}) must equal w_int8's "
                         f"in_features K={k}")
    if w_int8.stride(1) != 1:
        raise ValueError(f"w_int8 must be row-major [N, K] (stride(1) == 1), got strides "
                         f"{tuple(w_int8.stride())}")
    if not isinstance(scale, torch.Tensor) or scale.shape != (n,) or not scale.is_floating_point():
        raise ValueError(f"scale must be a float tensor of shape [{n}] (one per output channel), got "
                         f"{getattr(scale, 'dtype', type(scale))} {tuple(getattr(scale, 'shape', ()))}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n,)
                             or not bias.is_floating_point()):
        raise ValueError(f"bias must be None or a float tensor of shape [{n}], got "
                         f"{tuple(getattr(bias, 'shape', ()))}")
    for name, t in (("w_int8", w_int8), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if not scale.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        raise ValueError("scale and bias must be contiguous")
    return n, k


def _stream_launch(x2: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None, y: torch.Tensor, cfg: Int8LinearConfig):
    """``y = x2 @ (w_int8 * scale[:, None]).T (+ bias)`` with the persistent stream-K
    tensor-core kernel (``kind="stream"``), written into ``y``. Returns what the Triton launch
    returns (on CUDA the compiled kernel: benchmarks read its registers, shared memory and IR).

    Shapes: ``x2 [M, K]`` (unit column stride), ``w_int8 [N, K]`` int8 row-major, ``scale`` and
    ``bias`` ``[N]``, ``y [M, N]`` contiguous in ``x2.dtype``. Designed for decode batches
    (``M <= block_m = 16``); larger M runs ``cdiv(M, block_m)`` row tiles, re-reading the weights
    once per row tile.

    Algorithm. The output is cut into ``[block_m, block_n]`` tiles, each the sum of
    ``k_steps = cdiv(K, block_k)`` products of a ``[block_m, block_k]`` slice of x with a
    ``[block_n, block_k]`` int8 weight tile (converted to ``x.dtype`` in registers, exact for int8;
    fp32 accumulation). All ``tiles * k_steps`` such iterations form one flat sequence that is
    split into ``P = programs_per_sm * SMs`` contiguous, equal (+-1) ranges, one per program of a
    grid of ``P`` (capped at the iteration count). Every program runs its range as one
    software-pipelined loop (``num_stages`` loads in flight), so weight reads never pause at
    tile boundaries and every SM streams the same number of bytes: the per-tile pipeline
    prologue and drain of a one-tile-a-program grid, and its ragged last wave, disappear.

    This is the "stream-K" decomposition (Osama, Merrill, Cecka, Garland and Owens, "Stream-K:
    Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication on the GPU",
    PPoPP 2023) with the flat (tile, k step) loop and in-loop epilogue of Triton's persistent
    matmul tutorial (``python/tutorials/09-persistent-matmul.py``). Tiles cut by a range
    boundary are combined without waiting on other programs (no spin-waits, so no
    co-residency assumption and no deadlock in the interpreter): each contributor stores its
    fp32 partial in a workspace slot and counts itself in on the tile's counter; the last to
    arrive sums the partials in program order and applies the scale and bias. The sum order
    depends only on ``P``, so results are reproducible run to run. Each program visits its
    (at most two) cut segments before its whole tiles, so the partials are ready, and reduced,
    early in the kernel instead of in a tail after every program's stream; a tile may be
    shared by at most 32 programs (the grid shrinks if needed), the bound of the unrolled sum.

    The scale (and bias) of the current tile are read every step so the pipeliner prefetches
    them with the weights; rows of x at or beyond M are masked, never read.

    Orientation (``cfg.swap_ab``): ``False`` computes ``x @ w.T`` (weight tile = the MMA's B
    operand; with 16 rows Hopper's wgmma needs M >= 64, so this is mma.sync); ``True``
    computes ``(w @ x.T).T`` (weight tile = the A operand, ``[block_n, 16]`` accumulator; with
    ``block_n`` >= 64 a wgmma can take the converted A operand from registers). ``cfg.tma``
    loads weight tiles through a host-built TMA tensor descriptor (CUDA only; needs 16-byte
    aligned rows and base).

    Raises:
        ValueError: invalid configuration fields (:func:`check_stream_config`); ``tma`` on CPU
            tensors, without ``triton.tools.tensor_descriptor``, or with misaligned weights;
            an iteration space too large for int32 arithmetic.
    """
    check_stream_config(cfg)
    m, k = x2.shape
    n = w_int8.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_steps = triton.cdiv(k, bk)
    total = tiles * k_steps
    progs = min(max(1, cfg.programs_per_sm) * _num_sms(x2.device), total)
    # A tile of k_steps iterations meets at most ceil((k_steps - 1) / L) + 1 ranges of length
    # >= L = total // P; keep that <= 32 (the unrolled fixup), then round it up to a power of
    # two so that few shapes share one binary.
    if k_steps > 1 and triton.cdiv(k_steps - 1, total // progs) + 1 > 32:
        progs = total // triton.cdiv(k_steps - 1, 31)
    max_contrib = triton.next_power_of_2(triton.cdiv(k_steps - 1, total // progs) + 1)
    if (progs + 1) * (total + k_steps) >= 2 ** 31:
        raise ValueError(f"stream: {total} iterations x {progs} programs overflow the kernel's int32 "
                         f"index arithmetic; use a larger block_n/block_k or kind 'mma'")
    w_desc = w_int8
    if cfg.tma:
        if x2.device.type != "cuda":
            raise ValueError("stream: tma=True needs CUDA tensors (TMA is a Hopper copy engine)")
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor
        except ImportError as ex:  # pragma: no cover - Triton < 3.4
            raise ValueError("stream: tma=True needs triton.tools.tensor_descriptor (Triton >= 3.4)") from ex
        if w_int8.data_ptr() % 16 or w_int8.stride(0) % 16:
            raise ValueError(f"stream: tma=True needs a 16-byte aligned weight base and row stride, got "
                             f"stride {w_int8.stride(0)} bytes")
        w_desc = TensorDescriptor(w_int8, [n, k], [w_int8.stride(0), 1], [bn, bk])
    # A tile is cut (needs the workspace) unless every range is whole tiles.
    cut = total % progs != 0 or (total // progs) % k_steps != 0
    ws = torch.empty((tiles + progs - 1, bm * bn) if cut else (1,), dtype=torch.float32,
                     device=x2.device)                               # [slots, BM * BN] fp32
    cnt = _tile_counters(x2.device, tiles)        # always int32: one binary with and without cuts
    on_cpu = x2.device.type == "cpu"
    return _int8_stream_kernel[(progs,)](
        x2, w_int8, w_desc, scale, bias if bias is not None else scale, y, ws, cnt, m, n, k,
        x2.stride(0), w_int8.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=cfg.swap_ab,
        EVEN_K=k % bk == 0, STAGES=cfg.num_stages, USE_TMA=cfg.tma,
        FP32_MATH=on_cpu or x2.dtype == torch.float32, MAX_CONTRIB=max_contrib,
        ASM_BARRIER=not on_cpu and os.environ.get("TRITON_INTERPRET", "0") != "1", ONE_M=m <= bm,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def int8_linear(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, config: Int8LinearConfig | None = None
                ) -> torch.Tensor:
    """Weight-only INT8 linear: ``y = x @ (w_int8 * scale[:, None]).T (+ bias)``.

    Args:
        x: ``[..., K]`` float16/bfloat16/float32 activations.
        w_int8: ``[N, K]`` int8, row-major (``nn.Linear.weight`` orientation), or the same
            weights as byte planes, int32 ``[N, K / 4]`` (:func:`pack_int8_planes`).
        scale: ``[N]`` float per-output-channel scales (any float dtype; used in fp32).
        bias: optional ``[N]`` float bias.
        config: tile configuration override (default :func:`choose_int8_config`).

    Returns:
        ``[..., N]`` in ``x.dtype``. Accumulation is fp32.

    Raises:
        ValueError: wrong dtypes, shapes, strides or devices; CPU tensors without
            ``TRITON_INTERPRET=1``; an unknown ``config.kind``; byte planes with kind
            ``"stream"`` or an invalid stream configuration (:func:`check_stream_config`).
    """
    n, k = _check_int8_inputs(x, w_int8, scale, bias)
    planes = w_int8.dtype == torch.int32
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)                                                     # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)                   # [M, N]
    if m == 0:
        return y.reshape(*lead, n)
    on_cpu = x.device.type == "cpu"
    if on_cpu and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("int8_linear needs CUDA tensors, or (CPU tensors) the Triton interpreter: "
                         "set TRITON_INTERPRET=1 before importing llmserve.triton_kernels")
    cfg = config or choose_int8_config(m, n, k, x.device, planes=planes)
    if cfg.kind not in INT8_KINDS:
        raise ValueError(f"Int8LinearConfig.kind must be one of {', '.join(map(repr, INT8_KINDS))}, "
                         f"got {cfg.kind!r}")
    if cfg.kind == "stream":
        if planes:
            raise ValueError("kind 'stream' reads row-major int8 weights [N, K] only, got int32 byte "
                             "planes; unpack them (unpack_int8_planes) or use kind 'mma' or 'vec'")
        _stream_launch(x2, w_int8, scale, bias, y, cfg)
        return y.reshape(*lead, n)
    if cfg.kind == "vec":
        if m > GEMV_MAX_M:
            raise ValueError(f"kind 'vec' serves M <= {GEMV_MAX_M}, got M={m}")
        y = gemv(x2, w_int8, scale=scale, bias=bias,
                 config=GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                                   cfg.programs_per_sm))
        return y.reshape(*lead, n)
    if cfg.kind == "dequant":
        # Compute-bound shapes: one pass int8 -> x.dtype weights, then the vendor GEMM (the
        # same trade vLLM's AWQ path makes for >= 256 tokens). Costs 3 bytes per weight more.
        w_deq = torch.empty((n, k), dtype=x.dtype, device=x.device)                # [N, K]
        bn, bk = (32, 32) if on_cpu else (32, 256)
        kk = w_int8.shape[1]                                   # columns, or words of byte planes
        _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(kk, bk))](
            w_int8, scale, w_deq, n, kk, w_int8.stride(0), w_deq.stride(0),
            BLOCK_N=bn, BLOCK_K=bk, PLANES=planes, num_warps=1 if on_cpu else 4)
        y = torch.nn.functional.linear(x2, w_deq, bias)                            # [M, N]
        return y.reshape(*lead, n)
    # Byte planes: the K loop runs over words, four columns each, a quarter of the tile's
    # columns a step (same bytes), at least 16 (the smallest tensor-core K).
    kk, bk = (w_int8.shape[1], max(16, cfg.block_k // 4)) if planes else (k, cfg.block_k)
    k_per = triton.cdiv(triton.cdiv(kk, cfg.split_k), bk) * bk
    split = triton.cdiv(kk, k_per)
    even_k = kk % bk == 0
    has_bias = bias is not None
    ws = (torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    fused = split > 1 and cfg.fused_reduce
    cnt = _tile_counters(x.device, tiles) if fused else ws
    args = (x2, w_int8, scale, bias if has_bias else scale, y, ws, cnt, m, n, kk, k_per,
            x2.stride(0), x2.stride(1), w_int8.stride(0), w_int8.stride(1), y.stride(0), y.stride(1))
    _int8_linear_kernel[(tiles, split)](
        *args, HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab, EVEN_K=even_k, SPLIT=split > 1,
        FUSED_REDUCE=fused, FP32_MATH=on_cpu or x.dtype == torch.float32, PLANES=planes,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1 and not fused:
        block = 1024 if not on_cpu else 256
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, scale, bias if has_bias else scale, y, m, n, split, y.stride(0),
            HAS_BIAS=has_bias, BLOCK=block, num_warps=4 if not on_cpu else 1)
    return y.reshape(*lead, n)


def int8_linear_reference(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`int8_linear`: dequantize in fp32, matmul, cast to
    ``x.dtype``. Shapes as :func:`int8_linear` (byte planes are unpacked first)."""
    if w_int8.dtype == torch.int32:
        w_int8 = unpack_int8_planes(w_int8)
    w = w_int8.to(torch.float32) * scale.to(torch.float32)[:, None]          # [N, K]
    y = x.to(torch.float32) @ w.T                                             # [..., N]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8 quantization of a linear weight.

    ``scale[n] = max_k |w[n, k]| / 127`` (1.0 for all-zero rows), ``w_int8 = round(w / scale)``
    clamped to ``[-127, 127]`` (the symmetric range; -128 is never used).

    Args:
        w: ``[N, K]`` float weight (``nn.Linear.weight``).

    Returns:
        ``(w_int8 [N, K] int8 contiguous, scale [N] float32)``.

    Raises:
        ValueError: ``w`` is not a 2-D float tensor.
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float tensor [N, K], got "
                         f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    wf = w.detach().to(torch.float32)
    amax = wf.abs().amax(dim=1)                                               # [N]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    w_int8 = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return w_int8, scale

