"""The offline transform: quantize a state dict or swap a model's projections for quantized
layers, with the scheme recorded in metadata (never guessed from a path).
"""

from __future__ import annotations
import copy
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any
import torch
from torch import nn
from .schemes import (
    DEFAULT_INCLUDE,
    FORMAT_VERSION,
    INT4_QMAX,
    INT8_QMAX,
    QUANT_METHOD,
    SCHEMES,
    _check_group_size,
    _check_scheme,
    quantize_int4,
    quantize_int8,
    weight_absmax,
)
from .layers import Int4Linear, QUANTIZED_LAYERS


def quantization_metadata(scheme: str, group_size: int | None, modules: Iterable[str]) -> dict[str, Any]:
    """The JSON-serialisable record of a quantization (stored on the model as
    ``model.quantization_config``, in safetensors metadata and in ``config.json``)."""
    _check_scheme(scheme)
    is4 = scheme == "int4"
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "scheme": scheme,
        "weight_format": "int4" if is4 else "int8",
        "bits": 4 if is4 else 8,
        "symmetric": True,
        "zero_point": False,
        "int_range": [-INT4_QMAX, INT4_QMAX] if is4 else [-INT8_QMAX, INT8_QMAX],
        "granularity": ("group" if group_size is not None else "per-output-channel"),
        "group_size": group_size,
        "last_group": "shorter when in_features % group_size != 0 (no padding stored)" if is4 else None,
        "packing": ("two signed 4-bit two's-complement values per uint8 along in_features; "
                    "column 2j in the low nibble, 2j+1 in the high nibble; odd in_features "
                    "leaves the last high nibble 0") if is4 else None,
        "tensors": (["weight_packed uint8 [N, ceil(K/2)]", "weight_scale float32 [N, G]"] if is4
                    else ["weight int8 [N, K]", "weight_scale float32 [N]"]),
        "scale_dtype": "float32",
        "rounding": "round-to-nearest-even (torch.round); not GPTQ/AWQ",
        "activations": "not quantized (model dtype)",
        "modules": sorted(modules),
        "not_quantized": "everything else (embed_tokens, lm_head, norms) keeps the model dtype",
    }


def _selector(include: str | Iterable[str] | None):
    """Return ``(match(name) -> bool, names_or_None)``."""
    if include is None:
        include = DEFAULT_INCLUDE
    if isinstance(include, str):
        pattern = re.compile(include)
        return (lambda name: pattern.fullmatch(name) is not None), None
    names = list(include)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise ValueError(f"include must be a regex string or a list of module names, got {bad!r}")
    wanted = set(names)
    return (lambda name: name in wanted), wanted


