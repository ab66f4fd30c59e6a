"""Exact shapes of published Qwen2.5 checkpoints, for random-weight performance runs.

``--model random:qwen2.5-1.5b`` builds a model with Qwen2.5-1.5B's shapes and random weights,
directly on the target device (no download, no disk). Speed does not depend on weight values,
so these stand in for the real checkpoints when no hub is reachable. Shapes are those of the
``config.json`` files published with Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}.
"""

from __future__ import annotations

from ..config import ModelConfig

_COMMON = dict(max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
               bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16")

PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                head_dim=64, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                head_dim=128, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-3b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                              num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                              head_dim=128, tie_word_embeddings=True, **_COMMON),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                              head_dim=128, tie_word_embeddings=False, **_COMMON),
}


def preset_config(name: str) -> ModelConfig:
    """ModelConfig for ``random:<preset>`` names (case-insensitive, ``Qwen/Qwen2.5-1.5B`` style
    accepted too).

    Raises:
        ValueError: unknown preset (lists the known ones).
    """
    key = name.lower().removeprefix("random:").removeprefix("qwen/")
    if key not in PRESETS:
        raise ValueError(f"unknown random-weight preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[key]
