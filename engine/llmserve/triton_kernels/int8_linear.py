"""Weight-only INT8 linear layer in Triton: ``y = x @ (w_int8 * scale[:, None]).T + bias``.

Weight format: ``w_int8`` is ``[N, K]`` int8, row-major — the same orientation as
``nn.Linear.weight`` (out_features x in_features), so a state-dict transform quantizes each
weight in place without transposing. ``scale`` is ``[N]`` (fp32, fp16 or bf16): symmetric
per-output-channel scales, ``w ~= w_int8 * scale[:, None]`` with ``w_int8`` in ``[-127, 127]``.

The fused kernels read int8 tiles, convert them in registers (every int8 value is exact in
bf16/fp16), accumulate in fp32 and apply the per-channel scale (and bias) once in the epilogue —
the scale factors out of the K sum: ``sum_k x[m,k] * q[n,k] * s[n] = s[n] * sum_k x[m,k] * q[n,k]``.

Four kernel kinds (:class:`Int8LinearConfig.kind`), chosen per shape by
:func:`choose_int8_config` from H200 measurements (``results/kernels/NOTES.md``):

* ``"vec"`` (decode, M <= 4; the default at M = 1): the matrix-vector kernel of ``gemv.py``
  (one or two weight rows a program, fp32 element-wise accumulation reduced over K once, the
  per-channel scale in the epilogue); 1.42-1.60x faster than bf16 cuBLAS on Qwen2.5-1.5B
  shapes at M = 1. It replaced an earlier CUDA-core kernel of this file (8 rows a program,
  split-K; 1.15-1.32x), whose measurements stay in ``results/kernels/h200_run*``.
* ``"mma"`` (decode, M <= 64): tensor-core tiles (``BLOCK_M`` >= 16) with the int8 tile
  converted in registers; split-K over K when there are few output tiles, with the partials
  summed by the last split to finish (``fused_reduce``) or by a small reduction kernel. An
  optional "swap AB" orientation computes ``y.T = w @ x.T`` (measured slower on Hopper).
* ``"small"`` (decode of a few tokens, 2 <= M <= 16; M <= 64 accepted): weight-stationary
  "swap AB" tensor-core tiles built for the regime where the weight stream is the whole cost.
  A program owns ``BLOCK_N`` weight rows and a K range (split-K) and computes
  ``acc[BLOCK_N, BLOCK_M] += w_tile @ x_tile.T`` with the activations padded to ``BLOCK_M = 16``
  rows (the MMA's narrow side), so the 16-row minimum of a tensor-core tile is paid on the tiny
  activation operand instead of on the weights. Weight tiles are plain evict-first loads into
  registers, not a multi-stage shared-memory pipeline: with ``num_stages == 1`` the next weight
  tile is loaded by hand before the current one is multiplied, so every program keeps two
  weight tiles in flight, and many small programs per SM hide the HBM latency, as in
  ``gemv.py``; ``num_stages >= 2`` leaves the loop to Triton's shared-memory pipeliner instead.
  Partials of a split-K are reduced by the last split to finish. The orientation is the one
  weight-only GEMMs for small batches use (TensorRT-LLM's and Machete's "swap AB" for M < 64):
  the weight fills the MMA's wide M side.
  On CUDA it is chosen only through ``LLMSERVE_INT8_SMALL_CONFIG`` or an explicit config until
  H200 measurements pick defaults (``scripts/bench_int8_small.py``).
* ``"dequant"`` (prefill, M > 64): one pass int8 -> ``x.dtype`` weights, then cuBLAS. The fused
  tile kernel measured 1.7-2.1x slower than bf16 cuBLAS at M >= 256 (a guess, not profiled: the
  converted operand goes back through shared memory before each wgmma, stalling the pipeline);
  dequantize + cuBLAS costs 1.12-1.19x. vLLM's AWQ path makes the same trade for >= 256 tokens.

On CPU tensors (Triton interpreter) tiles are cast to fp32 before the product and small
configurations of the same kinds are chosen (``"small"`` for 2 <= M <= 16), so CPU tests reach
every kind.

``LLMSERVE_INT8_SMALL_CONFIG`` (read at each call, cached per value) selects the ``"small"``
kind for 2 <= M <= 16: ``"block_n,block_k,split_k,num_warps,num_stages"`` for every shape,
or ``;``-separated entries of which those prefixed ``KxN:`` apply to that weight shape only,
e.g. ``"1536x8960:32,256,1,2,1;8960x1536:16,256,8,1,1;16,256,0,1,1"``. ``split_k = 0``
chooses the split so that the grid holds at least four programs per SM. Unset or empty: the
built-in choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import num_sms, zeroed_counters
from .gemv import GEMV_MAX_M, GemvConfig, choose_gemv_config, gemv

__all__ = ["Int8LinearConfig", "choose_int8_config", "int8_linear", "int8_linear_reference",
           "quantize_int8_per_channel", "small_config"]


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


@triton.jit(do_not_specialize=["M", "k_per_split"])  # M varies per step: no recompiles
def _int8_linear_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
                        EVEN_K: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                        FP32_MATH: tl.constexpr):
    """Tensor-core tile kernel (``kind="mma"``)."""
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
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            kmask = (k0 - k_lo + offs_k) < k_hi
            x = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0)
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
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]
    _int8_epilogue(acc, rm, rn, rn_ld, pid, pid_k, M, N, s_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
                   stride_ym, stride_yn, HAS_BIAS, SPLIT, FUSED_REDUCE, BLOCK_M, BLOCK_N)


@triton.jit
def _small_load_w(w_ptrs, k0, k_rem, rk, EVEN_K: tl.constexpr):
    """Weight tile ``[BLOCK_N, BLOCK_K]`` int8 at ``k0`` past the split's start (``k_rem``: K
    left from that start). Read once, so evict first: L2 keeps the activations and partials."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs + k0, mask=((k0 + rk) < k_rem)[None, :], other=0, eviction_policy="evict_first")
    return w


