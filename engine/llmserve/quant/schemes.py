"""Weight-only quantization schemes: symmetric per-channel INT8 and packed INT4 (per channel or
group-wise), round-to-nearest (not GPTQ or AWQ). See :mod:`llmserve.quant` for the storage format.
"""

from __future__ import annotations
import math
import torch
import torch.nn.functional as F


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


def weight_absmax(weight: torch.Tensor, scheme: str, group_size: int | None = None) -> torch.Tensor:
    """The statistic a scheme scales by: ``max |w|`` per output row (``float32 [N]`` for the
    int8 schemes) or per row and group (``float32 [N, G]`` for int4, ``G = 1`` per channel).

    Raises:
        ValueError: unknown scheme, bad group size or weight.
    """
    _check_scheme(scheme)
    w32 = _check_weight(weight)
    if scheme != "int4":
        return w32.abs().amax(dim=1)                                  # [N]
    _check_group_size("int4", group_size)
    n, k = w32.shape
    g = k if group_size is None else group_size
    num_groups = _num_groups(k, group_size)
    return F.pad(w32, (0, num_groups * g - k)).view(n, num_groups, g).abs().amax(dim=2)  # [N, G]


def _check_absmax(absmax: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(absmax.shape) != shape:
        raise ValueError(f"absmax must have shape {list(shape)}, got {list(absmax.shape)}")
    return absmax.detach().to(torch.float32)


def quantize_int8(weight: torch.Tensor, absmax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8 quantization.

    Args:
        weight: ``[N, K]`` floating point (any float dtype; math in float32).
        absmax: ``[N]`` the ``max |w|`` to scale each row by, when it is not this tensor's own
            (a tensor-parallel shard of a row scales by the whole row's maximum, so every shard
            quantizes exactly as the unsplit weight; it must be ``>=`` this tensor's).

    Returns:
        ``(q, scale)``: ``q`` ``int8 [N, K]`` in ``[-127, 127]``; ``scale`` ``float32 [N]`` with
        ``scale[n] = max|weight[n]| / 127`` (0 for an all-zero row, whose ``q`` is 0).

    Raises:
        ValueError: not 2-D, not floating point, or non-finite values; ``absmax`` of the wrong
            shape.
    """
    w32 = _check_weight(weight)
    absmax = w32.abs().amax(dim=1) if absmax is None else _check_absmax(absmax, (w32.shape[0],))  # [N]
    _check_finite(absmax)
    scale = absmax / INT8_QMAX                                        # [N]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / safe[:, None]).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)  # [N, K]
    return q, scale.to(SCALE_DTYPE)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [N, K] int8``, ``scale [N]`` -> ``q * scale[:, None]`` as ``dtype [N, K]``."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


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


def quantize_int4(weight: torch.Tensor, group_size: int | None = None,
                  absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 (grid ``[-7, 7]``) with per-output-channel or group-wise scales.

    Args:
        weight: ``[N, K]`` floating point.
        group_size: ``None`` for one scale per output row, else the number of consecutive input
            columns sharing a scale (even, >= 2). A ``K`` not divisible by it leaves a shorter
            last group.
        absmax: ``[N, G]`` the ``max |w|`` to scale each group by, when it is not this
            tensor's own (as :func:`quantize_int8`).

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
    absmax = wp.abs().amax(dim=2) if absmax is None else _check_absmax(absmax, (n, num_groups))  # [N, G]
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
