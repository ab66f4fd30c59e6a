"""Batch-invariant kernels for the GPU: a matrix product and a paged attention whose result for a
row does not depend on how many rows share the launch or how a prompt was chunked.

Why the ordinary kernels are not: cuBLAS picks a kernel (tile shape, split-K factor, matrix-vector
path) from the call's shape, and each sums a row's products in its own order; the decode
attention splits a context into a number of pieces chosen from the batch size; the prefill
kernel starts its masked (diagonal) tiles where a chunk starts. bf16 near-ties then turn the
difference into other tokens. The remedy (Thinking Machines Lab, He et al. 2025, "Defeating
Nondeterminism in LLM Inference") is to fix the reduction order of every row:

* :func:`invariant_linear`: a program computes a ``BLOCK_M x BLOCK_N`` output tile by walking
  ``K`` from 0 with ``tl.dot`` into one fp32 accumulator (no split-K), with the same MMA
  instruction whatever the tile; so every output element goes through the same sequence of
  16-wide products and adds whatever ``M`` is and wherever its row sits in its tile (a
  tensor-core MMA computes each output element from its own row and column only). The tile
  sizes may then follow ``M`` (:func:`invariant_linear_config`: narrow tiles for decode steps,
  large ones for prefill steps).
* :func:`invariant_paged_attention`: one computation for prefill, chunked prefill and decode
  rows. A row's context is cut into segments of ``segment`` positions at absolute offsets;
  each segment is folded from the empty state in key tiles of ``BLOCK_N`` positions at absolute
  offsets with the online softmax (Milakov & Gimelshein 2018), always masked, and the segments'
  states are folded in ascending order (split-KV with a fixed split size, as in the reference
  above). A key tile or segment past a row's own position changes nothing bit for bit (its
  scores are ``-inf``: the rescale factor is exactly 1 and the added terms exactly 0), so a row
  gets the same bits whether its program runs more tiles for other rows or stops at its own,
  whatever chunk it arrived in and whether its prefix came from the prefix cache. Steps with a
  prompt token fold a row's segments inside one program (up to ``BLOCK_M // G`` query tokens
  of one sequence with the ``G`` query heads of one KV head); decode steps compute the
  segments in parallel programs and fold them in a second kernel, with the same function.

The other ops of the fused forward are per row already (RMSNorm programs reduce one row each,
RoPE, SiLU-and-mul and the residual adds are elementwise, the greedy argmax reduces one row a
program).

Configurations are arguments with defaults sized for Hopper; both kernels run on CPU tensors in
Triton's interpreter (fp32 math there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_cpu_launch, num_sms
from .paged_attention import (
    _LOG2E,
    _check_attention_inputs,
    _check_index,
    _load_kv_tile,
    _online_softmax_step,
    _qk,
    schedule_entry,
)

__all__ = ["decode_segment_programs", "invariant_linear", "invariant_linear_config",
           "invariant_paged_attention", "invariant_tile_tokens"]


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, FP32_MATH: tl.constexpr):
    """Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``: output tile ``(pid_m, pid_n)`` of
    ``x @ w.T + b``, ``K`` walked from 0 in ``BLOCK_K`` steps. Row tiles are the fast grid axis:
    the programs that share a weight tile run together and read it from HBM once (with columns
    first, a product of many row tiles streams a weight larger than the L2 once a row tile)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        a = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_rows + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)  # [BK, BN]
        if FP32_MATH:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


# Row counts from which larger tiles pay: decode steps of many sequences, then prefill steps.
INVARIANT_MID_M = 128
INVARIANT_LARGE_M = 512


