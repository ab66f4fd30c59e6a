"""The interface every paged attention backend implements, and the backend registry."""

from __future__ import annotations

from typing import Protocol

import torch

from .metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """A paged attention implementation.

    K/V cache tensors are per layer, shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter ``key``/``value`` ``[N, Hkv, D]`` into the caches at ``slot_mapping`` ``[N]``
        (entries < 0 are skipped)."""

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attend ``query`` ``[N, Hq, D]`` to the paged cache; return ``[N, Hq, D]`` in the
        query dtype. Causal within each sequence (see :mod:`.metadata`)."""


def get_attention_backend(name: str) -> AttentionBackend:
    """Return the backend registered under ``name`` (``torch`` or ``triton``).

    Raises:
        ValueError: unknown name (lists the supported ones).
        RuntimeError: ``triton`` requested but Triton is not importable.
    """
    if name == "torch":
        from .torch_backend import TorchPagedAttention
        return TorchPagedAttention()
    if name == "triton":
        try:
            from .triton_backend import TritonPagedAttention
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise RuntimeError(f"the triton attention backend needs Triton: {e}") from e
        return TritonPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}; supported: ['torch', 'triton']")
