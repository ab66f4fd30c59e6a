"""The engines: :class:`LLMEngine` (paged, batched: continuous or static batching with chunked
prefill and preemption by recompute), :class:`NaiveEngine` (the sequential control that recomputes
the whole prefix every step), :class:`AsyncLLMEngine` (the asyncio front end the server uses) and
:class:`~llmserve.engine.speculative.SpeculativeEngine` (draft-and-verify decoding)."""

from ..config import EngineConfig
from .async_engine import AsyncLLMEngine, QueueFullError
from .llm_engine import LLMEngine, RequestOutput
from .naive import NaiveEngine

__all__ = ["AsyncLLMEngine", "LLMEngine", "NaiveEngine", "QueueFullError", "RequestOutput", "build_engine"]


def build_engine(config: EngineConfig, naive: bool = False) -> LLMEngine | NaiveEngine:
    """Construct the engine a config names (``naive=True`` for the sequential control; the
    parts of either are built by :mod:`llmserve.engine.builder`)."""
    return NaiveEngine(config) if naive else LLMEngine(config)
