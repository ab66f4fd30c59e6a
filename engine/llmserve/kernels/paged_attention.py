"""Paged attention in Triton: KV-cache write, split-K decode ("flash-decoding") and a varlen
prefill/chunk kernel over block tables.

Layout (the same as :mod:`llmserve.attention.metadata` and the PyTorch reference
:func:`llmserve.attention.torch_backend.paged_attention_torch`):

* ``query`` ``[N, Hq, D]``: the flat varlen batch; sequence ``i`` owns rows
  ``query_start_loc[i] : query_start_loc[i+1]``.
* ``k_cache``/``v_cache`` ``[num_blocks + 1, block_size, Hkv, D]`` (contiguous; the last block
  is the engine's scratch block). Cache position ``p`` of sequence ``i`` lives at
  ``[block_tables[i, p // block_size], p % block_size]``.
* Query row ``j`` of sequence ``i`` has position ``context_lens[i] - q_len_i + j`` and attends
  to cache positions ``0 .. position`` (causal).

Kernels:

* ``_write_kv_kernel``: one program per new token; copies its ``[Hkv, D]`` key and value rows to
  the flat slot ``slot_mapping[n]``; slots ``< 0`` (padding) are skipped.
* ``_decode_kernel`` + ``_decode_reduce_kernel``: flash-decoding (Dao et al. 2023,
  "Flash-Decoding for long-context inference"). Grid ``(B, Hkv, num_splits)``: a program loads
  each K/V tile of its KV head once and uses it for all ``G = Hq / Hkv`` query heads of that KV
  head (the G rows are padded to ``G_PAD >= 16`` so the tile products run on ``tl.dot``); each
  split covers a contiguous range of the context and writes fp32 partial statistics (running
  max ``m``, sum ``l``, un-normalised output) that the reduction kernel merges with the
  log-sum-exp rule of online softmax (Milakov & Gimelshein 2018). With one split the decode
  kernel normalises and writes the output itself.
* ``_prefill_kernel``: FlashAttention-style (Dao et al. 2022) varlen kernel, grid
  ``(Hq, query tiles, B)``: a tile of query rows of one head streams the paged prefix and the
  causal part of its own chunk; tiles entirely below the tile's first query position skip the
  mask. Query heads are the fastest grid axis so the ``G`` heads sharing a KV head run next to
  each other and share the K/V tiles through L2; query tiles run last-first (longest first).
  A step replayed from a CUDA graph passes a tile schedule instead (grid ``(Hq, T)``, one
  program a listed (sequence, query tile), :func:`prefill_tile_schedule`), so a grid fixed at
  capture runs only the step's tiles, not ``B x`` the longest query's.

Mixed batches (some sequences decoding one token, others prefilling a chunk) run both kernels:
the decode kernel serves the ``q_len == 1`` sequences and the prefill kernel the rest, each
skipping the other's sequences, writing disjoint output rows.

All softmax arithmetic is fp32 (scores in the log2 domain, ``exp2``). On the GPU the tile
products take bf16/fp16 operands with fp32 accumulation (as FlashAttention does); fp32 inputs
use IEEE fp32 products. On CPU tensors (Triton interpreter) every loaded tile is cast to fp32
before any arithmetic, because the interpreter's bf16 arithmetic is wrong.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from ._launch import check_cpu_launch, num_sms, pdl_launch_kwargs, pdl_start, pdl_wait, zeroed_counters

__all__ = [
    "SPLIT_POLICIES",
    "SUPPORTED_HEAD_DIMS",
    "choose_num_splits",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_triton",
    "prefill_block_m",
    "prefill_tile_schedule",
    "write_kv_triton",
]

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
#: Default for merging decode splits inside the decode kernel (last split to finish) rather
#: than in a second launch.
DECODE_FUSED_REDUCE = True
#: Default of ``fused_max_splits``: above this many splits the separate (parallel) reduction
#: kernel is used. On the H200 the in-kernel merge (one split at a time) saved ~1-2 us at 2-5
#: splits but cost ~5 us at 32 (batch 1, context 2048). It merges only the non-empty splits, so
#: in a CUDA graph sized for ``max_model_len`` (32 splits at 2,048) a two-tile context merges
#: two and stays cheaper than kernel + reduction, while 32 non-empty splits do not. Hence the
#: split by *non-empty* splits below (numbers: docs/performance.md).
FUSED_REDUCE_MAX_SPLITS = 8
#: With more splits than that, sequences with at most this many non-empty splits are still
#: merged in the decode kernel (the reduction kernel skips them).
FUSED_REDUCE_INLINE = 8
#: Split-count policies of :func:`paged_attention_decode`: ``"legacy"`` (about 4 programs per
#: SM; the default: with CUDA-graph decode and ``max_context_len`` fixed to ``max_model_len``
#: most splits of short sequences are empty, and it gave the fastest decode kernel at batch
#: 256 with 3 pipeline stages on the H200) or ``"waves"`` (:func:`choose_num_splits`: whole
#: waves of programs, preferred when every sequence has the full context).
SPLIT_POLICIES = ("legacy", "waves")
#: Default pipeline depth of the default (64-position) decode tile on a GPU.
DECODE_STAGES = 3
_LOG2E = 1.4426950408889634
#: Few (sequence, KV head) pairs and a short context: one wide tile a program. At batch 1 the
#: decode kernel's time is a chain of dependent round trips (block table -> K/V -> scores ->
#: store, plus the split merge); a 256-position tile loads the whole context of most short
#: sequences at once and needs no merge. On the H200, batch-1 decode in short-context CUDA
#: graphs was faster for Qwen2.5-0.5B/1.5B/7B shapes with 256 positions (8 warps at head_dim
#: 128, 4 at 64); at batch 4 (8 pairs) faster at context 200 but slower at 300 (two tiles and
#: a merge), hence at most 4 pairs. Reading the old K/V rows of the tile before the PDL wait
#: (only the newest after it) measured slower. Used when ``batch * num_kv_heads <=
#: WIDE_MAX_PAIRS`` and ``max_context_len <= WIDE_MAX_CONTEXT`` unless ``wide_tile=False``.
WIDE_MAX_PAIRS = 4
WIDE_MAX_CONTEXT = 512


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_cb, stride_ct, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HKV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     PAGE: tl.constexpr):
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    offs_h = tl.arange(0, HKV_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    hmask = offs_h[:, None] < NUM_KV_HEADS                                    # [HKV_PAD, 1]
    blk = slot // PAGE
    off = slot % PAGE
    k = tl.load(key_ptr + n.to(tl.int64) * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=hmask, other=0.0)                                        # [HKV_PAD, D]
    v = tl.load(value_ptr + n.to(tl.int64) * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=hmask, other=0.0)
    dst = blk * stride_cb + off * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=hmask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def _kv_tile_offsets(bt_row_ptr, t, kvh, stride_kb, stride_kt, stride_kh,
                     PAGE: tl.constexpr, MASKED: tl.constexpr, tmask):
    """Element offsets ``[BLOCK_N]`` of cache positions ``t`` (one KV head) through the block
    table row."""
    if MASKED:
        page = tl.load(bt_row_ptr + t // PAGE, mask=tmask, other=0)
    else:
        page = tl.load(bt_row_ptr + t // PAGE)
    return page.to(tl.int64) * stride_kb + (t % PAGE) * stride_kt + kvh * stride_kh


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, t, kvh, offs_d, stride_kb, stride_kt, stride_kh,
                  PAGE: tl.constexpr, MASKED: tl.constexpr, tmask):
    """K and V tiles ``[BLOCK_N, D]`` of cache positions ``t`` (one KV head); with ``MASKED``,
    positions outside ``tmask`` read as 0."""
    off = _kv_tile_offsets(bt_row_ptr, t, kvh, stride_kb, stride_kt, stride_kh, PAGE, MASKED, tmask)
    ptrs = off[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + ptrs, mask=tmask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + ptrs, mask=tmask[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + ptrs)
        v = tl.load(v_cache_ptr + ptrs)
    return k, v


@triton.jit
def _masked_tile_step(q, k_cache_ptr, v_cache_ptr, off, tmask, offs_d, qk_scale, m_i, l_i, acc,
                      FP32_MATH: tl.constexpr, MAYBE_EMPTY: tl.constexpr):
    """Fold one masked key tile into the softmax state: positions with element offsets ``off``
    ``[BLOCK_N]`` (see :func:`_kv_tile_offsets`), only where ``tmask``; ``MAYBE_EMPTY``: the
    whole tile may be masked (an empty split's peeled first tile)."""
    ptrs = off[:, None] + offs_d[None, :]
    k = tl.load(k_cache_ptr + ptrs, mask=tmask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + ptrs, mask=tmask[:, None], other=0.0)
    s = tl.where(tmask[None, :], _qk(q, k, FP32_MATH) * qk_scale, float("-inf"))
    return _online_softmax_step(s, v, m_i, l_i, acc, FP32_MATH, MAYBE_EMPTY)


@triton.jit
def _prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of each address whose ``mask`` (int32) is non-zero (PTX ISA,
    "prefetch"): brings the line into L2 without holding registers for the data."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _qk(q, k, FP32_MATH: tl.constexpr):
    """Scores ``q @ k.T`` ``[R, BLOCK_N]`` in fp32 (exact fp32 products in the interpreter)."""
    if FP32_MATH:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, FP32_MATH: tl.constexpr, MAYBE_EMPTY: tl.constexpr):
    """Fold one key tile into the running softmax state (FlashAttention-2's online softmax,
    Dao 2023), base 2: ``s`` ``[R, BLOCK_N]`` scaled scores (``log2(e) / sqrt(D)`` already
    applied, masked positions ``-inf``), ``v`` ``[BLOCK_N, D]``; returns the new running max
    ``m_i [R]``, denominator ``l_i [R]`` and unnormalised output ``acc [R, D]``.
    ``MAYBE_EMPTY``: a row may have no visible key yet (causal diagonal), so its max stays
    ``-inf`` and must not be subtracted."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAYBE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_MATH:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# Arguments that change from step to step are not specialised (Triton would otherwise compile
# a new binary whenever one of them becomes 1 or a multiple of 16: seconds of stall in the
# middle of serving, seen as multi-second TTFT outliers in the first open-loop runs).
@triton.jit(do_not_specialize=["num_splits", "inline_max", "stride_btb"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
                   bt_ptr, ctx_ptr, qsl_ptr, qk_scale, num_splits, inline_max, num_q_heads,
                   stride_qn, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_on, stride_oh, stride_btb,
                   G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FP32_MATH: tl.constexpr,
                   SKIP_NON_DECODE: tl.constexpr, DIRECT_OUT: tl.constexpr,
                   MIN_TILES: tl.constexpr,
                   USE_PDL: tl.constexpr, PDL_TRIGGER_FIRST: tl.constexpr = False,
                   EARLY_PAGES: tl.constexpr = False, PREFETCH_KV: tl.constexpr = False):
    """Grid ``(B, Hkv, num_splits)``. The split of the context is decided here, per sequence:
    its ``ceil(ctx / BLOCK_N)`` tiles are spread over the ``num_splits`` programs
    (:func:`_active_splits`), so a short sequence in a grid sized for ``max_model_len`` (CUDA
    graphs) uses few programs; the others run no tiles and store nothing (no early return:
    the tile loop stays outside any branch).

    ``EARLY_PAGES``: the block-table entries of the split's first tile are read before the PDL
    wait (the table is step metadata), so after the wait the K/V loads of that tile depend on
    nothing but the wait; ``PREFETCH_KV`` (GPU only) also asks L2 for that tile's K/V lines
    before the wait (``prefetch.global.L2``: no registers held; the newest row, which the
    QKV kernel writes, is read again after the wait like every row)."""
    pdl_start(USE_PDL, PDL_TRIGGER_FIRST)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    # The step's metadata is written before the forward pass (PDL contract: not by the kernels
    # of the forward pass), so it is read before the wait; q and this step's K/V are not.
    q_row = tl.load(qsl_ptr + b)
    ctx = tl.load(ctx_ptr + b)
    tiles_per_split, active = _active_splits(ctx, num_splits, BLOCK_N, MIN_TILES)
    live = split < active  # splits past the sequence's context run no tiles and store nothing
    start = split * tiles_per_split * BLOCK_N
    end = tl.where(live, tl.minimum(start + tiles_per_split * BLOCK_N, ctx), start)
    if EARLY_PAGES:
        t0 = start + offs_n
        tmask0 = t0 < end
        off0 = _kv_tile_offsets(bt_row_ptr, t0, kvh, stride_kb, stride_kt, stride_kh, PAGE, True, tmask0)
        if PREFETCH_KV:
            lines = tl.arange(0, HEAD_DIM // 64) * 64              # 128-byte lines of a bf16 row
            pre = off0[:, None] + lines[None, :]
            pmask = (tmask0[:, None] & (lines[None, :] >= 0)).to(tl.int32)
            _prefetch_l2(k_cache_ptr + pre, pmask)
            _prefetch_l2(v_cache_ptr + pre, pmask)
    pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)
    if SKIP_NON_DECODE:
        if tl.load(qsl_ptr + b + 1) - q_row != 1:  # served by the prefill kernel
            return
    heads = kvh * G + offs_g                                                  # [G_PAD]
    gmask = offs_g < G
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)                               # [G_PAD, D]
    if FP32_MATH:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)

    if EARLY_PAGES:  # the first tile (masked) through the offsets read before the wait
        m_i, l_i, acc = _masked_tile_step(q, k_cache_ptr, v_cache_ptr, off0, tmask0, offs_d, qk_scale,
                                          m_i, l_i, acc, FP32_MATH, True)
        rest = start + BLOCK_N
    else:
        rest = start
    n_full = tl.maximum(end - rest, 0) // BLOCK_N
    full_end = rest + n_full * BLOCK_N
    # Full tiles: no masks.
    for n0 in range(rest, full_end, BLOCK_N):
        t = n0 + offs_n
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, t, kvh, offs_d, stride_kb, stride_kt,
                             stride_kh, PAGE, False, t)                       # [BLOCK_N, D] each
        s = _qk(q, k, FP32_MATH) * qk_scale                                   # [G_PAD, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, FP32_MATH, False)
    # Tail tile (fewer than BLOCK_N positions left): masked.
    if full_end < end:
        t = full_end + offs_n
        tmask = t < end
        off = _kv_tile_offsets(bt_row_ptr, t, kvh, stride_kb, stride_kt, stride_kh, PAGE, True, tmask)
        m_i, l_i, acc = _masked_tile_step(q, k_cache_ptr, v_cache_ptr, off, tmask, offs_d, qk_scale,
                                          m_i, l_i, acc, FP32_MATH, False)

    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    if DIRECT_OUT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    elif active == 1:  # the whole context in split 0: no partials (nothing to merge)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        first = (offs_g * 0 + split) == 0                                    # [G_PAD]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(gmask & first)[:, None])
    elif live:
        idx = (b.to(tl.int64) * num_q_heads + heads) * num_splits + split    # [G_PAD]
        tl.store(m_ptr + idx, m_i, mask=gmask)
        tl.store(l_ptr + idx, l_i, mask=gmask)
        tl.store(acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=gmask[:, None])
        if active <= inline_max:  # else the reduction kernel merges this sequence
            # The last active split of (sequence, KV head) to finish merges all active splits
            # (in split order: deterministic) and re-arms the counter; no reduction launch.
            # Partial stores are released by the barrier + acq_rel atomic and re-read from L2
            # (.cg).
            tl.debug_barrier()
            cnt = cnt_ptr + b * tl.num_programs(1) + kvh
            count = tl.atomic_add(cnt, 1)
            if count == active - 1:
                base = (b.to(tl.int64) * num_q_heads + heads) * num_splits            # [G_PAD]
                m_t = tl.full([G_PAD], float("-inf"), tl.float32)
                l_t = tl.zeros([G_PAD], tl.float32)
                o_t = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
                for sp in range(0, active):
                    m_s = tl.load(m_ptr + base + sp, mask=gmask, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(l_ptr + base + sp, mask=gmask, other=0.0, cache_modifier=".cg")
                    o_s = tl.load(acc_ptr + (base + sp)[:, None] * HEAD_DIM + offs_d[None, :],
                                  mask=gmask[:, None], other=0.0, cache_modifier=".cg")
                    m_n = tl.maximum(m_t, m_s)
                    m_n_safe = tl.where(m_n == float("-inf"), 0.0, m_n)
                    w_t = tl.exp2(m_t - m_n_safe)
                    w_s = tl.exp2(m_s - m_n_safe)
                    l_t = l_t * w_t + l_s * w_s
                    o_t = o_t * w_t[:, None] + o_s * w_s[:, None]
                    m_t = m_n
                out = o_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
                tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
                tl.atomic_xchg(cnt, 0)


@triton.jit
def _active_splits(ctx, num_splits, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """``(tiles_per_split, active)``: a context of ``ctx`` positions is ``ceil(ctx / BLOCK_N)``
    tiles, spread evenly over at most ``num_splits`` splits of at least ``MIN_TILES`` tiles (a
    short context is one split: no partials, no merge); ``active`` splits are non-empty."""
    tiles = tl.maximum(tl.cdiv(ctx, BLOCK_N), 1)
    tiles_per_split = tl.maximum(tl.cdiv(tiles, num_splits), MIN_TILES)
    return tiles_per_split, tl.cdiv(tiles, tiles_per_split)


@triton.jit(do_not_specialize=["num_splits", "inline_max"])
def _decode_reduce_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, qsl_ptr, ctx_ptr, num_splits, inline_max, num_q_heads,
                          stride_on, stride_oh,
                          HEAD_DIM: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                          MIN_TILES: tl.constexpr, SKIP_NON_DECODE: tl.constexpr, USE_PDL: tl.constexpr,
                          PDL_TRIGGER_FIRST: tl.constexpr = False):
    pdl_start(USE_PDL, PDL_TRIGGER_FIRST)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)
    q_row = tl.load(qsl_ptr + b)
    if SKIP_NON_DECODE:
        if tl.load(qsl_ptr + b + 1) - q_row != 1:
            return
    _, active = _active_splits(tl.load(ctx_ptr + b), num_splits, BLOCK_N, MIN_TILES)
    if active <= inline_max:  # the decode kernel merged (or wrote) this one itself
        return
    offs_s = tl.arange(0, S_BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (b.to(tl.int64) * num_q_heads + h) * num_splits
    m_t = tl.full([1], float("-inf"), tl.float32)
    l_t = tl.zeros([1], tl.float32)
    o_t = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, active, S_BLOCK):  # S_BLOCK splits at a time, merged online
        smask = (s0 + offs_s) < active
        m = tl.load(m_ptr + base + s0 + offs_s, mask=smask, other=float("-inf"))   # [S_BLOCK]
        l_s = tl.load(l_ptr + base + s0 + offs_s, mask=smask, other=0.0)           # [S_BLOCK]
        acc = tl.load(acc_ptr + (base + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=smask[:, None], other=0.0)                              # [S_BLOCK, D]
        m_new = tl.maximum(m_t, tl.max(m, 0))                                      # [1]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(m - m_safe)                                                    # 0 for empty splits
        w_t = tl.exp2(m_t - m_safe)
        l_t = l_t * w_t + tl.sum(w * l_s, 0)
        o_t = o_t * w_t + tl.sum(w[:, None] * acc, 0)
        m_t = m_new
    out = o_t / tl.where(l_t > 0, l_t, 1.0)                                        # [D]
    tl.store(out_ptr + q_row.to(tl.int64) * stride_on + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


@triton.jit
def schedule_entry(tile_ptr, j):
    """Entry ``j`` of a tile schedule (:func:`prefill_tile_schedule`'s ``sequence << 16 |
    query tile``) as ``(sequence, query tile)``; the sequence is -1 for a negative entry (no
    work)."""
    entry = tl.load(tile_ptr + j)
    return tl.where(entry < 0, -1, entry >> 16), entry & 0xFFFF


@triton.jit(do_not_specialize=["num_m_tiles", "stride_btb"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, ctx_ptr, qsl_ptr, tile_ptr,
                    qk_scale, num_m_tiles,
                    stride_qn, stride_qh, stride_kb, stride_kt, stride_kh,
                    stride_on, stride_oh, stride_btb,
                    G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_MATH: tl.constexpr,
                    SKIP_DECODE: tl.constexpr, SCHEDULED: tl.constexpr):
    """Grid ``(Hq, query tiles, B)``, or with ``SCHEDULED`` ``(Hq, T)``: program ``(h, j)``
    takes the tile ``tile_ptr[j]`` (``sequence << 16 | query tile``; negative: no work)."""
    h = tl.program_id(0)
    if SCHEDULED:
        b, m_tile = schedule_entry(tile_ptr, tl.program_id(1))
        if b < 0:
            return
    else:
        m_tile = num_m_tiles - 1 - tl.program_id(1)   # longest (last) query tiles first
        b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if SKIP_DECODE:
        if q_len <= 1:  # served by the decode kernel
            return
    if m_tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    kvh = h // G

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    mmask = offs_m < q_len
    q_pos = ctx - q_len + offs_m                                              # [BLOCK_M]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None], other=0.0)                               # [BLOCK_M, D]
    if FP32_MATH:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    first_pos = ctx - q_len + m_tile * BLOCK_M      # position of the tile's first query row
    kv_end = tl.minimum(ctx, first_pos + BLOCK_M)   # one past the last key any row may see
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # keys below: visible to every row
    for n0 in range(0, full_end, BLOCK_N):
        t = n0 + offs_n
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, t, kvh, offs_d, stride_kb, stride_kt,
                             stride_kh, PAGE, False, t)                       # [BLOCK_N, D] each
        s = _qk(q, k, FP32_MATH) * qk_scale                                   # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, FP32_MATH, False)
    for n0 in range(full_end, kv_end, BLOCK_N):  # the diagonal: causal mask
        t = n0 + offs_n
        tmask = t < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, t, kvh, offs_d, stride_kb, stride_kt,
                             stride_kh, PAGE, True, tmask)
        allowed = (t[None, :] <= q_pos[:, None]) & tmask[None, :]
        s = tl.where(allowed, _qk(q, k, FP32_MATH) * qk_scale, float("-inf"))
        # rows with nothing visible yet keep a -inf max
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, FP32_MATH, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed arrival counters for the fused split reduction."""
    return zeroed_counters("paged_attention", device, n)


