"""How an engine is assembled: the parts the step loop uses, built once, outside the hot files.

:class:`~llmserve.engine.llm_engine.LLMEngine` calls :func:`load_target` (model, tokenizer,
tensor-parallel ranks), :func:`build_structured_output` and :func:`build_paged_parts` (fused
forward, KV cache, block manager, scheduler, decode CUDA graphs, model runner) from its
constructor; :class:`~llmserve.engine.speculative.SpeculativeEngine` calls
:func:`build_draft_parts` for its draft model.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..attention.invariant import InvariantTritonAttention
from ..attention.triton_backend import TritonPagedAttention
from ..config import EngineConfig, ModelConfig, ResolvedFastPath
from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from ..models.loader import load_model
from ..tokenizer import load_tokenizer
from ..worker.cuda_graph import CUDAGraphDecodeRunner
from ..worker.mixed_graph import CUDAGraphMixedRunner
from ..kernels.invariant import invariant_tile_tokens
from ..kernels.paged_attention import prefill_block_m
from ..worker.kv_cache import KVCache
from ..worker.model_runner import ModelRunner
from .shard import LoadedShard, allocate_kv_cache, apply_decode_options, build_fast_forward, load_shard
from .structured import StructuredOutputManager
from .tensor_parallel import start_tensor_parallel

log = logging.getLogger("llmserve.engine.builder")

__all__ = ["DraftParts", "PagedParts", "build_draft_parts", "build_paged_parts", "build_structured_output",
           "load_target"]


def load_target(engine, config: EngineConfig, load_model_fn: Callable | None) -> None:
    """Load the target model and tokenizer into ``engine`` (``tp_runtime``, ``device``,
    ``model``, ``model_config``, ``model_path``, ``fast_path``, ``tokenizer``); with
    ``tensor_parallel_size > 1`` start the other ranks first (on a torchrun rank other than 0
    this serves as that rank and raises ``SystemExit``).

    Raises:
        ValueError: tensor parallelism on an engine that does not support it; from the loader.
        FileNotFoundError: from the loader.
    """
    loader = load_model_fn or load_model
    if config.batch_invariant and not str(config.device).startswith("cuda") \
            and torch.get_num_threads() != 1:
        # CPU kernels split a product's reduction across intra-op threads by problem size, so a
        # row's sums would depend on its batch again: the mode runs torch on one thread (on
        # CUDA the fixed-order Triton kernels do every reduction; the host threads stay).
        log.warning("batch-invariant mode: torch intra-op threads %d -> 1 for this process",
                    torch.get_num_threads())
        torch.set_num_threads(1)
    engine.tp_runtime = None
    tp = None
    if config.tensor_parallel_size > 1:
        if not engine.supports_tensor_parallel:
            raise ValueError(f"{type(engine).__name__} does not support tensor_parallel_size > 1 "
                             f"(got {config.tensor_parallel_size}); use LLMEngine")
        engine.tp_runtime = start_tensor_parallel(config, load_model_fn)
        engine.device = engine.tp_runtime.device
        tp = engine.tp_runtime.group
        engine._tp_finalizer = weakref.finalize(engine, engine.tp_runtime.shutdown)
    try:
        shard = load_shard(config, engine.device, loader, tp)
    except BaseException as e:
        engine._tp_abort(e)
        raise
    engine.model, engine.model_config, engine.model_path = shard.model, shard.model_config, shard.model_path
    # the fast-path choices for this model, decided once (size rules included)
    engine.fast_path = shard.fast_path
    engine.tokenizer = load_tokenizer(engine.model_path)


def build_structured_output(engine, config: EngineConfig) -> StructuredOutputManager:
    """The grammar matchers of an engine that enforces structured output."""
    return StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                                   max_entries=config.grammar_cache_size,
                                   pin_memory=engine.device.type == "cuda")


@dataclass(slots=True)
class PagedParts:
    """The paged engine's parts.

    Attributes:
        kv_cache: the KV cache tensors.
        block_manager: its blocks.
        scheduler: the scheduler over them (``max_model_len`` capped by the model's).
        runner: the model runner (fused forward and decode CUDA graphs when enabled).
    """

    kv_cache: KVCache
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner


def build_paged_parts(engine, config: EngineConfig) -> PagedParts:
    """Build the paged engine's parts for ``engine`` (loaded by :func:`load_target`).

    The fused forward is built before the KV cache: the copies it may keep
    (``fast_path.int8_fragments``) count against the free memory the cache is sized from.
    """
    tp = engine.tp_runtime.group if engine.tp_runtime is not None else None
    forward = build_fast_forward(LoadedShard(engine.model, engine.model_config, engine.model_path,
                                             engine.fast_path))
    dtype = engine.model.dtype if hasattr(engine.model, "dtype") else config.torch_dtype
    t0 = time.perf_counter()
    kv_cache = allocate_kv_cache(config, engine.model_config, dtype, engine.device, tp)
    startup = getattr(engine, "startup", None)
    if startup is not None:       # start-up record: seconds per phase and the KV pool's size
        startup.update(kv_cache_s=time.perf_counter() - t0, num_kv_blocks=kv_cache.num_blocks,
                       kv_cache_bytes=kv_cache.total_bytes)
    block_size = config.cache.block_size
    block_manager = BlockManager(kv_cache.num_blocks, block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching)
    sched_cfg = dataclasses.replace(config.scheduler, max_model_len=engine.max_model_len)
    scheduler = Scheduler(sched_cfg, block_manager)
    graphs = mixed = None
    if forward is not None and engine.device.type == "cuda" and engine.tp_runtime is None and (
            config.attention_backend == "triton" and config.use_cuda_graph):
        graphs = CUDAGraphDecodeRunner(forward, forward.compute_logits, kv_cache.kv_caches, block_size,
                                       config.scheduler.max_num_seqs, engine.max_model_len, engine.device,
                                       short_context=engine.fast_path.graph_short_context,
                                       greedy=forward.greedy if engine.fast_path.graph_argmax else None)
        t0 = time.perf_counter()
        graphs.capture()
        mixed = build_mixed_graphs(forward, kv_cache.kv_caches, config, engine)
        if startup is not None:
            startup["graph_capture_s"] = time.perf_counter() - t0
    runner = ModelRunner(engine.model, kv_cache.kv_caches, block_size, engine.device,
                         forward=forward, cuda_graphs=graphs, mixed_graphs=mixed,
                         channel=engine.tp_runtime.channel if engine.tp_runtime is not None else None)
    return PagedParts(kv_cache, block_manager, scheduler, runner)


def build_mixed_graphs(forward, kv_caches, config: EngineConfig, engine) -> CUDAGraphMixedRunner | None:
    """The captured graphs of steps with prefill chunks (:mod:`llmserve.worker.mixed_graph`),
    up to ``fast_path.mixed_graph_max_tokens`` tokens and never past the scheduler's step
    budget; None when that is 0. Called where the decode graphs are built (CUDA, the Triton
    attention backend, the fused forward, one rank); with the batch-invariant attention too,
    whose one kernel then runs a schedule of every row's tiles."""
    budget = config.scheduler.max_num_batched_tokens
    max_tokens = min(engine.fast_path.mixed_graph_max_tokens, budget or engine.max_model_len)
    backend = forward.model.attention_backend
    if max_tokens < 1:
        return None
    mc = engine.model_config
    if isinstance(backend, TritonPagedAttention):
        # the step splits between the decode kernel and a scheduled prefill kernel
        # (AttentionMetadata.prefill_tiles) over the sequences with several query rows
        block_m, every_row = prefill_block_m(mc.head_dim, engine.device), False
    elif isinstance(backend, InvariantTritonAttention):
        # the batch-invariant kernel serves every row of the step, the schedule lists them all
        block_m = invariant_tile_tokens(mc.num_attention_heads, mc.num_key_value_heads, engine.device)
        every_row = True
    else:
        return None
    mixed = CUDAGraphMixedRunner(forward, forward.compute_logits, kv_caches, config.cache.block_size,
                                 config.scheduler.max_num_seqs, max_tokens, engine.max_model_len,
                                 block_m, engine.device, schedule_decode_rows=every_row)
    mixed.capture()
    return mixed


@dataclass(slots=True)
class DraftParts:
    """A speculative draft model's own cache and runner.

    Attributes:
        kv_cache: the draft's KV cache (as many blocks as the target's, same block size).
        block_manager: its blocks.
        runner: its model runner (fused forward and 1-token decode graphs on CUDA).
    """

    kv_cache: KVCache
    block_manager: BlockManager
    runner: ModelRunner


def build_draft_parts(engine, config: EngineConfig, model: Any, model_config: ModelConfig,
                      share: bool) -> DraftParts:
    """The draft model's cache and runner next to ``engine``'s target.

    On CUDA the draft runs the fused forward too (the target's own one when ``share``) and,
    with the Triton backend and ``use_cuda_graph``, replays captured graphs for its 1-token
    passes (passes 2..k are always decode-only). On CPU: the readable path.
    """
    kv_cache = KVCache(num_layers=model_config.num_hidden_layers, num_blocks=engine.kv_cache.num_blocks,
                       block_size=engine.block_size, num_kv_heads=model_config.num_key_value_heads,
                       head_dim=model_config.head_dim, dtype=model.dtype, device=engine.device)
    block_manager = BlockManager(engine.kv_cache.num_blocks, engine.block_size)
    forward, graphs = None, None
    if engine.device.type == "cuda" and engine.fast_path.fused_forward:
        if share:
            forward = engine.runner.forward
        else:
            draft_path: ResolvedFastPath = config.fast_path.resolve(model_config, engine.device)
            apply_decode_options(model, draft_path)
            # its own size rules; fused like the target's (whatever the draft's size rules say)
            forward = build_fast_forward(LoadedShard(model, model_config, None,
                                                     dataclasses.replace(draft_path, fused_forward=True)))
        if config.attention_backend == "triton" and config.use_cuda_graph:
            graphs = CUDAGraphDecodeRunner(forward, forward.compute_logits, kv_cache.kv_caches,
                                           engine.block_size, config.scheduler.max_num_seqs,
                                           engine.max_model_len, engine.device,
                                           short_context=forward.options.graph_short_context)
            graphs.capture()
    runner = ModelRunner(model, kv_cache.kv_caches, engine.block_size, engine.device,
                         forward=forward, cuda_graphs=graphs)
    return DraftParts(kv_cache, block_manager, runner)
