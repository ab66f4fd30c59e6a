"""Configuration dataclasses, one per concern, validated once at construction.

Every invalid value raises ``ValueError`` naming the field, the allowed range and the value
received, so a CLI flag or a JSON body can be reported back to the user verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("qwen2",)
SCHEDULER_MODES = ("static", "continuous")
POLICIES = ("fcfs", "sjf", "priority")
ATTENTION_BACKENDS = ("torch", "triton")
LINEAR_BACKENDS = ("torch", "int8", "int4", "triton-int8")
DECODE_SPLIT_POLICIES = ("legacy", "waves")
INT8_LAYOUTS = ("row", "planes")
#: Largest hidden size for which the size-ruled fast-path options (``None`` fields of
#: :class:`FastPathConfig`) resolve to on: each was measured faster on the H200 for
#: Qwen2.5-0.5B / 1.5B shapes (hidden 896 / 1536) and slower for 7B (hidden 3584); hidden
#: 2048 was not measured (docs/performance.md).
SMALL_HIDDEN_MAX = 2048
#: Most tokens a step may have to take the matrix-vector path (``kernels/gemv.py``).
GEMV_MAX_TOKENS = 4
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``float32|fp32|float16|fp16|half|bfloat16|bf16``) or a ``torch.dtype``
    to a ``torch.dtype``.

    Raises:
        ValueError: unknown name; the message lists the supported names.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[key]


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of a Qwen2 decoder, read from a Hugging Face ``config.json``.

    Field names follow ``transformers.Qwen2Config``. ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``. ``rope_theta`` is read from the 4.x top-level key
    or from the 5.x ``rope_parameters`` dict.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    torch_dtype: str = "bfloat16"
    architecture: str = "Qwen2ForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                "num_attention_heads must be a multiple of num_key_value_heads, got "
                f"{self.num_attention_heads} and {self.num_key_value_heads}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed ``config.json``.

        Raises:
            ValueError: unsupported ``architectures``/``model_type`` (lists the supported ones)
                or a missing required key.
        """
        archs = d.get("architectures") or ["Qwen2ForCausalLM"]
        model_type = d.get("model_type", "qwen2")
        if model_type not in SUPPORTED_MODEL_TYPES or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"unsupported model: architectures={archs}, model_type={model_type!r}; "
                f"supported architectures: {list(SUPPORTED_ARCHITECTURES)}, "
                f"model types: {list(SUPPORTED_MODEL_TYPES)}")
        rope_theta = d.get("rope_theta")
        if rope_theta is None and isinstance(d.get("rope_parameters"), dict):
            rope_theta = d["rope_parameters"].get("rope_theta")
        if rope_theta is None:
            rope_theta = 10000.0
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json is missing required keys {missing}")
        n_heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(int(e) for e in eos)
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // n_heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            torch_dtype=str(dtype).replace("torch.", ""),
            architecture=archs[0],
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict ``transformers`` reads for this model (4.x and 5.x keys)."""
        return {
            "architectures": [self.architecture],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "hidden_act": "silu",
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "torch_dtype": self.torch_dtype,
        }


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache geometry.

    Attributes:
        block_size: tokens per physical block; a power of two in [1, 256].
        num_blocks: number of physical blocks; ``None`` derives it from ``memory_bytes``
            (or, on CUDA, from ``gpu_memory_utilization`` of free memory).
        memory_bytes: KV cache budget in bytes when ``num_blocks`` is None (CPU default 256 MiB).
        gpu_memory_utilization: fraction (0, 1] of free device memory given to the cache on CUDA.
        enable_prefix_caching: share the K/V of full blocks between requests with equal
            prefixes (automatic prefix caching, as vLLM V1; :mod:`llmserve.core.block_manager`);
            on by default; outputs are unchanged.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not _is_power_of_two(self.block_size) \
                or self.block_size > 256:
            raise ValueError(f"block_size must be a power of two between 1 and 256, got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer or None, got {self.num_blocks!r}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"memory_bytes must be positive or None, got {self.memory_bytes!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching behaviour.

    Attributes:
        mode: ``static`` (admit up to ``max_num_seqs``, run them all to completion, then admit
            the next batch; a finished member returns at once and is not computed further, but
            its slot stays empty until the batch is done) or ``continuous`` (admit between
            iterations).
        policy: order of the waiting queue: ``fcfs`` (arrival), ``sjf`` (shortest prompt +
            max_tokens first), ``priority`` (lower value first, then arrival).
        max_num_seqs: the maximum batch size (sequences per step), >= 1.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes), >= 1.
        prefill_chunk_size: the most prompt tokens one sequence computes in a step; ``None``
            disables chunked prefill (a prompt is prefilled whole, which needs
            ``max_num_batched_tokens`` >= its length).
        max_model_len: the most tokens (prompt + output) a sequence may hold.
    """

    mode: str = "continuous"
    policy: str = "fcfs"
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 4096
    prefill_chunk_size: int | None = None
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.mode not in SCHEDULER_MODES:
            raise ValueError(f"mode must be one of {list(SCHEDULER_MODES)}, got {self.mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}")
        if self.prefill_chunk_size is not None and (
                not isinstance(self.prefill_chunk_size, int) or self.prefill_chunk_size < 1):
            raise ValueError(
                f"prefill_chunk_size must be an integer >= 1 or None, got {self.prefill_chunk_size!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")