def _describe_include(include) -> str:
    return repr(DEFAULT_INCLUDE if include is None else include)


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], scheme: str,
                        modules: str | Iterable[str] | None = None,
                        group_size: int | None = None
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Quantize the weights of selected linear layers in a (HF-named) state dict.

    Args:
        state_dict: ``name -> tensor``; a linear layer ``X`` is recognised by a 2-D ``X.weight``.
        scheme: ``int8`` | ``int4`` | ``triton-int8`` (``triton-int8`` stores like ``int8``).
        modules: regex (``re.fullmatch`` on the module name ``X``) or list of module names;
            ``None`` means :data:`DEFAULT_INCLUDE` (decoder-layer projections only).
        group_size: int4 only; ``None`` = per output channel.

    Returns:
        ``(qstate, metadata)``: ``qstate`` has, for every selected ``X``, ``X.weight`` (int8) and
        ``X.weight_scale`` (int8 schemes) or ``X.weight_packed`` and ``X.weight_scale`` (int4) in
        place of the float ``X.weight``; every other entry (biases included) is passed through
        unchanged. ``metadata`` is :func:`quantization_metadata`. The keys equal
        ``quantize_model(...).state_dict()`` for the same selection.

    Raises:
        ValueError: unknown scheme, bad group size, no module selected, or a listed module that
            has no 2-D ``.weight`` in the state dict.
    """
    _check_scheme(scheme)
    _check_group_size(scheme, group_size)
    match, names = _selector(modules)
    selected = [k[: -len(".weight")] for k, v in state_dict.items()
                if k.endswith(".weight") and v.dim() == 2 and match(k[: -len(".weight")])]
    if names is not None:
        missing = sorted(set(names) - set(selected))
        if missing:
            raise ValueError(f"modules {missing} have no 2-D '.weight' in the state dict")
    if not selected:
        raise ValueError(f"no linear weight matched modules={_describe_include(modules)}; "
                         "names look like 'model.layers.0.self_attn.q_proj'")
    chosen = set(selected)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        mod = key[: -len(".weight")] if key.endswith(".weight") else None
        if mod in chosen:
            if scheme == "int4":
                packed, scale = quantize_int4(value, group_size)
                out[f"{mod}.weight_packed"] = packed
                out[f"{mod}.weight_scale"] = scale
            else:
                q, scale = quantize_int8(value)
                out[f"{mod}.weight"] = q
                out[f"{mod}.weight_scale"] = scale
        else:
            out[key] = value
    return out, quantization_metadata(scheme, group_size, selected)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _empty_quantized_layer(scheme: str, linear_like: nn.Module, group_size: int | None,
                           dtype: torch.dtype) -> nn.Module:
    cls = QUANTIZED_LAYERS[scheme]
    kwargs: dict[str, Any] = {"bias": getattr(linear_like, "bias", None) is not None,
                              "dtype": dtype, "device": linear_like.weight.device}
    if scheme == "int4":
        kwargs["group_size"] = group_size
    return cls(linear_like.in_features, linear_like.out_features, **kwargs)


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str, group_size: int | None = None,
                   include: str | Iterable[str] | None = None,
                   row_absmax: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """Swap selected ``nn.Linear`` modules for quantized layers, in place.

    Args:
        model: e.g. ``Qwen2ForCausalLM`` (HF module names).
        scheme: ``int8`` (:class:`Int8Linear`), ``int4`` (:class:`Int4Linear`) or
            ``triton-int8`` (:class:`TritonInt8Linear`).
        group_size: int4 only (``None`` = per output channel).
        include: regex (``re.fullmatch`` on module names) or list of module names; ``None`` =
            :data:`DEFAULT_INCLUDE` (the seven projections of every decoder layer; embeddings,
            ``lm_head`` and norms stay 16-bit).
        row_absmax: ``(module name, absmax) -> absmax``: called with each selected module's
            own scaling statistic (:func:`~llmserve.quant.schemes.weight_absmax`) and returning
            the one to quantize by; a tensor-parallel model passes the maximum over the shards
            of a row-parallel projection, so each shard quantizes as the whole weight would.

    Returns:
        The same ``model`` object, with ``model.quantization_config`` set to the metadata dict
        (:func:`quantization_metadata`).

    Raises:
        ValueError: unknown scheme, bad group size, model already quantized, a selected module
            that is not an ``nn.Linear``, a listed name that does not exist, or nothing selected.
    """
    _check_scheme(scheme)
    _check_group_size(scheme, group_size)
    existing = getattr(model, "quantization_config", None)
    if existing:
        raise ValueError(f"model is already quantized with scheme {existing.get('scheme')!r}; "
                         "quantize a fresh 16-bit model")
    match, names = _selector(include)
    targets = [(n, m) for n, m in model.named_modules() if n and match(n)]
    if names is not None:
        missing = sorted(set(names) - {n for n, _ in targets})
        if missing:
            raise ValueError(f"modules {missing} do not exist in the model")
    if not targets:
        raise ValueError(f"no module matched include={_describe_include(include)}; "
                         "names look like 'model.layers.0.self_attn.q_proj'")
    not_linear = [f"{n} ({type(m).__name__})" for n, m in targets if type(m) is not nn.Linear]
    if not_linear:
        raise ValueError(f"only nn.Linear modules can be quantized; selected {not_linear}")
    for name, linear in targets:
        absmax = None
        if row_absmax is not None:
            absmax = row_absmax(name, weight_absmax(linear.weight, scheme, group_size))
        if scheme == "int4":
            new = Int4Linear.from_linear(linear, group_size, absmax)
        else:
            new = QUANTIZED_LAYERS[scheme].from_linear(linear, absmax)
        _set_submodule(model, name, new)
    model.quantization_config = quantization_metadata(scheme, group_size, [n for n, _ in targets])
    return model


def quantized_copy(model: nn.Module, scheme: str, group_size: int | None = None,
                   include: str | Iterable[str] | None = None) -> nn.Module:
    """A quantized copy of ``model`` that leaves ``model`` untouched and shares every tensor
    that is not quantized (embeddings, norms, ``lm_head``) with it, so a 16-bit baseline and a
    quantized model can be compared side by side for the price of the quantized weights only."""
    memo: dict[int, Any] = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    clone = copy.deepcopy(model, memo)
    if hasattr(clone, "quantization_config") and clone.quantization_config is getattr(
            model, "quantization_config", None) and clone.quantization_config is not None:
        clone.quantization_config = copy.deepcopy(clone.quantization_config)
    return quantize_model(clone, scheme, group_size=group_size, include=include)


def apply_linear_backend(model: nn.Module, backend: str, group_size: int | None = None,
                         include: str | Iterable[str] | None = None) -> nn.Module:
    """Engine helper: ``backend`` is ``EngineConfig.linear_backend``; ``torch`` leaves the
    model unchanged, the others call :func:`quantize_model`.

    Raises:
        ValueError: unknown backend (lists ``torch`` and :data:`SCHEMES`).
    """
    if backend == "torch":
        return model
    if backend not in SCHEMES:
        raise ValueError(f"unknown linear backend {backend!r}; supported: {['torch', *SCHEMES]}")
    return quantize_model(model, backend, group_size=group_size, include=include)


def _tensor_key(t: torch.Tensor):
    if t.device.type == "meta" or t.numel() == 0:
        return ("id", id(t))
    return (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def model_nbytes(model: nn.Module, include_non_persistent: bool = False) -> int:
    """Exact bytes of the tensors a model stores: parameters plus persistent buffers.

    Each distinct tensor is counted once (tied weights such as a shared ``lm_head`` /
    ``embed_tokens`` count once), as ``numel * element_size``. Non-persistent buffers (e.g. RoPE
    cos/sin tables recomputed at load, which are not in a checkpoint) are excluded unless
    ``include_non_persistent=True`` (then the result is the resident size of all tensors).

    Returns:
        bytes (int).
    """
    seen: set = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None:
            return
        key = _tensor_key(t)
        if key in seen:
            return
        seen.add(key)
        total += t.numel() * t.element_size()

    for p in model.parameters():                       # deduplicated by identity
        add(p)
    for module in model.modules():
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        for name, b in module._buffers.items():
            if b is None or (name in non_persistent and not include_non_persistent):
                continue
            add(b)
    return total
