"""Checkpoint resolution and loading: ``tiny`` | local directory | Hugging Face hub id.

A checkpoint is a directory in the Hugging Face layout: ``config.json`` plus weights in
safetensors, either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (the ``weight_map`` format ``transformers`` writes). Weights
are read with the ``safetensors`` library directly onto the target device and cast to the
target dtype; no ``transformers`` model code runs. Every tensor is checked against the model
built from ``config.json`` before anything is loaded, and all problems (missing, unexpected,
mis-shaped tensors) are reported together, by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig, resolve_dtype
from .parallel import ShardPlan, TensorParallelGroup, shard_spec
from .qwen2 import Qwen2ForCausalLM

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some exporters write that carry no weights we need (recomputed from the config).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".rotary_emb.original_inv_freq")
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def _hf_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set truthy (read at call time, not import time)."""
    from ..envs import hf_hub_offline
    if hf_hub_offline():
        return True
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - very old huggingface_hub
        return False


def _hub_cache_dir() -> str:
    try:
        from huggingface_hub import constants
        return str(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover
        return os.path.expanduser("~/.cache/huggingface/hub")


def _looks_like_path(name: str) -> bool:
    return (os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name
            or name.count("/") > 1 or name.endswith("/"))


def resolve_model_path(name: str | os.PathLike) -> Path:
    """Turn a model name into a local checkpoint directory.

    Args:
        name: ``"tiny"`` (the embedded random model, written on first use by
            :func:`llmserve.models.tiny.ensure_tiny_checkpoint`), an existing local directory,
            or a Hugging Face hub id such as ``"Qwen/Qwen2.5-1.5B"`` (taken from the hub cache,
            else downloaded with ``huggingface_hub.snapshot_download`` unless
            ``HF_HUB_OFFLINE=1``).

    Returns:
        The absolute directory path.

    Raises:
        FileNotFoundError: a path-like name that does not exist, a file instead of a
            directory, or a hub id neither cached nor downloadable; the message names the id,
            the cache directory tried and the ``HF_HUB_OFFLINE`` setting.
    """
    name_str = os.fspath(name)
    if name_str == "tiny":
        from .tiny import ensure_tiny_checkpoint
        return ensure_tiny_checkpoint()
    p = Path(name_str).expanduser()
    if p.is_dir():
        return p.resolve()
    if p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} is a file; expected a checkpoint directory "
                                f"with {CONFIG_FILE} and safetensors weights")
    if isinstance(name, os.PathLike) or _looks_like_path(name_str) or not _HUB_ID.match(name_str):
        raise FileNotFoundError(
            f"model path {str(p.absolute())!r} does not exist; pass 'tiny', an existing checkpoint "
            f"directory, or a Hugging Face hub id like 'Qwen/Qwen2.5-1.5B'")
    return _resolve_hub_id(name_str)


def _resolve_hub_id(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise FileNotFoundError(f"{repo_id!r} is not a local directory and huggingface_hub is not "
                                f"installed to fetch it from the hub: {e}") from e
    cache = _hub_cache_dir()
    offline = _hf_offline()
    try:  # the cache first: no network round trip when the snapshot is already there
        return Path(snapshot_download(repo_id, local_files_only=True,
                                      allow_patterns=HUB_ALLOW_PATTERNS)).resolve()
    except Exception as cache_err:
        if offline:
            raise FileNotFoundError(
                f"model {repo_id!r} is not a local directory ({str(Path(repo_id).absolute())!r} does "
                f"not exist) and is not in the Hugging Face hub cache ({cache}); HF_HUB_OFFLINE=1 "
                f"forbids downloading it. Download it once online (unset HF_HUB_OFFLINE), copy a "
                f"snapshot into the cache, or pass a local checkpoint directory. "
                f"({type(cache_err).__name__}: {cache_err})") from cache_err
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS)).resolve()
    except Exception as e:
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local directory ({str(Path(repo_id).absolute())!r} does not "
            f"exist), is not in the Hugging Face hub cache ({cache}) and could not be downloaded "
            f"(HF_HUB_OFFLINE is not set): {type(e).__name__}: {e}. Check the id and your network, "
            f"or pass a local checkpoint directory.") from e


