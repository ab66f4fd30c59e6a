"""INT8 weight layouts the kernels read (pure torch): byte planes and MMA fragments.

``pack_int8_planes`` stores four int8 values in a 32-bit word arranged so each byte plane meets a
contiguous slice of the activations; ``pack_int8_fragments`` stores the weight in the order an
``mma.m16n8k32`` tile consumes it. Both are exact (``unpack(pack(w)) == w``).
"""

from __future__ import annotations
import torch


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
    :func:`~llmserve.kernels.int8_frag.int8_frag_linear` (see that module's docstring:
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
