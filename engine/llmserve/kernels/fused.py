"""Fused elementwise kernels for the fast decode path: (residual add +) RMSNorm, SiLU-and-mul,
and RoPE fused with the split of the packed QKV projection and the K/V cache write.

Why: at batch 1 a Qwen2.5-1.5B decode step moves 3.09 GB of weights in about 0.73 ms on the
H200, while the unfused PyTorch layer launches ~35 small kernels (RMSNorm alone is ~7), i.e.
~1,000 launches a step at several microseconds each even inside a CUDA graph. Fusing brings a
layer to about 10 kernels (norm, QKV GEMM, rope+KV write, attention, O GEMM, add+norm,
gate-up GEMM, silu-mul, down GEMM).

Numerics follow the PyTorch reference path (HF Qwen2): statistics in fp32; the residual sum is
rounded to the model dtype before it is normalised; the normalised value is rounded to the
model dtype before the weight multiply; ``silu(gate)`` is rounded before the multiply by
``up``. RoPE is computed in fp32 and rounded once (the reference rounds after each bf16 op, so
bf16 results may differ in the last bit).

All kernels cast loads to fp32 before arithmetic so they are exact under ``TRITON_INTERPRET=1``
(the interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import pdl_available, pdl_launch_kwargs, pdl_start, pdl_wait


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps,
                        stride_x, stride_r, stride_o, stride_ro,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr = False, PDL_TRIGGER_FIRST: tl.constexpr = False):
    """One row a program. With ``USE_PDL`` the norm weight (never written by a kernel) is read
    before the PDL wait and x / the residual after it."""
    pdl_start(USE_PDL, PDL_TRIGGER_FIRST)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)                   # rounded like a dtype add
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = (x * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual`` (when given) and ``out = weight * rmsnorm(residual')``.

    Args:
        x: ``[M, H]`` (rows may be strided; last dim contiguous).
        weight: ``[H]``.
        eps: variance epsilon.
        residual: ``[M, H]`` or ``None`` (then ``x`` itself is normalised and returned as the
            residual).
        pdl: launch with programmatic dependent launch where available
            (:func:`~llmserve.kernels._launch.pdl_available`; ignored elsewhere; see
            :func:`~llmserve.kernels._launch.pdl_wait`): the kernel may start while its
            predecessor drains and reads ``weight`` before waiting (so no kernel of the same
            PDL chain may write ``weight``), and the next PDL kernel (the LM head, or a
            fragment projection) may launch once this one passed its wait.

    Returns:
        ``(out [M, H], residual' [M, H])`` in ``x.dtype``.

    Raises:
        ValueError: shape or contiguity mismatch.
    """
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rmsnorm expects x [M, H] with a contiguous last dim and weight [H]; "
                         f"got x {tuple(x.shape)} stride {x.stride()}, weight {tuple(weight.shape)}")
    m, h = x.shape
    pdl = pdl and pdl_available(x.device)
    out = torch.empty_like(x)
    if residual is None:
        res_out = x
        _add_rmsnorm_kernel[(m,)](x, x, weight, out, x, h, eps, x.stride(0), x.stride(0),
                                  out.stride(0), x.stride(0), HAS_RES=False,
                                  BLOCK=triton.next_power_of_2(h), **pdl_launch_kwargs(pdl))
        return out, res_out
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")
    res_out = torch.empty_like(x)
    _add_rmsnorm_kernel[(m,)](x, residual, weight, out, res_out, h, eps, x.stride(0),
                              residual.stride(0), out.stride(0), res_out.stride(0),
                              HAS_RES=True, BLOCK=triton.next_power_of_2(h), **pdl_launch_kwargs(pdl))
    return out, res_out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_o, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr = False, PDL_TRIGGER_FIRST: tl.constexpr = False):
    pdl_start(USE_PDL, PDL_TRIGGER_FIRST)
    pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)  # nothing to read before it: every operand a kernel wrote
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for a packed ``[M, 2I]`` tensor (gate first, then up).

    Args:
        gate_up: ``[M, 2I]``, last dim contiguous.
        pdl: launch with programmatic dependent launch where available
            (:func:`~llmserve.kernels._launch.pdl_available`; ignored elsewhere; see
            :func:`~llmserve.kernels._launch.pdl_wait`): the kernel waits for its
            predecessor before any load, then lets the next PDL kernel (the down projection)
            launch and request its weights while this one runs.

    Returns:
        ``[M, I]`` in ``gate_up.dtype``.

    Raises:
        ValueError: not ``[M, 2I]`` with a contiguous last dim.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_and_mul expects [M, 2I] with a contiguous last dim, got {tuple(gate_up.shape)}")
    m, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty((m, i), dtype=gate_up.dtype, device=gate_up.device)
    pdl = pdl and pdl_available(gate_up.device)
    block = 1024
    _silu_mul_kernel[(m, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                 **pdl_launch_kwargs(pdl))
    return out


@triton.jit
def _rope_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                     stride_qkv, num_slots,
                     HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
                     HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    D: tl.constexpr = 2 * HALF
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    slot = tl.where(slot < 0, slot + num_slots, slot)            # padding -> scratch block
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + d)[None, :]             # [1, HALF] fp32
    sin = tl.load(sin_ptr + pos * HALF + d)[None, :]
    base = qkv_ptr + tok * stride_qkv
    # queries: [HQ, D] -> roped into q_out [N, HQ, D]
    hq = tl.arange(0, HQ_PAD)[:, None]
    mq = hq < HQ
    x1 = tl.load(base + hq * D + d[None, :], mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(base + hq * D + HALF + d[None, :], mask=mq, other=0.0).to(tl.float32)
    qo = q_out_ptr + tok * (HQ * D) + hq * D + d[None, :]
    tl.store(qo, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mq)
    tl.store(qo + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mq)
    # keys: roped and written to the cache slot; values: copied to the cache slot
    hk = tl.arange(0, HKV_PAD)[:, None]
    mk = hk < HKV
    kb = base + HQ * D + hk * D + d[None, :]
    k1 = tl.load(kb, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(kb + HALF, mask=mk, other=0.0).to(tl.float32)
    ko = k_cache_ptr + slot * (HKV * D) + hk * D + d[None, :]
    tl.store(ko, (k1 * cos - k2 * sin).to(k_cache_ptr.dtype.element_ty), mask=mk)
    tl.store(ko + HALF, (k2 * cos + k1 * sin).to(k_cache_ptr.dtype.element_ty), mask=mk)
    vb = base + (HQ + HKV) * D + hk * D + d[None, :]
    vo = v_cache_ptr + slot * (HKV * D) + hk * D + d[None, :]
    tl.store(vo, tl.load(vb, mask=mk, other=0.0).to(v_cache_ptr.dtype.element_ty), mask=mk)
    tl.store(vo + HALF, tl.load(vb + HALF, mask=mk, other=0.0).to(v_cache_ptr.dtype.element_ty), mask=mk)


def rope_qkv_write_kv(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Split a packed QKV projection, apply RoPE (rotate-half layout) to Q and K, write K and V
    into the paged cache, and return Q.

    Args:
        qkv: ``[N, (Hq + 2*Hkv) * D]`` output of the packed projection (bias included).
        positions: ``[N]`` int64 positions.
        slot_mapping: ``[N]`` int64 cache slots (``-1``: padding, written to the scratch block).
        cos, sin: fp32 ``[L, D/2]`` tables (``L`` > every position).
        k_cache, v_cache: contiguous ``[num_blocks + 1, block_size, Hkv, D]``.
        num_heads, num_kv_heads: ``Hq`` and ``Hkv``.

    Returns:
        ``q`` ``[N, Hq, D]`` (contiguous, ``qkv.dtype``).
    """
    n = qkv.shape[0]
    nb, bs, hkv, d = k_cache.shape
    if hkv != num_kv_heads or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or qkv.stride(-1) != 1:
        raise ValueError(f"rope_qkv_write_kv: qkv {tuple(qkv.shape)} does not match Hq={num_heads}, "
                         f"Hkv={num_kv_heads}, D={d}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_qkv_write_kv needs contiguous K/V caches")
    if cos.shape[-1] * 2 != d or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be fp32 [L, {d // 2}], got {cos.dtype} {tuple(cos.shape)}")
    q = torch.empty((n, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    _rope_qkv_kernel[(n,)](qkv, cos, sin, positions, slot_mapping, q, k_cache, v_cache,
                           qkv.stride(0), nb * bs, HQ=num_heads, HKV=num_kv_heads,
                           HQ_PAD=triton.next_power_of_2(num_heads),
                           HKV_PAD=triton.next_power_of_2(num_kv_heads), HALF=d // 2)
    return q
