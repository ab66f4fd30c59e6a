"""Small-M matrix-vector kernel ("gemv") with fused prologues and epilogues, for decode steps of
one to four tokens: ``y = epilogue(prologue(x) @ W.T)``.

Why a separate kernel: at batch 1 a decode step is a chain of matrix-vector products whose only
real cost is reading the weights once. cuBLAS's bf16 GEMV reached 3.2 TB/s on the largest
Qwen2.5-1.5B projection on the H200 but only 0.9-1.1 TB/s on the small ones (O projection
4.7 MB in 6.4 us), and every RMSNorm, SiLU-and-mul and residual add around it is one more
launch of a few microseconds. This kernel

* streams ``BLOCK_N`` (1-8) weight rows a program through its K loop, accumulating
  ``x[m, k] * w[n, k]`` element-wise in fp32 (or, with ``red``, summed over runs of adjacent
  columns first) and reducing over K once at the end; with one or
  two rows a program there are thousands of programs, so many loads are in flight without
  software pipelining (``STAGES`` > 1 streams the tiles through shared memory with ``cp.async``;
  it measured slower on the H200 on 21 of 23 shapes, so the tuned configurations use 1);
* reads int8 weights with per-output-channel scales (the weight-only INT8 path, scale applied
  once in the epilogue), either row-major int8 or packed four a 32-bit word in *byte planes*
  (``quantization.pack_int8_planes``: byte ``j`` of word ``i`` is column ``j * K/4 + i``, so each
  plane pairs with a contiguous slice of x and the fp32 accumulator holds a quarter of the
  tile's weights; H200, M = 1: Qwen2.5-1.5B gate/up 7.22 -> 6.40 us, down 7.71 -> 7.27), or
  bf16/fp16/fp32 weights;
* fuses, on the input side, RMSNorm (``x * g`` is accumulated together with ``sum(x^2)``; the
  row's ``rsqrt(mean(x^2) + eps)`` is a per-row scalar, so it is applied once in the epilogue,
  exactly: ``sum_k (x_k r g_k) w_nk = r * sum_k (x_k g_k) w_nk``); on the output side bias, a
  residual add, or SwiGLU over a packed ``[gate; up]`` weight (each program reads gate row
  ``n`` and up row ``N + n`` and writes ``silu(gate) * up``, so the gate-up projection's
  output is already the down projection's input).

Why SwiGLU is an epilogue of gate-up and not a prologue of down: as a prologue, every program
of the down projection re-reads and re-activates the whole ``[2I]`` gate-up row from L2 (per
weight row: 2 x 8,960 bf16 for 8,960 weights, measured 15.8 us vs 9.1 us for Qwen2.5-1.5B's
down projection on the H200); as an epilogue it costs two extra rows of accumulators.

Numerics against the unfused path (HF Qwen2): the unfused path rounds the normalised
activation to the model dtype before the matmul; this kernel keeps it in fp32, so bf16
results differ by about one bf16 rounding of the activation (relative ~4e-3 per element,
averaged down by the K sum) and are slightly *closer* to the fp32 result. In fp32 (CPU tests)
both paths agree to rounding.

The same "many small row tiles, fp32 element-wise accumulation, one reduction" structure is what
gemlite's and TensorRT-LLM's weight-only GEMV kernels use; the RMSNorm-into-GEMV fusion is the
one in FlashInfer/TensorRT-LLM "fused add-RMSNorm + quantized GEMM" decoders, written here from
the algebra above.
"""

from __future__ import annotations

import json
import os.path
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .int8_layout import unpack_int8_planes
from ._launch import check_cpu_launch, num_sms, pdl_launch_kwargs, pdl_start, pdl_wait

__all__ = ["GemvConfig", "choose_gemv_config", "gemv", "gemv_qkv_rope", "gemv_reference", "GEMV_MAX_M",
           "tuned_gemv_config", "weight_kind"]

GEMV_MAX_M = 4  # most rows of x (every program serves all of them); larger M use a GEMM

PROLOGUES = {"none": 0, "rmsnorm": 1}


@triton.jit
def _load_w(w_base, k0, K, rk, EVEN_K: tl.constexpr):
    """One ``[1, BLOCK_N, BLOCK_K]`` weight tile (streamed once: evict first)."""
    if EVEN_K:
        w = tl.load(w_base + k0, eviction_policy="evict_first")
    else:
        w = tl.load(w_base + k0, mask=((k0 + rk) < K)[None, None, :], other=0,
                    eviction_policy="evict_first")
    return w


@triton.jit
def _row_tiles(w_ptr, row_a, row_b, stride_wn, k0, K, rk, EVEN_K: tl.constexpr, TWO_ROWS: tl.constexpr):
    """The weight tiles at columns ``k0 + rk`` of rows ``row_a`` and (``TWO_ROWS``) ``row_b``
    ``[1, BLOCK_N, BLOCK_K]`` each; without ``TWO_ROWS`` the second is the first again."""
    w = _load_w(w_ptr + row_a[None, :, None].to(tl.int64) * stride_wn + rk[None, None, :], k0, K, rk, EVEN_K)
    wb = w
    if TWO_ROWS:
        wb = _load_w(w_ptr + row_b[None, :, None].to(tl.int64) * stride_wn + rk[None, None, :], k0, K, rk,
                     EVEN_K)
    return w, wb


@triton.jit
def _prefetch_w(w_base, K, rk, blk, num_blocks):
    """The first tile of row block ``blk``, loaded only if that block exists."""
    live = (rk < K) & ((rk * 0 + blk) < num_blocks)                  # [BLOCK_K]
    return tl.load(w_base, mask=live[None, None, :], other=0, eviction_policy="evict_first")


@triton.jit
def _gemv_rows(blk, N, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr):
    """Outputs ``rn`` of row block ``blk`` (``rn_ld`` wrapped into range for loads) and their
    weight rows: ``row_a`` and the second row ``row_b`` of a GLU pair (``N`` rows below) or a
    RoPE pair (row ``j + D/2`` of the same head); ``head``/``j`` locate a RoPE pair."""
    rn = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_ld = rn % N                                          # wrapped: in-bounds loads, masked stores
    if ROPE:                                                # pair (head, j): rows j and j + HALF
        head = rn_ld // HALF
        j = rn_ld % HALF
        row_a = head * (2 * HALF) + j
        row_b = row_a + HALF
    else:
        head = rn_ld
        j = rn_ld
        row_a = rn_ld
        row_b = rn_ld + N                                   # GLU: the "up" row (unused otherwise)
    return rn, rn_ld, row_a, row_b, head, j


@triton.jit
def _plane_bytes(w, j: tl.constexpr):
    """Byte ``j`` (0 = lowest) of int32 words ``w``, sign-extended to int32: the weights of
    byte plane ``j`` (:func:`~llmserve.kernels.int8_layout.pack_int8_planes`)."""
    return (w << (24 - 8 * j)) >> 24


