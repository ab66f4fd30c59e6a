"""Quantized checkpoints: safetensors weights with the scheme in the header and in
``config.json["quantization_config"]``.
"""

from __future__ import annotations
import json
from pathlib import Path
from typing import Any
import torch
from torch import nn
from .schemes import QUANT_METHOD
from .transform import _empty_quantized_layer, _set_submodule, _tensor_key


QUANTIZED_WEIGHTS_NAME = "model.safetensors"


def save_quantized(model: nn.Module, out_dir: str | Path,
                   hf_config: dict[str, Any] | None = None) -> Path:
    """Write a quantized model as ``out_dir/model.safetensors`` + ``out_dir/config.json``.

    The quantization metadata (``model.quantization_config``) goes into the safetensors header
    under ``"quantization_config"`` (a JSON string) and into ``config.json`` as
    ``"quantization_config"``. Tensors sharing storage (tied ``lm_head``) are written once.

    Args:
        hf_config: the model's ``config.json`` dict; default ``model.config.to_hf_dict()``.

    Raises:
        ValueError: the model is not quantized, or no config dict is available.
    """
    from safetensors.torch import save_file

    meta = getattr(model, "quantization_config", None)
    if not meta:
        raise ValueError("model has no quantization_config; call quantize_model first")
    if hf_config is None:
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "to_hf_dict"):
            raise ValueError("pass hf_config (the config.json dict): the model has no "
                             "config.to_hf_dict()")
        hf_config = cfg.to_hf_dict()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[Any, str] = {}
    tied: dict[str, str] = {}
    for name, t in model.state_dict().items():
        key = _tensor_key(t)
        if key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    header = {"format": "pt", "quantization_config": json.dumps(meta, sort_keys=True),
              "tied_tensors": json.dumps(tied, sort_keys=True)}
    save_file(tensors, str(out / QUANTIZED_WEIGHTS_NAME), metadata=header)
    config = dict(hf_config)
    config["quantization_config"] = meta
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def read_quantization_config(path: str | Path) -> dict[str, Any]:
    """The recorded quantization metadata of a checkpoint directory (``config.json``), checked
    against the safetensors header when that has one.

    Raises:
        ValueError: no ``quantization_config`` recorded, an unknown method, or the two records
            disagree.
    """
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    meta = cfg.get("quantization_config")
    if not meta:
        raise ValueError(f"{path}/config.json has no quantization_config: not a quantized "
                         "llmserve checkpoint (the scheme is never guessed from a file name)")
    if meta.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"unsupported quant_method {meta.get('quant_method')!r}; "
                         f"supported: [{QUANT_METHOD!r}]")
    st = path / QUANTIZED_WEIGHTS_NAME
    if st.exists():
        from safetensors import safe_open

        with safe_open(str(st), framework="pt") as f:
            header = (f.metadata() or {}).get("quantization_config")
        if header is not None and json.loads(header) != meta:
            raise ValueError(f"{st} header and config.json disagree about quantization_config")
    return meta


def load_quantized(path: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype | str | None = None, scheme: str | None = None) -> nn.Module:
    """Load a checkpoint written by :func:`save_quantized` into ``Qwen2ForCausalLM``.

    The scheme comes from the recorded ``quantization_config``. ``scheme`` may only switch
    between the two layouts of the same storage (``int8`` <-> ``triton-int8``).

    Args:
        dtype: compute dtype of the unquantized tensors; default ``config.json`` ``torch_dtype``.

    Returns:
        The model on ``device`` with ``model.quantization_config`` set.

    Raises:
        ValueError: see :func:`read_quantization_config`; an incompatible ``scheme``;
            unexpected or missing tensors.
    """
    from safetensors.torch import load_file

    from ..config import ModelConfig, resolve_dtype
    from ..models.qwen2 import Qwen2ForCausalLM

    path = Path(path)
    meta = read_quantization_config(path)
    recorded = meta["scheme"]
    if scheme is not None and scheme != recorded:
        if {scheme, recorded} != {"int8", "triton-int8"}:
            raise ValueError(f"checkpoint is quantized with {recorded!r}; it cannot be loaded "
                             f"as {scheme!r} (only int8 <-> triton-int8 share storage)")
        meta = dict(meta, scheme=scheme)
    cfg = json.loads((path / "config.json").read_text())
    mc = ModelConfig.from_hf_dict(cfg)
    torch_dtype = resolve_dtype(dtype if dtype is not None else mc.torch_dtype)
    with torch.device("meta"):                       # no memory for a throw-away random init
        model = Qwen2ForCausalLM(mc)
        for name in meta["modules"]:
            linear = model.get_submodule(name)
            _set_submodule(model, name, _empty_quantized_layer(meta["scheme"], linear,
                                                               meta.get("group_size"), torch_dtype))
    dev = torch.device(device)
    state = load_file(str(path / QUANTIZED_WEIGHTS_NAME), device=str(dev))
    state = {k: (v if not v.is_floating_point() or k.endswith("weight_scale") else v.to(torch_dtype))
             for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    from safetensors import safe_open

    with safe_open(str(path / QUANTIZED_WEIGHTS_NAME), framework="pt") as f:
        tied = json.loads((f.metadata() or {}).get("tied_tensors", "{}"))
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, "
                         f"unexpected {result.unexpected_keys}")
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise ValueError(f"checkpoint leaves tensors uninitialised: {leftover}")
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    model.quantization_config = meta
    return model
