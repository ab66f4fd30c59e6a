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
    :func:`llmserve.kernels.int8_linear.int8_linear` instead of dequantizing first.
``int4``
    Symmetric signed 4-bit on the grid ``[-7, 7]``, per output channel (``group_size=None``) or
    per group of ``group_size`` consecutive input columns (the last group of a row may be
    shorter; nothing is padded). Stored as ``weight_packed`` (``uint8 [N, ceil(K / 2)]``: two
    4-bit two's-complement values per byte along ``K``, column ``2j`` in the low nibble) and
    ``weight_scale`` (``float32 [N, G]``, ``G = ceil(K / group_size)``). Layer: :class:`Int4Linear`.

Rounding is ``torch.round`` (half to even), so every element's round-trip error is at most
``scale / 2``: plain round-to-nearest (RTN), not GPTQ or AWQ.

By default (``DEFAULT_INCLUDE``) the seven projections of every decoder layer are quantized;
embeddings, ``lm_head`` and norms stay 16-bit. The scheme, granularity and module list are
recorded in metadata (``model.quantization_config``, the safetensors header and
``config.json["quantization_config"]``) and read back by :func:`load_quantized`; a scheme is
never guessed from a file name.

Modules: :mod:`.schemes` (the numeric formats), :mod:`.layers` (the ``nn.Module`` swaps),
:mod:`.transform` (state-dict and model transforms), :mod:`.checkpoint` (save / load).
"""

from ..kernels.int8_layout import (
    pack_int8_fragments,
    pack_int8_planes,
    unpack_int8_fragments,
    unpack_int8_planes,
)
from .checkpoint import QUANTIZED_WEIGHTS_NAME, load_quantized, read_quantization_config, save_quantized
from .layers import QUANTIZED_LAYERS, Int4Linear, Int8Linear, TritonInt8Linear
from .schemes import (
    DEFAULT_INCLUDE,
    FORMAT_VERSION,
    INT4_QMAX,
    INT8_QMAX,
    QUANT_METHOD,
    SCALE_DTYPE,
    SCHEMES,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from .transform import (
    apply_linear_backend,
    model_nbytes,
    quantization_metadata,
    quantize_model,
    quantize_state_dict,
    quantized_copy,
)

__all__ = [
    "DEFAULT_INCLUDE", "FORMAT_VERSION", "INT4_QMAX", "INT8_QMAX", "QUANT_METHOD", "QUANTIZED_LAYERS",
    "QUANTIZED_WEIGHTS_NAME", "SCALE_DTYPE", "SCHEMES", "Int4Linear", "Int8Linear", "TritonInt8Linear",
    "apply_linear_backend", "dequantize_int4", "dequantize_int8", "load_quantized", "model_nbytes",
    "pack_int4", "pack_int8_fragments", "pack_int8_planes", "quantization_metadata", "quantize_int4",
    "quantize_int8", "quantize_model", "quantize_state_dict", "quantized_copy", "read_quantization_config",
    "save_quantized", "unpack_int4", "unpack_int8_fragments", "unpack_int8_planes",
]