@triton.jit
def _fold(acc, prod, RED: tl.constexpr):
    """``acc + prod`` with ``prod`` ``[BM, BN, BK]``; ``RED > 1``: each run of ``RED`` adjacent
    K columns summed first, so ``acc`` is ``[BM, BN, BK // RED]`` (fewer accumulator registers,
    so more weight bytes in flight per SM at the same occupancy)."""
    if RED == 1:
        return acc + prod
    else:
        return acc + tl.sum(tl.reshape(prod, [prod.shape[0], prod.shape[1], prod.shape[2] // RED, RED]), axis=3)


@triton.jit
def _x_tile(x_base, g_ptr, sq, k0, K, rk, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr,
            RED: tl.constexpr = 1):
    """x at columns ``k0 + rk`` in fp32, with the RMSNorm gain applied (``sq += x^2`` first)."""
    if EVEN_K:
        x = tl.load(x_base + k0).to(tl.float32)
    else:
        x = tl.load(x_base + k0, mask=((k0 + rk) < K)[None, None, :], other=0.0).to(tl.float32)
    if PROLOGUE == 1:        # RMSNorm: x * g now, rsqrt(mean(x^2) + eps) in the epilogue
        sq = _fold(sq, x * x, RED)
        if EVEN_K:
            g = tl.load(g_ptr + k0 + rk).to(tl.float32)
        else:
            g = tl.load(g_ptr + k0 + rk, mask=(k0 + rk) < K, other=0.0).to(tl.float32)
        x = x * g[None, None, :]
    return x, sq


@triton.jit
def _gemv_step(acc, acc_b, sq, w, wb, x_base, g_ptr, k0, K, rk, PROLOGUE: tl.constexpr,
               TWO_ROWS: tl.constexpr, EVEN_K: tl.constexpr, PLANES: tl.constexpr, RED: tl.constexpr = 1):
    """Accumulate one K tile: ``acc += prologue(x) * w`` (and ``acc_b`` for the second weight row
    of a GLU / RoPE pair; ``sq += x^2`` for the RMSNorm prologue). With ``PLANES`` the tile is
    int32 words (``K`` counts words) and byte plane ``j`` pairs with x's columns ``j * K + k``."""
    if PLANES:
        for j in tl.static_range(4):
            x, sq = _x_tile(x_base + j * K, g_ptr + j * K, sq, k0, K, rk, PROLOGUE, EVEN_K, RED)
            acc = _fold(acc, x * _plane_bytes(w, j).to(tl.float32), RED)
            if TWO_ROWS:
                acc_b = _fold(acc_b, x * _plane_bytes(wb, j).to(tl.float32), RED)
    else:
        x, sq = _x_tile(x_base, g_ptr, sq, k0, K, rk, PROLOGUE, EVEN_K, RED)
        acc = _fold(acc, x * w.to(tl.float32), RED)
        if TWO_ROWS:
            acc_b = _fold(acc_b, x * wb.to(tl.float32), RED)
    return acc, acc_b, sq


@triton.jit
def _epilogue_operands(rm_ld, res_row, rn_ld, row_a, row_b, scale_ptr, bias_ptr, res_ptr, pos_ptr, slot_ptr,
                       stride_rm,
                       W_INT8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                       ROPE: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Operands of a row block's epilogue that do not depend on its result: int8 scales of
    rows a/b ``[1, BN]``, bias of rows a/b (of output ``n`` when not RoPE) ``[1, BN]``, the
    rows' positions and cache slots ``[BM]`` (RoPE), the residual ``[BM, BN]`` fp32 (rows
    ``res_row`` of ``res_ptr``, int64 ``[BM]``); zeros for
    what the kernel does not use. (The cos/sin rows are not here: their address depends on a
    load, and a warp issues in order, so loading them before the K loop would hold it back.)"""
    sc_a = tl.zeros([1, BLOCK_N], tl.float32)
    sc_b = tl.zeros([1, BLOCK_N], tl.float32)
    bias_a = tl.zeros([1, BLOCK_N], tl.float32)
    bias_b = tl.zeros([1, BLOCK_N], tl.float32)
    pos = tl.zeros([BLOCK_M], tl.int64)
    slot = tl.zeros([BLOCK_M], tl.int64)
    res = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if W_INT8:
        sc_a = tl.load(scale_ptr + row_a).to(tl.float32)[None, :]
        if TWO_ROWS:
            sc_b = tl.load(scale_ptr + row_b).to(tl.float32)[None, :]
    if HAS_BIAS:
        if ROPE:
            bias_a = tl.load(bias_ptr + row_a).to(tl.float32)[None, :]
            bias_b = tl.load(bias_ptr + row_b).to(tl.float32)[None, :]
        else:
            bias_a = tl.load(bias_ptr + rn_ld).to(tl.float32)[None, :]
    if ROPE:
        pos = tl.load(pos_ptr + rm_ld).to(tl.int64)
        slot = tl.load(slot_ptr + rm_ld).to(tl.int64)
    if HAS_RES:
        res = tl.load(res_ptr + res_row[:, None] * stride_rm + rn_ld[None, :]).to(tl.float32)
    return sc_a, sc_b, bias_a, bias_b, pos, slot, res


@triton.jit
def _gemv_block(blk, w, wb, rm, rm_ld, rk, x_ptr, w_ptr, y_ptr, scale_ptr, bias_ptr, res_ptr, g_ptr,
                kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots, ids_ptr,
                M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                W_INT8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                PROLOGUE: tl.constexpr, GLU: tl.constexpr, ROPE: tl.constexpr,
                HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, STAGES: tl.constexpr, EARLY_EPI: tl.constexpr,
                PLANES: tl.constexpr, X_GATHER: tl.constexpr, RES_GATHER: tl.constexpr,
                RED: tl.constexpr = 1, pre_sc_a=None, pre_sc_b=None, pre_bias_a=None, pre_bias_b=None,
                pre_pos=None, pre_slot=None, pre_c=None, pre_s=None, PRE: tl.constexpr = 1,
                w1=None, wb1=None, w2=None, wb2=None, w3=None, wb3=None):
    """Row block ``blk``: accumulate over K (``w``/``wb``: its first weight tiles, already
    loaded; with ``PRE`` > 1 also ``w1``/``wb1`` .. the tiles at ``BLOCK_K``, ``2 * BLOCK_K``,
    .., loaded before the PDL wait), then the epilogue and the stores. ``X_GATHER`` /
    ``RES_GATHER``: row ``m`` of x / of the residual is row ``ids[m]`` of that table (an
    embedding lookup). ``EARLY_EPI == 2``:
    the ``pre_*`` operands (scales, bias, RoPE positions / slots / cos / sin rows) were loaded
    by the caller before its PDL wait; only the residual is loaded here, before the K loop."""
    TWO_ROWS: tl.constexpr = GLU or ROPE
    rn, rn_ld, row_a, row_b, head, j = _gemv_rows(blk, N, BLOCK_N, ROPE, HALF)
    if X_GATHER or RES_GATHER:
        ids = tl.load(ids_ptr + rm_ld).to(tl.int64)                                      # [BM]
    x_row = rm_ld.to(tl.int64)
    if X_GATHER:
        x_row = ids
    res_row = rm_ld.to(tl.int64)
    if RES_GATHER:
        res_row = ids
    if EARLY_EPI == 2:  # loaded before the PDL wait (all but the residual, which a kernel wrote)
        sc_a, sc_b, bias_a, bias_b, pos, slot = pre_sc_a, pre_sc_b, pre_bias_a, pre_bias_b, pre_pos, pre_slot
        _, _, _, _, _, _, res = _epilogue_operands(                     # the residual only
            rm_ld, res_row, rn_ld, row_a, row_b, scale_ptr, bias_ptr, res_ptr, pos_ptr, slot_ptr, stride_rm,
            False, False, HAS_RES, False, TWO_ROWS, BLOCK_M, BLOCK_N)
    elif EARLY_EPI:  # the epilogue's operands requested now: their latency overlaps the K loop
        sc_a, sc_b, bias_a, bias_b, pos, slot, res = _epilogue_operands(
            rm_ld, res_row, rn_ld, row_a, row_b, scale_ptr, bias_ptr, res_ptr, pos_ptr, slot_ptr, stride_rm,
            W_INT8, HAS_BIAS, HAS_RES, ROPE, TWO_ROWS, BLOCK_M, BLOCK_N)
    w_base = w_ptr + row_a[None, :, None].to(tl.int64) * stride_wn + rk[None, None, :]   # [1, BN, BK]
    wb_base = w_ptr + row_b[None, :, None].to(tl.int64) * stride_wn + rk[None, None, :]
    x_base = x_ptr + x_row[:, None, None] * stride_xm + (rn * 0)[None, :, None] \
        + rk[None, None, :]                                                              # [BM, BN, BK]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // RED], dtype=tl.float32)
    if TWO_ROWS:
        acc_b = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // RED], dtype=tl.float32)
    else:
        acc_b = tl.zeros([1, 1, 1], dtype=tl.float32)
    if PROLOGUE == 1:
        sq = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // RED], dtype=tl.float32)
    else:
        sq = tl.zeros([1, 1, 1], dtype=tl.float32)
    acc, acc_b, sq = _gemv_step(acc, acc_b, sq, w, wb, x_base, g_ptr, 0, K, rk, PROLOGUE, TWO_ROWS,
                                EVEN_K, PLANES, RED)
    if PRE >= 2:
        acc, acc_b, sq = _gemv_step(acc, acc_b, sq, w1, wb1, x_base, g_ptr, BLOCK_K, K, rk, PROLOGUE,
                                    TWO_ROWS, EVEN_K, PLANES, RED)
    if PRE >= 3:
        acc, acc_b, sq = _gemv_step(acc, acc_b, sq, w2, wb2, x_base, g_ptr, 2 * BLOCK_K, K, rk, PROLOGUE,
                                    TWO_ROWS, EVEN_K, PLANES, RED)
    if PRE >= 4:
        acc, acc_b, sq = _gemv_step(acc, acc_b, sq, w3, wb3, x_base, g_ptr, 3 * BLOCK_K, K, rk, PROLOGUE,
                                    TWO_ROWS, EVEN_K, PLANES, RED)
    for k0 in tl.range(PRE * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        w = _load_w(w_base, k0, K, rk, EVEN_K)
        if TWO_ROWS:
            wb = _load_w(wb_base, k0, K, rk, EVEN_K)
        acc, acc_b, sq = _gemv_step(acc, acc_b, sq, w, wb, x_base, g_ptr, k0, K, rk, PROLOGUE,
                                    TWO_ROWS, EVEN_K, PLANES, RED)
    if not EARLY_EPI:
        sc_a, sc_b, bias_a, bias_b, pos, slot, res = _epilogue_operands(
            rm_ld, res_row, rn_ld, row_a, row_b, scale_ptr, bias_ptr, res_ptr, pos_ptr, slot_ptr, stride_rm,
            W_INT8, HAS_BIAS, HAS_RES, ROPE, TWO_ROWS, BLOCK_M, BLOCK_N)
    out = tl.sum(acc, axis=2)                                                            # [BM, BN]
    if TWO_ROWS:
        out_b = tl.sum(acc_b, axis=2)
    if PROLOGUE == 1:
        n_cols = K
        if PLANES:
            n_cols = 4 * K                                     # K counts words
        ms = tl.sum(sq, axis=2) / n_cols                       # [BM, BN], every column equal
        rstd = tl.math.rsqrt(ms + eps)
        out = out * rstd
        if TWO_ROWS:
            out_b = out_b * rstd
    if W_INT8:
        out = out * sc_a
        if TWO_ROWS:
            out_b = out_b * sc_b
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ROPE:
        # The unfused path: qkv = round(proj + bias); RoPE in fp32 on the rounded values (rotate
        # half: [a, b] -> [a cos - b sin, b cos + a sin]); q to y, k and v to the cache slot.
        if HAS_BIAS:
            out = out + bias_a
            out_b = out_b + bias_b
        a = out.to(y_ptr.dtype.element_ty).to(tl.float32)
        b = out_b.to(y_ptr.dtype.element_ty).to(tl.float32)
        slot = tl.where(slot < 0, slot + num_slots, slot)      # padding -> scratch block
        if EARLY_EPI == 2:
            c = pre_c
            s = pre_s
        else:
            c = tl.load(cos_ptr + pos[:, None] * HALF + j[None, :])                      # [BM, BN]
            s = tl.load(sin_ptr + pos[:, None] * HALF + j[None, :])
        is_v = (head >= HQ + HKV)[None, :]
        ra = tl.where(is_v, a, a * c - b * s)
        rb = tl.where(is_v, b, b * c + a * s)
        is_q = (head < HQ)[None, :]
        q_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + row_a[None, :]
        tl.store(q_ptrs, ra.to(y_ptr.dtype.element_ty), mask=mask & is_q)
        tl.store(q_ptrs + HALF, rb.to(y_ptr.dtype.element_ty), mask=mask & is_q)
        kv_row = tl.where(head < HQ + HKV, head - HQ, head - HQ - HKV) * (2 * HALF) + j   # [BN]
        c_off = slot[:, None] * (HKV * 2 * HALF) + kv_row[None, :]
        is_k = (head >= HQ)[None, :] & (head < HQ + HKV)[None, :]
        tl.store(kc_ptr + c_off, ra.to(kc_ptr.dtype.element_ty), mask=mask & is_k)
        tl.store(kc_ptr + c_off + HALF, rb.to(kc_ptr.dtype.element_ty), mask=mask & is_k)
        tl.store(vc_ptr + c_off, ra.to(vc_ptr.dtype.element_ty), mask=mask & is_v)
        tl.store(vc_ptr + c_off + HALF, rb.to(vc_ptr.dtype.element_ty), mask=mask & is_v)
    else:
        if GLU:
            # SwiGLU as the unfused path rounds it: gate and up projections, then silu(gate),
            # in the model dtype; the product in fp32, rounded once at the store
            g = out.to(y_ptr.dtype.element_ty).to(tl.float32)
            up = out_b.to(y_ptr.dtype.element_ty).to(tl.float32)
            out = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32) * up
        if HAS_BIAS:
            out = out + bias_a
        if HAS_RES:
            # the unfused path rounds the projection to the model dtype before the residual add
            out = res.to(tl.float32) + out.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
                 out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, scale_ptr, bias_ptr, res_ptr, g_ptr,
                 kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots, ids_ptr,
                 M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                 W_INT8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                 PROLOGUE: tl.constexpr, GLU: tl.constexpr, ROPE: tl.constexpr,
                 HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, STAGES: tl.constexpr, PERSISTENT: tl.constexpr,
                 USE_PDL: tl.constexpr, EARLY_EPI: tl.constexpr = False,
                 PDL_TRIGGER_FIRST: tl.constexpr = False, PLANES: tl.constexpr = False,
                 X_GATHER: tl.constexpr = False, RES_GATHER: tl.constexpr = False,
                 RED: tl.constexpr = 1, PRE: tl.constexpr = 1):
    """A program computes ``BLOCK_N`` outputs (a row block) for all ``M <= BLOCK_M`` rows of x:
    row block ``pid``, or with ``PERSISTENT`` (a grid smaller than the block count) blocks
    ``pid, pid + grid, ...``, which avoids a last partial wave; the first tile of its next
    block is then loaded before the current block's K loop.

    An output is one weight row, or (``GLU``) the pair gate row ``n`` / up row ``N + n``, or
    (``ROPE``) the pair of rows ``j`` and ``j + D/2`` of one head of the packed QKV weight, which
    RoPE rotates together. ``x`` is addressed as a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` tile with a
    zero stride along N (all N-rows of the tile read the same activations: L1 hits), so it
    arrives in the weight tile's register layout and no layout conversion is needed.

    ``X_GATHER`` / ``RES_GATHER``: x / the residual are tables whose rows ``ids[m]`` are read
    (the token embedding: the lookup needs no kernel of its own).

    With ``USE_PDL`` the first weight tile is loaded before the wait (:func:`pdl_wait`):
    weights never depend on the previous kernel, so their first bytes stream while that kernel
    drains (``PDL_TRIGGER_FIRST``: while the kernels before it drain too). ``PRE`` (1-4, not
    with ``PERSISTENT``): that many tiles of each weight row are requested before the wait,
    so the HBM time that latency-bound predecessors (decode attention, kernel boundaries)
    leave idle streams more of this kernel's weights.
    """
    TWO_ROWS: tl.constexpr = GLU or ROPE
    pdl_start(USE_PDL, PDL_TRIGGER_FIRST)
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rm_ld = rm % M
    rk = tl.arange(0, BLOCK_K)
    _, _, row_a, row_b, _, _ = _gemv_rows(pid, N, BLOCK_N, ROPE, HALF)
    w, wb = _row_tiles(w_ptr, row_a, row_b, stride_wn, 0, K, rk, EVEN_K, TWO_ROWS)
    w1, wb1, w2, wb2, w3, wb3 = w, wb, w, wb, w, wb                  # placeholders unless PRE > 1
    if PRE >= 2:
        tl.static_assert(not PERSISTENT, "PRE > 1 needs one row block a program")
        w1, wb1 = _row_tiles(w_ptr, row_a, row_b, stride_wn, BLOCK_K, K, rk, EVEN_K, TWO_ROWS)
    if PRE >= 3:
        w2, wb2 = _row_tiles(w_ptr, row_a, row_b, stride_wn, 2 * BLOCK_K, K, rk, EVEN_K, TWO_ROWS)
    if PRE >= 4:
        w3, wb3 = _row_tiles(w_ptr, row_a, row_b, stride_wn, 3 * BLOCK_K, K, rk, EVEN_K, TWO_ROWS)
    if EARLY_EPI == 2:
        # Operands no kernel of the forward pass writes (weights: scales, bias; step metadata:
        # RoPE positions, cache slots and the cos/sin rows they select), requested before the
        # wait, so the epilogue's dependent position -> cos/sin load is off the critical path.
        tl.static_assert(not PERSISTENT, "EARLY_EPI == 2 needs one row block a program")
        _, p_rn_ld, p_row_a, p_row_b, _, p_j = _gemv_rows(pid, N, BLOCK_N, ROPE, HALF)
        p_sc_a, p_sc_b, p_bias_a, p_bias_b, p_pos, p_slot, _ = _epilogue_operands(
            rm_ld, rm_ld.to(tl.int64), p_rn_ld, p_row_a, p_row_b, scale_ptr, bias_ptr, res_ptr, pos_ptr, slot_ptr,
            stride_rm, W_INT8, HAS_BIAS, False, ROPE, TWO_ROWS, BLOCK_M, BLOCK_N)
        if ROPE:
            p_c = tl.load(cos_ptr + p_pos[:, None] * HALF + p_j[None, :])
            p_s = tl.load(sin_ptr + p_pos[:, None] * HALF + p_j[None, :])
        else:
            p_c = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            p_s = p_c
    else:
        p_sc_a = tl.zeros([1, 1], tl.float32)
        p_sc_b = p_sc_a
        p_bias_a = p_sc_a
        p_bias_b = p_sc_a
        p_c = p_sc_a
        p_s = p_sc_a
        p_pos = tl.zeros([1], tl.int64)
        p_slot = p_pos
    pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)  # everything below may read what earlier kernels wrote
    if PERSISTENT:
        nprog = tl.num_programs(0)
        num_blocks = tl.cdiv(N, BLOCK_N)
        for blk in range(pid, num_blocks, nprog):
            w_cur = w
            wb_cur = wb
            nxt = blk + nprog          # the next block's first tile, in flight during this block
            _, _, nrow_a, nrow_b, _, _ = _gemv_rows(nxt % num_blocks, N, BLOCK_N, ROPE, HALF)
            w = _prefetch_w(w_ptr + nrow_a[None, :, None].to(tl.int64) * stride_wn + rk[None, None, :], K,
                            rk, nxt, num_blocks)
            if TWO_ROWS:
                wb = _prefetch_w(w_ptr + nrow_b[None, :, None].to(tl.int64) * stride_wn + rk[None, None, :],
                                 K, rk, nxt, num_blocks)
            else:
                wb = w
            _gemv_block(blk, w_cur, wb_cur, rm, rm_ld, rk, x_ptr, w_ptr, y_ptr, scale_ptr, bias_ptr, res_ptr, g_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots, ids_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                        W_INT8, HAS_BIAS, HAS_RES, PROLOGUE, GLU, ROPE, HQ, HKV, HALF, BLOCK_M, BLOCK_N,
                        BLOCK_K, EVEN_K, STAGES, EARLY_EPI, PLANES, X_GATHER, RES_GATHER, RED)
    else:
        _gemv_block(pid, w, wb, rm, rm_ld, rk, x_ptr, w_ptr, y_ptr, scale_ptr, bias_ptr, res_ptr, g_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots, ids_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                    W_INT8, HAS_BIAS, HAS_RES, PROLOGUE, GLU, ROPE, HQ, HKV, HALF, BLOCK_M, BLOCK_N,
                    BLOCK_K, EVEN_K, STAGES, EARLY_EPI, PLANES, X_GATHER, RES_GATHER, RED,
                    p_sc_a, p_sc_b, p_bias_a, p_bias_b, p_pos, p_slot, p_c, p_s, PRE,
                    w1, wb1, w2, wb2, w3, wb3)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch configuration of :func:`gemv`: ``block_n`` output columns a row block,
    ``block_k`` weight columns a step (32-bit words, four columns each, for int8 byte planes),
    ``stages`` tiles in flight (1: no pipelining), ``programs_per_sm`` (0: one program a row block; ``p``: at most ``p`` programs per SM, each
    looping over row blocks, which avoids a last partial wave), ``red`` (a power of two <=
    ``block_k``: runs of ``red`` adjacent K columns of the product tile are summed in registers
    before they reach the fp32 accumulators, which then hold ``block_k / red`` columns; with
    ``red`` = the elements one thread loads as one 16-byte vector the sum needs no shuffles, and
    the freed registers let more programs share an SM. H200, Qwen2.5-1.5B gate-up: 15.4 ->
    14.3 us with ``[1, 512, 1 warp]`` and red 8, ``scripts/bench_gemv.py``), ``pre``
    (1-4: weight tiles a program requests before its PDL wait; capped at the row's tile count,
    and 1 on a persistent grid)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    stages: int = 1
    programs_per_sm: int = 0
    red: int = 1
    pre: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= 1, got {v!r}")
        if self.num_warps > 16:
            raise ValueError(f"GemvConfig.num_warps must be <= 16, got {self.num_warps}")
        if not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"GemvConfig.stages must be an int >= 1, got {self.stages!r}")
        if not isinstance(self.programs_per_sm, int) or self.programs_per_sm < 0:
            raise ValueError(f"GemvConfig.programs_per_sm must be an int >= 0, got {self.programs_per_sm!r}")
        if not isinstance(self.red, int) or self.red < 1 or self.red & (self.red - 1) or self.red > self.block_k:
            raise ValueError(f"GemvConfig.red must be a power of two in [1, block_k], got {self.red!r}")
        if not isinstance(self.pre, int) or not 1 <= self.pre <= 4:
            raise ValueError(f"GemvConfig.pre must be an int in [1, 4], got {self.pre!r}")

    def as_list(self) -> list[int]:
        """The table form: ``[block_n, block_k, num_warps, stages(, programs_per_sm(, red(, pre)))]``."""
        v = [self.block_n, self.block_k, self.num_warps, self.stages, self.programs_per_sm, self.red, self.pre]
        while len(v) > 4 and v[-1] == (0, 1, 1)[len(v) - 5]:     # trailing defaults left out
            v.pop()
        return v


_TABLES: dict[str, dict[str, GemvConfig]] = {}
_DEFAULT_TABLE = os.path.join(os.path.dirname(__file__), "gemv_configs.json")


def _table(path: str | None = None) -> dict[str, GemvConfig]:
    """Tuned configurations: ``gemv_configs.json`` next to this file (``path``, default
    ``_DEFAULT_TABLE``: another table, for tests), written by ``scripts/bench_gemv.py --table`` from a device sweep. Keys are
    ``"<gpu name>|<float|int8|int8p>|<prologue>|<M>|<K>|<N>"`` (:func:`weight_kind`; ``K`` in
    columns), values ``[block_n, block_k, num_warps, stages]``, with ``programs_per_sm`` fifth and
    ``red`` sixth and ``pre`` seventh (:class:`GemvConfig`); malformed entries are ignored, and
    a missing or unreadable table gives no entries (the rules of :func:`choose_gemv_config`
    apply). Each file is read once per process."""
    path = path or _DEFAULT_TABLE
    if path not in _TABLES:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        configs = data.get("configs") if isinstance(data, dict) else None
        table = {}
        for key, v in (configs.items() if isinstance(configs, dict) else ()):
            if isinstance(v, list) and len(v) in (4, 5, 6, 7):
                try:
                    table[key] = GemvConfig(*v)
                except (TypeError, ValueError):
                    pass                            # malformed entries are skipped
        _TABLES[path] = table
    return _TABLES[path]


def weight_kind(w_dtype: torch.dtype) -> str:
    """Table name of a weight format: ``"float"``, ``"int8"`` or ``"int8p"`` (int8 byte planes,
    int32 words; their ``block_k`` counts words)."""
    return {torch.int8: "int8", torch.int32: "int8p"}.get(w_dtype, "float")


def table_key(gpu: str, int8: bool | str, prologue: str, m: int, k: int, n: int) -> str:
    """Key of one tuned configuration (see :func:`_table`); ``int8``: a :func:`weight_kind`
    name, or a bool (``True``: ``"int8"``, ``False``: ``"float"``). ``k`` counts columns."""
    kind = int8 if isinstance(int8, str) else ("int8" if int8 else "float")
    return f"{gpu}|{kind}|{prologue}|{m}|{k}|{n}"


def choose_gemv_config(m: int, n: int, k: int, w_dtype: torch.dtype, device: torch.device,
                       prologue: str = "none") -> GemvConfig:
    """Shape-keyed configuration (deterministic, CUDA-graph safe; no autotuning at run time).

    Order: the tuned table (exact GPU name, weight kind, prologue, M, K, N; for M = 3 the
    M = 4 entry), then a rule from the H200 sweeps of ``scripts/bench_gemv.py``: no software
    pipelining (``stages=1`` beat 2-4 on every
    shape: with one or two rows a program, many programs per SM keep enough loads in flight
    without it), 512-1024 weight elements a program and step, one or two rows a program; for
    int8 byte planes (``w_dtype`` int32) the same 2 KB a row and step in words. ``k`` counts
    columns for every weight kind. CPU (Triton interpreter): small tiles.
    """
    if device.type != "cuda":
        return GemvConfig(block_n=8, block_k=32, num_warps=1, stages=1)
    hit = tuned_gemv_config(m, n, k, w_dtype, device, prologue)
    if hit:
        return hit
    kind = weight_kind(w_dtype)
    bn = 1 if n <= 4096 else 2
    bk = max(64, (1024 if bn == 1 else 512) // triton.next_power_of_2(m))
    if kind == "int8p":             # words: the same 2 KB a row and step as the float rule
        bk //= 2
        k //= 4
    return GemvConfig(block_n=bn, block_k=min(bk, triton.next_power_of_2(k)), num_warps=4, stages=1)


def tuned_gemv_config(m: int, n: int, k: int, w_dtype: torch.dtype, device: torch.device,
                      prologue: str = "none") -> GemvConfig | None:
    """The tuned table's configuration for this GPU and shape (see :func:`_table`), or None
    (CPU devices, untuned shapes). M = 3 runs the kernel compiled for 4 rows (``BLOCK_M`` is
    the next power of two), so without an entry of its own it takes M = 4's (Qwen2.5-1.5B qkv
    int8 at M = 3: 8.33 us on the rule tile, 4.68 with M = 4's, on the H200)."""
    if device.type != "cuda":
        return None
    gpu, kind = _gpu_name(device), weight_kind(w_dtype)
    return _tuned(gpu, kind, prologue, m, k, n) or (
        _tuned(gpu, kind, prologue, triton.next_power_of_2(m), k, n) if m & (m - 1) else None)


def _tuned(gpu: str, int8: bool | str, prologue: str, m: int, k: int, n: int) -> GemvConfig | None:
    """The table's configuration for this shape; for an untuned ``"+rope"`` prologue, the plain
    projection's tile with half the rows (each output is two weight rows); ``None`` if neither."""
    hit = _table().get(table_key(gpu, int8, prologue, m, k, n))
    if hit is None and prologue.endswith("+rope"):
        plain = _table().get(table_key(gpu, int8, prologue[:-len("+rope")], m, k, 2 * n))
        if plain:
            hit = GemvConfig(max(1, plain.block_n // 2), plain.block_k, plain.num_warps, plain.stages,
                             plain.programs_per_sm, plain.red, plain.pre)
    return hit


_GPU_NAMES: dict[int, str] = {}


def _gpu_name(device: torch.device) -> str:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _GPU_NAMES:
        _GPU_NAMES[idx] = torch.cuda.get_device_name(idx)
    return _GPU_NAMES[idx]


def _check_gemv_inputs(x, weight, scale, bias, residual, prologue, norm_weight, eps, glu, out,
                       x_rows=None, residual_rows=None, early_epilogue=False):
    """Validate :func:`gemv`'s arguments (``ValueError`` with the reason); returns ``(M, N, K)``."""
    _check_early(early_epilogue)
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {sorted(PROLOGUES)}, got {prologue!r}")
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor with a contiguous last dim, got "
                         f"{x.dtype} {tuple(x.shape)} stride {x.stride()}")
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"weight must be [N, K] row-major, got {tuple(weight.shape)} stride {weight.stride()}")
    rows, k = weight.shape
    planes = weight.dtype == torch.int32
    if planes:                      # int8 byte planes: [N, K/4] words (pack_int8_planes)
        k *= 4
    m = x.shape[0]
    for name, t in (("x_rows", x_rows), ("residual_rows", residual_rows)):
        if t is not None and (t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or t.device != x.device
                              or (t.numel() > 1 and t.stride(0) != 1)):
            raise ValueError(f"{name} must be a contiguous 1-D int32/int64 tensor on {x.device}, got "
                             f"{t.dtype} {tuple(t.shape)} stride {t.stride()} on {t.device}")
    if x_rows is not None and residual_rows is not None and x_rows is not residual_rows:
        raise ValueError("x_rows and residual_rows must be the same tensor when both are given")
    if x_rows is not None:
        m = x_rows.shape[0]
    elif residual_rows is not None:
        if residual_rows.shape[0] != m:
            raise ValueError(f"residual_rows must have one entry per row of x (M={m}), got {residual_rows.shape[0]}")
    if residual_rows is not None and residual is None:
        raise ValueError("residual_rows needs a residual table")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns; weight [{rows}, {weight.shape[1]}]"
                         f"{' (int8 byte planes, 4 columns a word)' if planes else ''} needs {k}")
    if glu and (rows % 2 or bias is not None or residual is not None):
        raise ValueError("glu needs a packed [2N, K] weight (an even row count), no bias and no residual")
    n = rows // 2 if glu else rows
    if m > GEMV_MAX_M:
        raise ValueError(f"gemv serves M <= {GEMV_MAX_M} rows, got M={m}; use a GEMM")
    w_int8 = weight.dtype in (torch.int8, torch.int32)
    if w_int8 and (scale is None or scale.shape != (rows,)):
        raise ValueError(f"an int8 weight needs scale [{rows}] (one per weight row)")
    if not w_int8 and scale is not None:
        raise ValueError("scale is only for int8 weights (a float weight is used as is)")
    for name, t in (("scale", scale), ("bias", bias), ("norm_weight", norm_weight), ("residual", residual)):
        if t is not None and (not t.is_floating_point() or t.stride(-1) != 1):
            raise ValueError(f"{name} must be a floating-point tensor with a contiguous last dim, got "
                             f"{t.dtype} stride {t.stride()}")
    if not isinstance(eps, (int, float)):
        raise ValueError(f"eps must be a number, got {eps!r}")
    if not w_int8 and weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must be int8, int32 (int8 byte planes) or x's "
                         f"dtype {x.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [N={n}], got {tuple(bias.shape)}")
    if prologue == "rmsnorm" and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"prologue 'rmsnorm' needs norm_weight [K={k}]")
    if residual is not None and residual_rows is None and (residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [M={m}, N={n}] with a contiguous last dim, got "
                         f"{tuple(residual.shape)}")
    if residual_rows is not None and (residual.dim() != 2 or residual.shape[1] != n):
        raise ValueError(f"a residual table read through residual_rows must be [R, N={n}], got "
                         f"{tuple(residual.shape)}")
    for name, t in (("weight", weight), ("scale", scale), ("bias", bias), ("residual", residual),
                    ("norm_weight", norm_weight), ("out", out)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if x.device.type == "cpu":
        check_cpu_launch("gemv")
    return m, n, k


def _launch(x, weight, out, cfg: GemvConfig, n: int, *, scale=None, bias=None, residual=None,
            norm_weight=None, prologue="none", eps=1e-6, glu=False, pdl=False, rope=None,
            early_epilogue=False, pdl_trigger_first=False, x_rows=None, residual_rows=None) -> None:
    """Launch :func:`_gemv_kernel` over ``n`` outputs (validated arguments). ``rope``: ``(k_cache,
    v_cache, cos, sin, positions, slot_mapping, num_heads, num_kv_heads)`` for the QKV+RoPE
    epilogue (then ``n`` counts rotation pairs); ``x_rows`` / ``residual_rows``: gathered rows."""
    m, k = x.shape
    ids = x_rows if x_rows is not None else residual_rows
    if ids is not None:
        m = ids.shape[0]
    planes = weight.dtype == torch.int32
    if planes:                      # the kernel's K loop runs over words (4 columns each)
        k = weight.shape[1]
    dummy = weight
    if rope is not None:
        kc, vc, cos, sin, pos, slots, hq, hkv = rope
        rope_args = (kc, vc, cos, sin, pos, slots, kc.shape[0] * kc.shape[1])
        half = cos.shape[-1]
    else:
        hq = hkv = half = 1
        rope_args = (dummy, dummy, dummy, dummy, dummy, dummy, 0)
    blocks = triton.cdiv(n, cfg.block_n)
    if cfg.programs_per_sm:
        blocks = min(blocks, cfg.programs_per_sm * num_sms(x.device, cpu_default=2))
    persistent = blocks < triton.cdiv(n, cfg.block_n)
    _gemv_kernel[(blocks,)](
        x, weight, out, scale if scale is not None else dummy, bias if bias is not None else dummy,
        residual if residual is not None else out, norm_weight if norm_weight is not None else dummy,
        *rope_args, ids if ids is not None else dummy, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else out.stride(0), eps,
        W_INT8=weight.dtype in (torch.int8, torch.int32), PLANES=planes, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        PROLOGUE=PROLOGUES[prologue], GLU=glu, ROPE=rope is not None, HQ=hq, HKV=hkv, HALF=half,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, STAGES=cfg.stages, PERSISTENT=persistent,
        EARLY_EPI=_early_mode(early_epilogue, persistent), X_GATHER=x_rows is not None,
        RES_GATHER=residual_rows is not None, RED=min(cfg.red, cfg.block_k),
        PRE=1 if persistent else min(cfg.pre, triton.cdiv(k, cfg.block_k)), num_warps=cfg.num_warps,
        **pdl_launch_kwargs(pdl, pdl_trigger_first))


def _check_early(early_epilogue) -> None:
    """``ValueError`` for an ``early_epilogue`` other than False/True/0/1/2."""
    if type(early_epilogue) not in (bool, int) or early_epilogue not in (0, 1, 2):
        raise ValueError(f"early_epilogue must be False/True or 0/1/2, got {early_epilogue!r}")


def _early_mode(early_epilogue, persistent: bool) -> int:
    """The kernel's ``EARLY_EPI`` for a validated ``early_epilogue`` (:func:`_check_early`): 0
    (after the K loop), 1 (before it) or 2 (weights' and step metadata's operands before the
    PDL wait, the residual before the K loop); a persistent grid, whose programs serve several
    row blocks, uses 1 for 2."""
    return 1 if early_epilogue == 2 and persistent else int(early_epilogue)


def gemv_qkv_rope(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None,
                  norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                  scale: torch.Tensor | None = None, config: GemvConfig | None = None,
                  pdl: bool = False, early_epilogue: bool | int = False,
                  pdl_trigger_first: bool = False, x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm -> packed QKV projection -> RoPE on Q and K -> K/V written to the paged cache, in
    one kernel; returns Q. The same function as ``gemv(x, weight, bias=bias,
    prologue="rmsnorm", ...)`` followed by :func:`~llmserve.kernels.fused.rope_qkv_write_kv`
    (each program computes the weight rows ``j`` and ``j + D/2`` of one head, the pair RoPE
    rotates together, so the rotation is an epilogue and the QKV activations never leave
    registers).

    Args:
        x: ``[M, H]`` residual-stream rows, ``M <= GEMV_MAX_M``.
        weight: packed ``[(Hq + 2*Hkv) * D, H]`` q/k/v weight (float, or int8 with ``scale``,
            row-major or as byte planes ``[(Hq + 2*Hkv) * D, H / 4]`` int32).
        bias: ``[(Hq + 2*Hkv) * D]`` or ``None``.
        norm_weight, eps: the input RMSNorm.
        positions: ``[M]`` int64 positions; slot_mapping: ``[M]`` int64 cache slots (``-1``:
            padding, written to the scratch block, the cache's last block).
        cos, sin: fp32 ``[L, D/2]`` RoPE tables (``L`` > every position).
        k_cache, v_cache: contiguous ``[num_blocks + 1, block_size, Hkv, D]``.
        num_heads, num_kv_heads: ``Hq``, ``Hkv``.
        pdl: programmatic dependent launch (see :func:`gemv`).
        early_epilogue, pdl_trigger_first, x_rows: see :func:`gemv` (with ``x_rows``, ``x`` is
            the embedding table and ``M = len(x_rows)``).

    Returns:
        ``q`` ``[M, Hq, D]`` in ``x.dtype``.

    Raises:
        ValueError: as :func:`gemv`, plus cache / table / head-count mismatches.
    """
    m, rows, k = _check_gemv_inputs(x, weight, scale, bias, None, "rmsnorm", norm_weight, eps, False, None,
                                    x_rows, early_epilogue=early_epilogue)
    if k_cache.dim() != 4 or not (k_cache.is_contiguous() and v_cache.is_contiguous()) \
            or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must be contiguous [num_blocks + 1, block_size, Hkv, D] "
                         "tensors of one shape")
    nb, bs, hkv, d = k_cache.shape
    if hkv != num_kv_heads or rows != (num_heads + 2 * num_kv_heads) * d or d % 2:
        raise ValueError(f"weight rows {rows} must be (Hq + 2*Hkv) * D = ({num_heads} + 2*{num_kv_heads}) "
                         f"* {d} with the cache's Hkv={hkv}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] * 2 != d or cos.dtype != torch.float32 \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos/sin must be contiguous fp32 [L, {d // 2}], got {cos.dtype} {tuple(cos.shape)}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (m,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [M={m}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cos", cos), ("sin", sin),
                    ("positions", positions), ("slot_mapping", slot_mapping)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    q = torch.empty((m, num_heads, d), dtype=x.dtype, device=x.device)
    if m == 0:
        return q
    n_pairs = rows // 2
    cfg = config or choose_gemv_config(m, n_pairs, k, weight.dtype, x.device, "rmsnorm+rope")
    _launch(x, weight, q.view(m, num_heads * d), cfg, n_pairs, scale=scale, bias=bias,
            norm_weight=norm_weight, prologue="rmsnorm", eps=eps, pdl=pdl,
            rope=(k_cache, v_cache, cos, sin, positions, slot_mapping, num_heads, num_kv_heads),
            early_epilogue=early_epilogue, pdl_trigger_first=pdl_trigger_first, x_rows=x_rows)
    return q


def gemv(x: torch.Tensor, weight: torch.Tensor, *, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         prologue: str = "none", norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         glu: bool = False, out: torch.Tensor | None = None,
         config: GemvConfig | None = None, pdl: bool = False,
         early_epilogue: bool | int = False, pdl_trigger_first: bool = False,
         x_rows: torch.Tensor | None = None, residual_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``y = residual + (prologue(x) @ (weight * scale[:, None]).T + bias)`` for ``M <= 4`` rows
    (with ``glu``: ``y = silu(p[:, :N]) * p[:, N:]`` of that projection ``p``).

    Args:
        x: ``[M, K]`` activations, ``M <= GEMV_MAX_M``, last dim contiguous; fp16/bf16/fp32.
        weight: ``[N, K]`` (``[2N, K]`` = ``[gate; up]`` with ``glu``) row-major
            (``nn.Linear.weight`` orientation), int8 (then ``scale`` is required) or the float
            dtype of ``x``; or int8 byte planes, int32 ``[N, K / 4]`` (with ``scale``; see
            :func:`~llmserve.kernels.int8_layout.pack_int8_planes`).
        scale: per-output-channel scales of an int8 weight (one per weight row).
        bias: optional ``[N]`` (not with ``glu``).
        residual: optional ``[M, N]`` added after the projection (rounded to ``x.dtype``
            first, like the unfused ``x + proj(h)``). May be ``out`` itself (in place). With
            ``residual_rows`` a table ``[R, N]`` that must not share memory with ``out``.
        prologue: ``"none"`` or ``"rmsnorm"``: ``x -> norm_weight * x * rsqrt(mean(x^2) +
            eps)`` (Qwen2 RMSNorm, the normalised value kept in fp32).
        norm_weight: ``[K]`` RMSNorm gain for ``prologue="rmsnorm"``.
        eps: RMSNorm epsilon.
        glu: SwiGLU epilogue over the packed gate/up weight (Qwen2 MLP ``act(gate) * up``).
        out: optional ``[M, N]`` output buffer (contiguous last dim), ``x.dtype`` or (plain
            projections: no residual, no glu) float32, e.g. fp32 logits.
        config: launch override (default :func:`choose_gemv_config`).
        pdl: launch with programmatic dependent launch (Hopper+; see ``_launch.py``): the
            first ``config.pre`` weight tiles (default 1) are read before waiting for the
            previous kernel. Only for weights
            that no kernel just before this one writes (the engine's decode path).
        early_epilogue: request the epilogue's operands (scales, bias, residual, RoPE
            positions and slots) before the K loop instead of after it, so their latency
            overlaps the weight stream. Same results. On the H200 it shortened batch-1 decode
            of Qwen2.5-0.5B/1.5B shapes (1.5B 1.146 -> 1.079 ms/step) but lengthened 7B
            (3.82 -> 4.11), so the engine turns it on by model size
            (:class:`~llmserve.models.fused_forward.FastQwen2Forward`). ``2`` (with ``pdl``):
            the operands no kernel writes (int8 scales, bias; RoPE positions, slots and
            cos/sin rows) are read before the PDL wait, the residual after it (a persistent
            grid uses ``1``).
        pdl_trigger_first: with ``pdl``, let the next kernel launch before this one waits for
            its predecessor (``_launch.pdl_wait``), so several kernels ahead can read their
            weights early. Only when every kernel of the chain waits before touching what
            earlier kernels write (the engine's decode path). Same results.
        x_rows: optional int32/int64 ``[M]``: ``x`` is then a table ``[R, K]`` (e.g. the token
            embedding) and row ``m`` of the input is ``x[x_rows[m]]``, so an embedding lookup
            needs no kernel of its own. Indices are not range-checked (device data).
        residual_rows: the same for ``residual`` (a table ``[R, N]``); with ``x_rows`` it
            must be the same tensor.

    Returns:
        ``[M, N]`` in ``out``'s dtype (default ``x.dtype``); fp32 accumulation.

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not fit, ``M > GEMV_MAX_M``, an
            unknown prologue, CPU tensors while the kernels are not interpreted
            (``TRITON_INTERPRET=1`` set before start-up); ``x_rows`` /
            ``residual_rows`` that are not contiguous 1-D int32/int64 on x's device, differ from
            each other, or come without a residual table; ``out`` sharing memory with a
            residual table.
    """
    m, n, k = _check_gemv_inputs(x, weight, scale, bias, residual, prologue, norm_weight, eps, glu, out,
                                 x_rows, residual_rows, early_epilogue)
    if residual_rows is not None and out is not None and out.untyped_storage().data_ptr() == \
            residual.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with a residual table read through residual_rows")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif (out.shape != (m, n) or out.stride(-1) != 1
          or not (out.dtype == x.dtype or (out.dtype == torch.float32 and residual is None and not glu))):
        raise ValueError(f"out must be [M={m}, N={n}] {x.dtype} (or float32 without residual/glu) "
                         f"with a contiguous last dim, got {out.dtype} {tuple(out.shape)}")
    elif out.numel() and x.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with x (programs read all of x while others "
                         "write out); only out is residual is allowed")
    if m == 0:
        return out
    cfg = config or choose_gemv_config(m, n, k, weight.dtype, x.device, prologue + ("+glu" if glu else ""))
    _launch(x, weight, out, cfg, n, scale=scale, bias=bias, residual=residual, norm_weight=norm_weight,
            prologue=prologue, eps=eps, glu=glu, pdl=pdl, early_epilogue=early_epilogue,
            pdl_trigger_first=pdl_trigger_first, x_rows=x_rows, residual_rows=residual_rows)
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, *, scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                   prologue: str = "none", norm_weight: torch.Tensor | None = None,
                   eps: float = 1e-6, glu: bool = False) -> torch.Tensor:
    """PyTorch reference of :func:`gemv` in fp32 (same arguments; the activation is not
    rounded between prologue and matmul; the projection is rounded to ``x.dtype`` before the
    residual add and, with ``glu``, before and after the SiLU, as the unfused path does)."""
    xf = x.float()
    if prologue == "rmsnorm":
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    if weight.dtype == torch.int32:          # int8 byte planes
        weight = unpack_int8_planes(weight)
    w = weight.float()
    if scale is not None:
        w = w * scale.float()[:, None]
    y = xf @ w.T
    if glu:
        n = w.shape[0] // 2
        g, u = y[:, :n].to(x.dtype).float(), y[:, n:].to(x.dtype).float()
        return (torch.nn.functional.silu(g).to(x.dtype).float() * u).to(x.dtype)
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = residual.float() + y.to(x.dtype).float()
    return y.to(x.dtype)