def invariant_linear_config(n: int, k: int, on_cpu: bool = False, m: int = 1) -> dict:
    """The tile configuration :func:`invariant_linear` uses for ``m`` rows times a ``[n, k]``
    weight.

    Every configuration accumulates ``K`` from 0 in the same 16-wide tensor-core steps into an
    fp32 accumulator, with no split of ``K``, so an output element gets the same bits from any
    of them: what fixes a row's bits is the order over ``K``, not the tile's width or height
    (checked bitwise across the thresholds on the GPU by ``tests/test_invariant_kernels.py``).
    The tiles can therefore follow the step's size:

    * below :data:`INVARIANT_MID_M` rows (decode steps; reading the weight is the cost): 64-row
      tiles, ``BLOCK_N`` 16 with ``BLOCK_K`` 128 and 6 stages for the narrow (<= 4,096 outputs)
      or long (``K`` >= 4,096) weights, so a small weight still spreads over the GPU with enough
      bytes in flight; 64 x 64 for wider ones and 64 x 128 beyond 32,768 outputs (the LM head);
    * up to :data:`INVARIANT_LARGE_M`: 128 x 128 (8 warps) for wide weights, 64 x 32 x 128 for
      long ones, 64 x 64 x 128 otherwise;
    * from it on (prefill steps): 128 x 128 x 64, 8 warps, 3 stages.

    Measured per shape on an H100 at M = 1..2048 (docs/performance.md). On CPU (the
    interpreter): 16 x 16 x 16 tiles for every ``m``.
    """
    if on_cpu:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1)
    if m >= INVARIANT_LARGE_M or (m >= INVARIANT_MID_M and n > 4096):
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    if m >= INVARIANT_MID_M:
        return dict(BLOCK_M=64, BLOCK_N=32 if k >= 4096 else 64, BLOCK_K=128, num_warps=4,
                    num_stages=6 if k >= 4096 else 4)
    if n <= 4096 or k >= 4096:
        return dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=6)
    return dict(BLOCK_M=64, BLOCK_N=64 if n <= 32768 else 128, BLOCK_K=64, num_warps=4, num_stages=4)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with a reduction order independent of the number of rows.

    Args:
        x: ``[..., K]`` float16/bfloat16/float32 (a copy is made when its rows are not
            contiguous in the last dim).
        weight: ``[N, K]``, same dtype and device, last dim contiguous.
        bias: ``[N]`` contiguous, same dtype and device, or None.
        block_m, block_n, block_k, num_warps, num_stages: overrides of
            :func:`invariant_linear_config` (a caller that wants invariance keeps ``BLOCK_M`` a
            multiple of 64 and ``num_warps`` 4 or 8, the warpgroup MMA of the defaults).

    Returns:
        ``[..., N]`` in ``x.dtype``; fp32 accumulation, bias added in fp32, one rounding.

    Raises:
        ValueError: not float16/bfloat16/float32; mismatched shapes, dtypes or devices; a weight
            not contiguous in its last dim or a bias not contiguous; a block size or launch
            option that is not a positive integer (block sizes: powers of two); CPU tensors
            without the Triton interpreter.
    """
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        raise ValueError("x and weight must be tensors")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] disagree: {tuple(x.shape)} vs {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) "
                         "must share dtype and device")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.device != weight.device
                             or bias.dtype != weight.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [N={weight.shape[0]}] {weight.dtype} tensor on "
                         f"{weight.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}")
    if weight.stride(-1) != 1:
        raise ValueError("weight must be contiguous in its last dim")
    on_cpu = x.device.type == "cpu"
    if on_cpu:
        check_cpu_launch("the batch-invariant linear kernel")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    cfg = invariant_linear_config(n, k, on_cpu, m)
    for key, val in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k),
                     ("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None:
            if type(val) is not int or val < 1 or (key.startswith("BLOCK") and val & (val - 1)):
                raise ValueError(f"{key.lower()} must be a positive integer"
                                 f"{' (a power of two)' if key.startswith('BLOCK') else ''}, got {val!r}")
            cfg[key] = val
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _invariant_matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        FP32_MATH=on_cpu or x.dtype == torch.float32, **cfg)
    return out.reshape(*lead, n)


@triton.jit
def _merge_segment(m_all, l_all, acc_all, m_s, l_s, acc_s):
    """Fold one context segment's softmax state ``(m_s, l_s, acc_s)`` (max, denominator
    ``[R]``, unnormalised output ``[R, D]``) into the running state of the segments before it.
    Both attention kernels fold segments with this one function, so a row gets the same bits
    whichever kernel ran it. A segment wholly past a row's position (``m_s = -inf``) changes
    nothing bit for bit; so does folding the first segment into the empty state."""
    m_new = tl.maximum(m_all, m_s)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_all - m_ref)
    b = tl.exp2(m_s - m_ref)
    return m_new, l_all * a + l_s * b, acc_all * a[:, None] + acc_s * b[:, None]


@triton.jit
def _load_q_rows(q_ptr, rows, head, offs_d, rmask, stride_qn, stride_qh, k_cache_ptr,
                 FP32_MATH: tl.constexpr):
    """Query rows ``[R, D]`` (token ``rows``, head ``head``; masked rows 0) in the dtype the
    attention products take: fp32 in the interpreter, the cache dtype on the GPU."""
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    if FP32_MATH:
        return q.to(tl.float32)
    return q.to(k_cache_ptr.dtype.element_ty)


@triton.jit
def _segment_state(q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, offs_d, offs_n, s0, s_end,
                   qk_scale, stride_kb, stride_kt, stride_kh, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, FP32_MATH: tl.constexpr):
    """Softmax state of rows ``q`` ``[BLOCK_M, D]`` at positions ``q_pos`` over the keys at
    ``s0 .. s_end - 1`` (one segment), from the empty state, in key tiles of ``BLOCK_N`` at
    absolute offsets, every tile masked (a tile past a row's position is an exact no-op)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(s0, s_end, BLOCK_N):
        t = n0 + offs_n
        tmask = t < s_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, t, kvh, offs_d, stride_kb, stride_kt,
                             stride_kh, PAGE, True, tmask)                    # [BLOCK_N, D] each
        allowed = (t[None, :] <= q_pos[:, None]) & tmask[None, :]
        s = tl.where(allowed, _qk(q, k, FP32_MATH) * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, FP32_MATH, True)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "stride_btb"])   # num_seqs varies per step: no recompiles