def read_model_config(path: Path) -> ModelConfig:
    """Parse ``path/config.json`` into a :class:`ModelConfig`.

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        ValueError: unsupported architecture (lists the supported ones) or a missing key.
    """
    cfg_file = Path(path) / CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(cfg_file)!r} not found: a checkpoint directory needs "
                                f"{CONFIG_FILE} and {SINGLE_FILE} (or {INDEX_FILE} + shards)")
    with open(cfg_file, encoding="utf-8") as f:
        return ModelConfig.from_hf_dict(json.load(f))


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by ``model.safetensors.index.json``,
    else ``model.safetensors``, else every ``*.safetensors`` in the directory (sorted).

    Raises:
        FileNotFoundError: no safetensors weights, or a shard named by the index is missing.
    """
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({path / v for v in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {str(path)!r} names shards that do not exist: {missing}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" (found {others}: only safetensors is supported; re-save with safe_serialization=True)" \
        if others else ""
    raise FileNotFoundError(f"no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}) in {str(path)!r}{hint}")


def checkpoint_tensor_index(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Map tensor name -> (file, shape, safetensors dtype string) without reading the data."""
    from safetensors import safe_open
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (file, tuple(sl.get_shape()), str(sl.get_dtype()))
    return out


def expected_tensor_shapes(model: nn.Module, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes the checkpoint must provide (``lm_head.weight`` is not
    required when the embeddings are tied)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers(remove_duplicate=False)})
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _fmt_names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def validate_checkpoint(path: Path, available: dict[str, tuple[Path, tuple[int, ...], str]],
                        expected: dict[str, tuple[int, ...]], config: ModelConfig) -> None:
    """Compare checkpoint tensors with the model's parameters.

    Raises:
        ValueError: listing every missing, unexpected and mis-shaped tensor by name (with the
            checkpoint and expected shapes).
    """
    def ignorable(name: str) -> bool:
        return name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")

    missing = sorted(n for n in expected if n not in available)
    unexpected = sorted(n for n in available if n not in expected and not ignorable(n))
    bad_shape = sorted(f"{n}: checkpoint {list(available[n][1])} vs expected {list(s)}"
                       for n, s in expected.items() if n in available and available[n][1] != s)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_fmt_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_fmt_names(unexpected)}")
    if bad_shape:
        problems.append(f"tensors with the wrong shape ({len(bad_shape)}): {_fmt_names(bad_shape)}")
    if problems:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match its config.json (Qwen2, "
            f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, "
            f"tie_word_embeddings={config.tie_word_embeddings}): " + "; ".join(problems))


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix) if prefix else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:  # pragma: no cover - names come from named_parameters/named_buffers
        raise AssertionError(f"no parameter or buffer {name}")


def _normalize_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def model_config_of(name: str | os.PathLike) -> tuple[ModelConfig, Path | None]:
    """The :class:`ModelConfig` a model name refers to and its checkpoint directory (None for
    ``random:<preset>``), without loading weights.

    Raises:
        FileNotFoundError / ValueError: as :func:`resolve_model_path` and :func:`read_model_config`.
    """
    if isinstance(name, str) and name.startswith("random:"):
        from .presets import preset_config
        return preset_config(name), None
    path = resolve_model_path(name)
    return read_model_config(path), path


def _read_shard(f, name: str, plan: ShardPlan | None, head_dim: int) -> torch.Tensor:
    """Tensor ``name`` of the open safetensors file ``f``: whole, or this rank's slice of it
    (:func:`~llmserve.models.parallel.shard_spec`), zero-padded where the plan pads."""
    spec = shard_spec(name, plan, head_dim) if plan is not None and plan.size > 1 else None
    if spec is None:
        return f.get_tensor(name)
    dim, start, count, length = spec
    sl = f.get_slice(name)
    t = sl[start:start + count] if dim == 0 else sl[:, start:start + count]
    if length > count:                     # vocabulary padding rows (zero)
        pad = list(t.shape)
        pad[dim] = length - count
        t = torch.cat([t, torch.zeros(pad, dtype=t.dtype, device=t.device)], dim=dim)
    return t


