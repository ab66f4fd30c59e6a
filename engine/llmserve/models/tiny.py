"""The embedded default model ("tiny"): a seeded random Qwen2 with the real Qwen vocabulary.

Shape: vocab 151,936 (Qwen2/2.5's padded vocabulary), 4 layers, hidden 128, 4 query heads and
2 K/V heads (GQA ratio 2), head_dim 32, SwiGLU intermediate 384, 4,096 positions,
rope_theta 1e6, tied embeddings, eos = ``<|endoftext|>`` (151643). 20.2 M parameters, stored
in float32: ``model.safetensors`` is 80.9 MB (the 151,936 x 128 embedding is 77.8 MB of it),
plus ~11 MB of tokenizer files. float32 so that CPU runs are exact to compare; it loads in
any dtype.

Weights are drawn from numpy's PCG64 generator (stable across numpy and torch versions), so
every machine builds byte-identical files. The init is chosen so greedy decoding is robust
to float summation order (batched vs sequential paths must agree token for token) and not
degenerate:

* embedding rows are random directions of norm ``sqrt(hidden)`` (every token equally
  "loud", so no hub token wins every argmax);
* projections have std ``1/sqrt(fan_in)`` so every layer moves the residual stream by
  about as much as the embedding itself: the next token depends on the context, not only on
  the current token;
* the final norm weight is ``LOGIT_SCALE`` times random signs: with tied embeddings a plain
  positive weight makes the current token's own logit the largest (output repeats the input
  forever); random signs decorrelate the output from the input embedding, and the scale sets
  the logit spread (std ~ ``LOGIT_SCALE * sqrt(hidden)`` = 11.3).

Measured (``tests/test_model.py::test_tiny_logits_are_peaked_and_varied``, 8 random prompts x
32 positions, fp32 CPU): median top1-top2 logit gap 1.57 (1st percentile 0.025), while the
paged path vs the reference path (different summation order) differ by at most 4.4e-5; the
argmax never equals the input token and greedy continuations are varied. Softmax at
temperature 1 is peaked but not one-hot (median top-2/top-1 probability ratio ~ 0.2).

The checkpoint is written once into ``$LLMSERVE_CACHE`` (:mod:`llmserve.envs`; default ``~/.cache/llmserve``) under a
name hashing the config, seed and init version, and then loaded through the normal loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig

TINY_SEED = 0
LOGIT_SCALE = 1.0
_INIT_VERSION = "1"  # bump when the init below changes (changes the cache dir name)

TINY_CONFIG = ModelConfig(
    vocab_size=151936,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151643,
    torch_dtype="float32",
)


def tiny_state_dict(config: ModelConfig = TINY_CONFIG, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """The tiny model's weights: HF names -> float32 CPU tensors (no ``lm_head.weight``: tied).

    Deterministic in ``(config, seed)`` on every platform (numpy PCG64).
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    h, d = config.hidden_size, config.head_dim
    nq, nkv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size

    def normal(shape, std):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def linear(out_f, in_f):
        return normal((out_f, in_f), in_f ** -0.5)

    emb = rng.standard_normal((config.vocab_size, h), dtype=np.float32)   # [V, H]
    emb *= np.float32(np.sqrt(h)) / np.linalg.norm(emb, axis=1, keepdims=True).astype(np.float32)
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.from_numpy(emb)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = linear(nq * d, h)
        sd[p + "self_attn.q_proj.bias"] = normal((nq * d,), 0.1)
        sd[p + "self_attn.k_proj.weight"] = linear(nkv * d, h)
        sd[p + "self_attn.k_proj.bias"] = normal((nkv * d,), 0.1)
        sd[p + "self_attn.v_proj.weight"] = linear(nkv * d, h)
        sd[p + "self_attn.v_proj.bias"] = normal((nkv * d,), 0.1)
        sd[p + "self_attn.o_proj.weight"] = linear(h, nq * d)
        sd[p + "mlp.gate_proj.weight"] = linear(inter, h)
        sd[p + "mlp.up_proj.weight"] = linear(inter, h)
        sd[p + "mlp.down_proj.weight"] = linear(h, inter)
        sd[p + "input_layernorm.weight"] = 1.0 + normal((h,), 0.1)
        sd[p + "post_attention_layernorm.weight"] = 1.0 + normal((h,), 0.1)
    signs = np.where(rng.random(h) < 0.5, -1.0, 1.0).astype(np.float32)
    sd["model.norm.weight"] = torch.from_numpy(signs * np.float32(LOGIT_SCALE))
    return sd


def _cache_root() -> Path:
    from ..envs import cache_root
    return cache_root()


def tiny_checkpoint_name(config: ModelConfig = TINY_CONFIG, seed: int = TINY_SEED) -> str:
    """Directory name ``tiny-qwen2-<12 hex of sha256(config, seed, init version)>``."""
    blob = json.dumps({"config": config.to_hf_dict(), "seed": seed, "init": _INIT_VERSION,
                       "logit_scale": LOGIT_SCALE}, sort_keys=True)
    return "tiny-qwen2-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def write_tiny_checkpoint(out_dir: str | os.PathLike, with_tokenizer: bool = True) -> Path:
    """Write the tiny checkpoint (``config.json``, ``model.safetensors``, generation config
    and, if ``with_tokenizer``, the built-in tokenizer files) into ``out_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TINY_CONFIG.to_hf_dict()
    cfg["dtype"] = cfg["torch_dtype"]
    cfg["llmserve_tiny"] = {"seed": TINY_SEED, "init_version": _INIT_VERSION, "logit_scale": LOGIT_SCALE}
    # One metadata key only: safetensors serialises the metadata map in hash order, so more
    # keys would make the file bytes (not the tensors) differ from run to run.
    save_file(tiny_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    gen = {"bos_token_id": TINY_CONFIG.bos_token_id, "eos_token_id": TINY_CONFIG.eos_token_id,
           "pad_token_id": TINY_CONFIG.eos_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    if with_tokenizer:
        from ..tokenizer import copy_builtin_tokenizer_files
        copy_builtin_tokenizer_files(out)
    return out


def ensure_tiny_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the tiny checkpoint directory, writing it on first use.

    Args:
        cache_dir: parent directory; default ``$LLMSERVE_CACHE`` or ``~/.cache/llmserve``.

    Returns:
        ``<cache_dir>/tiny-qwen2-<hash>`` holding config.json, model.safetensors (80.9 MB)
        and tokenizer files.

    The files are written into a temporary sibling directory which is then renamed into
    place (atomic on POSIX), so a reader never sees a partial checkpoint and two processes
    racing both end up with the same complete directory.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else _cache_root()
    final = root / tiny_checkpoint_name()
    if (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-tiny-", dir=root))
    try:
        write_tiny_checkpoint(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
