"""Row-wise argmax of fp32 logits in one launch, for greedy decoding inside the decode graph.

Why: ``torch.argmax`` over one 151,936-entry row took 7.5 us on the H200 plus a memset and a
launch gap after the LM head (an engine-step profile), about 1% of a
Qwen2.5-1.5B decode step. Here ``S`` programs per row each reduce a contiguous chunk, write
a partial ``(value, index)``, and the last program of the row to finish (an arrival counter,
as in the split-K decode attention's in-kernel merge) reduces the ``S`` partials in order;
launched with programmatic dependent launch it starts while the LM head drains.

Semantics match ``torch.argmax(x, dim=-1)``: the first index of the maximum; a NaN counts as
larger than every number, so a row with NaNs gives its first NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import num_sms, pdl_launch_kwargs, pdl_start, pdl_wait, zeroed_counters

__all__ = ["argmax_rows"]


@triton.jit
def _chunk_argmax(x_ptr, lo, hi, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """``(max, first index of max, first NaN index or hi)`` of ``x[lo:hi]`` (NaNs excluded from
    the max: they map to -inf there and are tracked separately)."""
    offs = tl.arange(0, BLOCK)
    best_v = tl.full([1], float("-inf"), tl.float32)
    best_i = tl.full([1], hi, tl.int32)
    nan_i = tl.full([1], hi, tl.int32)
    for it in tl.static_range(ITERS):
        idx = lo + it * BLOCK + offs
        live = idx < hi
        v = tl.load(x_ptr + idx, mask=live, other=float("-inf")).to(tl.float32)
        isnan = v != v
        nan_i = tl.minimum(nan_i, tl.min(tl.where(isnan & live, idx, hi), 0))
        v = tl.where(isnan, float("-inf"), v)
        m = tl.max(v, 0)
        first = tl.min(tl.where((v == m) & live, idx, hi), 0)
        take = m > best_v                       # strictly greater: earlier chunks win ties
        best_i = tl.where(take, first, best_i)
        best_v = tl.where(take, m, best_v)
    return best_v, best_i, nan_i


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, sel_ptr, stride_out, pv_ptr, pi_ptr, pn_ptr, cnt_ptr, V, stride_x, chunk,
                   S: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                   USE_PDL: tl.constexpr, PDL_TRIGGER_FIRST: tl.constexpr, SELECT: tl.constexpr):
    """Grid ``(B, S)``: program ``(b, s)`` reduces ``x[b, s*chunk : (s+1)*chunk]``; the last of
    the row's ``S`` programs merges the partials (in chunk order) into ``out[b]`` (``SELECT``:
    ``out[sel[0], b]``, the output row read from device memory) and re-arms the row's counter."""
    pdl_start(USE_PDL, PDL_TRIGGER_FIRST)
    b = tl.program_id(0)
    s = tl.program_id(1)
    if SELECT:    # written before the forward pass (the step's inputs): readable before the wait
        out_ptr += tl.load(sel_ptr).to(tl.int64) * stride_out
    pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)
    row = x_ptr + b.to(tl.int64) * stride_x
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    best_v, best_i, nan_i = _chunk_argmax(row, lo, hi, BLOCK, ITERS)
    # chunk-local "none" (hi) -> V, so the merge can compare indices across chunks
    best_i = tl.where(best_i >= hi, V, best_i)
    nan_i = tl.where(nan_i >= hi, V, nan_i)
    if S == 1:
        res = tl.where(nan_i < V, nan_i, tl.where(best_i < V, best_i, 0))
        tl.store(out_ptr + b + tl.arange(0, 1), res.to(tl.int64))
    else:
        one = tl.arange(0, 1)
        p = b * S + s
        tl.store(pv_ptr + p + one, best_v)
        tl.store(pi_ptr + p + one, best_i)
        tl.store(pn_ptr + p + one, nan_i)
        tl.debug_barrier()
        count = tl.atomic_add(cnt_ptr + b, 1)     # acq_rel: partial stores released / acquired
        if count == S - 1:
            offs = tl.arange(0, S_PAD)
            live = offs < S
            pv = tl.load(pv_ptr + b * S + offs, mask=live, other=float("-inf"), cache_modifier=".cg")
            pi = tl.load(pi_ptr + b * S + offs, mask=live, other=V, cache_modifier=".cg")
            pn = tl.load(pn_ptr + b * S + offs, mask=live, other=V, cache_modifier=".cg")
            m = tl.max(pv, 0)
            first = tl.min(tl.where(pv == m, pi, V), 0)   # chunks are in index order
            first_nan = tl.min(pn, 0)
            res = tl.where(first_nan < V, first_nan, tl.where(first < V, first, 0))
            tl.store(out_ptr + b, res.to(tl.int64))
            tl.atomic_xchg(cnt_ptr + b, 0)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, *, pdl: bool = False,
                pdl_trigger_first: bool = False, block: int = 1024, max_programs: int | None = None,
                out_row: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for a 2-D float tensor, in one kernel launch.

    Args:
        x: ``[B, V]`` float (fp32 logits), last dim contiguous, ``V < 2**31``.
        out: optional ``[B]`` int64 output (e.g. a CUDA graph's static buffer).
        pdl, pdl_trigger_first: programmatic dependent launch (see
            :func:`~llmserve.kernels.gemv.gemv`); ``x`` is read after the wait.
        block: elements a program reduces per step (power of two).
        max_programs: programs per row (default: the SM count, 2 in the interpreter).
        out_row: optional int64 ``[1]`` on ``x``'s device: ``out`` is then ``[R, B]`` (rows
            contiguous) and the result goes to row ``out_row[0]``, chosen when the kernel runs
            (a CUDA graph alternating between two output buffers). Not range-checked (device
            data); with PDL it is read before the wait, so no kernel that may still be running
            when this one starts (the one before it; with ``pdl_trigger_first`` several before
            it) may write it.

    Returns:
        ``[B]`` int64: the first index of each row's maximum (of its first NaN, if any), as
        ``torch.argmax``; 0 for an all ``-inf`` row, like torch. With ``out_row``: ``out``.

    Raises:
        ValueError: not 2-D, empty last dim, non-contiguous last dim, an integer dtype, an
            ``out`` of the wrong shape, dtype, device or stride (``[R, B]`` with contiguous rows
            when ``out_row`` is given, which is then required), an ``out_row`` that is not int64
            ``[1]`` on ``x``'s device, a non-power-of-two ``block``.
    """
    if x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a 2-D float tensor with a non-empty contiguous last dim, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    b, v = x.shape
    if v >= 2 ** 31:
        raise ValueError(f"last dim {v} too large (int32 indices)")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    if out_row is not None:
        if out is None or out.dim() != 2 or out.shape[1] != b or out.dtype != torch.int64 \
                or out.device != x.device or (b > 1 and out.stride(1) != 1):
            raise ValueError(f"with out_row, out must be int64 [R, {b}] on {x.device} with contiguous rows")
        if out_row.shape != (1,) or out_row.dtype != torch.int64 or out_row.device != x.device:
            raise ValueError(f"out_row must be int64 [1] on {x.device}, got {out_row.dtype} "
                             f"{tuple(out_row.shape)} on {out_row.device}")
    elif out is None:
        out = torch.empty(b, dtype=torch.int64, device=x.device)
    elif out.shape != (b,) or out.dtype != torch.int64 or out.device != x.device or (b > 1 and out.stride(0) != 1):
        raise ValueError(f"out must be a contiguous int64 [{b}] on {x.device}, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()} on {out.device}")
    if b == 0:
        return out
    if max_programs is None:
        max_programs = num_sms(x.device, cpu_default=2)
    blocks = triton.cdiv(v, block)
    s = max(1, min(blocks, max_programs))
    iters = triton.cdiv(blocks, s)
    s = triton.cdiv(blocks, iters)                    # every program gets whole blocks
    chunk = iters * block
    part_v = torch.empty(b * s, dtype=torch.float32, device=x.device)
    part_i = torch.empty(b * s, dtype=torch.int32, device=x.device)
    part_n = torch.empty(b * s, dtype=torch.int32, device=x.device)
    cnt = zeroed_counters("argmax", x.device, b)
    _argmax_kernel[(b, s)](x, out, out_row if out_row is not None else out,
                           out.stride(0) if out_row is not None else 0,
                           part_v, part_i, part_n, cnt, v, x.stride(0), chunk, SELECT=out_row is not None,
                           S=s, S_PAD=triton.next_power_of_2(s), BLOCK=block, ITERS=iters,
                           num_warps=4 if x.device.type == "cuda" else 1,
                           **pdl_launch_kwargs(pdl, pdl_trigger_first))
    return out
