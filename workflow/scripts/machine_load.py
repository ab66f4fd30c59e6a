"""What else the machine was doing while a benchmark cell ran: load, other processes' CPU,
stolen time, this process's CPU share, and the GPU's clocks.

A busy machine makes every number slower, and without a record a rerun on a loaded machine
reads as a regression. ``run_cells.py`` takes a :func:`snapshot` before and after each cell
and stores :func:`summarize` of the pair in the cell's provenance file (``machine``); the
aggregation flags a cell whose runs exceeded the config's ``contention`` thresholds.

Sources (Linux): ``/proc/stat`` (machine-wide CPU jiffies by state, ``steal`` included),
``/proc/loadavg`` via :func:`os.getloadavg`, :func:`os.times` for this process's CPU seconds,
``/proc/cpuinfo`` for the CPU model, and ``nvidia-smi`` for the GPU's SM/memory clocks and its
active clock-throttle reasons when a CUDA device is in use. Every field is ``None`` where its
source is missing (another OS, no ``nvidia-smi``).

Usage: ``import machine_load`` from ``workflow/scripts/``; ``python workflow/scripts/machine_load.py
[SECONDS]`` prints a summary of the machine over that many seconds (default 1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

__all__ = ["snapshot", "summarize", "machine_info", "gpu_clocks", "is_contended"]

#: /proc/stat "cpu" line fields, in order (man 5 proc).
_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _proc_stat() -> dict[str, int] | None:
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    if not parts or parts[0] != "cpu":
        return None
    values = [int(v) for v in parts[1:1 + len(_STAT_FIELDS)]]
    return dict(zip(_STAT_FIELDS, values + [0] * (len(_STAT_FIELDS) - len(values))))


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


_NVML: Any = None  # the initialised pynvml module, False once it proved unusable


def _nvml():
    """pynvml (``nvidia-ml-py``) initialised once per process, or None without it."""
    global _NVML
    if _NVML is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception:  # noqa: BLE001 - not installed, no driver: fall back to nvidia-smi
            _NVML = False
    return _NVML or None


def _gpu_clocks_nvml(nv) -> list[dict[str, Any]] | None:
    """:func:`gpu_clocks` through NVML (microseconds a query, where ``nvidia-smi`` starts a
    process each time), with the same keys and units as ``nvidia-smi``'s query."""
    try:
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            gpus.append({
                "index": float(i),
                "clocks.sm": float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                "clocks.mem": float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
                "clocks.max.sm": float(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
                "clocks.max.mem": float(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM)),
                "clocks_throttle_reasons.active":
                    f"0x{nv.nvmlDeviceGetCurrentClocksThrottleReasons(h):016X}",
                "temperature.gpu": float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                "power.draw": nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            })
        return gpus
    except Exception:  # noqa: BLE001 - an NVML error: let nvidia-smi answer
        return None


def gpu_clocks() -> list[dict[str, Any]] | None:
    """Per GPU: SM and memory clock now and at most (MHz), the active throttle reasons
    (a hex bit mask, 0x0 = none), temperature (C) and power draw (W); from NVML
    (``nvidia-ml-py``) when it is installed, else from ``nvidia-smi``; None without either."""
    nv = _nvml()
    if nv is not None:
        gpus = _gpu_clocks_nvml(nv)
        if gpus is not None:
            return gpus
    if shutil.which("nvidia-smi") is None:
        return None
    fields = ("index", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "clocks_throttle_reasons.active", "temperature.gpu", "power.draw")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        row: dict[str, Any] = {}
        for key, value in zip(fields, values):
            try:
                row[key] = float(value) if key not in ("clocks_throttle_reasons.active",) else value
            except ValueError:
                row[key] = value
        gpus.append(row)
    return gpus


def machine_info() -> dict[str, Any]:
    """The machine a run is judged on: core count, the cores this process may use, CPU model."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {"cpu_count": os.cpu_count(), "usable_cores": usable, "cpu_model": _cpu_model()}


def snapshot(gpu: bool = False) -> dict[str, Any]:
    """The counters at one moment (pass two to :func:`summarize`)."""
    t = os.times()
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"wall": time.monotonic(), "own_cpu_s": t.user + t.system, "stat": _proc_stat(),
            "loadavg": load, "gpu": gpu_clocks() if gpu else None}


def summarize(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """Load over the interval between two snapshots.

    Returns (None where unknown):
        wall_s: seconds between the snapshots.
        own_cores: this process's CPU seconds per wall second (1.0 = one busy core).
        other_cores: CPU seconds per wall second that the rest of the machine used
            (machine-wide busy time minus this process's own).
        steal_fraction: share of the machine's CPU time the hypervisor gave to other guests.
        loadavg_start, loadavg_end: the 1/5/15-minute load averages at each end.
        gpu_start, gpu_end: :func:`gpu_clocks` at each end, when asked for.
        machine: :func:`machine_info`.
    """
    wall = max(end["wall"] - start["wall"], 1e-9)
    own = max(end["own_cpu_s"] - start["own_cpu_s"], 0.0)
    other = steal = None
    if start["stat"] and end["stat"]:
        d = {k: end["stat"][k] - start["stat"][k] for k in _STAT_FIELDS}
        total = sum(d.values())
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy_s = (total - d["idle"] - d["iowait"] - d["steal"]) / tick
        other = max(busy_s - own, 0.0) / wall
        steal = d["steal"] / total if total > 0 else 0.0
    return {"wall_s": round(wall, 3), "own_cores": round(own / wall, 3),
            "other_cores": None if other is None else round(other, 3),
            "steal_fraction": None if steal is None else round(steal, 4),
            "loadavg_start": start["loadavg"], "loadavg_end": end["loadavg"],
            "gpu_start": start.get("gpu"), "gpu_end": end.get("gpu"),
            "machine": machine_info()}


def is_contended(summary: dict[str, Any] | None, max_other_cores: float,
                 max_steal_fraction: float) -> bool | None:
    """Whether a cell ran beside other work: other processes used more than
    ``max_other_cores`` cores on average, or more than ``max_steal_fraction`` of the CPU time
    was stolen. None when the run recorded no load (runs before this record existed)."""
    if not summary or summary.get("other_cores") is None:
        return None
    return (summary["other_cores"] > max_other_cores
            or (summary.get("steal_fraction") or 0.0) > max_steal_fraction)


def main(argv: list[str] | None = None) -> int:
    """Print the machine's load over ``argv[0]`` seconds (default 1)."""
    seconds = float((argv or sys.argv[1:] or ["1"])[0])
    a = snapshot(gpu=shutil.which("nvidia-smi") is not None)
    time.sleep(seconds)
    print(json.dumps(summarize(a, snapshot(gpu=a["gpu"] is not None)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