def _invariant_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, ctx_ptr, qsl_ptr,
                                tiles_ptr, num_seqs, qk_scale, stride_qn, stride_qh, stride_kb, stride_kt,
                                stride_kh, stride_on, stride_oh, stride_btb,
                                G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr,
                                FP32_MATH: tl.constexpr, SCHEDULED: tl.constexpr):
    """Grid ``(Hkv, query tiles, B)``: program ``(kvh, j, b)`` takes query tokens
    ``j*TOK .. (j+1)*TOK - 1`` (``TOK = BLOCK_M // G``) of sequence ``b`` with the ``G`` query
    heads of KV head ``kvh``; row ``r`` is token ``r // G``, head ``kvh*G + r % G``. The context
    is folded segment by segment (``SEGMENT`` positions from 0), in order. ``SCHEDULED``: grid
    ``(Hkv, T)`` instead, program ``(kvh, t)`` taking the (sequence, query tile) of entry ``t``
    of the work list at ``tiles_ptr`` (``sequence << 16 | tile``; ``-1``, or a sequence not
    below ``num_seqs``: nothing), so a captured graph's fixed grid runs only the step's tiles.
    Which program computes a row does not change its bits."""
    TOK: tl.constexpr = BLOCK_M // G
    kvh = tl.program_id(0)
    if SCHEDULED:
        b, m_tile = schedule_entry(tiles_ptr, tl.program_id(1))
        if (b < 0) | (b >= num_seqs):   # no work, or a malformed entry: nothing read out of bounds
            return
    else:
        m_tile = tl.program_id(1)
        b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if m_tile * TOK >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    r = tl.arange(0, BLOCK_M)
    tok = m_tile * TOK + r // G                                               # [BLOCK_M]
    head = kvh * G + r % G
    rmask = (r < TOK * G) & (tok < q_len)
    q_pos = ctx - q_len + tok                                                 # [BLOCK_M]
    rows = (q_start + tok).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_q_rows(q_ptr, rows, head, offs_d, rmask, stride_qn, stride_qh, k_cache_ptr,
                     FP32_MATH)                                               # [BLOCK_M, D]
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc_all = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_tok = tl.minimum((m_tile + 1) * TOK, q_len) - 1
    kv_end = ctx - q_len + last_tok + 1               # one past the last key any row may see
    for s0 in range(0, kv_end, SEGMENT):
        m_s, l_s, acc_s = _segment_state(q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, offs_d,
                                         offs_n, s0, tl.minimum(s0 + SEGMENT, kv_end), qk_scale,
                                         stride_kb, stride_kt, stride_kh, PAGE, BLOCK_M, HEAD_DIM,
                                         BLOCK_N, FP32_MATH)
        m_all, l_all, acc_all = _merge_segment(m_all, l_all, acc_all, m_s, l_s, acc_s)
    out = acc_all / tl.where(l_all > 0, l_all, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit(do_not_specialize=["stride_btb", "NSEG"])
def _invariant_decode_segment_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, qsl_ptr, ws_m_ptr, ws_l_ptr,
                                     ws_acc_ptr, qk_scale, stride_qn, stride_qh, stride_kb, stride_kt,
                                     stride_kh, stride_btb, NSEG,
                                     G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                     SEGMENT: tl.constexpr, FP32_MATH: tl.constexpr):
    """Decode steps (one query token a sequence), grid ``(Hkv, P, B)``: program
    ``(kvh, j, b)`` computes segments ``j, j + P, j + 2P, ...`` of sequence ``b``'s context for
    the ``G`` heads of KV head ``kvh`` (rows laid out as in :func:`_invariant_attention_kernel`,
    so the products run the same instructions), each from the empty state, and writes each
    segment's state to the workspace ``[B, Hq, NSEG]`` (``+ [D]`` for the output)."""
    kvh = tl.program_id(0)
    j = tl.program_id(1)
    b = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    q_row = tl.load(qsl_ptr + b)
    if tl.load(qsl_ptr + b + 1) == q_row:
        return
    r = tl.arange(0, BLOCK_M)
    head = kvh * G + r % G
    rmask = r < G
    q_pos = tl.zeros([BLOCK_M], tl.int32) + (ctx - 1)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    rows = tl.zeros([BLOCK_M], tl.int64) + q_row                              # the one token
    q = _load_q_rows(q_ptr, rows, head, offs_d, rmask, stride_qn, stride_qh, k_cache_ptr, FP32_MATH)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    hq = G * tl.num_programs(0)
    # NSEG covers max_context_len, an upper bound of ctx; the clamp keeps a broken bound from
    # writing past the workspace
    for seg in range(j, tl.minimum(tl.cdiv(ctx, SEGMENT), NSEG), tl.num_programs(1)):
        s0 = seg * SEGMENT
        m_s, l_s, acc_s = _segment_state(q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, offs_d, offs_n,
                                         s0, tl.minimum(s0 + SEGMENT, ctx), qk_scale, stride_kb, stride_kt,
                                         stride_kh, PAGE, BLOCK_M, HEAD_DIM, BLOCK_N, FP32_MATH)
        ws = (b.to(tl.int64) * hq + head) * NSEG + seg                        # [BLOCK_M]
        tl.store(ws_m_ptr + ws, m_s, mask=rmask)
        tl.store(ws_l_ptr + ws, l_s, mask=rmask)
        tl.store(ws_acc_ptr + ws[:, None] * HEAD_DIM + offs_d[None, :], acc_s, mask=rmask[:, None])


