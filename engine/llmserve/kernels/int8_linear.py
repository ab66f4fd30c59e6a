"""Weight-only INT8 linear layer in Triton: ``y = x @ (w_int8 * scale[:, None]).T + bias``.

Weight format: ``w_int8`` is ``[N, K]`` int8, row-major — the same orientation as
``nn.Linear.weight`` (out_features x in_features), so a state-dict transform quantizes each
weight in place without transposing — or the same values as *byte planes*, int32
``[N, K / 4]`` (:func:`~llmserve.kernels.int8_layout.pack_int8_planes`), which every kernel kind here
also reads. ``scale`` is ``[N]`` (fp32, fp16 or bf16): symmetric per-output-channel scales, ``w ~= w_int8 * scale[:, None]`` with ``w_int8`` in ``[-127, 127]``.

The fused kernels read int8 tiles, convert them in registers (every int8 value is exact in
bf16/fp16), accumulate in fp32 and apply the per-channel scale (and bias) once in the epilogue —
the scale factors out of the K sum: ``sum_k x[m,k] * q[n,k] * s[n] = s[n] * sum_k x[m,k] * q[n,k]``.

Three kernel kinds (:class:`Int8LinearConfig.kind`), chosen per shape by
:func:`choose_int8_config` from H200 measurements (``llmserve bench-kernels``; docs/performance.md):

* ``"vec"`` (decode, M <= 4; the default at M = 1): the matrix-vector kernel of ``gemv.py``
  (one or two weight rows a program, fp32 element-wise accumulation reduced over K once, the
  per-channel scale in the epilogue); 1.42-1.60x faster than bf16 cuBLAS on Qwen2.5-1.5B
  shapes at M = 1. It replaced an earlier CUDA-core kernel of this file (8 rows a program,
  split-K; 1.15-1.32x).
* ``"mma"`` (decode, M <= 64): tensor-core tiles (``BLOCK_M`` >= 16) with the int8 tile
  converted in registers; split-K over K when there are few output tiles, with the partials
  summed by the last split to finish (``fused_reduce``) or by a small reduction kernel. An
  optional "swap AB" orientation computes ``y.T = w @ x.T`` (measured slower on Hopper).
* ``"dequant"`` (prefill, M > 64): one pass int8 -> ``x.dtype`` weights, then cuBLAS. The fused
  tile kernel measured 1.7-2.1x slower than bf16 cuBLAS at M >= 256 (a guess, not profiled: the
  converted operand goes back through shared memory before each wgmma, stalling the pipeline);
  dequantize + cuBLAS costs 1.12-1.19x. vLLM's AWQ path makes the same trade for >= 256 tokens.

On CPU tensors (Triton interpreter) tiles are cast to fp32 before the product and small
configurations of the same kinds are chosen, so CPU tests reach every kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .int8_layout import pack_int8_planes, unpack_int8_planes  # the layout (pure torch), re-exported
from ._launch import check_cpu_launch, num_sms, zeroed_counters
from .gemv import GEMV_MAX_M, GemvConfig, _plane_bytes, choose_gemv_config, gemv, tuned_gemv_config

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
    M = 2..16; reading the planes' bytes as a permuted row-major matrix with x gathered in
    that order was 2-5x slower still, and one product a step over the four planes reordered
    plane-major in registers 1.3x slower, so byte planes pay
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
    kind: str = "mma"  # "mma" (tensor cores), "vec" (gemv.py, M <= 4), "dequant"
    # block_k: weight columns a step; with byte planes, "vec" passes it to gemv as words and
    # "mma" steps max(16, block_k // 4) words (the same bytes)
    programs_per_sm: int = 0  # "vec": GemvConfig.programs_per_sm
    red: int = 1  # "vec": GemvConfig.red (adjacent K columns summed before the accumulator)


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

    Picked from an H200 sweep (Qwen2.5-1.5B shapes, bf16; speed-ups
    over cuBLAS bf16 in parentheses):

    * ``m == 1``: the ``gemv.py`` matrix-vector kernel (``"vec"``) with its tuned or rule-based
      configuration (gate/up 7.1 us, 1.42x; down 7.8 us, 1.56x; qkv 3.5 us, 1.57x).
    * ``2 <= m <= 4`` where the gemv table has a tuned entry for the shape (M = 3 takes M = 4's):
      the matrix-vector kernel too, with that tile (``red`` included). The entries come from
      a sweep of ``scripts/bench_gemv.py`` (Qwen2.5-1.5B shapes; row-major int8 against the
      tensor-core kind in the same run: qkv M = 2 3.8 vs 6.3 us, M = 4 4.6 vs 6.3; gate/up
      M = 2 9.4 vs 9.4, down M = 2 9.3 vs 9.5; byte planes: down M = 2 10.5 vs 11.2). Only
      measured winners are entries: at M = 4 the larger shapes stay on tensor cores (gate/up
      12.1 vs 9.2, down 14.1 vs 9.6), and untuned shapes do not take the matrix-vector rule
      tile, which the same sweep measured slower than the tensor-core kind (gate/up M = 2
      15.7 vs 9.4 us, down M = 2 13.3 vs 9.5, qkv M = 4 8.3 vs 6.3).
    * byte planes, untuned shapes: the matrix-vector kind also for ``m = 2`` with ``k <= 4096``
      and ``m <= 4`` with up to 4 Mi weights (H200: qkv M = 2
      4.3 vs 6.5 us, M = 4 5.5 vs 6.4; gate/up M = 2 9.4 vs 10.8).
    * ``m <= 64`` otherwise: tensor-core tiles ``BLOCK_M = max(16, next_pow2(m))`` with the
      weight tile as the MMA's B operand (plain orientation measured faster than swap-AB):
      ``k <= 4096``: 32x256 weight tiles, split-K only to reach one program per SM (gate/up
      M=4/16 9.2-9.3 us, 1.1x); ``k > 4096``: 64x128 tiles, split-K to two programs per SM with
      the in-kernel (fused) reduction (down M=1/4/16 9.8-10.6 us, 1.15-1.26x).
    * ``m > 64``, and ``m = 64`` with ``k <= 4096``: dequantize to ``x.dtype`` then cuBLAS
      (M=2048: 1.12-1.19x the bf16 time; the fused tile kernels measured 1.7-2.1x, at M=256
      too; at M=64, Qwen2.5-1.5B gate/up 18.4 vs 21.3 us and qkv 8.9 vs 11.1 for the tiles).
    * CPU (Triton interpreter): the same kinds with small tiles (the matrix-vector kind at
      M = 1 only), so tests cover every path.

    ``planes``: the weight is int8 byte planes (:func:`pack_int8_planes`; ``k`` still counts
    columns).
    """
    w_dtype = torch.int32 if planes else torch.int8
    vec = m == 1 or (device.type == "cuda" and m <= GEMV_MAX_M and (
        tuned_gemv_config(m, n, k, w_dtype, device) is not None
        or (planes and ((m == 2 and k <= 4096) or n * k <= 4 * 1024 * 1024))))
    if vec:  # block_n / block_k / num_warps / num_stages of the gemv.py launch
        g = choose_gemv_config(m, n, k, w_dtype, device)
        return Int8LinearConfig(1, g.block_n, g.block_k, num_warps=g.num_warps, num_stages=g.stages,
                                kind="vec", programs_per_sm=g.programs_per_sm, red=g.red)
    if device.type != "cuda":
        if m <= 64:
            split = 2 if k >= 64 else 1
            return Int8LinearConfig(16 if m <= 16 else 32, 32, 32, split_k=split, num_warps=1,
                                    num_stages=1, fused_reduce=True)
        return Int8LinearConfig(1, 1, 1, kind="dequant")
    sms = _num_sms(device)
    # k <= 4096 at M = 64: dequantize + cuBLAS measured faster than the 64-row tensor-core tile
    # (gate/up 18.4 vs 21.3 us, qkv 8.9 vs 11.1; at M = 32 the tiles win, 12.5 vs 18.1 and 7.7
    # vs 8.8); k > 4096 (down) keeps the tiles (18.9 vs 20.9).
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
            ``TRITON_INTERPRET=1``.
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
    if on_cpu:
        check_cpu_launch("int8_linear")
    cfg = config or choose_int8_config(m, n, k, x.device, planes=planes)
    if cfg.kind not in ("mma", "vec", "dequant"):
        raise ValueError(f"Int8LinearConfig.kind must be 'mma', 'vec' or 'dequant', got {cfg.kind!r}")
    if cfg.kind == "vec":
        if m > GEMV_MAX_M:
            raise ValueError(f"kind 'vec' serves M <= {GEMV_MAX_M}, got M={m}")
        y = gemv(x2, w_int8, scale=scale, bias=bias,
                 config=GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                                   cfg.programs_per_sm, cfg.red))
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

