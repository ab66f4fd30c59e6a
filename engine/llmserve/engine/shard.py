"""Building one rank's model, fast path and KV cache: the steps every engine rank runs the same
way (rank 0 inside :class:`~llmserve.engine.llm_engine.LLMEngine`, the other tensor-parallel
ranks in :mod:`llmserve.engine.tensor_parallel`), so their collectives pair up."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import EngineConfig, ModelConfig, ResolvedFastPath

__all__ = ["LoadedShard", "allocate_kv_cache", "apply_decode_options", "build_fast_forward", "load_shard"]


@dataclass(slots=True)
class LoadedShard:
    """One rank's model: ``model`` (this rank's shards with tensor parallelism), its full
    ``model_config``, the checkpoint directory (None for ``random:`` models) and the fast-path
    choices resolved for it."""

    model: Any
    model_config: ModelConfig
    model_path: Path | None
    fast_path: ResolvedFastPath


def apply_decode_options(model, fast_path: ResolvedFastPath) -> None:
    """Give the model's Triton attention backend the decode kernel's options (a fresh backend
    object, so models loaded elsewhere keep theirs)."""
    backend = getattr(model, "attention_backend", None)
    if getattr(backend, "name", None) != "triton":
        return
    from ..attention.triton_backend import TritonPagedAttention

    if isinstance(backend, TritonPagedAttention):
        model.attention_backend = TritonPagedAttention(fast_path.decode_options())


def load_shard(config: EngineConfig, device: torch.device, loader: Callable, tp=None) -> LoadedShard:
    """Load the model (this rank's shards when ``tp`` has more than one rank), give its
    attention backend the decode options and quantize it per ``config.linear_backend``.

    Args:
        config: the engine configuration.
        device: this rank's device.
        loader: ``load_model``-like ``(name, device=, dtype=, attention_backend=[, tp=])``
            returning ``(model, model_config, path)``; ``tp`` is passed only with more than
            one rank.
        tp: this rank's :class:`~llmserve.models.parallel.TensorParallelGroup`, or None.

    Raises:
        ValueError/FileNotFoundError: from the loader or the quantization.
    """
    kw: dict[str, Any] = {"device": str(device), "dtype": config.dtype,
                          "attention_backend": config.attention_backend}
    sharded = tp is not None and tp.size > 1
    if sharded:
        kw["tp"] = tp
    model, model_config, path = loader(config.model, **kw)
    fast_path = config.fast_path.resolve(model_config, device)
    apply_decode_options(model, fast_path)
    if config.batch_invariant:
        from ..attention.invariant import InvariantPagedAttention, InvariantTritonAttention
        from ..models.batch_invariant import make_batch_invariant

        make_batch_invariant(model, fast_path.invariant_block_rows, config.cache.block_size)
        model.attention_backend = (InvariantTritonAttention() if torch.device(device).type == "cuda"
                                   else InvariantPagedAttention())
    if config.linear_backend != "torch":
        from ..quant import quantize_model

        # row-parallel shards scale by their whole row's maximum: the same int8/int4 weights
        # as the unsplit model
        quantize_model(model, config.linear_backend, row_absmax=tp.row_parallel_absmax if sharded else None)
    model.eval()
    return LoadedShard(model, model_config, path, fast_path)


def build_fast_forward(shard: LoadedShard):
    """With ``fast_path.fused_forward`` (by default: on CUDA) the fused forward (Triton
    norm/rope/silu kernels, packed QKV and gate-up GEMMs) of the shard's model, else None (the
    readable path)."""
    if not shard.fast_path.fused_forward:
        return None
    from ..models.fused_forward import FastQwen2Forward

    return FastQwen2Forward(shard.model, shard.fast_path)


def allocate_kv_cache(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                      device: torch.device, tp=None):
    """This rank's :class:`~llmserve.worker.kv_cache.KVCache`: every layer's K/V for the rank's
    own K/V heads. With more than one rank each rank sizes its cache from its budget and the
    ranks agree on the smallest block count (one all-reduce), since rank 0's block manager
    hands out block ids valid on every rank."""
    from ..worker.kv_cache import KVCache

    if tp is None or tp.size == 1:
        return KVCache.from_config(model_config, config.cache, dtype, device)
    plan = tp.plan
    local = dataclasses.replace(model_config, num_attention_heads=plan.q_count,
                                num_key_value_heads=plan.kv_count)
    num_blocks = KVCache.resolve_num_blocks(local, config.cache, dtype, device)
    num_blocks = tp.all_reduce_min_int(num_blocks, device)
    return KVCache.from_config(local, dataclasses.replace(config.cache, num_blocks=num_blocks), dtype, device)
