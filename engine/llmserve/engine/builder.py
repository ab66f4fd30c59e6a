"""How an engine is assembled: the parts the step loop uses, built once, outside the hot files.

:class:`~llmserve.engine.llm_engine.LLMEngine` calls :func:`load_target` (model, tokenizer,
tensor-parallel ranks), :func:`build_structured_output` and :func:`build_paged_parts` (fused
forward, KV cache, block manager, scheduler, decode CUDA graphs, model runner) from its
constructor; :class:`~llmserve.engine.speculative.SpeculativeEngine` calls
:func:`build_draft_parts` for its draft model.
"""

from __future__ import annotations

import dataclasses
import gc
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

__all__ = ["DeviceParts", "DraftParts", "EnginePartsCache", "PagedParts", "build_draft_parts", "build_paged_parts",
           "build_structured_output", "load_target", "parts_key"]


def pin_invariant_threads(config: EngineConfig) -> None:
    """The batch-invariant mode on a CPU runs torch on one intra-op thread (for the process):
    CPU kernels split a product's reduction across threads by problem size, so a row's sums
    would depend on its batch again. On CUDA the fixed-order Triton kernels do every reduction
    and the host threads stay."""
    if config.batch_invariant and not str(config.device).startswith("cuda") and torch.get_num_threads() != 1:
        log.warning("batch-invariant mode: torch intra-op threads %d -> 1 for this process",
                    torch.get_num_threads())
        torch.set_num_threads(1)


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


@dataclass(slots=True)
class DeviceParts:
    """What a paged engine builds on its device before its first step, and what an engine of
    the same :func:`parts_key` can take over instead of building it again (:class:`EnginePartsCache`).

    Attributes:
        shard: the loaded model, its config and path, and the resolved fast-path choices.
        tokenizer: the model's tokenizer.
        forward: the fused forward, or None (the readable path).
        kv_cache: the KV cache tensors (their contents are never read before a new owner's
            block manager hands a block out and its prefill writes it).
        graphs: the decode CUDA graphs, or None.
        mixed: the CUDA graphs of steps with prefill chunks, or None.
        key: the :func:`parts_key` of the configuration they were built for (an engine of
            another key refuses them).
    """

    shard: LoadedShard
    tokenizer: Any
    forward: Any
    kv_cache: KVCache
    graphs: CUDAGraphDecodeRunner | None
    mixed: CUDAGraphMixedRunner | None
    #: :func:`parts_key` of the configuration the parts were built for
    key: EngineConfig | None = None

    def reset(self) -> None:
        """Ready the parts for a new engine: wait for the device, zero the graph runners'
        replay counters and staging turns (what a fresh capture starts from)."""
        if self.kv_cache.kv_caches and self.kv_cache.kv_caches[0][0].is_cuda:
            torch.cuda.synchronize(self.kv_cache.kv_caches[0][0].device)
        for runner in (self.graphs, self.mixed):
            if runner is not None:
                runner.reset()


#: Scheduler and cache fields that only the host side of an engine reads (the scheduler, the
#: block manager): two configurations differing only in these build the same device parts.
SCHEDULING_ONLY = {"scheduler": ("mode", "policy", "prefill_chunk_size"), "cache": ("enable_prefix_caching",)}


def parts_key(config: EngineConfig) -> EngineConfig:
    """``config`` with the fields of :data:`SCHEDULING_ONLY` at their defaults: equal keys
    build equal :class:`DeviceParts` (the same weights from the same seed, KV cache, kernels
    and graph buckets), so an engine may take over another's."""
    fixed = {}
    for section, names in SCHEDULING_ONLY.items():
        part = getattr(config, section)
        defaults = {f.name: f.default for f in dataclasses.fields(part) if f.name in names}
        fixed[section] = dataclasses.replace(part, **defaults)
    return dataclasses.replace(config, **fixed)


def check_reuse_key(reuse: DeviceParts, config: EngineConfig) -> None:
    """Raises ValueError when ``reuse`` was built for another :func:`parts_key` than ``config``'s."""
    if reuse.key != parts_key(config):
        raise ValueError("the reused device parts were built for other engine settings (their parts_key "
                         "differs: block size, batch size, memory, model, backends or seed)")


