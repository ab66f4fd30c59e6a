"""One decoder layer of a batch-1..4 decode step in one kernel launch (a per-layer "megakernel").

Why: at batch 1 the matrix-vector path (``gemv.py``) runs a Qwen2 layer as five kernels (QKV +
RoPE + cache write, decode attention, O + residual, gate-up + SwiGLU, down + residual). On the
H200 each kernel boundary costs 1-3 us beyond the kernel's weight bytes even with programmatic
dependent launch (``results/kernels/NOTES.md``, session 5 timeline: about 14 us a layer above
the bytes for Qwen2.5-1.5B). Here the five stages run in one persistent launch: a grid of at
most as many programs as are resident at once, each program looping over its share of every
stage's work, with a grid-wide barrier (an arrival counter in global memory) between stages.
Before waiting at a barrier each program issues the loads of its first weight tile of the next
stage (weights do not depend on the barrier), so the next stage's bytes are already in flight
when it is released. Attention keeps its parallelism: (sequence, KV head, context split) items
spread over the programs, merged by the last split to finish (``paged_attention._decode_split``).

The stage bodies are the same device functions as the separate kernels (``gemv._gemv_loop`` and
``paged_attention._decode_split``), so the arithmetic and its rounding are the same.

Safety of the barrier: every program must be resident at once, or the programs that arrived
spin while the missing ones wait for an SM. The launcher sizes the grid from the compiled
kernel's registers and shared memory (at most the occupancy times the SM count). With PDL,
dependents are released (``gdc_launch_dependents``) only after the first barrier, so a later
kernel cannot take the SM slots of programs of this one that have not started. In the Triton
interpreter (programs run one after another) the grid is one program.

The same structure (a persistent kernel whose stages are ordered by counters in memory, each
SM prefetching its next weights) is what "megakernel" decoders such as Hazy Research's
low-latency Llama-1B kernel and Mirage's persistent kernels use; this is a Triton version
written for Qwen2's layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import gdc_launch_dependents, gdc_wait, num_sms, pdl_launch_kwargs, zeroed_counters
from .gemv import _gemv_loop, _gemv_tiles, choose_gemv_config
from .paged_attention import _LOG2E, _decode_split

try:  # profiling stamps only (never traced unless asked for)
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover - old Triton
    @triton.jit
    def globaltimer():
        return 0

__all__ = ["DecodeLayerConfig", "DecodeLayerWeights", "decode_layer", "choose_decode_layer_config"]


@triton.jit
def _grid_barrier(bar_ptr, target):
    """Wait until ``target`` arrivals have been counted at ``bar_ptr`` (this program's one
    included). The CTA barrier orders every warp's stores before the arrival (release); the
    poll is itself an acquire whose value is used, so the SM's L1 is invalidated after it and
    every other program's stores before its arrival are visible here. (An acquire whose result
    is unused was dropped by Triton 3.6 / ptxas: no ``CCTL.IVALL`` in the SASS, stale L1 lines
    of the residual stream, wrong results on the H200.)"""
    tl.debug_barrier()
    cur = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu") + 1    # one arrival a program
    while cur < target:
        cur = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stamp(ts_ptr, pid, k, STAMPS: tl.constexpr):
    """Profiling: the global timer (ns) to ``ts_ptr[pid, k]`` (10 stamps a program)."""
    if STAMPS:
        tl.debug_barrier()
        tl.store(ts_ptr + pid * 10 + k, globaltimer())


@triton.jit
def _decode_layer_kernel(
        r_ptr, q_ptr, o_ptr, act_ptr,
        wqkv_ptr, bqkv_ptr, ln1_ptr, wo_ptr, bo_ptr, ln2_ptr, wgu_ptr, wd_ptr, bd_ptr,
        kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots,
        bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, bar_ptr, ts_ptr,
        M, qk_scale, eps, num_splits, stride_btb, stride_kb, stride_kt, stride_kh,
        H: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        G_PAD: tl.constexpr, PAGE: tl.constexpr, ATT_BLOCK_N: tl.constexpr,
        QKV_BN: tl.constexpr, QKV_BK: tl.constexpr, O_BN: tl.constexpr, O_BK: tl.constexpr,
        GU_BN: tl.constexpr, GU_BK: tl.constexpr, DN_BN: tl.constexpr, DN_BK: tl.constexpr,
        HAS_BQKV: tl.constexpr, HAS_BO: tl.constexpr, HAS_BD: tl.constexpr,
        BLOCK_M: tl.constexpr, FP32_MATH: tl.constexpr, USE_PDL: tl.constexpr,
        STAMPS: tl.constexpr):
    """Grid ``(P,)``, all programs resident. Stages, each over all ``P`` programs:

    1. ``q, cache[slot] = RoPE(RMSNorm(r) @ Wqkv.T + b)`` (``QKV_BN`` rotation pairs a block);
    2. decode attention ``o = softmax(q K^T * scale) V`` over the paged cache, items
       (sequence, KV head, split);
    3. ``r += o @ Wo.T (+ b)``;
    4. ``act = silu(gate) * up`` of ``RMSNorm(r) @ Wgu.T``;
    5. ``r += act @ Wd.T (+ b)``.

    Barrier ``k`` (after stage ``k``) waits for ``k * P`` arrivals at ``bar_ptr[0]``; the last
    program to leave re-arms ``bar_ptr[0..1]`` to zero. With ``STAMPS`` each program writes the
    global timer (ns) at 10 points to ``ts_ptr[pid, 0..9]``: start, then the end of each stage
    and of each barrier wait (profiling only)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    QD: tl.constexpr = HQ * D
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D // 2        # rotation pairs of the QKV projection
    HALF: tl.constexpr = D // 2
    G: tl.constexpr = HQ // HKV
    # Stage 1's first weight tile streams while the previous kernel drains.
    w, wb = _gemv_tiles(pid, tl.cdiv(NQKV, QKV_BN), wqkv_ptr, H, NQKV, H, QKV_BN, QKV_BK, True, HALF, True)
    if USE_PDL:
        gdc_wait()
    _stamp(ts_ptr, pid, 0, STAMPS)
    _gemv_loop(pid, nprog, w, wb, r_ptr, wqkv_ptr, q_ptr, wqkv_ptr, bqkv_ptr, r_ptr, ln1_ptr,
               kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots, M, NQKV, H, H, H, QD, QD, eps,
               False, HAS_BQKV, False, 1, False, True, HQ, HKV, HALF, BLOCK_M, QKV_BN, QKV_BK,
               H % QKV_BK == 0, 1)
    _stamp(ts_ptr, pid, 1, STAMPS)
    _grid_barrier(bar_ptr, nprog)
    _stamp(ts_ptr, pid, 2, STAMPS)
    if USE_PDL:  # every program of this grid is resident now: later kernels may take free slots
        gdc_launch_dependents()

    for item in range(pid, M * HKV * num_splits, nprog):
        b = item // (HKV * num_splits) + pid * 0      # tensors in the interpreter too
        kvh = (item // num_splits) % HKV + pid * 0
        split = item % num_splits + pid * 0
        _decode_split(b, kvh, split, b, tl.load(ctx_ptr + b), q_ptr, kc_ptr, vc_ptr, o_ptr, m_ptr, l_ptr,
                      acc_ptr, cnt_ptr, bt_ptr, qk_scale, num_splits, num_splits, HQ, HKV,
                      QD, D, stride_kb, stride_kt, stride_kh, QD, D, stride_btb,
                      G, G_PAD, D, PAGE, ATT_BLOCK_N, FP32_MATH, False, 1)
    _stamp(ts_ptr, pid, 3, STAMPS)
    w, wb = _gemv_tiles(pid, tl.cdiv(H, O_BN), wo_ptr, QD, H, QD, O_BN, O_BK, False, 1, False)
    _grid_barrier(bar_ptr, 2 * nprog)
    _stamp(ts_ptr, pid, 4, STAMPS)

    _gemv_loop(pid, nprog, w, wb, o_ptr, wo_ptr, r_ptr, wo_ptr, bo_ptr, r_ptr, ln1_ptr,
               kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots, M, H, QD, QD, QD, H, H, eps,
               False, HAS_BO, True, 0, False, False, HQ, HKV, HALF, BLOCK_M, O_BN, O_BK, QD % O_BK == 0, 1)
    _stamp(ts_ptr, pid, 5, STAMPS)
    w, wb = _gemv_tiles(pid, tl.cdiv(INTER, GU_BN), wgu_ptr, H, INTER, H, GU_BN, GU_BK, False, 1, True)
    _grid_barrier(bar_ptr, 3 * nprog)
    _stamp(ts_ptr, pid, 6, STAMPS)

    _gemv_loop(pid, nprog, w, wb, r_ptr, wgu_ptr, act_ptr, wgu_ptr, wgu_ptr, r_ptr, ln2_ptr,
               kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots, M, INTER, H, H, H, INTER, INTER,
               eps, False, False, False, 1, True, False, HQ, HKV, HALF, BLOCK_M, GU_BN, GU_BK,
               H % GU_BK == 0, 1)
    _stamp(ts_ptr, pid, 7, STAMPS)
    w, wb = _gemv_tiles(pid, tl.cdiv(H, DN_BN), wd_ptr, INTER, H, INTER, DN_BN, DN_BK, False, 1, False)
    _grid_barrier(bar_ptr, 4 * nprog)
    _stamp(ts_ptr, pid, 8, STAMPS)

    _gemv_loop(pid, nprog, w, wb, act_ptr, wd_ptr, r_ptr, wd_ptr, bd_ptr, r_ptr, ln2_ptr,
               kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, num_slots, M, H, INTER, INTER, INTER, H, H,
               eps, False, HAS_BD, True, 0, False, False, HQ, HKV, HALF, BLOCK_M, DN_BN, DN_BK,
               INTER % DN_BK == 0, 1)
    _stamp(ts_ptr, pid, 9, STAMPS)
    # Re-arm: the last program out has seen every program pass the last barrier.
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(bar_ptr + 1, 0)


@dataclass(frozen=True, slots=True)
class DecodeLayerConfig:
    """Launch configuration of :func:`decode_layer`: ``(block_n, block_k)`` of each projection
    stage (QKV counts rotation pairs), the attention tile ``att_block_n`` (cache positions a
    split), ``num_warps`` of every program and ``programs_per_sm`` (capped by the occupancy)."""

    qkv: tuple[int, int]
    o: tuple[int, int]
    gate_up: tuple[int, int]
    down: tuple[int, int]
    att_block_n: int = 64
    num_warps: int = 4
    programs_per_sm: int = 2

    def __post_init__(self) -> None:
        for name in ("qkv", "o", "gate_up", "down"):
            v = getattr(self, name)
            if len(v) != 2 or any((not isinstance(x, int)) or x < 1 or x & (x - 1) for x in v):
                raise ValueError(f"DecodeLayerConfig.{name} must be two powers of two (block_n, block_k), got {v!r}")
        for name in ("att_block_n", "num_warps", "programs_per_sm"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"DecodeLayerConfig.{name} must be a power of two >= 1, got {v!r}")
        if self.att_block_n < 16:
            raise ValueError(f"DecodeLayerConfig.att_block_n must be >= 16 (a tensor-core tile), got {self.att_block_n}")


@dataclass(frozen=True, slots=True)
class DecodeLayerWeights:
    """One layer's tensors, all contiguous and in the activation dtype: ``w_qkv`` ``[(Hq +
    2 Hkv) D, H]`` with ``b_qkv`` ``[(Hq + 2 Hkv) D]`` or ``None``, ``ln1``/``ln2`` ``[H]``,
    ``w_o`` ``[H, Hq D]`` with ``b_o``, ``w_gate_up`` ``[2 I, H]`` (gate rows, then up rows),
    ``w_down`` ``[H, I]`` with ``b_down``."""

    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    ln1: torch.Tensor
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln2: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    b_down: torch.Tensor | None


def _env_pairs(name: str) -> tuple[int, int] | None:
    v = os.environ.get(name)
    if not v:
        return None
    try:
        a, b = (int(x) for x in v.split(","))
    except ValueError:
        raise ValueError(f"{name} must be 'block_n,block_k', got {v!r}") from None
    return a, b


def choose_decode_layer_config(m: int, hidden: int, inter: int, num_heads: int, num_kv_heads: int,
                               head_dim: int, dtype: torch.dtype, device: torch.device) -> DecodeLayerConfig:
    """Tiles of each stage: the tuned matrix-vector tiles of the separate kernels
    (:func:`~llmserve.triton_kernels.gemv.choose_gemv_config`; their warp counts do not apply,
    one count serves the whole kernel). Environment overrides for A/B runs:
    ``LLMSERVE_DECODE_LAYER_{QKV,O,GU,DOWN}="bn,bk"``, ``LLMSERVE_DECODE_LAYER_WARPS``,
    ``LLMSERVE_DECODE_LAYER_PPS`` (programs per SM), ``LLMSERVE_DECODE_LAYER_ATT_BN``.
    CPU (interpreter): small tiles."""
    if device.type != "cuda":
        return DecodeLayerConfig((4, 16), (4, 16), (4, 16), (4, 16), att_block_n=16, num_warps=1,
                                 programs_per_sm=1)
    qd = num_heads * head_dim
    pairs = (num_heads + 2 * num_kv_heads) * head_dim // 2

    def tile(env, n, k, prologue):
        got = _env_pairs(env)
        if got:
            return got
        c = choose_gemv_config(m, n, k, dtype, device, prologue)
        return c.block_n, c.block_k

    return DecodeLayerConfig(
        qkv=tile("LLMSERVE_DECODE_LAYER_QKV", pairs, hidden, "rmsnorm+rope"),
        o=tile("LLMSERVE_DECODE_LAYER_O", hidden, qd, "none"),
        gate_up=tile("LLMSERVE_DECODE_LAYER_GU", inter, hidden, "rmsnorm+glu"),
        down=tile("LLMSERVE_DECODE_LAYER_DOWN", hidden, inter, "none"),
        att_block_n=int(os.environ.get("LLMSERVE_DECODE_LAYER_ATT_BN", "64")),
        num_warps=int(os.environ.get("LLMSERVE_DECODE_LAYER_WARPS", "4")),
        programs_per_sm=int(os.environ.get("LLMSERVE_DECODE_LAYER_PPS", "2")))


_OCCUPANCY: dict[tuple, int] = {}


def _resident_programs(kernel, args: tuple, kwargs: dict, device: torch.device, num_warps: int,
                       key: tuple) -> int:
    """Programs of the compiled ``kernel`` that fit on one SM at once (registers, shared memory,
    warps), from the binary Triton builds for these arguments (cached by ``key``)."""
    if key in _OCCUPANCY:
        return _OCCUPANCY[key]
    ck = kernel.warmup(*args, grid=(1,), **kwargs)
    ck._init_handles()
    props = torch.cuda.get_device_properties(device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    per_warp = -(-max(int(ck.n_regs), 1) * 32 // 256) * 256          # allocated in units of 256
    fits = [regs_sm // (per_warp * num_warps), threads_sm // (32 * num_warps), 32]
    smem = int(getattr(ck.metadata, "shared", 0) or 0)
    if smem:
        fits.append(smem_sm // (smem + 1024))                           # 1 KB reserved a block
    _OCCUPANCY[key] = max(1, min(fits))
    return _OCCUPANCY[key]


def decode_layer(r: torch.Tensor, w: DecodeLayerWeights, *, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, max_context_len: int, num_heads: int, num_kv_heads: int,
                 eps: float, scale: float, barrier: torch.Tensor, config: DecodeLayerConfig | None = None,
                 num_splits: int | None = None, pdl: bool = False,
                 stamps: torch.Tensor | None = None) -> torch.Tensor:
    """One Qwen2 decoder layer for ``M <= 4`` decode tokens (one per sequence) in one launch;
    updates the residual stream ``r`` in place (and returns it) and writes this step's K/V.

    Same function as ``gemv_qkv_rope`` -> ``paged_attention_decode`` -> ``gemv`` (O, residual)
    -> ``gemv`` (gate-up, RMSNorm, SwiGLU) -> ``gemv`` (down, residual), see the module
    docstring.

    Args:
        r: ``[M, H]`` residual stream, contiguous, fp16/bf16/fp32 (the weights' dtype).
        w: the layer's tensors (:class:`DecodeLayerWeights`).
        positions, slot_mapping: ``[M]`` int32/int64 (``slot -1``: padding row, written to the
            scratch block).
        cos, sin: fp32 ``[L, D/2]`` RoPE tables.
        k_cache, v_cache: contiguous ``[num_blocks + 1, block_size, Hkv, D]``.
        block_tables: ``[M, max_blocks]`` int32; context_lens: ``[M]`` int32 (including this
            step's token); max_context_len: host-side bound of ``context_lens`` (sizes the
            attention splits).
        num_heads, num_kv_heads: ``Hq``, ``Hkv``; eps: RMSNorm epsilon; scale: softmax scale.
        barrier: ``[>= 2]`` int32 zeros, owned by this call site (left zero again).
        config: launch override (default :func:`choose_decode_layer_config`).
        num_splits: context splits of each (sequence, KV head) (default: as many whole tiles
            a split as keep one attention item a program, at most 64).
        pdl: programmatic dependent launch (Hopper+); see ``_launch.py``.
        stamps: profiling only (CUDA): int64 ``[R, 10]``, ``R`` >= the grid (at most 32 programs
            an SM), pre-filled by the caller (e.g. with -1): row ``p`` receives program ``p``'s
            global-timer stamps (:func:`_decode_layer_kernel`).

    Returns:
        ``r``.

    Raises:
        ValueError: shapes, dtypes, devices or contiguity that do not fit, ``M > 4``.
    """
    m, hidden = r.shape if r.dim() == 2 else (None, None)
    if m is None or not r.is_contiguous() or r.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"r must be a contiguous [M, H] fp16/bf16/fp32 tensor, got {r.dtype} {tuple(r.shape)}")
    if not 1 <= m <= 4:
        raise ValueError(f"decode_layer serves 1 <= M <= 4 rows, got {m}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous [num_blocks + 1, block_size, Hkv, D] tensors of one shape")
    _, page, hkv, d = k_cache.shape
    if hkv != num_kv_heads or num_heads % num_kv_heads or d % 2 or d & (d - 1):
        raise ValueError(f"heads {num_heads}/{num_kv_heads} and head_dim {d} (a power of two) must match the cache "
                         f"(Hkv={hkv})")
    qd, nqkv = num_heads * d, (num_heads + 2 * num_kv_heads) * d
    inter = w.w_down.shape[1] if w.w_down.dim() == 2 else -1
    shapes = {"w_qkv": (w.w_qkv, (nqkv, hidden)), "ln1": (w.ln1, (hidden,)), "w_o": (w.w_o, (hidden, qd)),
              "ln2": (w.ln2, (hidden,)), "w_gate_up": (w.w_gate_up, (2 * inter, hidden)),
              "w_down": (w.w_down, (hidden, inter)), "b_qkv": (w.b_qkv, (nqkv,)), "b_o": (w.b_o, (hidden,)),
              "b_down": (w.b_down, (hidden,)), "k_cache": (k_cache, None)}
    for name, (t, shape) in shapes.items():
        if t is None:
            continue
        if (shape is not None and tuple(t.shape) != shape) or not t.is_contiguous() or t.dtype != r.dtype \
                or t.device != r.device:
            raise ValueError(f"{name} must be a contiguous {r.dtype} tensor of shape {shape} on {r.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping), ("context_lens", context_lens)):
        if t.shape != (m,) or t.dtype not in (torch.int32, torch.int64) or t.device != r.device:
            raise ValueError(f"{name} must be int32/int64 [M={m}] on {r.device}, got {t.dtype} {tuple(t.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != m or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [M={m}, max_blocks] with a contiguous last dim")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] * 2 != d or cos.dtype != torch.float32 \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos/sin must be contiguous fp32 [L, {d // 2}]")
    if barrier.dtype != torch.int32 or barrier.numel() < 2 or barrier.device != r.device:
        raise ValueError("barrier must be >= 2 int32 zeros on r's device")
    on_cpu = r.device.type != "cuda"
    if on_cpu and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("decode_layer needs CUDA tensors, or (CPU tensors) TRITON_INTERPRET=1")
    cfg = config or choose_decode_layer_config(m, hidden, inter, num_heads, num_kv_heads, d, r.dtype, r.device)
    q = torch.empty((m, qd), dtype=r.dtype, device=r.device)
    o = torch.empty((m, qd), dtype=r.dtype, device=r.device)
    act = torch.empty((m, inter), dtype=r.dtype, device=r.device)
    tiles = triton.cdiv(max(int(max_context_len), 1), cfg.att_block_n)
    sms = num_sms(r.device, cpu_default=1)
    grid = 1 if on_cpu else sms * cfg.programs_per_sm
    if num_splits is None:
        num_splits = grid // (m * num_kv_heads)
    num_splits = max(1, min(tiles, int(num_splits), 64))
    num_splits = triton.cdiv(tiles, triton.cdiv(tiles, num_splits))     # whole tiles a split
    m_buf = torch.empty((m, num_heads, num_splits), dtype=torch.float32, device=r.device)
    l_buf = torch.empty_like(m_buf)
    acc_buf = torch.empty((m, num_heads, num_splits, d), dtype=torch.float32, device=r.device)
    cnt = zeroed_counters("decode_layer_attention", r.device, m * num_kv_heads)
    dummy = r
    args = (r, q, o, act, w.w_qkv, w.b_qkv if w.b_qkv is not None else dummy, w.ln1, w.w_o,
            w.b_o if w.b_o is not None else dummy, w.ln2, w.w_gate_up, w.w_down,
            w.b_down if w.b_down is not None else dummy,
            k_cache, v_cache, cos, sin, positions, slot_mapping, k_cache.shape[0] * page,
            block_tables, context_lens, m_buf, l_buf, acc_buf, cnt, barrier,
            stamps if stamps is not None else barrier,
            m, float(scale) * _LOG2E, float(eps), num_splits, block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    g = num_heads // num_kv_heads
    kwargs = dict(H=hidden, INTER=inter, HQ=num_heads, HKV=num_kv_heads, D=d,
                  G_PAD=max(16, triton.next_power_of_2(g)), PAGE=page, ATT_BLOCK_N=cfg.att_block_n,
                  QKV_BN=cfg.qkv[0], QKV_BK=cfg.qkv[1], O_BN=cfg.o[0], O_BK=cfg.o[1],
                  GU_BN=cfg.gate_up[0], GU_BK=cfg.gate_up[1], DN_BN=cfg.down[0], DN_BK=cfg.down[1],
                  HAS_BQKV=w.b_qkv is not None, HAS_BO=w.b_o is not None, HAS_BD=w.b_down is not None,
                  BLOCK_M=triton.next_power_of_2(m), FP32_MATH=on_cpu or r.dtype == torch.float32,
                  USE_PDL=pdl, STAMPS=stamps is not None, num_warps=cfg.num_warps, num_stages=1, **pdl_launch_kwargs(pdl))
    if os.environ.get("LLMSERVE_DECODE_LAYER_PTXAS"):        # diagnostics: ptxas options
        kwargs["ptx_options"] = os.environ["LLMSERVE_DECODE_LAYER_PTXAS"]
    if os.environ.get("LLMSERVE_DECODE_LAYER_GRID"):          # diagnostics: a fixed grid
        grid = int(os.environ["LLMSERVE_DECODE_LAYER_GRID"])
    elif not on_cpu:
        key = (r.device.index, r.dtype, m, tuple(sorted((k, v) for k, v in kwargs.items())))
        grid = sms * min(cfg.programs_per_sm,
                         _resident_programs(_decode_layer_kernel, args, kwargs, r.device, cfg.num_warps, key))
    if stamps is not None and (on_cpu or stamps.dtype != torch.int64 or stamps.dim() != 2
                               or stamps.shape[1] != 10 or stamps.shape[0] < grid or not stamps.is_contiguous()):
        raise ValueError(f"stamps must be a contiguous CUDA int64 [>= {grid}, 10] tensor")
    _decode_layer_kernel[(grid,)](*args, **kwargs)
    return r
