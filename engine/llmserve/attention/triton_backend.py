"""The Triton paged attention backend (``--paged-attention-backend triton``).

Same interface and semantics as :class:`~llmserve.attention.torch_backend.TorchPagedAttention`;
the kernels live in :mod:`llmserve.kernels.paged_attention`. On CPU tensors it runs
only in the Triton interpreter (``TRITON_INTERPRET=1`` set before start-up) — slow, meant for
tests.
"""

from __future__ import annotations

import torch

from ..kernels.paged_attention import paged_attention_triton, write_kv_triton
from .metadata import AttentionMetadata


class TritonPagedAttention:
    """Paged attention with Triton kernels: split-K decode and varlen chunked prefill.

    Args:
        decode_options: keyword options of
            :func:`~llmserve.kernels.paged_attention.paged_attention_decode` (``split_policy``,
            ``stages``, ``min_tiles``, ``fused_max_splits``, ``wide_tile``, ``early_pages``,
            ``prefetch_kv``; see :meth:`llmserve.config.ResolvedFastPath.decode_options`);
            default: the kernel's defaults.
    """

    name = "triton"

    def __init__(self, decode_options: dict | None = None) -> None:
        self.decode_options = dict(decode_options or {})

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter ``key``/``value`` ``[N, Hkv, D]`` into the caches at ``slot_mapping`` ``[N]``
        (entries < 0 are skipped). Raises ``ValueError`` on bad shapes/dtypes/devices."""
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attend ``query`` ``[N, Hq, D]`` to the paged cache; ``[N, Hq, D]`` in the query
        dtype (padding rows zero). Raises ``ValueError`` on bad inputs."""
        return paged_attention_triton(query, k_cache, v_cache, meta, scale, **self.decode_options)
