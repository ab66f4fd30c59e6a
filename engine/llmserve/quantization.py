"""Weight-only INT8 / INT4 quantization: an offline state-dict transform plus a module swap.

Schemes (``SCHEMES``), all weight-only (activations stay in the model dtype), all symmetric
(no zero point), all with ``float32`` scales:

``int8``
    Per-output-channel: for a weight ``W [N, K]`` (``N`` = out_features, ``K`` = in_features)
    ``scale[n] = max_k |W[n, k]| / 127`` and ``q[n, k] = round(W[n, k] / scale[n])`` clamped to
    ``[-127, 127]`` (the value -128 is never produced, so the grid is symmetric). Stored as
    ``weight`` (``int8 [N, K]``) and ``weight_scale`` (``float32 [N]``). Layer: :class:`Int8Linear`.
``triton-int8``
    The same storage as ``int8``; :class:`TritonInt8Linear` calls the fused Triton kernel
    ``llmserve.triton_kernels.int8_linear.int8_linear(x, w_int8, scale, bias)`` instead of
    dequantizing first.
``int4``
    Symmetric signed 4-bit on the grid ``[-7, 7]`` (``scale = max|w| / 7``; -8 is representable
    by the packing but never produced, so the grid is symmetric around zero), per output channel
    (``group_size=None``) or per group of ``group_size`` consecutive input columns. If ``K`` is
    not a multiple of ``group_size`` the last group of each row is shorter (it covers the last
    ``K % group_size`` columns); nothing is padded in storage. Stored as ``weight_packed``
    (``uint8 [N, ceil(K / 2)]``: two 4-bit two's-complement values per byte along ``K``, column
    ``2j`` in the low nibble and ``2j + 1`` in the high nibble; an odd ``K`` leaves the last high
    nibble 0) and ``weight_scale`` (``float32 [N, G]``, ``G = ceil(K / group_size)``, ``G = 1``
    per-channel). Layer: :class:`Int4Linear`.

Rounding is ``torch.round`` (half to even), so every element's round-trip error
``|W - q * scale|`` is at most ``scale / 2`` (plus float32 rounding). This is plain
round-to-nearest (RTN) quantization, not GPTQ or AWQ.

Which layers are quantized is explicit: by default (``DEFAULT_INCLUDE``) the seven linear
projections inside every decoder layer (``model.layers.N.self_attn.{q,k,v,o}_proj`` and
``model.layers.N.mlp.{gate,up,down}_proj``); ``model.embed_tokens``, ``lm_head`` and all norms
stay in the 16-bit model dtype. The scheme, granularity and module list are recorded in a
metadata dict (``model.quantization_config``), written to the safetensors header and to
``config.json["quantization_config"]`` by :func:`save_quantized`, and read back by
:func:`load_quantized`; a scheme is never guessed from a file name.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SCHEMES = ("int8", "int4", "triton-int8")
QUANT_METHOD = "llmserve-weight-only"
FORMAT_VERSION = 1
#: Regex (``re.fullmatch`` on module names) of the layers quantized by default.
DEFAULT_INCLUDE = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
INT8_QMAX = 127
INT4_QMAX = 7
SCALE_DTYPE = torch.float32


def _check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; supported: {list(SCHEMES)}")
    return scheme


def _check_group_size(scheme: str, group_size: int | None) -> int | None:
    if group_size is None:
        return None
    if scheme != "int4":
        raise ValueError(
            f"group_size applies only to the int4 scheme (int8 is per output channel), got "
            f"group_size={group_size!r} with scheme {scheme!r}; pass group_size=None")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 \
            or group_size % 2:
        raise ValueError(f"group_size must be an even integer >= 2 or None (per output channel), "
                         f"got {group_size!r}")
    return group_size


def _check_weight(w: torch.Tensor, what: str = "weight") -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"{what} must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{what} must be a floating-point tensor, got {w.dtype}")
    return w.detach().to(torch.float32)


def _check_finite(absmax: torch.Tensor, what: str = "weight") -> None:
    # max|w| over a row/group is NaN or Inf iff the row/group holds a NaN or Inf
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError(f"{what} contains NaN or Inf; cannot quantize it")


# ----------------------------------------------------------------------------------------------
# INT8
# ----------------------------------------------------------------------------------------------

def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8 quantization.

    Args:
        weight: ``[N, K]`` floating point (any float dtype; math in float32).

    Returns:
        ``(q, scale)``: ``q`` ``int8 [N, K]`` in ``[-127, 127]``; ``scale`` ``float32 [N]`` with
        ``scale[n] = max|weight[n]| / 127`` (0 for an all-zero row, whose ``q`` is 0).

    Raises:
        ValueError: not 2-D, not floating point, or non-finite values.
    """
    w32 = _check_weight(weight)
    absmax = w32.abs().amax(dim=1)                                    # [N]
    _check_finite(absmax)
    scale = absmax / INT8_QMAX                                        # [N]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / safe[:, None]).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)  # [N, K]
    return q, scale.to(SCALE_DTYPE)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [N, K] int8``, ``scale [N]`` -> ``q * scale[:, None]`` as ``dtype [N, K]``."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


