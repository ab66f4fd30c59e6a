"""Batch-invariant paged attention in PyTorch: one fixed reduction order per query row.

What makes ordinary attention batch-variant is that the order in which a row's scores and
values are summed depends on the shapes of the step: how many rows share a matrix product,
how far a group is padded, how the context was split across prefill chunks. Here every query
row is reduced the same way whatever it is batched with:

* the context is cut into tiles of ``tile`` keys at absolute positions ``[n*tile, (n+1)*tile)``
  (the KV cache's blocks when ``tile`` is the block size), so the tiling never depends on how
  a prompt was chunked or which sequences share the step;
* within a tile, ``q . k`` is an elementwise product summed over the head dimension and
  ``p @ v`` an elementwise product summed over the tile's keys: reductions over the last,
  contiguous dimension of a fixed size, which PyTorch computes the same way for every row
  whatever the number of rows (checked by ``tests/test_batch_invariant.py``);
* tiles are merged by the online-softmax recurrence (Milakov & Gimelshein 2018) in ascending
  order, one tile at a time. A tile that lies wholly past a row's position changes nothing
  bit for bit (its maximum is ``-inf``, so the rescale factor is exactly 1 and the added terms
  exactly 0), so rows of a step that runs more tiles than they need get the same bits as rows
  that stop at their own last tile.

This follows the fixed split-size strategy of Thinking Machines Lab's batch-invariant kernels
(He et al. 2025, "Defeating Nondeterminism in LLM Inference"), written with plain tensor ops.
Arithmetic is fp32 whatever the cache dtype. It is the readable path of the batch-invariant
mode, on the CPU; its cost is one Python iteration per context tile per layer. On a GPU the mode
uses :class:`InvariantTritonAttention` instead (PyTorch's CUDA reductions choose how to split a
sum from the tensor's shape, so the ops above are not invariant there): the same tiling and
merge order in one Triton kernel (:mod:`llmserve.kernels.invariant`).
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata
from .torch_backend import TorchPagedAttention


def invariant_attention_rows(q: torch.Tensor, positions: torch.Tensor, row_blocks: torch.Tensor,
                             k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of independent query rows over tiles of a key/value pool.

    Args:
        q: ``[N, Hq, D]`` query rows (any float dtype).
        positions: ``[N]`` int64 absolute position of each row; row ``r`` attends to keys at
            positions ``0 .. positions[r]``.
        row_blocks: ``[N, T]`` int64 pool index of each row's tile ``n`` (keys
            ``n*tile .. (n+1)*tile - 1``); ``T >= max(positions) // tile + 1``. Entries past a
            row's last tile may be any valid index (they are masked).
        k_pool, v_pool: ``[P, tile, Hkv, D]``; ``Hq`` a multiple of ``Hkv`` (GQA: query head
            ``h`` reads KV head ``h // (Hq // Hkv)``).
        scale: softmax scale.

    Returns:
        ``[N, Hq, D]`` float32. Row ``r``'s bits depend only on ``q[r]``, its position and its
        keys/values, not on ``N``, on the other rows, or on ``T``.
    """
    n_rows, hq, d = q.shape
    tile, hkv = k_pool.shape[1], k_pool.shape[2]
    g = hq // hkv
    dev = q.device
    qf = q.float().view(n_rows, hkv, g, 1, d)                                 # [N, Hkv, G, 1, D]
    m = torch.full((n_rows, hkv, g), float("-inf"), device=dev)               # running max
    l = torch.zeros((n_rows, hkv, g), device=dev)                             # running sum of exp
    acc = torch.zeros((n_rows, hkv, g, d), device=dev)                        # running output
    offs = torch.arange(tile, device=dev)
    last_tile = int(positions.max()) // tile if n_rows else -1
    for n in range(last_tile + 1):
        idx = row_blocks[:, n]
        valid = (n * tile + offs)[None, :] <= positions[:, None]              # [N, tile]
        k = k_pool[idx].float().permute(0, 2, 1, 3).contiguous()              # [N, Hkv, tile, D]
        v = v_pool[idx].float().permute(0, 2, 3, 1)                           # [N, Hkv, D, tile]
        v = torch.where(valid[:, None, None, :], v, 0.0).contiguous()         # masked keys: 0
        s = (qf * k[:, :, None]).sum(-1) * scale                              # [N, Hkv, G, tile]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))                                  # [N, Hkv, G]
        m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        alpha = torch.exp(m - m_safe)                                         # 0 on the first tile
        p = torch.exp(s - m_safe[..., None])                                  # masked -> 0
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[:, :, :, None, :] * v[:, :, None]).sum(-1)
        m = m_new
    out = acc / l.clamp_min(1e-30)[..., None]                                 # [N, Hkv, G, D]
    return out.view(n_rows, hq, d)


