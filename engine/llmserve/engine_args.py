"""Engine flags, defined once, and the defaults each device resolves them to.

Every command that builds an engine (``generate``, ``benchmark``, ``serve``, ``quantize-eval``
and the GPU comparison) goes through :class:`EngineArgs`: its fields are the engine's
command-line flags (names as vLLM's where vLLM has one), :func:`add_engine_args` generates the
``argparse`` flags from those fields, and :meth:`EngineArgs.create_engine_config` is the one
place that turns them into an :class:`~llmserve.config.EngineConfig`.

A field left at ``None`` takes its device's default (:func:`device_defaults`): on CUDA the fast
path (bf16, Triton paged attention, CUDA graphs, the fused forward, asynchronous scheduling,
chunked prefill with a GPU step budget, 256 sequences, the KV pool sized from free memory); on a
CPU the readable path (fp32, the PyTorch attention backend, the readable forward, 8 sequences).
An explicit flag always wins, so the readable path stays one flag away on a GPU
(``--attention-backend torch`` or ``--no-fused-forward``).

The step budget also depends on how the engine is used (``usage``, as vLLM's usage context):
``"offline"`` (``generate``, ``benchmark``: throughput, large prefill chunks) or ``"server"``
(``serve``: short steps, so a long prompt arriving costs each running decode little; Sarathi-Serve,
Agrawal et al., OSDI 2024). The numbers are the ones measured fastest on the H200 for
Qwen2.5-1.5B shapes (docs/performance.md).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .config import (ATTENTION_BACKENDS, INT8_LAYOUTS, LINEAR_BACKENDS, POLICIES, CacheConfig,
                     EngineConfig, FastPathConfig, SchedulerConfig)

USAGES = ("offline", "server")

__all__ = ["USAGES", "DeviceDefaults", "EngineArgs", "add_engine_args", "device_defaults",
           "device_type", "default_dtype", "describe_config"]


def device_type(device: str | None) -> str:
    """``"cuda"`` for ``cuda``/``cuda:N``, else ``"cpu"``."""
    return "cuda" if str(device or "cpu").startswith("cuda") else "cpu"


def default_dtype(device: str | None, dtype: str | None = None) -> str:
    """``dtype`` if given, else fp32 on a CPU and bf16 on CUDA (the one dtype rule)."""
    if dtype:
        return dtype
    return "bfloat16" if device_type(device) == "cuda" else "float32"


@dataclass(frozen=True, slots=True)
class DeviceDefaults:
    """What a field left unset resolves to on one device, for one usage.

    Attributes:
        dtype: compute dtype name.
        attention_backend: ``torch`` or ``triton``.
        max_num_seqs: most sequences per step.
        prefill_chunk_size: most prompt tokens of one sequence per step, ``None`` = chunked
            prefill off.
        max_num_batched_tokens: token budget of one step.
    """

    dtype: str
    attention_backend: str
    max_num_seqs: int
    prefill_chunk_size: int | None
    max_num_batched_tokens: int


#: CUDA step shapes by usage: (prefill chunk, step token budget), tokens. Server: vLLM V1's
#: online budget of 2,048 tokens in chunks of 512; offline: chunks of 2,048 in 8,192-token steps
#: (the fastest measured on the H200 for the 256-request offline workload).
_CUDA_STEP = {"server": (512, 2048), "offline": (2048, 8192)}
#: CPU server: chunks of 64 (a CPU step's time grows with its tokens); offline: no chunking.
_CPU_SERVER_CHUNK = 64


def device_defaults(device: str | None, usage: str = "offline", *, max_num_seqs: int | None = None,
                    prefill_chunk_size: int | None = None, max_model_len: int = 4096) -> DeviceDefaults:
    """The defaults of every device-dependent field.

    Args:
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        usage: ``"offline"`` or ``"server"`` (see the module docstring).
        max_num_seqs: the explicit value, if any (the CPU server budget counts one decode token
            per sequence).
        prefill_chunk_size: the explicit chunk, if any: ``0`` = chunking off, ``None`` = the
            device's default. The budget follows it.
        max_model_len: context cap (tokens): without chunking a step must hold a whole prompt.

    Raises:
        ValueError: an unknown ``usage``.
    """
    if usage not in USAGES:
        raise ValueError(f"usage must be one of {list(USAGES)}, got {usage!r}")
    cuda = device_type(device) == "cuda"
    seqs = max_num_seqs if max_num_seqs is not None else (256 if cuda else 8)
    if cuda:
        d_chunk, d_budget = _CUDA_STEP[usage]
    else:
        d_chunk = _CPU_SERVER_CHUNK if usage == "server" else None
        d_budget = None
    chunk = d_chunk if prefill_chunk_size is None else (prefill_chunk_size or None)
    if chunk is None:                       # whole prompts: a step must hold the longest
        budget = max(8192 if cuda else 4096, max_model_len)
    elif cuda:
        budget = max(d_budget, chunk)
    else:                                   # CPU: one chunk plus one decode token per sequence
        budget = chunk + seqs if usage == "server" else max(4096, max_model_len, chunk)
    return DeviceDefaults(dtype=default_dtype(device), attention_backend="triton" if cuda else "torch",
                          max_num_seqs=seqs, prefill_chunk_size=chunk, max_num_batched_tokens=budget)


# ------------------------------------------------------------------------------------------------
# argparse value types
# ------------------------------------------------------------------------------------------------
def int_at_least(lo: int):
    """An argparse ``type`` parsing an integer >= ``lo``.

    Returns: a function ``str -> int`` that raises ``argparse.ArgumentTypeError`` (argparse turns
    it into a usage error naming the flag) for a non-integer or a value below ``lo``.
    """
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {s}")
        return v
    parse.__name__ = f"integer>={lo}"
    return parse


def _chunk(s: str) -> int:
    """``--prefill-chunk-size``: tokens >= 1, or ``0``/``none``/``off`` (chunking off, as 0)."""
    if s.strip().lower() in ("0", "none", "off"):
        return 0
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, or 0/none/off, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, or 0/none/off, got {s}")
    return v


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {s!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {s}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {s!r}") from None
    if not 0.0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {s}")
    return v


def _flag(default: Any, *flags: str, help: str, **argparse_kw: Any) -> Any:
    """A dataclass field that is also a command-line flag (``flags[0]`` is the canonical name,
    the rest aliases); ``argparse_kw`` goes to ``add_argument``."""
    return field(default=default, metadata={"flags": flags, "help": help, "kw": argparse_kw})


_BOOL = {"action": argparse.BooleanOptionalAction}


@dataclass
class EngineArgs:
    """Every engine flag of the command line, one field each (``None``: the device default).

    The flag of a field is its name with dashes (``max_num_seqs`` -> ``--max-num-seqs``);
    old names stay as aliases (``--max-batch-size``, ``--paged-attention-backend``,
    ``--prefill-chunk``). See :func:`device_defaults` for what ``None`` resolves to.
    """

    model: str = _flag("tiny", "--model", help="'tiny' (the embedded random Qwen2), "
                       "'random:<preset>' (random weights of a real model's shapes), a local "
                       "checkpoint directory, or a hub id (default tiny)")
    device: str = _flag("cpu", "--device", help="cpu | cuda | cuda:N (default cpu)")
    dtype: str | None = _flag(None, "--dtype", help="float32 | float16 | bfloat16 (default: "
                              "float32 on a CPU, bfloat16 on CUDA)")
    seed: int | None = _flag(None, "--seed", type=int_at_least(0),
                             help="engine seed: random weights and unseeded sampling (default 0)")
    # ---- scheduler
    policy: str = _flag("fcfs", "--policy", choices=POLICIES, help="waiting-queue order (default fcfs)")
    max_num_seqs: int | None = _flag(None, "--max-num-seqs", "--max-batch-size", type=int_at_least(1),
                                     metavar="N", help="most sequences per step (default: 256 on "
                                     "CUDA, 8 on a CPU)")
    max_num_batched_tokens: int | None = _flag(
        None, "--max-num-batched-tokens", type=int_at_least(1), metavar="N",
        help="token budget of one step (default on CUDA: 8192 for generate/benchmark, 2048 for "
             "serve; on a CPU: one chunk plus one token per sequence for serve, else "
             "max(4096, --max-model-len); without chunking at least --max-model-len)")
    prefill_chunk_size: int | None = _flag(
        None, "--prefill-chunk-size", "--prefill-chunk", type=_chunk, metavar="N",
        help="most prompt tokens of one sequence per step; 0 = chunked prefill off (default on "
             "CUDA: 2048 for generate/benchmark, 512 for serve; on a CPU: 64 for serve, off "
             "otherwise)")
    max_model_len: int = _flag(4096, "--max-model-len", type=int_at_least(2),
                               help="most tokens (prompt + output) of one sequence (default 4096)")
    # ---- KV cache
    block_size: int = _flag(16, "--block-size", type=int_at_least(1), help="tokens per KV block (default 16)")
    num_blocks: int | None = _flag(None, "--num-blocks", type=int_at_least(1),
                                   help="KV blocks (default: from --gpu-memory-utilization of free "
                                        "memory on CUDA, 256 MiB on a CPU)")
    gpu_memory_utilization: float = _flag(0.85, "--gpu-memory-utilization", type=_fraction,
                                          help="fraction of free GPU memory the KV cache takes "
                                               "(default 0.85)")
    enable_prefix_caching: bool = _flag(True, "--enable-prefix-caching", **_BOOL,
                                        help="share the KV of equal prompt prefixes "
                                             "(--no-enable-prefix-caching or --no-prefix-caching: off; default on)")
    # ---- kernels and the fast path
    attention_backend: str | None = _flag(None, "--attention-backend", "--paged-attention-backend",
                                          choices=ATTENTION_BACKENDS,
                                          help="paged attention: triton (default on CUDA) or "
                                               "torch (the readable one; default on a CPU)")
    linear_backend: str = _flag("torch", "--linear-backend", choices=LINEAR_BACKENDS,
                                help="projections: torch (16-bit, default), int8/int4 (weight-only, "
                                     "reference), triton-int8 (fused kernel)")
    cuda_graph: bool | None = _flag(None, "--cuda-graph", **_BOOL,
                                    help="replay decode steps from CUDA graphs (CUDA with the Triton "
                                         "backend and the fused forward; default on, off with "
                                         "--tensor-parallel-size > 1)")
    async_scheduling: bool | None = _flag(None, "--async-scheduling", **_BOOL,
                                          help="launch step n+1 before reading step n's tokens "
                                               "(default: on CUDA, off on a CPU)")
    fused_forward: bool | None = _flag(None, "--fused-forward", **_BOOL,
                                       help="the fused forward (Triton kernels, packed projections) "
                                            "or the readable one (default: fused on CUDA)")
    mixed_graph_max_tokens: int = _flag(2048, "--mixed-graph-max-tokens", type=int_at_least(0),
                                        metavar="N",
                                        help="steps with prefill chunks of at most N tokens replay "
                                             "a CUDA graph captured for their token count (with "
                                             "--cuda-graph; 0: eager; default 2048)")
    pdl: bool = _flag(True, "--pdl", **_BOOL,
                      help="programmatic dependent launch of the fast-path kernels where the GPU "
                           "has it (default on)")
    int8_layout: str = _flag("row", "--int8-layout", choices=INT8_LAYOUTS,
                             help="Triton INT8 weights in the fused forward: row-major int8 or byte "
                                  "planes (default row)")
    batch_invariant: bool = _flag(False, "--batch-invariant", action="store_true",
                                  help="batch-invariant mode: a request's logits are bitwise the same "
                                       "whatever it is batched with (on CUDA: fixed-order Triton kernels; "
                                       "on a CPU: the readable path)")
    invariant_block_rows: int = _flag(16, "--invariant-block-rows", type=int_at_least(1), metavar="N",
                                      help="rows per fixed-shape matrix product in the batch-invariant "
                                           "mode (default 16)")
    # ---- parallelism
    tensor_parallel_size: int = _flag(1, "--tensor-parallel-size", "-tp", type=int_at_least(1),
                                      metavar="N", help="shard the model over N ranks of this host "
                                      "(one process a rank; GPUs cuda:0..N-1 with --device cuda; default 1)")
    distributed_timeout_s: float = _flag(300.0, "--distributed-timeout", type=_positive_float,
                                         metavar="SECONDS", help="with --tensor-parallel-size > 1: "
                                         "how long a rank waits on the others (default 300)")
    # ---- speculative decoding
    speculative_model: str | None = _flag(None, "--speculative-model", metavar="PATH|tiny",
                                          help="draft model for speculative decoding ('tiny', a "
                                               "checkpoint directory, a hub id, random:<preset>, or "
                                               "'target' to reuse the target's weights)")
    num_speculative_tokens: int = _flag(4, "--num-speculative-tokens", type=int_at_least(0),
                                        help="draft tokens proposed per step with --speculative-model "
                                             "(default 4)")

    # ---------------------------------------------------------------------------------------
    @classmethod
    def from_namespace(cls, ns: Any) -> "EngineArgs":
        """The fields found on ``ns`` (parsed flags or any object); missing ones keep their
        defaults."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
                      if hasattr(ns, f.name)})

    def resolved(self, usage: str = "offline") -> DeviceDefaults:
        """This configuration's device-dependent values (explicit fields, else the defaults)."""
        d = device_defaults(self.device, usage, max_num_seqs=self.max_num_seqs,
                            prefill_chunk_size=self.prefill_chunk_size, max_model_len=self.max_model_len)
        return DeviceDefaults(
            dtype=default_dtype(self.device, self.dtype),
            attention_backend=self.attention_backend or d.attention_backend,
            max_num_seqs=d.max_num_seqs, prefill_chunk_size=d.prefill_chunk_size,
            max_num_batched_tokens=self.max_num_batched_tokens or d.max_num_batched_tokens)

    def create_engine_config(self, usage: str = "offline", *, mode: str = "continuous",
                             seed: int | None = None, max_num_seqs: int | None = None) -> EngineConfig:
        """The :class:`~llmserve.config.EngineConfig` these flags name on their device.

        Args:
            usage: ``"offline"`` or ``"server"`` (the step budget's defaults).
            mode: scheduler mode, ``continuous`` or ``static``.
            seed: overrides :attr:`seed` (the benchmark's workload seed).
            max_num_seqs: overrides :attr:`max_num_seqs` (the benchmark's batch-1 configurations).

        Raises:
            ValueError: an invalid value, naming the field (from the config dataclasses).
        """
        args = self if max_num_seqs is None else dataclasses.replace(self, max_num_seqs=max_num_seqs)
        r = args.resolved(usage)
        graphs = self.cuda_graph if self.cuda_graph is not None else self.tensor_parallel_size == 1
        return EngineConfig(
            model=self.model, device=self.device, dtype=r.dtype,
            seed=int(self.seed or 0) if seed is None else int(seed),
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=bool(self.enable_prefix_caching)),
            scheduler=SchedulerConfig(mode=mode, policy=self.policy, max_num_seqs=r.max_num_seqs,
                                      max_num_batched_tokens=r.max_num_batched_tokens,
                                      prefill_chunk_size=r.prefill_chunk_size,
                                      max_model_len=self.max_model_len),
            attention_backend=r.attention_backend, linear_backend=self.linear_backend,
            use_cuda_graph=graphs, async_scheduling=self.async_scheduling,
            fast_path=FastPathConfig(fused_forward=self.fused_forward, pdl=self.pdl,
                                     int8_layout=self.int8_layout,
                                     mixed_graph_max_tokens=self.mixed_graph_max_tokens,
                                     invariant_block_rows=self.invariant_block_rows),
            batch_invariant=bool(self.batch_invariant), tensor_parallel_size=self.tensor_parallel_size,
            distributed_timeout_s=self.distributed_timeout_s)


