"""The whole Qwen2 MLP of a decode step in one kernel: RMSNorm -> gate/up projection -> SwiGLU
-> down projection, for ``M <= 4`` token rows ("fused MLP" gemv).

Why: at batch 1 the gate-up and down projections are two matrix-vector kernels (Qwen2.5-1.5B on
the H200: 15.6 and 8.0 us a layer against 13.0 and 6.5 us of weight bytes at 4.24 TB/s;
``results/kernels/NOTES.md``), and each pays a ramp at its start and a tail at its end. The
down projection only needs, for output ``h``, the sum over the intermediate index ``i`` of
``act[i] * Wd[h, i]``, so it splits along ``i`` with no dependence between the splits: a
program that has just computed ``act`` for its block of intermediate rows can at once
multiply it by the matching *rows* of ``Wd.T`` (``[I, H]``, stored transposed so the rows are
contiguous) and add its ``[M, H]`` partial sums into an fp32 accumulator with atomics
("split-K by atomics", the stream-K/split-K reduction of CUTLASS and Triton's matmul tutorials,
here along the down projection's K which is the MLP's intermediate size). One launch streams
all three weights; there is no grid-wide dependency between gate-up and down.

The accumulator ``acc`` ``[M, H]`` fp32 is not added to the residual stream here (every program
would race with the others): the next layer's QKV projection reads ``x + acc`` (rounded to the
model dtype, exactly what the unfused residual add computes) and stores it as the new residual
stream (:func:`~llmserve.triton_kernels.gemv.gemv`'s ``x_add``/``x_out``), and the O projection
after it zeroes ``acc`` again (``zero``). The summation order of the atomics varies from run to
run, so results are reproducible only to fp32 rounding of the down projection (bf16 outputs may
differ in the last bit between runs, like any split-K GEMM with atomic reduction).

Numerics against the unfused path (HF Qwen2): the same roundings as
:func:`~llmserve.triton_kernels.gemv.gemv` with ``glu=True`` (gate and up rounded to the model
dtype, SiLU rounded, the product rounded once, as the stored activation would be) followed by the
down projection in fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import pdl_launch_kwargs, pdl_start, pdl_wait
from .gemv import GEMV_MAX_M, _gemv_rows, _gemv_step, _load_w

__all__ = ["FusedMLPConfig", "fused_mlp", "fused_mlp_config", "fused_mlp_reference"]


@triton.jit
def _fused_mlp_kernel(x_ptr, g_ptr, wgu_ptr, wdt_ptr, acc_ptr, M, I, H, stride_xm, eps,
                      BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                      PDL_TRIGGER_FIRST: tl.constexpr = False):
    """Program ``pid`` owns intermediate rows ``pid * BLOCK_I ...``: the gate rows ``i``, up rows
    ``I + i`` of the packed ``[2I, H]`` weight and rows ``i`` of ``Wd.T`` ``[I, H]``. Phase 1 is
    the gate-up gemv over ``H`` (x broadcast along the rows, as in ``gemv``); phase 2 streams the
    down rows in ``BLOCK_K``-wide column tiles and adds each ``[M, BLOCK_K]`` partial into
    ``acc`` with relaxed fp32 atomics."""
    pdl_start(USE_PDL, PDL_TRIGGER_FIRST)
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rm_ld = rm % M
    rk = tl.arange(0, BLOCK_K)
    rn, rn_ld, row_a, row_b, _, _ = _gemv_rows(pid, I, BLOCK_I, False, 1)       # gate i, up I + i
    w_base = wgu_ptr + row_a[None, :, None].to(tl.int64) * H + rk[None, None, :]  # [1, BI, BK]
    wb_base = wgu_ptr + row_b[None, :, None].to(tl.int64) * H + rk[None, None, :]
    w = _load_w(w_base, 0, H, rk, EVEN_K)          # first tiles before the wait (weights only)
    wb = _load_w(wb_base, 0, H, rk, EVEN_K)
    pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)
    x_base = x_ptr + rm_ld[:, None, None].to(tl.int64) * stride_xm + (rn * 0)[None, :, None] \
        + rk[None, None, :]                                                     # [BM, BI, BK]
    acc_g = tl.zeros([BLOCK_M, BLOCK_I, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_I, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_I, BLOCK_K], dtype=tl.float32)
    acc_g, acc_u, sq = _gemv_step(acc_g, acc_u, sq, w, wb, x_base, g_ptr, 0, H, rk, 1, True, EVEN_K,
                                  False, x_base, x_base, False)
    for k0 in tl.range(BLOCK_K, H, BLOCK_K):
        w = _load_w(w_base, k0, H, rk, EVEN_K)
        wb = _load_w(wb_base, k0, H, rk, EVEN_K)
        acc_g, acc_u, sq = _gemv_step(acc_g, acc_u, sq, w, wb, x_base, g_ptr, k0, H, rk, 1, True,
                                      EVEN_K, False, x_base, x_base, False)
    rstd = tl.math.rsqrt(tl.sum(sq, axis=2) / H + eps)                          # [BM, BI]
    dt = x_ptr.dtype.element_ty
    gate = (tl.sum(acc_g, axis=2) * rstd).to(dt).to(tl.float32)
    up = (tl.sum(acc_u, axis=2) * rstd).to(dt).to(tl.float32)
    act = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt).to(tl.float32)
    act = tl.where((rn < I)[None, :], act, 0.0)           # rows past I (wrapped loads) add nothing
    act3 = act[:, :, None]                                                      # [BM, BI, 1]
    d_base = wdt_ptr + row_a[None, :, None].to(tl.int64) * H + rk[None, None, :]  # [1, BI, BK]
    o_base = acc_ptr + rm[:, None].to(tl.int64) * H + rk[None, :]               # [BM, BK]
    mmask = (rm < M)[:, None]
    for k0 in tl.range(0, H, BLOCK_K):
        wd = _load_w(d_base, k0, H, rk, EVEN_K).to(tl.float32)                  # [1, BI, BK]
        part = tl.sum(act3 * wd, axis=1)                                        # [BM, BK]
        tl.atomic_add(o_base + k0, part, mask=mmask & ((k0 + rk) < H)[None, :], sem="relaxed")


@dataclass(frozen=True, slots=True)
class FusedMLPConfig:
    """Launch configuration of :func:`fused_mlp`: ``block_i`` intermediate rows a program (a
    power of two; ``I / block_i`` programs, each adding ``M x H`` fp32 atomics), ``block_k``
    columns a weight tile, ``num_warps``."""

    block_i: int = 8
    block_k: int = 256
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_i", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1) or v > 1024:
                raise ValueError(f"FusedMLPConfig.{name} must be a power of two in [1, 1024], got {v!r}")


def fused_mlp_config() -> FusedMLPConfig:
    """The configuration the engine uses: ``LLMSERVE_FUSED_MLP_CONFIG="block_i,block_k,warps"``
    or the defaults of :class:`FusedMLPConfig`.

    Raises:
        ValueError: a malformed value."""
    env = os.environ.get("LLMSERVE_FUSED_MLP_CONFIG", "").strip()
    if not env:
        return FusedMLPConfig()
    try:
        vals = [int(v) for v in env.split(",")]
        if len(vals) != 3:
            raise ValueError
    except ValueError:
        raise ValueError(f"LLMSERVE_FUSED_MLP_CONFIG must be 'block_i,block_k,num_warps', got {env!r}") from None
    return FusedMLPConfig(*vals)


def fused_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down_t: torch.Tensor,
              norm_weight: torch.Tensor, eps: float, acc: torch.Tensor, *,
              config: FusedMLPConfig | None = None, pdl: bool = False,
              pdl_trigger_first: bool = False) -> torch.Tensor:
    """``acc += silu(gate(n(x))) * up(n(x)) @ Wd.T`` with ``n`` = RMSNorm, in one launch.

    Args:
        x: ``[M, H]`` residual-stream rows (``M <= GEMV_MAX_M``), fp16/bf16/fp32, last dim
            contiguous.
        w_gate_up: packed ``[2I, H]`` = ``[gate; up]`` row-major, x's dtype.
        w_down_t: the down projection transposed, ``[I, H]`` row-major (``down_proj.weight.T``
            made contiguous), x's dtype.
        norm_weight: ``[H]`` post-attention RMSNorm gain; eps: its epsilon.
        acc: ``[M, H]`` float32 contiguous accumulator the down projection is *added* into (zero
            it first for a plain MLP output); must not overlap ``x``.
        config: launch override (default :func:`fused_mlp_config`).
        pdl, pdl_trigger_first: programmatic dependent launch, as in
            :func:`~llmserve.triton_kernels.gemv.gemv`.

    Returns:
        ``acc``.

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not fit; ``M > GEMV_MAX_M``; CPU
            tensors without ``TRITON_INTERPRET=1``.
    """
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor with a contiguous last dim, got "
                         f"{x.dtype} {tuple(x.shape)}")
    m, h = x.shape
    if m > GEMV_MAX_M:
        raise ValueError(f"fused_mlp serves M <= {GEMV_MAX_M} rows, got M={m}")
    if w_gate_up.dim() != 2 or w_gate_up.shape[1] != h or w_gate_up.shape[0] % 2 or not w_gate_up.is_contiguous():
        raise ValueError(f"w_gate_up must be a contiguous [2I, H={h}] weight, got {tuple(w_gate_up.shape)}")
    i = w_gate_up.shape[0] // 2
    if w_down_t.shape != (i, h) or not w_down_t.is_contiguous():
        raise ValueError(f"w_down_t must be the contiguous [I={i}, H={h}] transposed down weight, got "
                         f"{tuple(w_down_t.shape)} stride {w_down_t.stride()}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down_t", w_down_t)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} dtype {t.dtype} must be x's dtype {x.dtype}")
    if norm_weight.shape != (h,) or not norm_weight.is_floating_point() or norm_weight.stride(-1) != 1:
        raise ValueError(f"norm_weight must be a floating-point [H={h}] tensor")
    if acc.shape != (m, h) or acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError(f"acc must be a contiguous float32 [{m}, {h}] tensor, got {acc.dtype} {tuple(acc.shape)}")
    if acc.numel() and x.numel() and acc.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("acc must not share memory with x")
    for name, t in (("w_gate_up", w_gate_up), ("w_down_t", w_down_t), ("norm_weight", norm_weight), ("acc", acc)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("fused_mlp needs CUDA tensors, or (CPU tensors) TRITON_INTERPRET=1 set before "
                         "importing llmserve.triton_kernels")
    if m == 0:
        return acc
    cfg = config or fused_mlp_config()
    _fused_mlp_kernel[(triton.cdiv(i, cfg.block_i),)](
        x, norm_weight, w_gate_up, w_down_t, acc, m, i, h, x.stride(0), float(eps),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k,
        EVEN_K=h % cfg.block_k == 0, num_warps=cfg.num_warps, **pdl_launch_kwargs(pdl, pdl_trigger_first))
    return acc


def fused_mlp_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down_t: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch reference of :func:`fused_mlp`'s contribution ``[M, H]`` fp32, with its
    roundings (normalised activation kept in fp32; gate, up, SiLU and the activation rounded to
    x's dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = xf @ w_gate_up.float().T
    i = w_down_t.shape[0]
    g, u = y[:, :i].to(x.dtype).float(), y[:, i:].to(x.dtype).float()
    act = (torch.nn.functional.silu(g).to(x.dtype).float() * u).to(x.dtype).float()
    return act @ w_down_t.float()
