"""Build the engine a config names: the one constructor the commands share."""

from __future__ import annotations

from ..config import EngineConfig
from .llm_engine import LLMEngine
from .naive import NaiveEngine


def build_engine(config: EngineConfig, naive: bool = False, *, speculative_model: str | None = None,
                 num_speculative_tokens: int = 4) -> LLMEngine | NaiveEngine:
    """Construct the engine a config names.

    Args:
        config: the engine configuration.
        naive: the sequential, cache-free control engine (:class:`NaiveEngine`).
        speculative_model: a draft model (``'tiny'``, a checkpoint directory, a hub id,
            ``random:<preset>`` or ``'target'``): a speculative-decoding engine.
        num_speculative_tokens: draft tokens proposed per step with ``speculative_model``.

    Raises:
        ValueError: ``naive`` with ``speculative_model``, or what the engine's constructor raises.
    """
    if speculative_model:
        if naive:
            raise ValueError("--speculative-model needs a paged engine; it cannot be used with the naive engine")
        from .speculative import SpeculativeEngine

        return SpeculativeEngine(config, draft_model=speculative_model,
                                 num_speculative_tokens=num_speculative_tokens)
    return NaiveEngine(config) if naive else LLMEngine(config)
