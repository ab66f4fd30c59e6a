"""Qwen2 model, checkpoint loading and the embedded tiny model."""

from .loader import load_model, resolve_model_path, save_checkpoint
from .qwen2 import Qwen2ForCausalLM
from .tiny import TINY_CONFIG, ensure_tiny_checkpoint

__all__ = ["Qwen2ForCausalLM", "load_model", "resolve_model_path", "save_checkpoint",
           "ensure_tiny_checkpoint", "TINY_CONFIG"]
