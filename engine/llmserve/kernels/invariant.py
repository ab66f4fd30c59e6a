"""Batch-invariant kernels for the GPU: a matrix product and a paged attention whose result for a
row does not depend on how many rows share the launch or how a prompt was chunked.

Why the ordinary kernels are not: cuBLAS picks a kernel (tile shape, split-K factor, matrix-vector
path) from the call's shape, and each sums a row's products in its own order; the decode
attention splits a context into a number of pieces chosen from the batch size; the prefill
kernel starts its masked (diagonal) tiles where a chunk starts. bf16 near-ties then turn the
difference into other tokens. The remedy (Thinking Machines Lab, He et al. 2025, "Defeating
Nondeterminism in LLM Inference") is to fix the reduction order of every row:

* :func:`invariant_linear`: one tile configuration per weight shape ``(N, K)``, never chosen
  from ``M``; a program computes a ``BLOCK_M x BLOCK_N`` output tile by walking ``K`` in
  ``BLOCK_K`` steps from 0 with ``tl.dot`` (no split-K). Every output row therefore goes through
  the same instruction sequence whatever ``M`` is and wherever the row sits in its tile (a
  tensor-core MMA computes each output element from its own row and column only).
* :func:`invariant_paged_attention`: one kernel for prefill, chunked prefill and decode rows.
  A program holds up to ``BLOCK_M // G`` query tokens of one sequence with the ``G`` query heads
  of one KV head (``BLOCK_M`` rows), and folds the context in key tiles of ``BLOCK_N``
  positions at absolute offsets ``0, BLOCK_N, 2 BLOCK_N, ...`` with the online softmax
  (Milakov & Gimelshein 2018), always masked. A key tile past a row's own position changes
  nothing bit for bit (its scores are ``-inf``: the rescale factor is exactly 1 and the added
  terms exactly 0), so a row gets the same bits whether its program runs more tiles for other
  rows or stops at its own last tile, whatever chunk it arrived in and whether its prefix came
  from the prefix cache.

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

from ._launch import check_cpu_launch
from .paged_attention import (
    _LOG2E,
    _check_attention_inputs,
    _load_kv_tile,
    _online_softmax_step,
    _qk,
)

__all__ = ["invariant_linear", "invariant_linear_config", "invariant_paged_attention"]


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, FP32_MATH: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``: output tile ``(pid_m, pid_n)`` of
    ``x @ w.T + b``, ``K`` walked from 0 in ``BLOCK_K`` steps."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
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


def invariant_linear_config(n: int, k: int, on_cpu: bool = False) -> dict:
    """The tile configuration :func:`invariant_linear` uses for a ``[n, k]`` weight: a function
    of the weight's shape only (never of the number of rows), which is what makes the product
    batch-invariant.

    ``BLOCK_M`` 64 rows (one Hopper warpgroup MMA), ``BLOCK_K`` 64; ``BLOCK_N`` as narrow as
    keeps enough programs for a step of a few rows to spread a small weight over the GPU
    (16 columns up to 4,096 outputs, 64 up to 32,768, else 128). On CPU (the interpreter):
    16 x 16 x 16 tiles.
    """
    if on_cpu:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1)
    block_n = 16 if n <= 4096 else 64 if n <= 32768 else 128
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=64, num_warps=4, num_stages=4)


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
            :func:`invariant_linear_config` (a caller that wants invariance passes the same
            values for every call on one weight).

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
    cfg = invariant_linear_config(n, k, on_cpu)
    for key, val in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k),
                     ("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None:
            if type(val) is not int or val < 1 or (key.startswith("BLOCK") and val & (val - 1)):
                raise ValueError(f"{key.lower()} must be a positive integer"
                                 f"{' (a power of two)' if key.startswith('BLOCK') else ''}, got {val!r}")
            cfg[key] = val
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _invariant_matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        FP32_MATH=on_cpu or x.dtype == torch.float32, **cfg)
    return out.reshape(*lead, n)


@triton.jit(do_not_specialize=["stride_btb"])
def _invariant_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, ctx_ptr, qsl_ptr,
                                qk_scale, stride_qn, stride_qh, stride_kb, stride_kt, stride_kh,
                                stride_on, stride_oh, stride_btb,
                                G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                FP32_MATH: tl.constexpr):
    """Grid ``(Hkv, query tiles, B)``: program ``(kvh, j, b)`` takes query tokens
    ``j*TOK .. (j+1)*TOK - 1`` (``TOK = BLOCK_M // G``) of sequence ``b`` with the ``G`` query
    heads of KV head ``kvh``; row ``r`` is token ``r // G``, head ``kvh*G + r % G``."""
    TOK: tl.constexpr = BLOCK_M // G
    kvh = tl.program_id(0)
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
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=rmask[:, None], other=0.0)                               # [BLOCK_M, D]
    if FP32_MATH:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_tok = tl.minimum((m_tile + 1) * TOK, q_len) - 1
    kv_end = ctx - q_len + last_tok + 1               # one past the last key any row may see
    for n0 in range(0, kv_end, BLOCK_N):              # every tile masked: one code path per row
        t = n0 + offs_n
        tmask = t < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, t, kvh, offs_d, stride_kb, stride_kt,
                             stride_kh, PAGE, True, tmask)                    # [BLOCK_N, D] each
        allowed = (t[None, :] <= q_pos[:, None]) & tmask[None, :]
        s = tl.where(allowed, _qk(q, k, FP32_MATH) * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, FP32_MATH, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def invariant_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta, scale: float, *, block_m: int | None = None,
                              block_n: int | None = None, num_warps: int | None = None,
                              num_stages: int | None = None) -> torch.Tensor:
    """Causal paged attention of a flat varlen batch (prefill chunks and decode tokens alike,
    same contract as :func:`~llmserve.kernels.paged_attention.paged_attention_triton`), each row
    reduced in one fixed order: key tiles of ``block_n`` positions from position 0.

    Args:
        query: ``[N, Hq, D]``, the cache dtype.
        k_cache, v_cache: ``[num_blocks + 1, block_size, Hkv, D]`` contiguous, holding this
            step's K/V.
        meta: :class:`~llmserve.attention.metadata.AttentionMetadata` (``max_query_len`` sizes
            the grid; ``prefill_tiles`` must be None: this kernel serves decode rows too, so the
            mixed-step graphs' split schedule does not apply).
        scale: softmax scale.
        block_m: rows a program (query tokens x the ``G`` heads of a KV head; default 64, 16 on
            CPU); at least ``G``. block_n: keys a tile (default 64, 16 on CPU). The same
            values must be used for every call whose rows are to agree.
        num_warps, num_stages: launch options.

    Returns:
        ``[N, Hq, D]`` in ``query.dtype``; rows not covered by ``query_start_loc`` are zero.

    Raises:
        ValueError: inconsistent shapes, dtypes, devices or strides; ``block_m < G``;
            ``meta.prefill_tiles`` set.
    """
    n, hq, hkv, d, bs, b = _check_attention_inputs(query, k_cache, v_cache, meta)
    if meta.prefill_tiles is not None:
        raise ValueError("invariant_paged_attention runs every row itself; meta.prefill_tiles "
                         "(the mixed-step graphs' schedule) must be None")
    on_cpu = query.device.type == "cpu"
    if on_cpu:
        check_cpu_launch("the batch-invariant attention kernel")
    g = hq // hkv
    bm = block_m if block_m is not None else (16 if on_cpu else 64)
    bn = block_n if block_n is not None else (16 if on_cpu else 64)
    if bm < g or bm & (bm - 1) or bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_m must be a power of two >= G={g} and block_n a power of two "
                         f">= 16, got {bm}, {bn}")
    out = torch.zeros_like(query)
    if b == 0 or n == 0 or meta.max_query_len <= 0:
        return out
    tok = bm // g
    grid = (hkv, triton.cdiv(int(meta.max_query_len), tok), b)
    _invariant_attention_kernel[grid](
        query, k_cache, v_cache, out, meta.block_tables, meta.context_lens, meta.query_start_loc,
        float(scale) * _LOG2E,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        G=g, HEAD_DIM=d, PAGE=bs, BLOCK_M=bm, BLOCK_N=bn,
        FP32_MATH=on_cpu or query.dtype == torch.float32,
        num_warps=num_warps or (1 if on_cpu else 4), num_stages=num_stages or (1 if on_cpu else 2))
    return out
