"""GPU utilisation and memory high-water sampled by NVML (``nvidia-ml-py``) in a background thread.

``nvmlDeviceGetUtilizationRates`` reports the percentage of the last sample period (1/6 s to
1 s, driver dependent) in which a kernel ran, so it says "busy", not "efficient"; memory is the
device-wide used bytes (every process), while ``torch_max_memory_allocated_bytes`` is this
process's allocator high-water. On CPU, or without NVML, the summary's fields are ``None`` and
``reason`` says why.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["GPUMonitor", "empty_gpu_summary"]

_FIELDS = ("device_name", "device_index", "num_samples", "interval_s", "util_mean", "util_peak",
           "memory_used_peak_bytes", "memory_total_bytes", "torch_max_memory_allocated_bytes",
           "torch_max_memory_reserved_bytes")


def empty_gpu_summary(reason: str) -> dict[str, Any]:
    """The GPU section when nothing was sampled: every field None, plus the reason."""
    return {"available": False, "reason": reason, **{k: None for k in _FIELDS}}


class GPUMonitor:
    """Sample one CUDA device's utilisation and memory every ``interval_s`` seconds.

    Usage::

        mon = GPUMonitor("cuda:0"); mon.start(); ...; summary = mon.stop()

    Args:
        device: ``cpu`` (nothing sampled) or ``cuda[:N]``.
        interval_s: sampling period, seconds.

    ``stop()`` returns a dict with ``available``, ``reason`` and :data:`_FIELDS`
    (utilisation in percent, memory in bytes). Never raises for a missing NVML.
    """

    def __init__(self, device: str = "cpu", interval_s: float = 0.1) -> None:
        self.device = str(device)
        self.interval_s = float(interval_s)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._util: list[float] = []
        self._mem_peak = 0
        self._mem_total: int | None = None
        self._name: str | None = None
        self._index: int | None = None
        self._reason: str | None = None
        self._nvml = None
        self._handle = None

    # ---- setup ---------------------------------------------------------------------------------
    def _cuda_index(self) -> int:
        import torch

        if ":" in self.device:
            return int(self.device.split(":", 1)[1])
        return torch.cuda.current_device() if torch.cuda.is_available() else 0

    def _init_nvml(self) -> bool:
        if not self.device.startswith("cuda"):
            self._reason = f"device is {self.device!r}: no GPU to sample"
            return False
        try:
            import pynvml  # provided by the nvidia-ml-py package
        except ImportError:
            self._reason = "nvidia-ml-py (pynvml) is not installed: pip install nvidia-ml-py"
            return False
        try:
            pynvml.nvmlInit()
            self._index = self._cuda_index()
            # Map the CUDA ordinal through CUDA_VISIBLE_DEVICES to the NVML index when possible.
            from ..envs import cuda_visible_devices
            vis = cuda_visible_devices()
            nvml_index = self._index
            if vis:
                parts = [p.strip() for p in vis.split(",") if p.strip()]
                if self._index < len(parts) and parts[self._index].isdigit():
                    nvml_index = int(parts[self._index])
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self._name = name.decode() if isinstance(name, bytes) else str(name)
            self._mem_total = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).total)
        except Exception as e:  # noqa: BLE001 - NVML errors are many and driver specific
            self._reason = f"NVML unavailable: {type(e).__name__}: {e}"
            return False
        self._nvml = pynvml
        return True

    def _sample_once(self) -> None:
        nv = self._nvml
        try:
            self._util.append(float(nv.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            self._mem_peak = max(self._mem_peak, int(nv.nvmlDeviceGetMemoryInfo(self._handle).used))
        except Exception:  # noqa: BLE001 - a transient NVML error loses one sample
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample_once()
            self._stop.wait(self.interval_s)

    # ---- public --------------------------------------------------------------------------------
    def start(self) -> "GPUMonitor":
        """Begin sampling (no-op with a recorded reason on CPU / without NVML)."""
        if self._init_nvml():
            try:
                import torch
                torch.cuda.reset_peak_memory_stats(self._index)
            except Exception:  # noqa: BLE001
                pass
            self._thread = threading.Thread(target=self._run, name="llmserve-gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sampling and return the summary (see class docstring)."""
        if self._thread is None:
            return empty_gpu_summary(self._reason or "monitor was not started")
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._thread = None
        self._sample_once()
        out = empty_gpu_summary("")
        out.update(available=True, reason=None, device_name=self._name, device_index=self._index,
                   num_samples=len(self._util), interval_s=self.interval_s,
                   util_mean=(sum(self._util) / len(self._util)) if self._util else None,
                   util_peak=max(self._util) if self._util else None,
                   memory_used_peak_bytes=self._mem_peak or None,
                   memory_total_bytes=self._mem_total)
        try:
            import torch
            out["torch_max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated(self._index))
            out["torch_max_memory_reserved_bytes"] = int(torch.cuda.max_memory_reserved(self._index))
        except Exception:  # noqa: BLE001
            pass
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        return out