# ----------------------------------------------------------------------------------------------
# INT8 byte planes (a kernel layout of row-major int8 weights)
# ----------------------------------------------------------------------------------------------

def _check_int8_2d(w_int8: torch.Tensor) -> tuple[int, int]:
    """``(N, K)`` of a 2-D int8 weight; ``ValueError`` for anything else (the packers' check)."""
    if not isinstance(w_int8, torch.Tensor) or w_int8.dtype != torch.int8 or w_int8.dim() != 2:
        raise ValueError(f"w_int8 must be a 2-D int8 tensor [N, K], got "
                         f"{getattr(w_int8, 'dtype', type(w_int8))} {tuple(getattr(w_int8, 'shape', ()))}")
    return tuple(w_int8.shape)


def pack_int8_planes(w_int8: torch.Tensor) -> torch.Tensor:
    """Pack an int8 weight four values a 32-bit word in *byte planes*: byte ``j`` (0 = least
    significant) of word ``i`` of a row is column ``j * K/4 + i``.

    The storage of the Triton kernels' fastest INT8 matrix-vector path
    (``triton_kernels/gemv.py``, ``int8_linear.py``; :class:`TritonInt8Linear` holds it when the
    fused forward repacks it). Why: a kernel that loads a tile of words gets four tiles of weights, each pairing with a
    *contiguous* slice of ``x`` (columns ``j * K/4 + k0 ...``), and accumulates all four into
    one fp32 accumulator of the word tile's size, a quarter of the registers and adds of a
    row-major int8 tile of the same bytes. (Quantized-GEMV kernels such as Marlin's and
    TensorRT-LLM's interleave weights for the same reason, with their own layouts.)

    Args:
        w_int8: ``[N, K]`` int8 (``K`` a multiple of 4).

    Returns:
        ``[N, K / 4]`` int32, contiguous (the same bytes, reordered; byte ``j`` is bits
        ``8j .. 8j + 7``, i.e. little-endian, as on x86, ARM and NVIDIA GPUs).

    Raises:
        ValueError: not a 2-D int8 tensor, or ``K % 4 != 0``.
    """
    n, k = _check_int8_2d(w_int8)
    if k % 4:
        raise ValueError(f"byte planes need K divisible by 4, got K={k}")
    return w_int8.reshape(n, 4, k // 4).transpose(1, 2).contiguous().view(torch.int32).reshape(n, k // 4)


def unpack_int8_planes(planes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int8_planes`: int32 ``[N, K / 4]`` -> int8 ``[N, K]``.

    Raises:
        ValueError: not a 2-D int32 tensor.
    """
    if not isinstance(planes, torch.Tensor) or planes.dtype != torch.int32 or planes.dim() != 2:
        raise ValueError(f"planes must be a 2-D int32 tensor [N, K / 4], got "
                         f"{getattr(planes, 'dtype', type(planes))} {tuple(getattr(planes, 'shape', ()))}")
    n, kw = planes.shape
    return planes.contiguous().view(torch.int8).reshape(n, kw, 4).transpose(1, 2).reshape(n, 4 * kw)


def pack_int8_fragments(w_int8: torch.Tensor) -> torch.Tensor:
    """Reorder an int8 weight into the MMA fragment layout of
    :func:`~llmserve.triton_kernels.int8_frag.int8_frag_linear` (see that module's docstring:
    each lane's 16-byte load is its ``mma.sync.m16n8k16`` A operand for two K steps).

    Args:
        w_int8: ``[N, K]`` int8 (values in ``[-127, 127]``; -128 would be read as -128 too),
            ``N % 16 == 0``, ``K % 32 == 0``.

    Returns:
        int32 ``[N / 16, K / 32, 32, 4]``, contiguous: chunk ``(nb, kb)``, lane ``l``: the
        16 bytes ``q[16 nb + l//4, 32 kb + 8 (l%4) : +8]`` and
        ``q[16 nb + l//4 + 8, 32 kb + 8 (l%4) : +8]``, each stored as ``q + 128`` (little-endian
        bytes in the words).

    Raises:
        ValueError: not a 2-D int8 tensor, or the sizes above.
    """
    n, k = _check_int8_2d(w_int8)
    if n % 16 or k % 32:
        raise ValueError(f"the fragment layout needs N % 16 == 0 and K % 32 == 0, got N={n}, K={k}")
    b = (w_int8.view(torch.uint8) ^ 0x80).reshape(n // 16, 2, 8, k // 32, 4, 8)  # nb h g kb q byte
    b = b.permute(0, 3, 2, 4, 1, 5).contiguous()                                  # nb kb g q h byte
    return b.view(torch.int32).reshape(n // 16, k // 32, 32, 4)


def unpack_int8_fragments(frags: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int8_fragments`: int32 ``[N/16, K/32, 32, 4]`` -> int8 ``[N, K]``.

    Raises:
        ValueError: not a 4-D int32 tensor of that form.
    """
    if (not isinstance(frags, torch.Tensor) or frags.dtype != torch.int32 or frags.dim() != 4
            or tuple(frags.shape[2:]) != (32, 4)):
        raise ValueError(f"frags must be an int32 tensor [N/16, K/32, 32, 4], got "
                         f"{getattr(frags, 'dtype', type(frags))} {tuple(getattr(frags, 'shape', ()))}")
    nb, kb = frags.shape[:2]
    b = frags.contiguous().view(torch.uint8).reshape(nb, kb, 8, 4, 2, 8) ^ 0x80      # nb kb g q h byte
    return b.permute(0, 4, 2, 1, 3, 5).reshape(nb * 16, kb * 32).view(torch.int8)


# ----------------------------------------------------------------------------------------------
# INT4: packing and group-wise quantization
# ----------------------------------------------------------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed 4-bit values two per byte along the last dimension.

    Args:
        q: integer tensor ``[..., K]`` with values in ``[-8, 7]``.

    Returns:
        ``uint8 [..., ceil(K / 2)]``: element ``2j`` in the low nibble and ``2j + 1`` in the high
        nibble, each as a 4-bit two's complement; an odd ``K`` is padded with a 0 nibble.

    Raises:
        ValueError: non-integer dtype or a value outside ``[-8, 7]``.
    """
    if q.is_floating_point() or q.dtype == torch.bool:
        raise ValueError(f"pack_int4 expects an integer tensor, got {q.dtype}")
    q16 = q.to(torch.int16)
    if q16.numel() and (int(q16.min()) < -8 or int(q16.max()) > 7):
        raise ValueError(f"int4 values must be in [-8, 7], got range "
                         f"[{int(q16.min())}, {int(q16.max())}]")
    if q16.shape[-1] % 2:
        q16 = F.pad(q16, (0, 1))                                      # [..., K + 1]
    u = (q16 & 0xF).to(torch.uint8)                                   # two's-complement nibbles
    return u[..., 0::2] | (u[..., 1::2] << 4)                         # [..., ceil(K / 2)]


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`.

    Args:
        packed: ``uint8 [..., P]``.
        k: the unpacked length, ``2P - 1`` or ``2P``.

    Returns:
        ``int8 [..., k]`` with values in ``[-8, 7]``.

    Raises:
        ValueError: wrong dtype or ``k`` inconsistent with ``P``.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4 expects uint8, got {packed.dtype}")
    p = packed.shape[-1]
    if k not in (2 * p - 1, 2 * p):
        raise ValueError(f"k={k} is inconsistent with {p} packed bytes (expected {2 * p - 1} or {2 * p})")
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    v = torch.stack((low, high), dim=-1).flatten(-2)                  # [..., 2P]
    v = torch.where(v >= 8, v - 16, v)                                # sign-extend the nibble
    return v[..., :k].contiguous()                                    # [..., k]


def _num_groups(k: int, group_size: int | None) -> int:
    return 1 if group_size is None else math.ceil(k / group_size)


def quantize_int4(weight: torch.Tensor, group_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 (grid ``[-7, 7]``) with per-output-channel or group-wise scales.

    Args:
        weight: ``[N, K]`` floating point.
        group_size: ``None`` for one scale per output row, else the number of consecutive input
            columns sharing a scale (even, >= 2). A ``K`` not divisible by it leaves a shorter
            last group.

    Returns:
        ``(packed, scale)``: ``packed`` ``uint8 [N, ceil(K / 2)]`` (see :func:`pack_int4`);
        ``scale`` ``float32 [N, G]`` with ``G = ceil(K / group_size)`` (1 per-channel),
        ``scale = max|w in group| / 7``.

    Raises:
        ValueError: bad weight or group size.
    """
    _check_group_size("int4", group_size)
    w32 = _check_weight(weight)
    n, k = w32.shape
    g = k if group_size is None else group_size
    num_groups = _num_groups(k, group_size)
    wp = F.pad(w32, (0, num_groups * g - k)).view(n, num_groups, g)  # [N, G, g]; zero padding
    absmax = wp.abs().amax(dim=2)                                     # [N, G]
    _check_finite(absmax)
    scale = absmax / INT4_QMAX                                        # [N, G]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wp / safe[:, :, None]).clamp_(-INT4_QMAX, INT4_QMAX)  # [N, G, g]
    q = q.view(n, num_groups * g)[:, :k].to(torch.int8)               # [N, K]
    return pack_int4(q), scale.to(SCALE_DTYPE)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                    group_size: int | None = None, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """``packed [N, ceil(K/2)] uint8``, ``scale [N, G]`` -> ``dtype [N, K]`` (K = in_features)."""
    q = unpack_int4(packed, in_features).to(torch.float32)            # [N, K]
    s = scale.to(torch.float32)
    if s.dim() == 1:
        s = s[:, None]
    g = in_features if group_size is None else group_size
    s = s.repeat_interleave(g, dim=1)[:, :in_features]                # [N, K]
    return (q * s).to(dtype)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

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
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize an ``nn.Linear`` (its weight dtype becomes the bias/compute dtype)."""
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                device=w.device, dtype=w.dtype)
        q, s = quantize_int8(w)
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
    (``LLMSERVE_INT8_FRAGMENTS=1``); ``load_state_dict`` repacks that copy in place too.

    ``forward`` flattens ``x [..., K]`` to ``[M, K]`` and calls
    ``llmserve.triton_kernels.int8_linear.int8_linear(x, weight, weight_scale, bias)``, which
    reads the int8 tiles directly (no dequantized copy of the weight).

    Raises (in ``forward``):
        RuntimeError: ``x`` is not on a CUDA device and ``TRITON_INTERPRET=1`` is not set (Triton
            only runs on CPU tensors in its interpreter, which must be enabled before triton is
            imported). There is no silent fallback to the reference path: use scheme ``int8``.

    Note: Triton decides between interpreter and compiler when its jit functions are defined,
    i.e. when ``triton`` is first imported; ``TRITON_INTERPRET=1`` must be in the environment
    by then (``llmserve.triton_kernels`` sets it itself on a machine without CUDA if it is the
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
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "the triton-int8 linear backend needs a CUDA device (got an input on "
                f"{x.device}); set TRITON_INTERPRET=1 before starting Python to run the kernel "
                "in Triton's CPU interpreter (slow), or use the 'int8' reference scheme")
        from .triton_kernels.int8_linear import int8_linear  # lazy: triton is optional

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
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None) -> Int4Linear:
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                group_size=group_size, device=w.device, dtype=w.dtype)
        packed, s = quantize_int4(w, group_size)
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


# ----------------------------------------------------------------------------------------------
# Metadata, selection
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Offline state-dict transform
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Module swap
# ----------------------------------------------------------------------------------------------

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
                   include: str | Iterable[str] | None = None) -> nn.Module:
    """Swap selected ``nn.Linear`` modules for quantized layers, in place.

    Args:
        model: e.g. ``Qwen2ForCausalLM`` (HF module names).
        scheme: ``int8`` (:class:`Int8Linear`), ``int4`` (:class:`Int4Linear`) or
            ``triton-int8`` (:class:`TritonInt8Linear`).
        group_size: int4 only (``None`` = per output channel).
        include: regex (``re.fullmatch`` on module names) or list of module names; ``None`` =
            :data:`DEFAULT_INCLUDE` (the seven projections of every decoder layer; embeddings,
            ``lm_head`` and norms stay 16-bit).

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
        if scheme == "int4":
            new = Int4Linear.from_linear(linear, group_size)
        else:
            new = QUANTIZED_LAYERS[scheme].from_linear(linear)
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


# ----------------------------------------------------------------------------------------------
# Size accounting
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Quantized checkpoints
# ----------------------------------------------------------------------------------------------

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

    from .config import ModelConfig, resolve_dtype
    from .models.qwen2 import Qwen2ForCausalLM

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