@triton.jit
def _small_load_x(x_ptrs, k0, k_rem, rk, row_ok, EVEN_K: tl.constexpr):
    """Activation tile ``x.T [BLOCK_K, BLOCK_M]`` at ``k0``; padding rows (``m >= M``) read 0."""
    if EVEN_K:
        xt = tl.load(x_ptrs + k0, mask=row_ok[None, :], other=0.0)
    else:
        xt = tl.load(x_ptrs + k0, mask=row_ok[None, :] & ((k0 + rk) < k_rem)[:, None], other=0.0)
    return xt


@triton.jit
def _small_mma(acc, w, xt, FP32_MATH: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ xt [BLOCK_K, BLOCK_M]``, the int8 tile
    converted to the activation dtype in registers (exact: |w| <= 127)."""
    if FP32_MATH:
        acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(w.to(xt.dtype), xt, acc)
    return acc


@triton.jit(do_not_specialize=["M", "steps_per_split"])  # M varies per step: no recompiles
def _int8_small_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, steps_per_split,
                       stride_xm, stride_wn, stride_ym, stride_yn,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
                       FUSED_REDUCE: tl.constexpr, FP32_MATH: tl.constexpr, REG_PREFETCH: tl.constexpr):
    """Weight-stationary swap-AB kernel for few rows (``kind="small"``).

    Grid ``(cdiv(N, BLOCK_N), splits)``: program ``(pid_n, pid_k)`` owns weight rows
    ``pid_n * BLOCK_N + [0, BLOCK_N)`` (wrapped into range for loads, stores masked) and K steps
    ``[pid_k * steps_per_split, ...)`` of ``BLOCK_K`` each, and accumulates
    ``acc[n, m] = sum_k w[n, k] * x[m, k]`` in fp32 over ``[BLOCK_N, BLOCK_M]`` with
    ``BLOCK_M >= M`` (>= 16) padded rows of x read as zeros. ``REG_PREFETCH`` (``num_stages ==
    1``): the weight tile of step ``i + 1`` is loaded before step ``i``'s product, so its HBM
    load is in flight during it (the activation tile, the same for every program of the split
    and so an L1/L2 hit, is loaded where it is used: holding the next one too would double the
    registers of the largest operand, ``BLOCK_K x 16`` bf16); otherwise a plain loop for
    Triton's pipeliner. The epilogue (scale,
    bias, split-K partials and their reduction) is :func:`_int8_epilogue`'s.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_ld = rn % N
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * (steps_per_split * BLOCK_K)       # a multiple of BLOCK_K: aligned, vector loads
    k_rem = K - k_lo
    w_ptrs = w_ptr + rn_ld[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]       # [BN, BK]
    w = _small_load_w(w_ptrs, 0, k_rem, rk, EVEN_K)    # the first weight bytes before anything else
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + (k_lo + rk)[:, None]           # [BK, BM]
    n_steps = tl.minimum(steps_per_split, tl.cdiv(k_rem, BLOCK_K))                     # >= 1
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if REG_PREFETCH:
        for i in range(1, n_steps):
            w_next = _small_load_w(w_ptrs, i * BLOCK_K, k_rem, rk, EVEN_K)  # in flight meanwhile
            xt = _small_load_x(x_ptrs, (i - 1) * BLOCK_K, k_rem, rk, row_ok, EVEN_K)   # L1/L2 hit
            acc = _small_mma(acc, w, xt, FP32_MATH)
            w = w_next
        xt = _small_load_x(x_ptrs, (n_steps - 1) * BLOCK_K, k_rem, rk, row_ok, EVEN_K)
        acc = _small_mma(acc, w, xt, FP32_MATH)
    else:
        acc = _small_mma(acc, w, _small_load_x(x_ptrs, 0, k_rem, rk, row_ok, EVEN_K), FP32_MATH)
        for i in range(1, n_steps):
            w = _small_load_w(w_ptrs, i * BLOCK_K, k_rem, rk, EVEN_K)
            xt = _small_load_x(x_ptrs, i * BLOCK_K, k_rem, rk, row_ok, EVEN_K)
            acc = _small_mma(acc, w, xt, FP32_MATH)
    _int8_epilogue(tl.trans(acc), rm, rn, rn_ld, pid_n, pid_k, M, N, s_ptr, bias_ptr, y_ptr, ws_ptr,
                   cnt_ptr, stride_ym, stride_yn, HAS_BIAS, SPLIT, FUSED_REDUCE, BLOCK_M, BLOCK_N)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_on,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[n, k] = w[n, k] * scale[n]`` in the output dtype (``kind="dequant"``)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0)
    sc = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    out = w.to(tl.float32) * sc[:, None]
    tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_on + rk[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


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
    """Tile configuration of :func:`int8_linear` (see :func:`choose_int8_config`).

    ``"small"`` uses ``block_n`` (weight rows a program, power of two >= 16), ``block_k``
    (power of two >= 16), ``split_k``, ``num_warps``, ``num_stages`` (1: register prefetch;
    >= 2: Triton's pipeliner) and ``fused_reduce``; its activation tile is
    ``max(16, next_pow2(M))`` rows whatever ``block_m`` says, and ``swap_ab``/``group_m`` are
    implied/unused.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    swap_ab: bool = False
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    fused_reduce: bool = False  # split-K: last split reduces (no second launch) vs reduce kernel
    kind: str = "mma"  # "mma" (tensor cores), "small" (M <= 64), "vec" (gemv.py, M <= 4), "dequant"
    programs_per_sm: int = 0  # "vec": GemvConfig.programs_per_sm


KINDS = ("mma", "small", "vec", "dequant")
SMALL_M = (2, 16)       # rows for which choose_int8_config may pick "small" (CPU; CUDA: env)
SMALL_MAX_M = 64        # rows a "small" launch accepts
SMALL_ENV = "LLMSERVE_INT8_SMALL_CONFIG"
SMALL_AUTO_PROGRAMS_PER_SM = 4  # split_k = 0 (auto): at least this many programs per SM


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


def _pow2_at_least(v, lo: int) -> bool:
    return isinstance(v, int) and v >= lo and v & (v - 1) == 0


def _check_small_config(cfg: Int8LinearConfig, m: int) -> None:
    """``ValueError`` unless ``cfg`` is a launchable ``"small"`` configuration for ``m`` rows."""
    if m > SMALL_MAX_M:
        raise ValueError(f"kind 'small' serves M <= {SMALL_MAX_M} rows, got M={m}")
    for name, v in (("block_n", cfg.block_n), ("block_k", cfg.block_k)):
        if not _pow2_at_least(v, 16):
            raise ValueError(f"kind 'small' needs {name} a power of two >= 16 (a tensor-core tile "
                             f"side), got {v!r}")
    if not isinstance(cfg.split_k, int) or cfg.split_k < 1:
        raise ValueError(f"kind 'small' needs split_k >= 1, got {cfg.split_k!r}")
    if not _pow2_at_least(cfg.num_warps, 1) or cfg.num_warps > 16:
        raise ValueError(f"kind 'small' needs num_warps a power of two in 1..16, got {cfg.num_warps!r}")
    if not isinstance(cfg.num_stages, int) or cfg.num_stages < 1:
        raise ValueError(f"kind 'small' needs num_stages >= 1, got {cfg.num_stages!r}")


def small_config(m: int, n: int, k: int, device: torch.device, block_n: int, block_k: int,
                 split_k: int = 0, num_warps: int = 1, num_stages: int = 1,
                 fused_reduce: bool = True) -> Int8LinearConfig:
    """A ``"small"`` configuration; ``split_k = 0`` picks the split that gives at least
    ``SMALL_AUTO_PROGRAMS_PER_SM`` programs per SM (each split >= 2 ``block_k`` steps).

    Raises:
        ValueError: a field out of range, or ``m > SMALL_MAX_M``.
    """
    if split_k == 0 and _pow2_at_least(block_n, 16) and _pow2_at_least(block_k, 16):
        split_k = _fit_split(m, n, k, max(16, m), block_n, block_k,
                             SMALL_AUTO_PROGRAMS_PER_SM * _num_sms(device))
    cfg = Int8LinearConfig(16, block_n, block_k, split_k=split_k, swap_ab=True, num_warps=num_warps,
                           num_stages=num_stages, fused_reduce=fused_reduce, kind="small")
    _check_small_config(cfg, m)
    return cfg


_SMALL_ENV_CACHE: dict[str, dict] = {}


def _small_env_table(raw: str) -> dict:
    """Parse ``LLMSERVE_INT8_SMALL_CONFIG`` into ``{(K, N) or None: (block_n, block_k, split_k,
    num_warps, num_stages)}`` (``None``: every other shape); cached per value."""
    hit = _SMALL_ENV_CACHE.get(raw)
    if hit is not None:
        return hit
    table: dict = {}
    for entry in filter(None, (e.strip() for e in raw.split(";"))):
        try:
            key = None
            if ":" in entry:
                shape, entry = entry.split(":", 1)
                kk, nn = shape.lower().split("x")
                key = (int(kk), int(nn))
            vals = tuple(int(v) for v in entry.split(","))
            if len(vals) != 5:
                raise ValueError(f"{len(vals)} numbers, not 5")
            if vals[2] < 0:
                raise ValueError("split_k must be >= 0 (0: auto)")
            _check_small_config(Int8LinearConfig(16, vals[0], vals[1], split_k=max(1, vals[2]),
                                                 num_warps=vals[3], num_stages=vals[4], kind="small"), 1)
        except ValueError as e:
            raise ValueError(f"{SMALL_ENV} must be ';'-separated entries '[KxN:]block_n,block_k,"
                             f"split_k,num_warps,num_stages' (split_k 0: auto), got {raw!r}: {e}") from None
        table[key] = vals
    _SMALL_ENV_CACHE[raw] = table
    return table


def _small_from_env(m: int, n: int, k: int, device: torch.device) -> Int8LinearConfig | None:
    """The ``"small"`` configuration ``LLMSERVE_INT8_SMALL_CONFIG`` gives this shape, if any."""
    raw = os.environ.get(SMALL_ENV, "")
    if not raw.strip() or not SMALL_M[0] <= m <= SMALL_M[1]:
        return None
    table = _small_env_table(raw)
    vals = table.get((k, n), table.get(None))
    if vals is None:
        return None
    bn, bk, split, warps, stages = vals
    return small_config(m, n, k, device, bn, bk, split, warps, stages)


def choose_int8_config(m: int, n: int, k: int, device: torch.device) -> Int8LinearConfig:
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
    * ``m > 64``: dequantize to ``x.dtype`` then cuBLAS (M=2048: 1.12-1.19x the bf16 time; the
      fused tile kernels measured 1.7-2.1x, at M=256 too).
    * ``2 <= m <= 16`` with ``LLMSERVE_INT8_SMALL_CONFIG`` set (module docstring): the
      ``"small"`` kind with that configuration. Not yet a CUDA default: no H200 measurement.
    * CPU (Triton interpreter): the same kinds with small tiles (``"small"`` for
      ``2 <= m <= 16``), so tests cover every path.

    Raises:
        ValueError: a malformed ``LLMSERVE_INT8_SMALL_CONFIG``.
    """
    if m == 1:  # block_n / block_k / num_warps / num_stages of the gemv.py launch
        g = choose_gemv_config(1, n, k, torch.int8, device)
        return Int8LinearConfig(1, g.block_n, g.block_k, num_warps=g.num_warps, num_stages=g.stages,
                                kind="vec", programs_per_sm=g.programs_per_sm)
    small = _small_from_env(m, n, k, device)
    if small is not None:
        return small
    if device.type != "cuda":
        if SMALL_M[0] <= m <= SMALL_M[1]:
            return small_config(m, n, k, device, 16, 32, 2 if k >= 64 else 1)
        if m <= 64:
            split = 2 if k >= 64 else 1
            return Int8LinearConfig(16 if m <= 16 else 32, 32, 32, split_k=split, num_warps=1,
                                    num_stages=1, fused_reduce=True)
        return Int8LinearConfig(1, 1, 1, kind="dequant")
    sms = _num_sms(device)
    if m <= 64:
        bm = max(16, triton.next_power_of_2(m))
        if k <= 4096:
            split = _fit_split(m, n, k, bm, 32, 256, sms)
            return Int8LinearConfig(bm, 32, 256, split_k=split, num_warps=4, num_stages=4,
                                    fused_reduce=True)
        split = _fit_split(m, n, k, bm, 64, 128, 2 * sms)
        return Int8LinearConfig(bm, 64, 128, split_k=split, num_warps=4, num_stages=4, fused_reduce=True)
    return Int8LinearConfig(1, 1, 1, kind="dequant")


def _check_int8_inputs(x, w_int8, scale, bias):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a float16/bfloat16/float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(w_int8, torch.Tensor) or w_int8.dtype != torch.int8 or w_int8.dim() != 2:
        raise ValueError("w_int8 must be a 2-D int8 tensor [N, K] (out_features x in_features), got "
                         f"{getattr(w_int8, 'dtype', type(w_int8))} {tuple(getattr(w_int8, 'shape', ()))}")
    n, k = w_int8.shape
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


def int8_linear(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, config: Int8LinearConfig | None = None
                ) -> torch.Tensor:
    """Weight-only INT8 linear: ``y = x @ (w_int8 * scale[:, None]).T (+ bias)``.

    Args:
        x: ``[..., K]`` float16/bfloat16/float32 activations.
        w_int8: ``[N, K]`` int8, row-major (``nn.Linear.weight`` orientation).
        scale: ``[N]`` float per-output-channel scales (any float dtype; used in fp32).
        bias: optional ``[N]`` float bias.
        config: tile configuration override (default :func:`choose_int8_config`).

    Returns:
        ``[..., N]`` in ``x.dtype``. Accumulation is fp32.

    Raises:
        ValueError: wrong dtypes, shapes, strides or devices; CPU tensors without
            ``TRITON_INTERPRET=1``; an unknown ``config.kind``; kind ``"vec"`` with M > 4 or
            ``"small"`` with M > 64 or tiles that are not powers of two >= 16 (see
            :class:`Int8LinearConfig`); a malformed ``LLMSERVE_INT8_SMALL_CONFIG``.
    """
    _check_int8_inputs(x, w_int8, scale, bias)
    n, k = w_int8.shape
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
    cfg = config or choose_int8_config(m, n, k, x.device)
    if cfg.kind not in KINDS:
        raise ValueError(f"Int8LinearConfig.kind must be one of {KINDS}, got {cfg.kind!r}")
    has_bias = bias is not None
    fp32_math = on_cpu or x.dtype == torch.float32
    if cfg.kind == "small":
        _check_small_config(cfg, m)
        steps = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k)   # BLOCK_K steps a split
        split = triton.cdiv(k, steps * cfg.block_k)                       # no empty split
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
        row_blocks = triton.cdiv(n, cfg.block_n)
        fused = split > 1 and cfg.fused_reduce
        cnt = _tile_counters(x.device, row_blocks) if fused else ws
        _int8_small_kernel[(row_blocks, split)](
            x2, w_int8, scale, bias if has_bias else scale, y, ws, cnt, m, n, k, steps,
            x2.stride(0), w_int8.stride(0), y.stride(0), y.stride(1),
            HAS_BIAS=has_bias, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, SPLIT=split > 1, FUSED_REDUCE=fused,
            FP32_MATH=fp32_math, REG_PREFETCH=cfg.num_stages == 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if split > 1 and not fused:
            _reduce_splits(ws, scale, bias, y, m, n, split, on_cpu)
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
        _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
            w_int8, scale, w_deq, n, k, w_int8.stride(0), w_deq.stride(0),
            BLOCK_N=bn, BLOCK_K=bk, num_warps=1 if on_cpu else 4)
        y = torch.nn.functional.linear(x2, w_deq, bias)                            # [M, N]
        return y.reshape(*lead, n)
    k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)
    even_k = k % cfg.block_k == 0
    ws = (torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    fused = split > 1 and cfg.fused_reduce
    cnt = _tile_counters(x.device, tiles) if fused else ws
    args = (x2, w_int8, scale, bias if has_bias else scale, y, ws, cnt, m, n, k, k_per,
            x2.stride(0), x2.stride(1), w_int8.stride(0), w_int8.stride(1), y.stride(0), y.stride(1))
    _int8_linear_kernel[(tiles, split)](
        *args, HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab, EVEN_K=even_k, SPLIT=split > 1,
        FUSED_REDUCE=fused, FP32_MATH=fp32_math,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1 and not fused:
        _reduce_splits(ws, scale, bias, y, m, n, split, on_cpu)
    return y.reshape(*lead, n)


def _reduce_splits(ws, scale, bias, y, m: int, n: int, split: int, on_cpu: bool) -> None:
    """``y = sum_s ws[s] * scale (+ bias)`` (split-K partials ``ws [split, M, N]`` fp32)."""
    block = 1024 if not on_cpu else 256
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        ws, scale, bias if bias is not None else scale, y, m, n, split, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4 if not on_cpu else 1)


def int8_linear_reference(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`int8_linear`: dequantize in fp32, matmul, cast to
    ``x.dtype``. Shapes as :func:`int8_linear`."""
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