#: Fields a command may leave out of its flags (it sets them itself).
_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def add_engine_args(parser: argparse.ArgumentParser | Any, *, exclude: tuple[str, ...] = (),
                    only: tuple[str, ...] | None = None,
                    help_overrides: dict[str, str] | None = None) -> None:
    """Add every :class:`EngineArgs` field as a flag to ``parser`` (or an argument group).

    Args:
        parser: an ``ArgumentParser`` or argument group.
        exclude: field names the command defines itself (e.g. ``seed`` in ``benchmark``).
        only: add just these fields (a command that builds its engine around a prepared model).
        help_overrides: field name -> help text where a command's default differs.

    Raises:
        ValueError: an unknown field name in ``exclude``, ``only`` or ``help_overrides``.
    """
    unknown = [n for n in (*exclude, *(only or ()), *(help_overrides or {})) if n not in _FIELDS]
    if unknown:
        raise ValueError(f"unknown engine fields {unknown}; known: {sorted(_FIELDS)}")
    for name, f in _FIELDS.items():
        if name in exclude or (only is not None and name not in only):
            continue
        meta = f.metadata
        kw = dict(meta["kw"])
        helptext = (help_overrides or {}).get(name, meta["help"])
        parser.add_argument(*meta["flags"], dest=name, default=f.default, help=helptext, **kw)
        if name == "enable_prefix_caching":     # the short 'off' spelling, kept for old commands
            parser.add_argument("--no-prefix-caching", dest=name, action="store_false",
                                help=argparse.SUPPRESS)