@dataclass(frozen=True, slots=True)
class FastPathConfig:
    """Every choice of the fast GPU path, one field each; the defaults are the tuned behaviour
    on the H200 (numbers: docs/performance.md). Fields whose value is ``None`` follow a size
    rule, resolved once per model by :meth:`resolve` (``hidden_size <=``
    :data:`SMALL_HIDDEN_MAX` unless said otherwise).

    Attributes:
        fused_forward: run the fused forward (:mod:`llmserve.models.fused_forward`: packed
            projections and Triton kernels) instead of the readable one
            (:mod:`llmserve.models.qwen2`). ``None``: fused on CUDA, readable on CPU. ``True``
            on CPU runs the kernels in the Triton interpreter (``TRITON_INTERPRET=1``).
        gemv_max_tokens: largest step (tokens) that takes the fused matrix-vector path, in
            [0, :data:`GEMV_MAX_TOKENS`]; ``0`` turns it off. 1: on the H200 the kernel beats
            cuBLAS at one token but not yet at 2..4 on the MLP shapes.
        pdl: launch the fast-path kernels with programmatic dependent launch where the device
            has it (Hopper or later, a Triton with ``launch_pdl``): each kernel starts while
            the previous one drains and reads its first weight tile before waiting for it.
        gemv_early_epilogue: the matrix-vector kernels request their epilogue operands
            (scales, bias, residual) before the K loop. ``None``: the size rule.
        gemv_pre_wait: with PDL, the QKV kernel reads its RoPE operands (positions, slots,
            cos/sin rows, bias, int8 scales) before its PDL wait. ``None``: the size rule.
        pdl_trigger_qkv: with PDL, the decode QKV kernel lets the attention kernel launch
            before its own wait, so the attention reads its block table and asks L2 for its
            K/V rows earlier. ``None``: the size rule.
        graph_short_context: context length (tokens) of the second, short-context decode
            graphs captured for small batches (their attention grid has fewer splits, merged
            inside the decode kernel); ``0`` captures only full-length graphs. In [0, 1 << 20].
        mixed_graph_max_tokens: largest step (tokens) with prefill chunks that replays a CUDA
            graph captured for its token count (:mod:`llmserve.worker.mixed_graph`); larger
            steps run eagerly, ``0`` runs every such step eagerly. Needs the Triton attention
            backend and CUDA graphs. In [0, 16384].
        graph_argmax: compute greedy tokens inside the decode graphs (one Triton argmax after
            the LM head) rather than in the sampler.
        decode_splits: split-count policy of the decode attention kernel, ``legacy`` (about
            4 programs per SM) or ``waves`` (whole waves of programs).
        decode_stages: pipeline depth of the decode attention's default tile, in [1, 8].
        decode_min_tiles: fewest K/V tiles a decode split takes, in [1, 1024].
        decode_fused_max_splits: most splits the decode kernel merges itself (more: a
            separate reduction kernel), in [1, 128].
        decode_wide_tile: one 256-position tile a program for few sequences and short
            contexts.
        decode_early_pages: the decode kernel reads its first tile's block-table entries
            before the PDL wait. ``None``: with the wide tile only.
        decode_prefetch_kv: with early pages, also ask L2 for that tile's K/V rows before the
            wait (NVIDIA GPUs, 16-bit caches).
        int8_layout: how the fused forward keeps Triton INT8 weights: ``row`` (row-major int8)
            or ``planes`` (byte planes, four a 32-bit word: faster batch-1 decode of 1.5B/7B
            shapes, slower for 0.5B and for steps of 2..64 tokens). ``state_dict`` stays
            row-major either way.
        int8_fragments: also keep Triton INT8 weights in the MMA-fragment layout (twice the
            int8 weight memory) for steps of 2..16 tokens (bf16 on CUDA, ``int8_layout="row"``).
        int8_frag_pdl: launch the fragment kernel and its neighbours with PDL. ``None``: the
            size rule.
        invariant_block_rows: rows per fixed-shape matrix product in the batch-invariant mode
            (``EngineConfig.batch_invariant``); every projection and the LM head run as blocks
            of this many rows, the last zero-padded. Smaller wastes less work on padding at
            small batches, larger makes fewer calls at large ones. In ``[1, 1024]``. CPU
            only: on CUDA the mode's Triton linear kernel has its own fixed tiles.

    Raises:
        ValueError: a field outside its range, naming it.
    """

    fused_forward: bool | None = None
    gemv_max_tokens: int = 1
    pdl: bool = True
    gemv_early_epilogue: bool | None = None
    gemv_pre_wait: bool | None = None
    pdl_trigger_qkv: bool | None = None
    graph_short_context: int = 512
    mixed_graph_max_tokens: int = 2048
    graph_argmax: bool = True
    decode_splits: str = "legacy"
    decode_stages: int = 3
    decode_min_tiles: int = 1
    decode_fused_max_splits: int = 8
    decode_wide_tile: bool = True
    decode_early_pages: bool | None = None
    decode_prefetch_kv: bool = True
    int8_layout: str = "row"
    int8_fragments: bool = False
    int8_frag_pdl: bool | None = None
    invariant_block_rows: int = 16

    def __post_init__(self) -> None:
        for name in ("fused_forward", "gemv_early_epilogue", "gemv_pre_wait", "pdl_trigger_qkv",
                     "decode_early_pages", "int8_frag_pdl"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be True, False or None (the size rule), got {v!r}")
        for name in ("pdl", "graph_argmax", "decode_wide_tile", "decode_prefetch_kv", "int8_fragments"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        for name, lo, hi in (("gemv_max_tokens", 0, GEMV_MAX_TOKENS), ("graph_short_context", 0, 1 << 20),
                             ("mixed_graph_max_tokens", 0, 16384),
                             ("decode_stages", 1, 8), ("decode_min_tiles", 1, 1024),
                             ("decode_fused_max_splits", 1, 128), ("invariant_block_rows", 1, 1024)):
            v = getattr(self, name)
            if type(v) is not int or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        if self.decode_splits not in DECODE_SPLIT_POLICIES:
            raise ValueError(f"decode_splits must be one of {list(DECODE_SPLIT_POLICIES)}, "
                             f"got {self.decode_splits!r}")
        if self.int8_layout not in INT8_LAYOUTS:
            raise ValueError(f"int8_layout must be one of {list(INT8_LAYOUTS)}, got {self.int8_layout!r}")
        if self.int8_fragments and self.int8_layout != "row":
            raise ValueError("int8_fragments needs int8_layout='row' (the fragment copy is packed "
                             f"from row-major int8), got int8_layout={self.int8_layout!r}")

    def resolve(self, model: "ModelConfig", device: "str | torch.device") -> "ResolvedFastPath":
        """The plain values for one model on one device: ``None`` fields replaced by their
        size rule (``model.hidden_size <= SMALL_HIDDEN_MAX``), ``fused_forward`` by whether
        ``device`` is CUDA. Called once per model at engine build."""
        small = model.hidden_size <= SMALL_HIDDEN_MAX

        def rule(v: bool | None) -> bool:
            return small if v is None else v

        return ResolvedFastPath(
            fused_forward=(torch.device(device).type == "cuda") if self.fused_forward is None
            else self.fused_forward,
            gemv_max_tokens=self.gemv_max_tokens, pdl=self.pdl,
            gemv_early_epilogue=rule(self.gemv_early_epilogue), gemv_pre_wait=rule(self.gemv_pre_wait),
            pdl_trigger_qkv=rule(self.pdl_trigger_qkv), graph_short_context=self.graph_short_context,
            mixed_graph_max_tokens=self.mixed_graph_max_tokens, graph_argmax=self.graph_argmax,
            decode_splits=self.decode_splits,
            decode_stages=self.decode_stages, decode_min_tiles=self.decode_min_tiles,
            decode_fused_max_splits=self.decode_fused_max_splits, decode_wide_tile=self.decode_wide_tile,
            decode_early_pages=self.decode_early_pages, decode_prefetch_kv=self.decode_prefetch_kv,
            int8_layout=self.int8_layout, int8_fragments=self.int8_fragments,
            int8_frag_pdl=rule(self.int8_frag_pdl), invariant_block_rows=self.invariant_block_rows)


@dataclass(frozen=True, slots=True)
class ResolvedFastPath:
    """:class:`FastPathConfig` resolved for one model and device (:meth:`FastPathConfig.resolve`):
    the same fields with every size rule decided. ``decode_early_pages`` stays ``None`` when
    unset: the decode kernel decides it per launch (with its wide tile)."""

    fused_forward: bool
    gemv_max_tokens: int
    pdl: bool
    gemv_early_epilogue: bool
    gemv_pre_wait: bool
    pdl_trigger_qkv: bool
    graph_short_context: int
    mixed_graph_max_tokens: int
    graph_argmax: bool
    decode_splits: str
    decode_stages: int
    decode_min_tiles: int
    decode_fused_max_splits: int
    decode_wide_tile: bool
    decode_early_pages: bool | None
    decode_prefetch_kv: bool
    int8_layout: str
    int8_fragments: bool
    int8_frag_pdl: bool
    invariant_block_rows: int

    def decode_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`llmserve.kernels.paged_attention.paged_attention_decode`."""
        return {"split_policy": self.decode_splits, "stages": self.decode_stages,
                "min_tiles": self.decode_min_tiles, "fused_max_splits": self.decode_fused_max_splits,
                "wide_tile": self.decode_wide_tile, "early_pages": self.decode_early_pages,
                "prefetch_kv": self.decode_prefetch_kv}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine needs besides the model weights.

    Attributes:
        model: ``tiny`` (embedded random model), a local checkpoint directory, or a hub id.
        device: ``cpu`` or ``cuda`` (``cuda:N``).
        dtype: compute dtype name (see :func:`resolve_dtype`).
        seed: global seed for weight init of synthetic models and unseeded sampling.
        attention_backend: ``torch`` (reference paged attention) or ``triton``.
        linear_backend: ``torch`` (16-bit), ``int8``/``int4`` (reference dequantize-then-matmul)
            or ``triton-int8`` (fused kernel).
        use_cuda_graph: replay decode steps from CUDA graphs (CUDA, Triton attention backend,
            fused forward).
        async_scheduling: launch step n+1 before reading step n's sampled tokens, so host
            work overlaps the device (``None``: on for CUDA devices, off on CPU).
        fast_path: the fast GPU path's choices (:class:`FastPathConfig`).
        batch_invariant: the batch-invariant mode: a sequence's logits are bitwise the same
            whatever it is batched with (batch size, co-scheduled requests, prefill chunk size
            and step token budget, preemption and recompute, prefix-cache hits), so greedy
            outputs rerun exactly (seeded sampled ones too on a CPU, where that is tested). Linear layers run in fixed-shape
            row blocks (``fast_path.invariant_block_rows``) and attention in one fixed tile
            order per row (:mod:`llmserve.models.batch_invariant`,
            :mod:`llmserve.attention.invariant`). On a CPU it runs the readable path
            (``attention_backend='torch'``, no fused forward) and building an engine sets
            torch's intra-op threads to 1 for the process (CPU kernels split a reduction across
            threads by problem size, which would make a row's sums depend on its batch again).
            On CUDA it runs the fused forward with ``attention_backend='triton'`` and CUDA
            graphs for decode steps, every projection and the attention through the
            fixed-order Triton kernels of :mod:`llmserve.kernels.invariant` (steps with prefill
            chunks run without graphs). ``linear_backend='torch'`` and one rank on both.
            Default off.
        freeze_gc: at the end of :meth:`LLMEngine.warmup` (which the server and the benchmark
            run before serving or measuring; on a CPU it only does this), collect once
            and move every live object into Python's permanent generation (``gc.freeze()``),
            so the collector's full passes during serving scan only objects made per request
            instead of the model, tokenizer and buffers (a full pass over those held one
            decode step for over 100 ms at batch 256). Default on.
        grammar_cache_size: compiled grammars of structured-output requests kept for reuse
            (one per distinct schema; least recently used ones are dropped), >= 1.
        grammar_parallel_fill_rows: a step with at least this many constrained rows fills
            their next-token bitmasks on xgrammar's thread pool; fewer rows (and always a
            single row) are filled one after another on the engine's thread, >= 1. Waking a
            pool costs more than a few rows' serial fills, and a pool's fill waits for its
            slowest thread, so a busy host hurts it most; the measurements behind the default
            are in docs/performance.md (structured output). Default 16.
        grammar_fill_threads: threads of that pool, >= 1 (``None``: xgrammar's default, half
            the host's cores).
        tensor_parallel_size: ranks the model is sharded over (Megatron-style, one process a
            rank on one host: :mod:`llmserve.engine.tensor_parallel`), >= 1. With ``N > 1`` the
            engine spawns ``N - 1`` worker processes (or joins the ranks ``torchrun`` started);
            it must divide the model's query heads and intermediate size (checked when the
            model's config is read). CUDA graphs are not supported with it.
        distributed_timeout_s: seconds a rank waits on the others (start-up, every collective)
            before the engine raises; > 0. A rank that dies is noticed at once; this bounds a
            rank that hangs.
    """

    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = "torch"
    linear_backend: str = "torch"
    use_cuda_graph: bool = True
    async_scheduling: bool | None = None
    fast_path: FastPathConfig = field(default_factory=FastPathConfig)
    freeze_gc: bool = True
    batch_invariant: bool = False
    grammar_cache_size: int = 256
    grammar_parallel_fill_rows: int = 16
    grammar_fill_threads: int | None = None
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        g = self.grammar_cache_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"grammar_cache_size must be an integer >= 1, got {g!r}")
        r = self.grammar_parallel_fill_rows
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"grammar_parallel_fill_rows must be an integer >= 1, got {r!r}")
        f = self.grammar_fill_threads
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 1):
            raise ValueError(f"grammar_fill_threads must be None or an integer >= 1, got {f!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, got {t!r}")
        for name in ("freeze_gc", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.fast_path, FastPathConfig):
            raise ValueError(f"fast_path must be a FastPathConfig, got {type(self.fast_path).__name__}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {list(LINEAR_BACKENDS)}, got {self.linear_backend!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.batch_invariant:
            cuda = self.device.startswith("cuda")
            attn = "triton" if cuda else "torch"
            wrong = [f"{k}={v!r}" for k, v, ok in (
                ("attention_backend", self.attention_backend, attn),
                ("linear_backend", self.linear_backend, "torch")) if v != ok]
            if self.fast_path.fused_forward is (not cuda):
                wrong.append(f"fast_path.fused_forward={not cuda}")
            if tp > 1:
                wrong.append(f"tensor_parallel_size={tp}")
            if wrong:
                raise ValueError("batch_invariant=True needs on a CPU the readable path (attention_backend "
                                 "'torch', no fused forward) and on CUDA the fused forward with "
                                 "attention_backend 'triton' (its invariant kernels replace the "
                                 "attention and every projection); linear_backend 'torch' and one "
                                 "rank on both (quantized kernels have no fixed-order form, and an "
                                 "all-reduce adds the ranks' partial sums in its own order); got "
                                 + ", ".join(wrong))
        if tp > 1 and self.device.startswith("cuda") and self.use_cuda_graph \
                and self.attention_backend == "triton" and self.fast_path.fused_forward is not False:
            raise ValueError(f"tensor_parallel_size={tp} does not support CUDA graphs: set "
                             "use_cuda_graph=False (--no-cuda-graph), or use the torch attention "
                             "backend or fast_path.fused_forward=False (no graphs are captured then)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)
