"""Build the engine a config names.
"""

from __future__ import annotations
from ..config import EngineConfig
from .llm_engine import LLMEngine
from .naive import NaiveEngine


def build_engine(config: EngineConfig, naive: bool = False) -> LLMEngine | NaiveEngine:
    """Construct the engine a config names (``naive=True`` for the sequential control)."""
    return NaiveEngine(config) if naive else LLMEngine(config)
