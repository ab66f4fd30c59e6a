"""Triton kernels: paged attention (KV write, split-K decode, varlen prefill), INT8 weight-only
linear, and fused elementwise ops.

On a machine without CUDA the kernels can only run in Triton's interpreter, on CPU tensors.
Triton decides between the compiler and the interpreter when a kernel is *defined* (at
``@triton.jit`` time, reading ``TRITON_INTERPRET``), so ``TRITON_INTERPRET=1`` must be set
before this package is imported (the test suite's ``conftest.py`` does it on machines without
CUDA). This package never reads or writes the environment: launch options are arguments.

Interpreter caveat: bf16 arithmetic is wrong there (numpy has no bf16), so the kernels cast
loaded tiles to fp32 before any math whenever they run on CPU tensors; test in fp32/fp16 on CPU
and in bf16 on the GPU.
"""

from __future__ import annotations

from .int8_linear import int8_linear, int8_linear_reference, quantize_int8_per_channel
from .paged_attention import (
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_triton,
    write_kv_triton,
)

__all__ = [
    "int8_linear",
    "int8_linear_reference",
    "quantize_int8_per_channel",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_triton",
    "write_kv_triton",
]
