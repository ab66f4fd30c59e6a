"""llmserve: an inspectable Qwen2/Qwen2.5 inference and serving engine."""

__version__ = "0.1.0"
