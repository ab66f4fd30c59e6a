"""Batch-invariant layers: every row computed the same way whatever else is in the batch.

A matrix product's library kernel is chosen from the shapes of the call: a single row goes
down a matrix-vector path, a few rows a small-tile GEMM, many rows a blocked or split-K GEMM,
and each sums a row's products in its own order, so the same token's logits change with the
batch it is in (bf16 near-ties then flip the argmax). The fix used here (after Thinking
Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025) is to make the call shape
independent of the batch: rows are processed in blocks of a fixed number of rows (the last
block zero-padded), so every block is the same ``[block_rows, K] x [K, N]`` product and each
row's reduction order depends only on ``K``.

The other ops of the forward are per row already (RMSNorm's statistics and softmax reduce over
the last dimension; RoPE and residuals are elementwise), except SiLU, whose vectorised and
scalar code paths round differently: it is computed as ``x / (1 + exp(-x))`` in fp32, one
formula on every path. Attention is :mod:`llmserve.attention.invariant`.

On a GPU the same layers run the Triton kernels of :mod:`llmserve.kernels.invariant` (one tile
configuration per weight shape), inside the fused forward, whose norms and elementwise kernels
already work one row a program.

Model weights keep their names and values (the layers swap their class in place), so a model
made batch-invariant loads and quantizes like any other.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def row_blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       block_rows: int) -> torch.Tensor:
    """``x @ weight.T + bias`` computed in fixed-shape blocks of ``block_rows`` rows.

    Args:
        x: ``[..., K]``; weight: ``[N, K]``; bias: ``[N]`` or None (same dtype as ``x``).
        block_rows: rows per block (every call has this shape; the last block is padded with
            zero rows).

    Returns:
        ``[..., N]`` in ``x.dtype``. Row ``i``'s values depend only on ``x[i]``, not on how many
        rows ``x`` has or where row ``i`` sits.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    pad = (-m) % block_rows
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    if x2.shape[0] == block_rows:
        out = F.linear(x2, weight, bias)
    else:
        out = torch.cat([F.linear(blk, weight, bias) for blk in x2.split(block_rows)])
    return out[:m].reshape(*lead, weight.shape[0])


class RowBlockedLinear(nn.Linear):
    """``nn.Linear`` in the batch-invariant mode (parameters unchanged): on CPU tensors
    :func:`row_blocked_linear`; on CUDA tensors
    :func:`~llmserve.kernels.invariant.invariant_linear`, one Triton kernel whose tile
    configuration depends only on the weight's shape (a cuBLAS call of a fixed shape would be
    invariant too, but a prefill of thousands of rows would take one launch per block)."""

    block_rows: int = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from ..kernels.invariant import invariant_linear

            return invariant_linear(x, self.weight, self.bias)
        return row_blocked_linear(x, self.weight, self.bias, self.block_rows)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU with one formula on every code path: ``x / (1 + exp(-x))`` in fp32, back to
    ``x.dtype``. ``x``: any shape and float dtype."""
    h = x.float()
    return (h / (1.0 + torch.exp(-h))).to(x.dtype)


def make_batch_invariant(model: nn.Module, block_rows: int, tile: int) -> nn.Module:
    """Switch a :class:`~llmserve.models.qwen2.Qwen2ForCausalLM` to batch-invariant layers in
    place and return it.

    Every ``nn.Linear`` (projections and LM head) becomes a :class:`RowBlockedLinear` with
    ``block_rows``; the MLPs use :func:`invariant_silu`; the reference forward's attention uses
    tiles of ``tile`` keys (the KV cache's block size, so the reference and paged paths agree).
    The paged path's attention is the backend the engine installs
    (:class:`~llmserve.attention.invariant.InvariantPagedAttention` on a CPU,
    :class:`~llmserve.attention.invariant.InvariantTritonAttention` on CUDA).

    Raises:
        ValueError: ``block_rows`` or ``tile`` not a positive integer; a linear layer that is
            not a plain ``nn.Linear`` (quantized layers are not batch-invariant).
    """
    for name, v in (("block_rows", block_rows), ("tile", tile)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    for name, mod in model.named_modules():
        if hasattr(mod, "invariant_tile"):            # Qwen2Attention: the reference forward
            mod.invariant_tile = tile
        if hasattr(mod, "act") and hasattr(mod, "gate_proj"):   # Qwen2MLP
            mod.act = invariant_silu
        if isinstance(mod, RowBlockedLinear):
            mod.block_rows = block_rows
        elif type(mod) is nn.Linear:
            mod.__class__ = RowBlockedLinear
            mod.block_rows = block_rows
        elif isinstance(mod, nn.Linear) or hasattr(mod, "qweight"):
            raise ValueError(f"layer {name!r} ({type(mod).__name__}) has no batch-invariant form; "
                             "the batch-invariant mode needs the 16-bit linear backend ('torch')")
    model.batch_invariant_tile = tile
    return model