def describe_config(config: EngineConfig) -> str:
    """One line naming what an :class:`~llmserve.config.EngineConfig` runs: device, dtype,
    backends, batch, step budget, KV geometry (logged once by ``serve`` at start)."""
    s, c, fp = config.scheduler, config.cache, config.fast_path
    cuda = device_type(config.device) == "cuda"
    fused = fp.fused_forward if fp.fused_forward is not None else cuda
    graphs = bool(config.use_cuda_graph and cuda and config.attention_backend == "triton" and fused
                  and config.tensor_parallel_size == 1)
    async_ = config.async_scheduling if config.async_scheduling is not None else cuda
    chunk = s.prefill_chunk_size if s.prefill_chunk_size else "off"
    blocks = c.num_blocks if c.num_blocks else (
        f"from {c.gpu_memory_utilization:.0%} of free memory" if device_type(config.device) == "cuda"
        else "from the CPU budget")
    return (f"device={config.device} dtype={config.dtype} attention={config.attention_backend} "
            f"linear={config.linear_backend} forward={'fused' if fused else 'readable'} cuda_graph={graphs} "
            f"mixed_graph_max_tokens={min(fp.mixed_graph_max_tokens, s.max_num_batched_tokens) if graphs else 0} "
            f"async_scheduling={async_} "
            f"mode={s.mode} policy={s.policy} max_num_seqs={s.max_num_seqs} "
            f"max_num_batched_tokens={s.max_num_batched_tokens} prefill_chunk={chunk} "
            f"max_model_len={s.max_model_len} block_size={c.block_size} kv_blocks={blocks} "
            f"prefix_caching={c.enable_prefix_caching} batch_invariant={config.batch_invariant} "
            f"tensor_parallel_size={config.tensor_parallel_size}")