class EnginePartsCache:
    """Keeps one finished engine's :class:`DeviceParts` for the next engine of the same
    :func:`parts_key`, so a process that runs many engines one after another (a benchmark
    matrix's cells) loads the weights, allocates the KV cache and captures the CUDA graphs once
    per distinct configuration instead of once per engine.

    The scheduler, block manager, sampler, structured-output matchers and every counter of the
    new engine are its own, built fresh; only the device parts move. An engine gives its parts
    back with :meth:`put` (it can take no request afterwards), the next one with an equal key
    takes them in :func:`llmserve.engine.build_engine` (``parts_cache=``). One engine owns the
    parts at a time, and the cache holds at most one set: a key that differs drops it.

    Not for tensor parallelism or speculative decoding (those build their own parts).
    """

    def __init__(self) -> None:
        self._key: EngineConfig | None = None
        self._parts: DeviceParts | None = None
        #: engines built on parts taken from this cache (counted by ``build_engine`` once the
        #: engine is constructed)
        self.reuses = 0

    def holds(self, config: EngineConfig) -> bool:
        """Whether the cache holds parts an engine of ``config`` can take."""
        return self._parts is not None and self._key == parts_key(config)

    def take(self, config: EngineConfig) -> DeviceParts | None:
        """The held parts when their key equals ``config``'s (the cache lets go of them), else
        None; parts of another key are dropped (:meth:`clear`)."""
        if not self.holds(config):
            self.clear()
            return None
        parts, self._parts, self._key = self._parts, None, None
        parts.reset()
        return parts

    def put(self, engine) -> bool:
        """Take ``engine``'s device parts for the next engine of its key; ``engine`` cannot
        take requests afterwards. An engine with requests in flight, or one without parts to
        give (naive, speculative, tensor parallel), leaves the cache empty. Returns whether
        parts were kept."""
        self.clear()
        detach = getattr(engine, "detach_device_parts", None)
        if not callable(detach) or engine.has_unfinished_requests():
            return False
        parts = detach()
        if parts is None:
            return False
        self._key, self._parts = parts_key(engine.config), parts
        return True

    def clear(self) -> None:
        """Drop the held parts; their device memory is freed once nothing else refers to them
        (``gc.collect`` runs here for reference cycles among them; objects an engine froze with
        ``gc.freeze`` wait for ``gc.unfreeze``, which the pipeline's runner calls)."""
        if self._parts is None:
            return
        cuda = bool(self._parts.kv_cache.kv_caches) and self._parts.kv_cache.kv_caches[0][0].is_cuda
        self._key = self._parts = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def build_structured_output(engine, config: EngineConfig) -> StructuredOutputManager:
    """The grammar matchers of an engine that enforces structured output."""
    return StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                                   max_entries=config.grammar_cache_size,
                                   pin_memory=engine.device.type == "cuda",
                                   parallel_fill_rows=config.grammar_parallel_fill_rows,
                                   fill_threads=config.grammar_fill_threads)


@dataclass(slots=True)
class PagedParts:
    """The paged engine's parts.

    Attributes:
        kv_cache: the KV cache tensors.
        block_manager: its blocks.
        scheduler: the scheduler over them (``max_model_len`` capped by the model's).
        runner: the model runner (fused forward and decode CUDA graphs when enabled).
        device: what of these another engine of the same :func:`parts_key` may take over
            (None with tensor parallelism).
    """

    kv_cache: KVCache
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    device: DeviceParts | None = None


def build_paged_parts(engine, config: EngineConfig, reuse: DeviceParts | None = None) -> PagedParts:
    """Build the paged engine's parts for ``engine`` (loaded by :func:`load_target`), or with
    ``reuse`` (taken from an :class:`EnginePartsCache`) only the host side: block manager,
    scheduler and model runner over the reused forward, KV cache and graphs.

    The fused forward is built before the KV cache: the copies it may keep
    (``fast_path.int8_fragments``) count against the free memory the cache is sized from.
    """
    tp = engine.tp_runtime.group if engine.tp_runtime is not None else None
    startup = getattr(engine, "startup", None)
    block_size = config.cache.block_size
    if reuse is not None:
        check_reuse_key(reuse, config)
        forward, kv_cache, graphs, mixed = reuse.forward, reuse.kv_cache, reuse.graphs, reuse.mixed
        if startup is not None:
            startup.update(kv_cache_s=0.0, num_kv_blocks=kv_cache.num_blocks, kv_cache_bytes=kv_cache.total_bytes,
                           reused_parts=True, **({"graph_capture_s": 0.0} if graphs is not None else {}))
    else:
        forward = build_fast_forward(LoadedShard(engine.model, engine.model_config, engine.model_path,
                                                 engine.fast_path))
        dtype = engine.model.dtype if hasattr(engine.model, "dtype") else config.torch_dtype
        t0 = time.perf_counter()
        kv_cache = allocate_kv_cache(config, engine.model_config, dtype, engine.device, tp)
        if startup is not None:       # start-up record: seconds per phase and the KV pool's size
            startup.update(kv_cache_s=time.perf_counter() - t0, num_kv_blocks=kv_cache.num_blocks,
                           kv_cache_bytes=kv_cache.total_bytes)
        graphs, mixed = build_graphs(engine, config, forward, kv_cache)
    block_manager = BlockManager(kv_cache.num_blocks, block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching)
    sched_cfg = dataclasses.replace(config.scheduler, max_model_len=engine.max_model_len)
    scheduler = Scheduler(sched_cfg, block_manager)
    runner = ModelRunner(engine.model, kv_cache.kv_caches, block_size, engine.device,
                         forward=forward, cuda_graphs=graphs, mixed_graphs=mixed,
                         channel=engine.tp_runtime.channel if engine.tp_runtime is not None else None)
    device = None
    if engine.tp_runtime is None:
        device = DeviceParts(LoadedShard(engine.model, engine.model_config, engine.model_path, engine.fast_path),
                             engine.tokenizer, forward, kv_cache, graphs, mixed, key=parts_key(config))
    return PagedParts(kv_cache, block_manager, scheduler, runner, device)


def build_graphs(engine, config: EngineConfig, forward, kv_cache: KVCache
                 ) -> tuple[CUDAGraphDecodeRunner | None, CUDAGraphMixedRunner | None]:
    """Capture the decode graphs and the graphs of steps with prefill chunks (CUDA, the Triton
    attention backends, the fused forward, one rank, ``use_cuda_graph``), else ``(None, None)``;
    the capture's wall seconds go to ``engine.startup["graph_capture_s"]``."""
    startup = getattr(engine, "startup", None)
    block_size = config.cache.block_size
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
    return graphs, mixed


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
