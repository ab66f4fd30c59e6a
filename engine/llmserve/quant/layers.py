"""Quantized linear layers: ``Int8Linear`` and ``Int4Linear`` (dequantize, then the PyTorch linear)
and ``TritonInt8Linear`` (the fused Triton INT8 kernel, int8 tiles dequantized in registers).
"""

from __future__ import annotations
import torch
import torch.nn.functional as F
from torch import nn
from .schemes import (
    SCALE_DTYPE,
    _check_group_size,
    _num_groups,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)
from ..envs import triton_interpret
from ..kernels.int8_layout import pack_int8_fragments, pack_int8_planes, unpack_int8_planes


class Int8Linear(nn.Module):
    """Reference weight-only INT8 linear: dequantize the whole weight, then ``F.linear``.

    Buffers (so ``state_dict`` names match :func:`quantize_state_dict`):
        ``weight`` ``int8 [out_features, in_features]``, ``weight_scale`` ``float32 [out_features]``,
        ``bias`` ``[out_features]`` in the model dtype, or absent.

    ``forward(x [..., in_features]) -> [..., out_features]`` in ``x.dtype``. The dequantized
    weight is materialised per call (memory and time cost of the reference path).
    """

    scheme = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                   device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, dtype=SCALE_DTYPE, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, absmax: torch.Tensor | None = None) -> Int8Linear:
        """Quantize an ``nn.Linear`` (its weight dtype becomes the bias/compute dtype);
        ``absmax`` ``[out_features]``: see :func:`~llmserve.quant.schemes.quantize_int8`."""
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                device=w.device, dtype=w.dtype)
        q, s = quantize_int8(w, absmax)
        m.weight.copy_(q)
        m.weight_scale.copy_(s)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out_features, in_features]`` in ``dtype``."""
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.scheme}")


class TritonInt8Linear(Int8Linear):
    """INT8 linear backed by the fused Triton kernel (same storage as :class:`Int8Linear`;
    the fused serving forward may re-point ``weight`` at int8 byte planes, int32
    ``[out_features, in_features / 4]`` (see :attr:`planes`), while ``state_dict`` and
    ``load_state_dict`` keep the row-major int8 checkpoint format). The fused forward may also
    give it :attr:`fragments`, a view of its rows in an MMA-fragment copy of the weight
    (``FastPathConfig.int8_fragments``); ``load_state_dict`` repacks that copy in place too.

    ``forward`` flattens ``x [..., K]`` to ``[M, K]`` and calls
    ``llmserve.kernels.int8_linear.int8_linear(x, weight, weight_scale, bias)``, which
    reads the int8 tiles directly (no dequantized copy of the weight).

    Raises (in ``forward``):
        RuntimeError: ``x`` is not on a CUDA device and ``TRITON_INTERPRET=1`` is not set (Triton
            only runs on CPU tensors in its interpreter, which must be enabled before triton is
            imported). There is no silent fallback to the reference path: use scheme ``int8``.

    Note: Triton decides between interpreter and compiler when its jit functions are defined,
    i.e. when ``triton`` is first imported; ``TRITON_INTERPRET=1`` must be in the environment
    by then (``llmserve.kernels`` sets it itself on a machine without CUDA if it is the
    first to import triton). Setting it later makes the kernel fail inside the interpreter.
    """

    scheme = "triton-int8"
    #: int32 ``[out / 16, in / 32, 32, 4]`` view of this layer's rows in the fused forward's
    #: fragment copy (:func:`pack_int8_fragments`), or None; not part of ``state_dict``.
    fragments: torch.Tensor | None = None

    @property
    def planes(self) -> bool:
        """Whether ``weight`` holds byte planes (int32) instead of row-major int8."""
        return self.weight.dtype == torch.int32

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out_features, in_features]`` in ``dtype`` (byte planes unpacked first)."""
        w = self.weight
        if self.planes:
            w = unpack_int8_planes(w)
        return dequantize_int8(w, self.weight_scale, dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """As ``nn.Module``'s, except that a byte-plane ``weight`` is saved unpacked: a new
        row-major int8 tensor (also with ``keep_vars=True``, so writing into it does not reach
        the module; and each call unpacks every such weight, one tensor per layer)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.planes:
            destination[prefix + "weight"] = unpack_int8_planes(self.weight.detach())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """As ``nn.Module``'s; a module holding byte planes takes the checkpoint's row-major
        int8 ``[out, in]`` weight (packed, then copied in place, so views of it stay valid) or
        planes ``[out, in / 4]`` int32; anything else is reported as a mismatch."""
        key = prefix + "weight"
        w = state_dict.get(key)
        if self.planes and isinstance(w, torch.Tensor):
            out, inp = self.out_features, self.in_features
            if w.dtype == torch.int8 and w.shape == (out, inp):
                state_dict[key] = pack_int8_planes(w.contiguous())
            elif not (w.dtype == torch.int32 and w.shape == (out, inp // 4)):
                error_msgs.append(f"size/dtype mismatch for {key}: expected int8 [{out}, {inp}] (held "
                                  f"as int32 byte planes [{out}, {inp // 4}]), got {w.dtype} "
                                  f"{tuple(w.shape)}")
                state_dict[key] = self.weight        # reported above; left as it is
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.fragments is not None and not self.planes:
            # in place: CUDA graphs captured the fragment copy's address
            self.fragments.copy_(pack_int8_fragments(self.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda and not triton_interpret():
            raise RuntimeError(
                "the triton-int8 linear backend needs a CUDA device (got an input on "
                f"{x.device}); set TRITON_INTERPRET=1 before starting Python to run the kernel "
                "in Triton's CPU interpreter (slow), or use the 'int8' reference scheme")
        from ..kernels.int8_linear import int8_linear  # lazy: triton is optional

        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()             # [M, K]
        y = int8_linear(x2, self.weight, self.weight_scale, self.bias)  # [M, N]
        return y.reshape(*lead, self.out_features)                    # [..., N]


class Int4Linear(nn.Module):
    """Reference weight-only INT4 linear: unpack + dequantize the weight, then ``F.linear``.

    Buffers: ``weight_packed`` ``uint8 [out_features, ceil(in_features / 2)]``,
    ``weight_scale`` ``float32 [out_features, G]`` (``G = ceil(in_features / group_size)``, 1
    per-channel), ``bias`` ``[out_features]`` in the model dtype, or absent.
    """

    scheme = "int4"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group_size: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        _check_group_size("int4", group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.register_buffer("weight_packed", torch.zeros(
            out_features, (in_features + 1) // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(
            out_features, _num_groups(in_features, group_size), dtype=SCALE_DTYPE, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None,
                    absmax: torch.Tensor | None = None) -> Int4Linear:
        """Quantize an ``nn.Linear``; ``absmax`` ``[out_features, G]``: see
        :func:`~llmserve.quant.schemes.quantize_int4`."""
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                group_size=group_size, device=w.device, dtype=w.dtype)
        packed, s = quantize_int4(w, group_size, absmax)
        m.weight_packed.copy_(packed)
        m.weight_scale.copy_(s)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out_features, in_features]`` in ``dtype``."""
        return dequantize_int4(self.weight_packed, self.weight_scale, self.in_features,
                               self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group_size={self.group_size}, scheme=int4")


QUANTIZED_LAYERS = {"int8": Int8Linear, "int4": Int4Linear, "triton-int8": TritonInt8Linear}
