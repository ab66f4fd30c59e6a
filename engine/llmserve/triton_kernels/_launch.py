"""Launch helpers shared by the Triton kernels: the device's SM count and the zeroed arrival
counters of the in-kernel ("last program reduces") split merges."""

from __future__ import annotations

import torch

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
