"""Configuration dataclasses, one per concern, validated once at construction.

Every invalid value raises ``ValueError`` naming the field, the allowed range and the value
received, so a CLI flag or a JSON body can be reported back to the user verbatim.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("qwen2",)
SCHEDULER_MODES = ("static", "continuous")
POLICIES = ("fcfs", "sjf", "priority")
ATTENTION_BACKENDS = ("torch", "triton")
LINEAR_BACKENDS = ("torch", "int8", "int4", "triton-int8")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def env_switch(name: str) -> bool | None:
    """An on/off environment switch of the engine's A/B knobs: ``"1"`` -> True, ``"0"`` ->
    False, unset or empty -> None (the caller's default).

    Raises:
        ValueError: any other value, naming the variable.
    """
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"


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
            the next batch) or ``continuous`` (admit between iterations).
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
        use_cuda_graph: replay decode steps from CUDA graphs (CUDA, Triton attention backend).
        async_scheduling: launch step n+1 before reading step n's sampled tokens, so host
            work overlaps the device (``None``: on for CUDA devices, off on CPU).
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

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {list(LINEAR_BACKENDS)}, got {self.linear_backend!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)