@triton.jit(do_not_specialize=["NSEG"])
def _invariant_decode_merge_kernel(ws_m_ptr, ws_l_ptr, ws_acc_ptr, ctx_ptr, qsl_ptr, out_ptr, stride_on, stride_oh,
                                   NSEG, G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr,
                                   SEGMENT: tl.constexpr):
    """Grid ``(Hkv, B)``: fold sequence ``b``'s segments ``0, 1, ...`` for the ``G`` heads of
    KV head ``kvh`` (``GP``: ``G`` rounded up to a power of two) with :func:`_merge_segment`, in
    order, and write the normalised output."""
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    q_row = tl.load(qsl_ptr + b)
    if tl.load(qsl_ptr + b + 1) == q_row:
        return
    r = tl.arange(0, GP)
    rmask = r < G
    head = kvh * G + r
    offs_d = tl.arange(0, HEAD_DIM)
    hq = G * tl.num_programs(0)
    base = (b.to(tl.int64) * hq + head) * NSEG                                # [GP]
    m_all = tl.full([GP], float("-inf"), tl.float32)
    l_all = tl.zeros([GP], tl.float32)
    acc_all = tl.zeros([GP, HEAD_DIM], tl.float32)
    for seg in range(0, tl.minimum(tl.cdiv(ctx, SEGMENT), NSEG)):
        m_s = tl.load(ws_m_ptr + base + seg, mask=rmask, other=float("-inf"))
        l_s = tl.load(ws_l_ptr + base + seg, mask=rmask, other=0.0)
        acc_s = tl.load(ws_acc_ptr + (base + seg)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=rmask[:, None], other=0.0)
        m_all, l_all, acc_all = _merge_segment(m_all, l_all, acc_all, m_s, l_s, acc_s)
    out = acc_all / tl.where(l_all > 0, l_all, 1.0)[:, None]
    tl.store(out_ptr + q_row.to(tl.int64) * stride_on + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


# A decode step spreads its segments over programs only while the fp32 workspace stays small.
DECODE_WORKSPACE_BYTES = 64 << 20


def decode_segment_programs(batch: int, num_kv_heads: int, num_segments: int, num_q_heads: int,
                            head_dim: int, num_sms: int) -> int:
    """Programs a (sequence, KV head) pair gets in a decode step of
    :func:`invariant_paged_attention`: enough for about four of them per SM over the whole step
    (at most one a segment), or 1 when the step's pairs fill the GPU already or the workspace
    (``batch x num_q_heads x num_segments x (head_dim + 2)`` fp32) would exceed
    :data:`DECODE_WORKSPACE_BYTES`. 1 means the one-kernel path, which gives the same bits.
    ``num_segments`` comes from the step's ``max_context_len`` (in a CUDA graph the length it
    was captured for), so a graph fixes the count; the bits never depend on it."""
    if batch * num_q_heads * num_segments * (head_dim + 2) * 4 > DECODE_WORKSPACE_BYTES:
        return 1
    return max(1, min(num_segments, (4 * num_sms) // max(1, batch * num_kv_heads)))


def _default_block_m(on_cpu: bool) -> int:
    return 16 if on_cpu else 64


def invariant_tile_tokens(num_q_heads: int, num_kv_heads: int, device: torch.device | str) -> int:
    """Query tokens a program of :func:`invariant_paged_attention` takes at its default
    ``block_m`` (``block_m // G``, ``G = num_q_heads // num_kv_heads``): the unit of a tile
    schedule for it (:func:`~llmserve.kernels.paged_attention.prefill_tile_schedule` with
    ``skip_decode=False``, since this kernel serves decode rows too).

    Raises:
        ValueError: head counts that are not positive, or ``G`` above the default ``block_m``.
    """
    if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads must be a positive multiple of num_kv_heads, got "
                         f"{num_q_heads}, {num_kv_heads}")
    g = num_q_heads // num_kv_heads
    bm = _default_block_m(torch.device(device).type == "cpu")
    if g > bm:
        raise ValueError(f"G={g} query heads a KV head exceed the default block_m={bm}")
    return bm // g


def invariant_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta, scale: float, *, block_m: int | None = None,
                              block_n: int | None = None, segment: int | None = None,
                              decode_programs: int | None = None, num_warps: int | None = None,
                              num_stages: int | None = None) -> torch.Tensor:
    """Causal paged attention of a flat varlen batch (prefill chunks and decode tokens alike,
    same contract as :func:`~llmserve.kernels.paged_attention.paged_attention_triton`), each row
    reduced in one fixed order.

    A row's context is cut into segments of ``segment`` positions at absolute offsets
    ``0, segment, 2 segment, ...``; within a segment keys are folded in tiles of ``block_n``
    positions with the online softmax, and the segments' states are folded in ascending order
    (:func:`_merge_segment`). Steps with a prompt token run one kernel that folds the segments
    of a row one after the other; decode steps (``meta.max_query_len == 1``, at most one query
    token a sequence) spread the segments over ``decode_programs`` programs a (sequence, KV head) pair
    (grid ``Hkv x P x B``, so a few sequences with a long context still fill the GPU) and fold
    them in a second kernel, through an fp32 workspace of ``B x Hq x segments x (D + 2)``
    values; with ``P = 1`` (a batch that fills the GPU already, or a workspace too large) they
    take the one-kernel path. ``meta.max_context_len`` must bound every context (the workspace
    is sized from it; a longer context is cut there). Both do the same operations in
    the same order on each row, so a token decoded in a batch, recomputed as a prompt row after
    preemption, or read back from the prefix cache gets the same bits.

    Args:
        query: ``[N, Hq, D]``, the cache dtype.
        k_cache, v_cache: ``[num_blocks + 1, block_size, Hkv, D]`` contiguous, holding this
            step's K/V.
        meta: :class:`~llmserve.attention.metadata.AttentionMetadata` (``max_query_len`` sizes
            the prompt kernel's grid, ``max_context_len`` the decode kernel's). With
            ``prefill_tiles`` (a captured graph of a step with prefill chunks, whose grid is
            fixed) the one-kernel path runs the listed (sequence, query tile) pairs, grid
            ``(Hkv, len(prefill_tiles))``; the list must be built by
            :func:`~llmserve.kernels.paged_attention.prefill_tile_schedule` with ``block_m =``
            :func:`invariant_tile_tokens` and ``skip_decode=False`` (this kernel serves the
            decode rows too). A row gets the same bits with or without a list.
        scale: softmax scale.
        block_m: rows a program (query tokens x the ``G`` heads of a KV head; default 64, 16 on
            CPU); at least ``G``. block_n: keys a tile (default 64, 16 on CPU). segment:
            positions a segment, a multiple of ``block_n`` (default ``2 * block_n``). The same
            values must be used for every call whose rows are to agree. decode_programs:
            programs a (sequence, KV head) pair of a decode step (default
            :func:`decode_segment_programs`; 1: the one-kernel path); any value gives the same
            bits.
        num_warps, num_stages: launch options.

    Returns:
        ``[N, Hq, D]`` in ``query.dtype``; rows not covered by ``query_start_loc`` are zero.

    Raises:
        ValueError: inconsistent shapes, dtypes, devices or strides; ``block_m < G``; a
            ``segment`` that is not a positive multiple of ``block_n``; ``decode_programs``,
            ``num_warps`` or ``num_stages`` not a positive integer; ``meta.prefill_tiles``
            together with ``block_m``, not a 1-D int32/int64 tensor on the cache's device, or
            shorter than ``ceil(N / invariant_tile_tokens) + B``.
    """
    n, hq, hkv, d, bs, b = _check_attention_inputs(query, k_cache, v_cache, meta)
    on_cpu = query.device.type == "cpu"
    if on_cpu:
        check_cpu_launch("the batch-invariant attention kernel")
    g = hq // hkv
    bm = block_m if block_m is not None else _default_block_m(on_cpu)
    bn = block_n if block_n is not None else (16 if on_cpu else 64)
    if type(bm) is not int or type(bn) is not int or bm < g or bm & (bm - 1) or bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_m must be a power of two >= G={g} and block_n a power of two "
                         f">= 16, got {bm!r}, {bn!r}")
    seg = segment if segment is not None else 2 * bn
    if type(seg) is not int or seg < bn or seg % bn:
        raise ValueError(f"segment must be a positive multiple of block_n={bn}, got {seg!r}")
    for name, val in (("decode_programs", decode_programs), ("num_warps", num_warps),
                      ("num_stages", num_stages)):
        if val is not None and (type(val) is not int or val < 1):
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    tiles = meta.prefill_tiles
    if tiles is not None:
        if block_m is not None:
            raise ValueError("meta.prefill_tiles are built for the default tile "
                             "(invariant_tile_tokens); block_m cannot be set with them")
        _check_index("meta.prefill_tiles", tiles, 1, k_cache.device)
        need = triton.cdiv(n, bm // g) + b
        if tiles.shape[0] < need:
            raise ValueError(f"meta.prefill_tiles has {tiles.shape[0]} entries; a step of {n} "
                             f"query rows in {b} sequences needs {need} (ceil(rows / "
                             f"invariant_tile_tokens) + sequences, as prefill_tile_schedule "
                             "sizes it): a shorter list leaves rows uncomputed")
    out = torch.zeros_like(query)
    if b == 0 or n == 0 or meta.max_query_len <= 0:
        return out
    fp32 = on_cpu or query.dtype == torch.float32
    warps = num_warps or (1 if on_cpu else 4)
    stages = num_stages or (1 if on_cpu else 2)
    nseg = triton.cdiv(max(int(meta.max_context_len), 1), seg)
    if decode_programs is None:
        programs = decode_segment_programs(b, hkv, nseg, hq, d, num_sms(query.device, 64))
    else:
        programs = min(decode_programs, nseg)
    if meta.max_query_len == 1 and programs > 1 and tiles is None:
        ws_m = torch.empty((b, hq, nseg), dtype=torch.float32, device=query.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((b, hq, nseg, d), dtype=torch.float32, device=query.device)
        _invariant_decode_segment_kernel[(hkv, programs, b)](
            query, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
            ws_m, ws_l, ws_acc, float(scale) * _LOG2E,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables.stride(0), nseg,
            G=g, HEAD_DIM=d, PAGE=bs, BLOCK_M=bm, BLOCK_N=bn, SEGMENT=seg, FP32_MATH=fp32,
            num_warps=warps, num_stages=stages)
        _invariant_decode_merge_kernel[(hkv, b)](
            ws_m, ws_l, ws_acc, meta.context_lens, meta.query_start_loc, out, out.stride(0),
            out.stride(1), nseg, G=g, GP=triton.next_power_of_2(g), HEAD_DIM=d, SEGMENT=seg,
            num_warps=1 if on_cpu else 4)
        return out
    tok = bm // g
    if tiles is not None:
        grid = (hkv, tiles.shape[0])
    else:
        tiles, grid = meta.query_start_loc, (hkv, triton.cdiv(int(meta.max_query_len), tok), b)  # unused
    _invariant_attention_kernel[grid](
        query, k_cache, v_cache, out, meta.block_tables, meta.context_lens, meta.query_start_loc,
        tiles, b, float(scale) * _LOG2E,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        G=g, HEAD_DIM=d, PAGE=bs, BLOCK_M=bm, BLOCK_N=bn, SEGMENT=seg, FP32_MATH=fp32,
        SCHEDULED=len(grid) == 2, num_warps=warps, num_stages=stages)
    return out
