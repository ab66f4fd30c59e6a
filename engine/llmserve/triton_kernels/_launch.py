"""Launch helpers shared by the Triton kernels: the device's SM count, the zeroed arrival
counters of the in-kernel ("last program reduces") split merges, and programmatic dependent
launch (PDL)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_NUM_SMS: dict[int, int] = {}
_COUNTERS: dict[tuple[str, str, int | None], torch.Tensor] = {}


def num_sms(device: torch.device, cpu_default: int) -> int:
    """Multiprocessor count of a CUDA device (cached); ``cpu_default`` in the interpreter, kept
    small so CPU tests still exercise several splits."""
    if device.type != "cuda":
        return cpu_default
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def zeroed_counters(owner: str, device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 arrival counters, one buffer per (``owner``, device); every
    kernel that uses them leaves them zero again. Calls on concurrent streams of one device
    must not both use the same owner's buffer."""
    key = (owner, device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


# ----------------------------------------------------------------------------------------------
# Programmatic dependent launch (PDL, Hopper and later)
# ----------------------------------------------------------------------------------------------
# A kernel launched with PDL may start while its predecessor in the stream is still running;
# it must execute ``griddepcontrol.wait`` (Triton: ``gdc_wait``) before it reads anything the
# predecessor wrote or writes anything the predecessor reads. Work before the wait that touches
# only immutable data (weights) overlaps the predecessor's tail. Each of our PDL kernels calls
# ``gdc_launch_dependents`` right after its own wait, so at most one kernel runs ahead.
# CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"; Triton exposes it
# as ``triton.language.extra.cuda.gdc_wait`` and the ``launch_pdl`` launch option.

_PDL_OK: dict[int, bool] = {}


def _triton_has_pdl() -> bool:
    try:
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except Exception:  # noqa: BLE001 - any import problem means: no PDL
        return False
    return any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with PDL: a CUDA device of compute
    capability >= 9.0, a Triton that has ``launch_pdl``, and ``LLMSERVE_PDL`` not ``0``."""
    if device.type != "cuda" or os.environ.get("LLMSERVE_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_OK:
        _PDL_OK[idx] = torch.cuda.get_device_capability(idx)[0] >= 9 and _triton_has_pdl()
    return _PDL_OK[idx]


def pdl_launch_kwargs(use_pdl: bool) -> dict:
    """Extra launch options of a kernel launched with PDL (empty otherwise, so the interpreter
    and older Tritons never see the option)."""
    return {"launch_pdl": True} if use_pdl else {}


try:  # the device-side half of PDL; no-ops where this Triton lacks it (never traced then)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old Triton
    import triton

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


# ----------------------------------------------------------------------------------------------
# L2 prefetch of weights a later kernel will read (Hopper+)
# ----------------------------------------------------------------------------------------------
# At batch 1 a decode layer's QKV projection, attention and O projection are latency-bound: for
# ~14 us of a ~40 us layer HBM is nearly idle, then gate-up streams 55 MB (Qwen2.5-1.5B). These
# kernels can ask the memory system to bring the first megabytes of a later kernel's weights into
# L2 meanwhile (``cp.async.bulk.prefetch.L2``: fire and forget, no registers, no shared memory,
# completes on its own); the later kernel then finds those lines in L2. PTX ISA 8.0,
# "cp.async.bulk.prefetch"; the idea is the one of cross-kernel weight prefetching in low-batch
# decoders (e.g. the "prefetch next layer's weights into L2" trick of Hopper GEMV decoders),
# written here from the PTX manual.

_PF_ASM_NORMAL = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                  "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")
_PF_ASM_LAST = tl.constexpr("{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }")


def l2_prefetch_available(device: torch.device) -> bool:
    """Whether :func:`l2_prefetch` may be compiled for ``device``: a CUDA device of compute
    capability >= 9.0 (bulk prefetch is an sm_90 instruction), not the interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx)[0] >= 9


def l2_prefetch_args(prefetch: torch.Tensor | None, device: torch.device, num_warps: int) -> dict:
    """Kernel arguments of the optional L2 prefetch: ``prefetch`` is a contiguous tensor whose
    bytes (a later kernel's weights) are prefetched; ignored (``PF_NT=0``) where the
    instruction does not exist (CPU interpreter, GPUs before Hopper) or the tensor is empty.

    Raises:
        ValueError: a non-contiguous tensor, one on another device, or a start/size not a
            multiple of 16 bytes (the bulk prefetch's alignment)."""
    if prefetch is None or prefetch.numel() == 0 or not l2_prefetch_available(device):
        return dict(pf_ptr=None, pf_bytes=0, PF_NT=0, PF_LAST=False)
    nbytes = prefetch.numel() * prefetch.element_size()
    if not prefetch.is_contiguous() or prefetch.device != device or prefetch.data_ptr() % 16 or nbytes % 16:
        raise ValueError("prefetch must be a contiguous tensor on the kernel's device, 16-byte aligned, "
                         f"a multiple of 16 bytes; got {nbytes} bytes at {prefetch.data_ptr():#x}")
    return dict(pf_ptr=prefetch, pf_bytes=nbytes, PF_NT=32 * num_warps,
                PF_LAST=os.environ.get("LLMSERVE_L2_PREFETCH_HINT", "last") == "last")


@triton.jit
def l2_prefetch(base_ptr, nbytes, part, nparts, NT: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Prefetch program ``part``'s share (of ``nparts``) of the bytes ``[base_ptr, base_ptr +
    nbytes)`` into L2: ``NT`` pieces a program (one a thread when ``NT`` is the program's thread
    count), each a ``cp.async.bulk.prefetch.L2`` of a multiple of 16 bytes. ``base_ptr`` must be
    16-byte aligned and ``nbytes`` a multiple of 16; ``nbytes <= 0`` issues nothing.
    ``EVICT_LAST``: the lines get the ``evict_last`` L2 policy (kept over streamed lines)."""
    per = tl.cdiv(nbytes, nparts * NT * 16) * 16                  # bytes a piece, multiple of 16
    start = (part * NT + tl.arange(0, NT)).to(tl.int64) * per     # [NT]
    size = tl.minimum(tl.maximum(nbytes - start, 0), per).to(tl.int32)
    ptrs = base_ptr.to(tl.pointer_type(tl.int8), bitcast=True) + start
    if EVICT_LAST:
        tl.inline_asm_elementwise(_PF_ASM_LAST, "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_PF_ASM_NORMAL, "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False,
                                  pack=1)
