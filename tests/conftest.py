"""Shared fixtures and helpers.

* ``hf_qwen2`` (session): factory of small random Qwen2 checkpoints written by ``transformers``
  itself (``Qwen2ForCausalLM(Qwen2Config(...)).save_pretrained``), with weights rescaled by
  :func:`peaked_init_` so greedy argmax has a clear margin. Returns ``(path, hf_model)``.
* ``tiny_model`` / ``tiny_path`` (session): the embedded tiny model, loaded once (fp32, CPU).
* :func:`build_attn_metadata`: hand-built :class:`AttentionMetadata` for a step of
  ``(num_computed, num_new)`` sequences over given block tables, plus positions.
* GPU tests are marked ``gpu`` and skipped when CUDA is unavailable.
* Without CUDA, ``TRITON_INTERPRET=1`` is set here, before llmserve is imported, so the Triton
  kernels run on CPU tensors in the interpreter.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pytest
import torch

# Triton picks its interpreter when a kernel is defined: without CUDA, set it before any
# llmserve module is imported (llmserve itself never writes the environment).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from llmserve.attention import AttentionMetadata  # noqa: E402


def _fixed_order_interpreter_dot() -> None:
    """Make the Triton interpreter's ``tl.dot`` sum each output element over ``K`` in one fixed
    order whatever the tile's height.

    The interpreter computes ``tl.dot`` with ``np.matmul``, that is with the CPU's BLAS, and
    OpenBLAS picks its kernel (and so each element's order of additions) from the CPU model and
    the matrix's shape: on AMD EPYC processors a 16-row tile and a 17-row tile round the same
    row differently. A GPU's tensor-core MMA computes every element from its own row and column
    in a fixed order, which is what the batch-invariant kernels rely on
    (llmserve.kernels.invariant); ``np.einsum`` without path optimisation loops over the
    output elements and sums ``K`` in order in its own code, so it models that on any CPU."""
    import numpy as np
    from triton.runtime import interpreter as interp

    cls = interp.InterpreterBuilder
    if getattr(cls.create_dot, "_fixed_order", False):
        return
    plain = cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if not (a_data.dtype == b_data.dtype == d.data.dtype):
            # mixed precisions (fp8, fp16 into fp32): the interpreter's own conversions
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.einsum("...mk,...kn->...mn", a_data, b_data, optimize=False)
        return interp.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._fixed_order = True
    cls.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _fixed_order_interpreter_dot()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --------------------------------------------------------------------------------------------
# Random HF checkpoints
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def peaked_init_(model: torch.nn.Module, seed: int = 0, embed_std: float = 1.0) -> torch.nn.Module:
    """Re-initialise an HF-named Qwen2 model in place so its logits are peaked.

    Embedding (and an untied ``lm_head``) ~ N(0, embed_std^2); linear weights ~
    N(0, 1/fan_in) so every layer moves the residual stream; biases ~ N(0, 0.01); norm
    weights ~ 1 + N(0, 0.01). Deterministic in ``seed``.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            new = torch.randn(p.shape, generator=g) * embed_std
        elif name.endswith("norm.weight"):
            new = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith(".bias"):
            new = 0.1 * torch.randn(p.shape, generator=g)
        else:
            new = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
        p.copy_(new.to(p.dtype))
    return model


HF_VARIANTS: dict[str, dict] = {
    # name: Qwen2Config overrides (vocab 1000, hidden 64, 2 layers unless overridden)
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa4_untied_sharded": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                tie_word_embeddings=False, _shard="60KB"),
}


def make_hf_qwen2(path: Path, seed: int = 0, vocab_size: int = 1000, hidden_size: int = 64,
                  intermediate_size: int = 128, num_hidden_layers: int = 2,
                  max_position_embeddings: int = 512, rope_theta: float = 10000.0,
                  _shard: str | None = None, **overrides):
    """Write a random ``transformers`` Qwen2 checkpoint to ``path``; return the HF model (fp32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                      max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                      rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      **overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float().eval()
    peaked_init_(model, seed)
    kw = {"max_shard_size": _shard} if _shard else {}
    model.save_pretrained(str(path), **kw)
    return model


@pytest.fixture(scope="session")
def hf_qwen2(tmp_path_factory):
    """Factory ``get(variant) -> (checkpoint_dir, hf_model)`` over :data:`HF_VARIANTS`, each
    written once per session."""
    made: dict[str, tuple[Path, object]] = {}

    def get(variant: str):
        if variant not in made:
            path = tmp_path_factory.mktemp(f"hf-{variant}")
            model = make_hf_qwen2(path, **HF_VARIANTS[variant])
            made[variant] = (path, model)
        return made[variant]

    return get


# --------------------------------------------------------------------------------------------
# The embedded tiny model
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from llmserve.models.tiny import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint()


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    """``(model, config)`` of the tiny checkpoint, fp32 on CPU, loaded once per session."""
    from llmserve.models.loader import load_model
    model, config, _ = load_model(str(tiny_path), device="cpu", dtype="float32")
    return model, config


# --------------------------------------------------------------------------------------------
# Attention metadata by hand
# --------------------------------------------------------------------------------------------

def build_attn_metadata(seqs: list[tuple[int, int]], block_tables: list[list[int]],
                        block_size: int, device: str | torch.device = "cpu"
                        ) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step in which sequence ``i`` already has ``seqs[i][0]`` tokens cached
    and computes ``seqs[i][1]`` new ones, using physical blocks ``block_tables[i]``.

    Returns:
        ``(meta, positions)``; ``positions`` ``[N]`` int64 matches the flat token order.
    """
    slots, positions, qsl, ctx = [], [], [0], []
    for (done, new), bt in zip(seqs, block_tables):
        assert len(bt) * block_size >= done + new, "block table too short"
        for p in range(done, done + new):
            positions.append(p)
            slots.append(bt[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + new)
        ctx.append(done + new)
    width = max(len(bt) for bt in block_tables)
    table = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for i, bt in enumerate(block_tables):
        table[i, :len(bt)] = torch.tensor(bt, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        max_query_len=max(n for _, n in seqs),
        max_context_len=max(ctx),
        block_size=block_size,
        is_decode_only=all(n == 1 for _, n in seqs),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def empty_kv_caches(config, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu"):
    """One zeroed ``(k, v)`` pair per layer, ``[num_blocks + 1, block_size, Hkv, D]`` (the
    extra last block is the scratch block)."""
    shape = (num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)]


# --------------------------------------------------------------------------------------------
# A real server on loopback
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def tiny_server(max_num_batched_tokens: int, prefill_chunk_size: int):
    """A uvicorn server on 127.0.0.1 serving the tiny model (CPU, fp32, 256 KV blocks of 16,
    max batch 8, context 512) with the given step budget and chunk size. Yields the
    ``BackgroundServer`` with ``.engine`` (the ``AsyncLLMEngine``) and ``.checkpoint`` (the
    tiny checkpoint directory, for clients that load its tokenizer); stops both on exit."""
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.async_engine import AsyncLLMEngine
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.models.tiny import ensure_tiny_checkpoint
    from llmserve.serve.app import create_app
    from llmserve.serve.server import BackgroundServer

    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32",
                       cache=CacheConfig(block_size=16, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                                 prefill_chunk_size=prefill_chunk_size, max_model_len=512))
    eng = AsyncLLMEngine(LLMEngine(cfg))
    srv = BackgroundServer(create_app(eng, served_model_name="tiny", shutdown_timeout=2.0),
                           shutdown_timeout=2.0).start()
    srv.engine = eng
    srv.checkpoint = ensure_tiny_checkpoint()
    try:
        yield srv
    finally:
        srv.stop()
        eng.shutdown()