def load_model(name: str | os.PathLike = "tiny", device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "float32", attention_backend=None,
               tp: TensorParallelGroup | None = None
               ) -> tuple[Qwen2ForCausalLM, ModelConfig, Path]:
    """Build a :class:`Qwen2ForCausalLM` and load its checkpoint.

    Args:
        name: ``"tiny"`` | local checkpoint directory | hub id (see :func:`resolve_model_path`).
        device: ``"cpu"`` | ``"cuda"`` | ``"cuda:N"``; weights are read straight onto it.
        dtype: compute dtype (``float32``/``float16``/``bfloat16`` or aliases); checkpoint
            tensors of another dtype are cast on the device.
        attention_backend: backend object or name (``"torch"`` default, ``"triton"``).
        tp: this rank's tensor-parallel group (None: one rank). The checkpoint is checked
            against the full model's shapes, then only this rank's slice of each sharded
            tensor is read (:func:`~llmserve.models.parallel.shard_spec`); names stay the HF
            ones.

    Returns:
        ``(model, config, path)``: the model in eval mode with ``requires_grad=False`` weights,
        its :class:`ModelConfig`, and the resolved checkpoint directory.

    Raises:
        FileNotFoundError: unknown path / hub id, no ``config.json`` or no safetensors weights.
        ValueError: unsupported architecture, or missing/unexpected/mis-shaped tensors (all
            named in one message), or an unknown dtype.
    """
    from safetensors import safe_open

    torch_dtype = resolve_dtype(dtype)
    if isinstance(name, str) and name.startswith("random:"):
        return load_random_model(name, device, torch_dtype, attention_backend, tp=tp)
    path = resolve_model_path(name)
    config = read_model_config(path)
    files = checkpoint_files(path)
    available = checkpoint_tensor_index(files)

    sharded = tp is not None and tp.size > 1
    with torch.device("meta"):  # no memory is allocated for the random init
        model = Qwen2ForCausalLM(config, attention_backend=attention_backend, tp=tp)
        full = Qwen2ForCausalLM(config) if sharded else model
    expected = expected_tensor_shapes(model, config)
    validate_checkpoint(path, available, expected_tensor_shapes(full, config), config)
    del full

    dev = _normalize_device(device)
    by_file: dict[Path, list[str]] = {}
    for n in expected:
        by_file.setdefault(available[n][0], []).append(n)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device=str(dev)) as f:
            for n in names:
                t = _read_shard(f, n, tp.plan if sharded else None, config.head_dim)
                if not t.is_floating_point():
                    raise ValueError(f"checkpoint tensor {n} in {str(file)!r} has dtype {t.dtype}; "
                                     f"expected a floating-point tensor")
                _set_tensor(model, n, t.to(torch_dtype))
    model.tie_weights()
    model.rope_cos_sin(dev)  # build the RoPE tables now (not lazily inside a CUDA graph capture)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    assert not leftover, f"parameters left uninitialised: {leftover}"
    model.eval()
    return model, config, path


def load_random_model(name: str, device: str | torch.device = "cpu",
                      dtype: str | torch.dtype = "bfloat16", attention_backend=None,
                      seed: int = 0, tp: TensorParallelGroup | None = None
                      ) -> tuple[Qwen2ForCausalLM, ModelConfig, None]:
    """A model with the exact shapes of a published Qwen2.5 checkpoint and random weights
    (``random:qwen2.5-0.5b|1.5b|3b|7b``), built directly on ``device``: for performance runs
    where no checkpoint can be downloaded (speed does not depend on weight values).

    Weights are N(0, 0.02) (the ``initializer_range`` of Qwen2 configs), norms are ones.
    Returns ``(model, config, None)``: there is no checkpoint directory, so the built-in
    tokenizer is used. With a tensor-parallel ``tp`` each rank draws its own shards (seed
    ``seed + rank``), so the weights differ from the one-rank model's.

    Raises:
        ValueError: unknown preset (lists the known ones).
    """
    from .presets import preset_config

    config = preset_config(name)
    dev = _normalize_device(device)
    torch.manual_seed(seed + (tp.rank if tp is not None else 0))
    with torch.device(dev):
        model = Qwen2ForCausalLM(config, attention_backend=attention_backend, tp=tp).to(resolve_dtype(dtype))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("layernorm.weight") or pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.tie_weights()
    model.rope_cos_sin(dev)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model, config, None


def save_checkpoint(model: nn.Module, config: ModelConfig, path: str | os.PathLike,
                    extra_config: dict[str, Any] | None = None,
                    metadata: dict[str, str] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (HF layout) for ``model``.

    Args:
        model: any module whose ``state_dict`` uses the HF names (a quantized model's extra
            tensors are written as they are).
        config: written via :meth:`ModelConfig.to_hf_dict`; ``torch_dtype``/``dtype`` record
            the dtype of the embedding weights.
        path: directory, created if needed; existing files of the same names are replaced.
        extra_config: keys merged into ``config.json`` (e.g. a quantization record).
        metadata: string key/values stored in the safetensors header.

    Returns:
        The directory path. ``lm_head.weight`` is omitted when the embeddings are tied
        (as ``transformers`` does).
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    emb = state.get("model.embed_tokens.weight")
    if emb is not None and emb.is_floating_point():
        config = dataclasses.replace(config, torch_dtype=str(emb.dtype).replace("torch.", ""))
    cfg = config.to_hf_dict()
    cfg["dtype"] = cfg["torch_dtype"]  # transformers 5.x key
    if extra_config:
        cfg.update(extra_config)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt", **(metadata or {})})
    with open(out / CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return out
