"""The physical KV-cache tensors: per layer ``(k_cache, v_cache)`` of shape
``[num_blocks + 1, block_size, num_kv_heads, head_dim]``; the extra last block is scratch (the
slot padded rows write to). Block ids come from :class:`llmserve.core.block_manager.BlockManager`.
"""

from __future__ import annotations
from typing import TYPE_CHECKING
import torch
from ..config import CacheConfig, ModelConfig, resolve_dtype
if TYPE_CHECKING:  # pragma: no cover
    pass


DEFAULT_CPU_CACHE_BYTES = 256 * 1024 * 1024  # CacheConfig's documented CPU default (256 MiB)


# ---------------------------------------------------------------------------------------------
# Physical tensors
# ---------------------------------------------------------------------------------------------
class KVCache:
    """The per-layer K and V tensors of the paged cache.

    ``kv_caches[layer] = (k_cache, v_cache)``, each ``[num_blocks + 1, block_size,
    num_kv_heads, head_dim]`` of ``dtype`` on ``device``. Block ``num_blocks`` (the last one) is
    scratch: it is never handed out by the allocator, so a padding slot of ``-1`` in a flat
    ``[(num_blocks + 1) * block_size, ...]`` view lands in it harmlessly.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: geometry (all >= 1).
        dtype: element type (a ``torch.dtype`` or a name accepted by ``resolve_dtype``).
        device: where the tensors live.

    Raises:
        ValueError: a non-positive size or an unsupported dtype.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)  # +1: scratch block
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(num_layers)
        ]

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def scratch_block_id(self) -> int:
        """Index of the scratch block (never allocated): ``num_blocks``."""
        return self.num_blocks

    @property
    def bytes_per_token_slot(self) -> int:
        """Bytes of K+V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one allocatable block over all layers (K and V)."""
        return self.block_size * self.bytes_per_token_slot

    @property
    def total_bytes(self) -> int:
        """Bytes held by the tensors, scratch block included."""
        return (self.num_blocks + 1) * self.block_bytes

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_caches[layer]

    # ---- sizing helpers -----------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(model_config: ModelConfig, dtype: torch.dtype | str) -> int:
        """Bytes of K+V per token: ``2 * layers * kv_heads * head_dim * itemsize``."""
        itemsize = resolve_dtype(dtype).itemsize
        return (2 * model_config.num_hidden_layers * model_config.num_key_value_heads
                * model_config.head_dim * itemsize)

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype | str) -> int:
        """Bytes of one block over all layers: ``2 * layers * block_size * kv_heads * head_dim * itemsize``."""
        return block_size * KVCache.bytes_per_token(model_config, dtype)

    @staticmethod
    def num_blocks_for_budget(memory_bytes: int, model_config: ModelConfig, block_size: int,
                              dtype: torch.dtype | str) -> int:
        """Allocatable blocks that fit in ``memory_bytes`` (bytes), one scratch block reserved.

        Raises:
            ValueError: the budget holds fewer than 2 blocks (one usable + scratch).
        """
        bpb = KVCache.bytes_per_block(model_config, block_size, dtype)
        n = int(memory_bytes) // bpb - 1
        if n < 1:
            raise ValueError(
                f"KV cache budget of {int(memory_bytes)} bytes is too small: one block of "
                f"{block_size} tokens needs {bpb} bytes and at least 2 blocks (one usable + one "
                f"scratch) are required; raise memory_bytes / gpu_memory_utilization or lower block_size")
        return n

    @staticmethod
    def resolve_num_blocks(model_config: ModelConfig, cache_config: CacheConfig,
                           dtype: torch.dtype | str, device: torch.device | str) -> int:
        """Number of allocatable blocks for ``cache_config``, without allocating anything.

        Order: ``cache_config.num_blocks`` if set; else ``memory_bytes``; else on CUDA
        ``gpu_memory_utilization`` x the device's free memory (``torch.cuda.mem_get_info``,
        measured now: call after the weights are loaded); else 256 MiB on CPU.

        Raises:
            ValueError: the budget is too small for 2 blocks.
        """
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        device = torch.device(device)
        if cache_config.memory_bytes is not None:
            budget = cache_config.memory_bytes
        elif device.type == "cuda":
            free_bytes, _total = torch.cuda.mem_get_info(device)
            budget = int(free_bytes * cache_config.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_CACHE_BYTES
        return KVCache.num_blocks_for_budget(budget, model_config, cache_config.block_size, dtype)

    @classmethod
    def from_config(cls, model_config: ModelConfig, cache_config: CacheConfig,
                    dtype: torch.dtype | str, device: torch.device | str) -> "KVCache":
        """Allocate the cache for a model (geometry from ``model_config``, size per
        :meth:`resolve_num_blocks`)."""
        num_blocks = cls.resolve_num_blocks(model_config, cache_config, dtype, device)
        return cls(num_layers=model_config.num_hidden_layers, num_blocks=num_blocks,
                   block_size=cache_config.block_size, num_kv_heads=model_config.num_key_value_heads,
                   head_dim=model_config.head_dim, dtype=dtype, device=device)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"KVCache(layers={self.num_layers}, blocks={self.num_blocks}+1 scratch, "
                f"block_size={self.block_size}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device}, {self.total_bytes / 2**20:.1f} MiB)")
