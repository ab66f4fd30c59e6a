"""Paged attention backends behind one interface (``torch`` reference, ``triton`` kernels)."""

from .base import AttentionBackend, get_attention_backend
from .metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
