"""Launch helpers shared by the Triton kernels: whether Triton runs them in its interpreter,
the device's SM count, the zeroed arrival counters of the in-kernel ("last program reduces")
split merges, and programmatic dependent launch (PDL).

Nothing here (or anywhere in ``kernels/``) reads the environment: every choice arrives as an
argument of a launcher."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NUM_SMS: dict[int, int] = {}
_COUNTERS: dict[tuple[str, str, int | None], torch.Tensor] = {}


@triton.jit
def _probe():
    pass


def interpreting() -> bool:
    """Whether Triton runs this package's kernels in its interpreter (on CPU tensors). Triton
    decides when a kernel is defined, from ``TRITON_INTERPRET`` at that moment, so this asks
    a kernel defined with the others rather than the environment."""
    return type(_probe).__name__ == "InterpretedFunction"


def check_cpu_launch(what: str) -> None:
    """``ValueError`` for a launch on CPU tensors when Triton compiled the kernels for a GPU.

    Args:
        what: the launcher's name, for the message."""
    if not interpreting():
        raise ValueError(f"{what} needs CUDA tensors, or (CPU tensors) the Triton interpreter: "
                         "set TRITON_INTERPRET=1 before starting Python")


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
# ``gdc_launch_dependents`` right after its own wait, so at most one kernel runs ahead, unless
# compiled with ``TRIGGER_FIRST`` (see :func:`pdl_wait`).
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
    capability >= 9.0, a Triton that has ``launch_pdl``, kernels not interpreted. Whether
    they are is the caller's choice (``FastPathConfig.pdl``)."""
    if device.type != "cuda" or interpreting():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_OK:
        _PDL_OK[idx] = torch.cuda.get_device_capability(idx)[0] >= 9 and _triton_has_pdl()
    return _PDL_OK[idx]


def pdl_launch_kwargs(use_pdl: bool, trigger_first: bool = False) -> dict:
    """The PDL part of a launch of a kernel with ``USE_PDL`` / ``PDL_TRIGGER_FIRST``
    constexprs (:func:`pdl_start`, :func:`pdl_wait`): those two, plus the ``launch_pdl`` option
    when PDL is on (absent otherwise, so the interpreter and older Tritons never see it)."""
    kw = {"USE_PDL": bool(use_pdl), "PDL_TRIGGER_FIRST": bool(use_pdl and trigger_first)}
    return {**kw, "launch_pdl": True} if use_pdl else kw


try:  # the device-side half of PDL; no-ops where this Triton lacks it (never traced then)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old Triton
    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def pdl_start(USE_PDL: tl.constexpr, TRIGGER_FIRST: tl.constexpr):
    """First statement of a kernel launched with ``launch_pdl``: with ``TRIGGER_FIRST``, allow
    the next kernel to launch right away (see :func:`pdl_wait`); nothing otherwise."""
    if USE_PDL:
        if TRIGGER_FIRST:
            gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr, TRIGGER_FIRST: tl.constexpr):
    """The wait of a kernel launched with ``launch_pdl`` (nothing without ``USE_PDL``): after it,
    everything the previous kernels wrote is visible. Without ``TRIGGER_FIRST`` the next
    kernel is allowed to launch here, after the wait, so at most one kernel runs ahead. With
    it (:func:`pdl_start` triggered already) the kernels after this one can launch, and read
    their weights, while several earlier ones still run: a cascade bounded by the SMs'
    resources. Both orders are correct as long as (a) every kernel launched with
    ``launch_pdl`` executes this wait, and (b) no kernel reads what earlier kernels write (or
    writes what they read) before its own wait: the wait returns only when the previous grid
    has completed, and that grid completed only after its own wait returned, so every earlier
    kernel has completed too (CUDA Programming Guide, "Programmatic Dependent Launch and
    Synchronization"). A kernel launched without PDL waits for its predecessor as usual and
    ends the chain."""
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_FIRST:
            gdc_launch_dependents()