def invariant_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              tile: int) -> torch.Tensor:
    """The same computation over whole uncached sequences (the reference forward).

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hkv, D]``; every row starts at position 0.
        scale: softmax scale. tile: keys per tile (the paged path's block size, so both paths
            give the same bits).

    Returns:
        ``[B, T, Hq, D]`` float32.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    nt = -(-t // tile)
    pad = nt * tile - t
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).reshape(b * nt, tile, hkv, d)
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).reshape(b * nt, tile, hkv, d)
    row_blocks = (torch.arange(b, device=q.device)[:, None] * nt
                  + torch.arange(nt, device=q.device)[None, :])               # [B, nt]
    row_blocks = row_blocks.repeat_interleave(t, dim=0)                       # [B*T, nt]
    positions = torch.arange(t, device=q.device).repeat(b)                    # [B*T]
    out = invariant_attention_rows(q.reshape(b * t, hq, d), positions, row_blocks, kp, vp, scale)
    return out.view(b, t, hq, d)


def invariant_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batch-invariant causal paged attention of a flat varlen batch (same contract as
    :func:`llmserve.attention.torch_backend.paged_attention_torch`); the tiles are the cache's
    blocks.

    Returns:
        ``[N, Hq, D]`` in ``query.dtype``; rows of padding tokens are zero.
    """
    qsl = meta.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]                                               # [B]
    n_real = int(qsl[-1]) if qsl.numel() else 0
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    if n_real == 0:
        return out.to(query.dtype)
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.numel(), device=query.device), q_lens)
    first_pos = meta.context_lens.long() - q_lens                              # [B]
    row_in_seq = torch.arange(n_real, device=query.device) - qsl[:-1][seq_of_row]
    positions = first_pos[seq_of_row] + row_in_seq                             # [N_real]
    row_blocks = meta.block_tables.long()[seq_of_row]                          # [N_real, max_blocks]
    out[:n_real] = invariant_attention_rows(query[:n_real], positions, row_blocks, k_cache, v_cache,
                                            scale)
    return out.to(query.dtype)


class InvariantPagedAttention(TorchPagedAttention):
    """The batch-invariant backend on a CPU (what ``EngineConfig.batch_invariant`` selects with
    ``device='cpu'``): the torch backend's K/V writes, :func:`invariant_paged_attention` for the
    attention."""

    name = "torch-invariant"

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """:func:`invariant_paged_attention`: ``[N, Hq, D]`` in the query dtype."""
        return invariant_paged_attention(query, k_cache, v_cache, meta, scale)


class InvariantTritonAttention:
    """The batch-invariant backend on CUDA (what ``EngineConfig.batch_invariant`` selects with
    ``device='cuda'``): the Triton K/V write and
    :func:`~llmserve.kernels.invariant.invariant_paged_attention` for prefill and decode rows
    alike. Its key tile is ``block_n`` positions (default: the kernel's, 64)."""

    name = "triton-invariant"

    def __init__(self, block_n: int | None = None) -> None:
        # imported here, not at module level: the CPU backend above needs no Triton
        from ..kernels.invariant import invariant_paged_attention
        from ..kernels.paged_attention import write_kv_triton

        self.block_n = block_n
        self._attend = invariant_paged_attention
        self._write = write_kv_triton

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """Scatter ``key``/``value`` ``[N, Hkv, D]`` into the caches at ``slot_mapping`` ``[N]``
        (entries < 0 are skipped)."""
        self._write(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """:func:`~llmserve.kernels.invariant.invariant_paged_attention`: ``[N, Hq, D]`` in the
        query dtype (padding rows zero)."""
        return self._attend(query, k_cache, v_cache, meta, scale, block_n=self.block_n)
