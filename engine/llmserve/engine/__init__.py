"""The engines: :class:`LLMEngine` (paged, batched: continuous or static batching with chunked
prefill and preemption by recompute), :class:`NaiveEngine` (the sequential control that recomputes
the whole prefix every step), :class:`AsyncLLMEngine` (the asyncio front end the server uses) and
:class:`~llmserve.engine.speculative.SpeculativeEngine` (draft-and-verify decoding)."""

from ..config import EngineConfig
from .async_engine import AsyncLLMEngine, QueueFullError
from .builder import EnginePartsCache
from .llm_engine import LLMEngine, RequestOutput
from .naive import NaiveEngine
from .speculative import SpeculativeEngine

__all__ = ["AsyncLLMEngine", "EnginePartsCache", "LLMEngine", "NaiveEngine", "QueueFullError", "RequestOutput",
           "SpeculativeEngine", "build_engine"]


def build_engine(config: EngineConfig, naive: bool = False, *, speculative_model: str | None = None,
                 num_speculative_tokens: int = 4, parts_cache: EnginePartsCache | None = None
                 ) -> LLMEngine | NaiveEngine:
    """Construct the engine a config names (the parts of each are built by
    :mod:`llmserve.engine.builder`); the one constructor the commands share.

    Args:
        config: the engine configuration.
        naive: the sequential, cache-free control engine (:class:`NaiveEngine`).
        speculative_model: a draft model (``'tiny'``, a checkpoint directory, a hub id,
            ``random:<preset>`` or ``'target'``): a :class:`SpeculativeEngine`.
        num_speculative_tokens: draft tokens proposed per step with ``speculative_model``.
        parts_cache: an :class:`~llmserve.engine.builder.EnginePartsCache`: a paged engine on
            one rank takes the device parts (weights, KV cache, CUDA graphs) it holds for an
            equal configuration instead of building them (give them back with
            ``parts_cache.put(engine)`` when done). The naive, speculative and tensor-parallel
            engines take none: the cache is emptied before they are built.

    Raises:
        ValueError: ``naive`` with ``speculative_model``, or what the engine's constructor raises.
    """
    if parts_cache is not None and (naive or speculative_model or config.tensor_parallel_size > 1):
        parts_cache.clear()    # this engine takes no parts: the held ones' memory goes back first
    if speculative_model:
        if naive:
            raise ValueError("--speculative-model needs a paged engine; it cannot be used with the naive engine")
        return SpeculativeEngine(config, draft_model=speculative_model, num_speculative_tokens=num_speculative_tokens)
    if naive:
        return NaiveEngine(config)
    reuse = parts_cache.take(config) if parts_cache is not None else None   # emptied above for tensor parallel
    engine = LLMEngine(config, reuse=reuse)
    if reuse is not None:
        parts_cache.reuses += 1
    return engine