def _on_cpu(t: torch.Tensor) -> bool:
    """True when ``t`` lives on the CPU, i.e. the kernels must run in the Triton interpreter.

    Raises:
        ValueError: CPU tensors while Triton compiled the kernels for a GPU (``TRITON_INTERPRET``
            was not ``1`` when they were defined): they cannot read host memory.
    """
    if t.device.type == "cpu":
        check_cpu_launch("the paged attention kernels")
        return True
    return False


def _num_sms(device: torch.device) -> int:
    return num_sms(device, cpu_default=16)


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides "
                         f"{tuple(t.stride())}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    _check_float("k_cache", k_cache, 4)
    _check_float("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must match: {tuple(k_cache.shape)} {k_cache.dtype} vs "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous "
                         "[num_blocks + 1, block_size, num_kv_heads, head_dim] tensors")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    nb, bs, hkv, d = k_cache.shape
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    if bs < 1 or bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two, got {bs}")
    return nb, bs, hkv, d


def _check_index(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be an int32 or int64 tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the KV cache is on {device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tuple(t.stride())}")


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into the paged cache (in place).

    Args:
        key, value: ``[N, Hkv, D]`` float (may be strided views, e.g. slices of a fused QKV
            output; the last dim must have stride 1). Cast to the cache dtype on store.
        k_cache, v_cache: contiguous ``[num_blocks + 1, block_size, Hkv, D]``.
        slot_mapping: ``[N]`` int64/int32 flat slots ``block * block_size + offset``; entries
            ``< 0`` (padding) are skipped (nothing is written, not even the scratch block).

    Raises:
        ValueError: wrong dtypes, shapes, devices or strides.
    """
    _, bs, hkv, d = _check_cache(k_cache, v_cache)
    for name, t in (("key", key), ("value", value)):
        _check_float(name, t, 3)
        if tuple(t.shape[1:]) != (hkv, d):
            raise ValueError(f"{name} must be [N, {hkv}, {d}] to match the cache, got {tuple(t.shape)}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but the KV cache is on {k_cache.device}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} rows but value has {value.shape[0]}")
    _check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    n = key.shape[0]
    if slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {n} tokens")
    if n == 0:
        return
    _on_cpu(k_cache)
    _write_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=hkv, HKV_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d, PAGE=bs,
        num_warps=1 if d * hkv <= 512 else 4)


def _check_attention_inputs(query, k_cache, v_cache, meta):
    _, bs, hkv, d = _check_cache(k_cache, v_cache)
    _check_float("query", query, 3)
    n, hq, dq = query.shape
    if dq != d:
        raise ValueError(f"query head_dim {dq} != cache head_dim {d}")
    if hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} must equal the KV cache dtype {k_cache.dtype}")
    if query.device != k_cache.device:
        raise ValueError(f"query is on {query.device} but the KV cache is on {k_cache.device}")
    if meta.block_size != bs:
        raise ValueError(f"meta.block_size ({meta.block_size}) != the cache's block size ({bs})")
    dev = k_cache.device
    _check_index("meta.query_start_loc", meta.query_start_loc, 1, dev)
    _check_index("meta.context_lens", meta.context_lens, 1, dev)
    _check_index("meta.block_tables", meta.block_tables, 2, dev)
    b = meta.context_lens.shape[0]
    if meta.query_start_loc.shape[0] != b + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {b + 1} entries, got "
                         f"{meta.query_start_loc.shape[0]}")
    if meta.block_tables.shape[0] != b:
        raise ValueError(f"block_tables has {meta.block_tables.shape[0]} rows for {b} sequences")
    return n, hq, hkv, d, bs, b


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, block_n: int,
                      num_sms: int, head_dim: int = 128) -> int:
    """Number of context splits for the decode kernel: whole waves of programs.

    A decode program of head_dim 128 (``BLOCK_N`` 64, 2 stages) holds ~64 KB of shared memory,
    so about 3 fit on an SM (``slots = 3 * num_sms``; proportionally more for smaller head
    dims, at most 8). The count is the smallest whose wave efficiency ``waves / ceil(waves)``
    (``waves = batch * num_kv_heads * splits / slots``) is within 5% of the best (fewer
    splits merge more cheaply), with no split shorter than one ``block_n`` tile, at most 128.

    Measured on the H200 (132 SMs, slots 396), 12/2 heads, D=128, bf16: batch 64, context 2048
    (128 programs a split): 3 splits (0.97 of a wave) 39-40 us, 4 (1.29 waves) 40-48 us, 5
    (1.62) 45 us, 1 58 us; batch 256 (512 a split): 1 split (1.29 waves) 161 us, 2 splits
    (2.59) 135 us (``llmserve bench-kernels``; docs/performance.md). Returns the count actually used after rounding the tiles
    per split.
    """
    tiles = max(1, triton.cdiv(max_context_len, block_n))
    base = max(1, batch * num_kv_heads)
    slots = num_sms * max(1, min(8, (3 * 128) // max(head_dim, 1)))
    eff = {}
    for s in range(1, min(tiles, 128) + 1):
        s = triton.cdiv(tiles, triton.cdiv(tiles, s))  # the count after rounding tiles per split
        waves = base * s / slots
        eff[s] = waves / math.ceil(waves)
    top = max(eff.values())
    return min(s for s, e in eff.items() if e >= 0.95 * top)


def _decode_config(d: int, on_cpu: bool, pairs: int = 1 << 30, max_ctx: int = 1 << 30,
                   elt: int = 2, *, wide_tile: bool = True, stages: int = DECODE_STAGES) -> dict:
    """Tile of the decode kernel: ``pairs`` = sequences x KV heads, ``max_ctx`` = the context
    bound (see :data:`WIDE_MAX_PAIRS`), ``elt`` = bytes per cache element (the wide tile is for
    16-bit caches: with fp32 K/V at head_dim 128 it needs 264 KB of shared memory, more than
    an H200 SM has); ``wide_tile``: allow the wide tile; ``stages``: pipeline depth of the
    default tile (the wide tile keeps 1)."""
    if on_cpu:
        return dict(BLOCK_N=16, num_warps=1, num_stages=1)
    if wide_tile and pairs <= WIDE_MAX_PAIRS and max_ctx <= WIDE_MAX_CONTEXT and d <= 128 and elt <= 2:
        return dict(BLOCK_N=256, num_warps=8 if d >= 128 else 4, num_stages=1, wide=True)
    return dict(BLOCK_N=64 if d <= 128 else 32, num_warps=4, num_stages=stages)


def _use_early_pages(wide: bool, early_pages: bool | None = None) -> bool:
    """Whether the decode kernel reads its first tile's block-table entries before the PDL
    wait: ``early_pages`` if given, else only with the wide tile (``wide``: the heuristic
    chose it; the regime where it was measured faster)."""
    return bool(wide) if early_pages is None else bool(early_pages)


def _check_decode_options(split_policy, stages, min_tiles, fused_max_splits) -> None:
    """``ValueError`` naming the first decode option outside its range."""
    if split_policy not in SPLIT_POLICIES:
        raise ValueError(f"split_policy must be one of {list(SPLIT_POLICIES)}, got {split_policy!r}")
    for name, v, lo, hi in (("stages", stages, 1, 8), ("min_tiles", min_tiles, 1, 1024),
                            ("fused_max_splits", fused_max_splits, 1, 128)):
        if type(v) is not int or not lo <= v <= hi:
            raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")


def paged_attention_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta, scale: float, out: torch.Tensor | None = None, *,
                           skip_non_decode: bool = False, num_splits: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, fused_reduce: bool | None = None,
                           pdl: bool = False, pdl_trigger_first: bool = False,
                           split_policy: str = "legacy", stages: int = DECODE_STAGES,
                           min_tiles: int = 1, fused_max_splits: int = FUSED_REDUCE_MAX_SPLITS,
                           wide_tile: bool = True, early_pages: bool | None = None,
                           prefetch_kv: bool = True) -> torch.Tensor:
    """Split-K decode attention: one query token per sequence (row ``query_start_loc[i]``).

    The grid has ``num_splits`` programs per (sequence, KV head), sized for
    ``meta.max_context_len``; each sequence spreads its own context over them and programs
    with no tiles exit at once, so a CUDA graph captured for ``max_model_len`` costs little for
    short sequences (and with one non-empty split the output is written without partials).

    Args:
        query: ``[N, Hq, D]``, same dtype as the cache.
        k_cache, v_cache: ``[num_blocks + 1, block_size, Hkv, D]`` contiguous.
        meta: :class:`~llmserve.attention.metadata.AttentionMetadata`.
        scale: softmax scale.
        out: optional ``[N, Hq, D]`` output (written only at the decode rows).
        skip_non_decode: leave sequences whose query length is not 1 untouched (mixed batches).
        num_splits, block_n, num_warps, num_stages: overrides of the heuristics (benchmarks).
        fused_reduce: merge the splits in the last-finishing split program (one launch)
            instead of a separate reduction kernel (default: :data:`DECODE_FUSED_REDUCE` when
            ``num_splits <= fused_max_splits``).
        pdl: launch with programmatic dependent launch (Hopper+): the step's metadata
            (``query_start_loc``, ``context_lens``) is read before waiting for the previous
            kernel, so no kernel of the PDL chain before this one may write it (the engine
            writes it before the forward pass); q and the K/V cache are read after the wait.
        pdl_trigger_first: with ``pdl``, let the next kernel launch before this one waits
            (see :func:`~llmserve.kernels.gemv.gemv`).
        split_policy: how many splits the grid has (:data:`SPLIT_POLICIES`; ignored with
            ``num_splits``).
        stages: pipeline depth of the default 64-position tile on a GPU, in [1, 8].
        min_tiles: fewest K/V tiles a split takes (contexts up to this many tiles are one
            split, written without partials or a merge), >= 1; an explicit ``num_splits``
            uses 1. At 1 (the default) a two-tile context at batch 1 takes two splits and a
            merge, which measured faster than one split of two tiles on the H200.
        fused_max_splits: most splits merged inside the decode kernel (more: the reduction
            kernel, except for sequences with at most :data:`FUSED_REDUCE_INLINE` non-empty
            splits), in [1, 128].
        wide_tile: allow the wide tile for few sequences and short contexts
            (:data:`WIDE_MAX_PAIRS`).
        early_pages: read the first tile's block-table entries before the PDL wait
            (``None``: with the wide tile only). Same results.
        prefetch_kv: with ``early_pages``, on an NVIDIA GPU and a 16-bit cache whose head_dim
            is a multiple of 64, ask L2 for the first tile's K/V rows before the PDL wait
            (``prefetch.global.L2``). Same results.

    Returns:
        ``out`` (allocated when not given; rows not written are zero when allocated here).

    Raises:
        ValueError: inconsistent shapes, dtypes, devices or strides; a decode option outside
            its range.
    """
    _check_decode_options(split_policy, stages, min_tiles, fused_max_splits)
    n, hq, hkv, d, bs, b = _check_attention_inputs(query, k_cache, v_cache, meta)
    on_cpu = _on_cpu(query)
    if out is None:
        out = torch.zeros_like(query) if (n != b or skip_non_decode) else torch.empty_like(query)
    if b == 0 or n == 0:
        return out
    max_ctx = max(int(meta.max_context_len), 1)
    cfg = _decode_config(d, on_cpu, b * hkv, max_ctx, k_cache.element_size(), wide_tile=wide_tile,
                         stages=stages)
    wide = cfg.pop("wide", False)      # the wide tile keeps its own stage count (1)
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    if num_warps is not None:
        cfg["num_warps"] = num_warps
    if num_stages is not None:
        cfg["num_stages"] = num_stages
    bn = cfg["BLOCK_N"]
    tiles = triton.cdiv(max_ctx, bn)
    num_splits_override = num_splits is not None
    if num_splits is None and split_policy == "legacy":
        num_splits = min(tiles, max(1, triton.cdiv(4 * _num_sms(query.device), max(1, b * hkv))), 128)
    if num_splits is None:
        num_splits = choose_num_splits(b, hkv, max_ctx, bn, _num_sms(query.device), d)
    num_splits = max(1, min(int(num_splits), tiles))
    min_tiles = 1 if num_splits_override else min_tiles
    num_splits = max(1, min(num_splits, triton.cdiv(tiles, min_tiles)))
    num_splits = triton.cdiv(tiles, triton.cdiv(tiles, num_splits))  # whole tiles a split
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    direct = num_splits == 1
    fused_reduce_default = fused_reduce is None and DECODE_FUSED_REDUCE
    if fused_reduce is None:  # the in-kernel merge runs in one program: not too many splits
        fused_reduce = DECODE_FUSED_REDUCE and num_splits <= fused_max_splits
    fused = fused_reduce and not direct
    # Splits merged inside the decode kernel (last split to finish): all of them when fused;
    # otherwise sequences with at most FUSED_REDUCE_INLINE non-empty splits (short contexts in a
    # grid sized for max_model_len), the reduction kernel taking the rest.
    inline_max = num_splits if fused else (FUSED_REDUCE_INLINE if fused_reduce_default else 1)
    cnt = _counters(query.device, b * hkv) if inline_max > 1 else meta.context_lens
    if direct:
        m_buf = l_buf = acc_buf = out  # unused
    else:
        m_buf = torch.empty((b, hq, num_splits), dtype=torch.float32, device=query.device)
        l_buf = torch.empty_like(m_buf)
        acc_buf = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=query.device)
    fp32_math = on_cpu or query.dtype == torch.float32
    # With the wide tile (few sequences, short contexts): the block-table entries of the first
    # tile read before the PDL wait, and (16-bit caches on a GPU) an L2 prefetch of its K/V
    # rows; faster batch-1 decode for Qwen2.5-0.5B/1.5B/7B shapes on the H200. Not measured
    # with the default tile (larger batches), whose empty splits would also run the peeled
    # tile's (masked) arithmetic: kept off there unless early_pages=True.
    early_pages = _use_early_pages(wide, early_pages)
    prefetch = (prefetch_kv and k_cache.element_size() == 2
                and d % 64 == 0 and torch.version.hip is None)       # inline PTX: NVIDIA only
    _decode_kernel[(b, hkv, num_splits)](
        query, k_cache, v_cache, out, m_buf, l_buf, acc_buf, cnt,
        meta.block_tables, meta.context_lens, meta.query_start_loc,
        float(scale) * _LOG2E, num_splits, inline_max, hq,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        G=g, G_PAD=g_pad, HEAD_DIM=d, PAGE=bs, BLOCK_N=bn, FP32_MATH=fp32_math,
        SKIP_NON_DECODE=skip_non_decode, DIRECT_OUT=direct,
        MIN_TILES=min_tiles, EARLY_PAGES=early_pages, PREFETCH_KV=early_pages and prefetch and not on_cpu,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch_kwargs(pdl, pdl_trigger_first))
    if not direct and not fused:
        _decode_reduce_kernel[(b, hq)](
            out, m_buf, l_buf, acc_buf, meta.query_start_loc, meta.context_lens, num_splits, inline_max, hq,
            out.stride(0), out.stride(1),
            HEAD_DIM=d, S_BLOCK=min(16, triton.next_power_of_2(num_splits)), BLOCK_N=bn,
            MIN_TILES=min_tiles, SKIP_NON_DECODE=skip_non_decode, num_warps=1 if on_cpu else 4,
            **pdl_launch_kwargs(pdl, pdl_trigger_first))
    return out


def _prefill_config(d: int, on_cpu: bool) -> dict:
    if on_cpu:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    if d <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if d <= 128:  # H200 sweep, 4 x 2048 fresh prefill: 194 us (4 warps) vs 211 us (8 warps)
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def paged_attention_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta, scale: float, out: torch.Tensor | None = None, *,
                            skip_decode: bool = False, block_m: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> torch.Tensor:
    """Varlen causal attention of query chunks against their paged prefix and themselves.

    Args:
        query: ``[N, Hq, D]``, same dtype as the cache.
        k_cache, v_cache: ``[num_blocks + 1, block_size, Hkv, D]`` contiguous, already holding
            this step's K/V.
        meta: :class:`~llmserve.attention.metadata.AttentionMetadata` (uses ``max_query_len``;
            with ``prefill_tiles`` the grid is ``(Hq, len(prefill_tiles))`` and runs the listed
            tiles, built by :func:`prefill_tile_schedule` with :func:`prefill_block_m`).
        scale: softmax scale.
        out: optional ``[N, Hq, D]`` output.
        skip_decode: leave sequences with query length 1 to the decode kernel.
        block_m, block_n, num_warps, num_stages: overrides of the per-head-dim config.

    Returns:
        ``out`` (zero-initialised when allocated here, so padding rows are zero).

    Raises:
        ValueError: inconsistent shapes, dtypes, devices or strides.
    """
    n, hq, hkv, d, bs, b = _check_attention_inputs(query, k_cache, v_cache, meta)
    on_cpu = _on_cpu(query)
    if out is None:
        out = torch.zeros_like(query)
    if b == 0 or n == 0 or meta.max_query_len <= 0:
        return out
    cfg = _prefill_config(d, on_cpu)
    tiles = meta.prefill_tiles
    if tiles is not None:
        if block_m is not None and block_m != cfg["BLOCK_M"]:
            raise ValueError(f"meta.prefill_tiles are built for BLOCK_M={cfg['BLOCK_M']} "
                             f"(prefill_block_m), not block_m={block_m}")
        if not skip_decode:
            raise ValueError("meta.prefill_tiles list the sequences of more than one query row: "
                             "run the prefill kernel with skip_decode=True next to the decode kernel")
        _check_index("meta.prefill_tiles", tiles, 1, k_cache.device)
    for key, val in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("num_warps", num_warps),
                     ("num_stages", num_stages)):
        if val is not None:
            cfg[key] = val
    num_m_tiles = triton.cdiv(int(meta.max_query_len), cfg["BLOCK_M"])
    fp32_math = on_cpu or query.dtype == torch.float32
    if tiles is not None:
        grid = (hq, tiles.shape[0])
    else:
        tiles, grid = meta.query_start_loc, (hq, num_m_tiles, b)  # tiles unused
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, meta.block_tables, meta.context_lens, meta.query_start_loc,
        tiles, float(scale) * _LOG2E, num_m_tiles,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        G=hq // hkv, HEAD_DIM=d, PAGE=bs, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        FP32_MATH=fp32_math, SKIP_DECODE=skip_decode, SCHEDULED=len(grid) == 2,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def prefill_block_m(head_dim: int, device: torch.device | str) -> int:
    """Query rows per tile of the prefill kernel for ``head_dim`` on ``device``: the unit of a
    tile schedule (:func:`prefill_tile_schedule`)."""
    return _prefill_config(head_dim, torch.device(device).type == "cpu")["BLOCK_M"]


def prefill_tile_schedule(query_start_loc, block_m: int, out, skip_decode: bool = True) -> int:
    """Write the prefill kernel's work list for one step into ``out`` (host arrays).

    Entry ``j`` is ``sequence << 16 | query tile`` for every query tile of every sequence with
    more than one query row (or every sequence, without ``skip_decode``), each sequence's
    tiles last-first (its longest-context tiles start first); the rest of ``out`` is ``-1``.
    A grid sized for ``len(out)`` then runs exactly the step's tiles whatever the batch looks
    like, which is what a captured CUDA graph needs (its grid is fixed at capture).

    Args:
        query_start_loc: ``[B+1]`` integer array (``cu_seqlens_q``).
        block_m: query rows per tile (:func:`prefill_block_m`).
        out: ``[T]`` int32 numpy array, ``T >= ceil(N / block_m) + B`` always suffices.

    Returns:
        The number of tiles written.

    Raises:
        ValueError: ``block_m`` below 1, ``out`` too short, or a sequence index or tile that does
            not fit 16 bits.
    """
    if type(block_m) is not int or block_m < 1:
        raise ValueError(f"block_m must be an integer >= 1, got {block_m!r}")
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    qlen = np.diff(qsl)
    seqs = np.nonzero(qlen > 1 if skip_decode else qlen > 0)[0]
    counts = -(-qlen[seqs] // block_m)
    total = int(counts.sum())
    if total > out.shape[0]:
        raise ValueError(f"tile schedule needs {total} entries, out has {out.shape[0]}")
    if len(seqs) and (int(seqs[-1]) >= 1 << 15 or int(counts.max()) > 1 << 16):
        raise ValueError("tile schedule entries hold a sequence index < 32768 and a tile < 65536")
    if total:
        seq_of = np.repeat(seqs, counts)                                   # [total]
        first = np.cumsum(counts) - counts                                 # each sequence's first entry
        tile = np.repeat(counts - 1, counts) - (np.arange(total) - np.repeat(first, counts))
        out[:total] = (seq_of << 16) | tile
    out[total:] = -1
    return total


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta, scale: float, **decode_options) -> torch.Tensor:
    """Causal paged attention of a flat varlen batch (same contract as
    :func:`llmserve.attention.torch_backend.paged_attention_torch`).

    Decode-only steps (``meta.is_decode_only``: exactly one query row per sequence) take the
    split-K decode kernel alone; other steps run the decode kernel for their ``q_len == 1``
    sequences and the prefill kernel for the rest (each skips the other's sequences).

    Args:
        query: ``[N, Hq, D]`` float16/bfloat16/float32 (the cache dtype).
        k_cache, v_cache: ``[num_blocks + 1, block_size, Hkv, D]``, contiguous, holding this
            step's K/V.
        meta: :class:`~llmserve.attention.metadata.AttentionMetadata`.
        scale: softmax scale (usually ``D ** -0.5``).
        decode_options: keyword options of :func:`paged_attention_decode` (``split_policy``,
            ``stages``, ``min_tiles``, ``fused_max_splits``, ``wide_tile``, ``early_pages``,
            ``prefetch_kv``) for the decode kernel.

    Returns:
        ``[N, Hq, D]`` in ``query.dtype``; rows not covered by ``query_start_loc`` are zero.

    Raises:
        ValueError: inconsistent shapes, dtypes, devices or strides; head_dim not in
            :data:`SUPPORTED_HEAD_DIMS`.
    """
    if meta.is_decode_only:
        return paged_attention_decode(query, k_cache, v_cache, meta, scale, **decode_options)
    out = torch.zeros_like(query)
    paged_attention_decode(query, k_cache, v_cache, meta, scale, out, skip_non_decode=True, **decode_options)
    paged_attention_prefill(query, k_cache, v_cache, meta, scale, out, skip_decode=True)
    return out

