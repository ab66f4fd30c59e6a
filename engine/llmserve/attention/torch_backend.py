"""Reference paged attention in PyTorch: block-wise online softmax, vectorised over the batch.

Algorithm: each sequence's K/V blocks are gathered through its block table; for every
(query, block) pair we compute the block's partial softmax statistics — running max ``m``,
sum of exponentials ``l`` and un-normalised output ``o`` — and then merge the blocks with the
log-sum-exp rescaling of online softmax (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; the same merge FlashAttention and flash-decoding's split-K reduction
use). Every block of a group is processed in one batched tensor op: there is no Python loop
over tokens or blocks. Arithmetic is fp32 whatever the cache dtype.

Varlen, so a step costs about the sum of its sequences' work: the decode rows (query length 1)
form batched groups of similar context (powers of two), each padded only to its own longest
context, and every prefill chunk is attended on its own, sized to its own query length and
context. No row is padded to another
sequence's prompt (co-batching short prompts with one long prompt would otherwise make the step
cost ``max query x max context`` for every sequence).
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into the paged cache.

    Args:
        key, value: ``[N, Hkv, D]``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``; the last block is the engine's
            scratch block, so a padding slot of ``-1`` lands there harmlessly.
        slot_mapping: ``[N]`` int64 flat slots (``block * block_size + offset``).
    """
    nb, bs, hkv, d = k_cache.shape
    k_cache.view(nb * bs, hkv, d)[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(nb * bs, hkv, d)[slot_mapping] = value.to(v_cache.dtype)


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, q_start: torch.Tensor, q_lens: torch.Tensor,
                  context_lens: torch.Tensor, max_q: int, max_ctx: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention for a group of sequences; returns (output rows ``[R, Hq, D]`` fp32, their
    flat row indices ``[R]``)."""
    device = q.device
    _, bs, hkv, d = k_cache.shape
    hq = q.shape[1]
    g = hq // hkv
    b = block_tables.shape[0]
    nblk = (max_ctx + bs - 1) // bs
    bt = block_tables[:, :nblk].long()                                   # [B, nb]
    keys = k_cache[bt].float()                                           # [B, nb, bs, Hkv, D]
    vals = v_cache[bt].float()                                           # [B, nb, bs, Hkv, D]

    j = torch.arange(max_q, device=device)
    rows = q_start[:, None].long() + j[None, :]                          # [B, Q]
    row_valid = j[None, :] < q_lens[:, None]                             # [B, Q]
    rows = torch.where(row_valid, rows, torch.zeros_like(rows))
    qg = q[rows].float().view(b, max_q, hkv, g, d)                       # [B, Q, Hkv, G, D]

    # scores[b, h, g, q, n, s] = <q, k> * scale
    scores = torch.einsum("bqhgd,bnshd->bhgqns", qg, keys) * scale        # [B, Hkv, G, Q, nb, bs]
    q_pos = (context_lens - q_lens)[:, None].long() + j[None, :]          # [B, Q]
    k_pos = torch.arange(nblk * bs, device=device).view(nblk, bs)         # [nb, bs]
    allowed = (k_pos[None, None] <= q_pos[:, :, None, None]) \
        & (k_pos[None, None] < context_lens[:, None, None, None].long())  # [B, Q, nb, bs]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))

    # Per-block partial softmax statistics.
    m_blk = scores.amax(dim=-1)                                          # [B, Hkv, G, Q, nb]
    m_safe = torch.where(torch.isfinite(m_blk), m_blk, torch.zeros_like(m_blk))
    p = torch.exp(scores - m_safe[..., None])                            # masked -> exp(-inf)=0
    l_blk = p.sum(dim=-1)                                                # [B, Hkv, G, Q, nb]
    o_blk = torch.einsum("bhgqns,bnshd->bhgqnd", p, vals)                # [B, Hkv, G, Q, nb, D]

    # Online-softmax merge across blocks.
    m_all = m_blk.amax(dim=-1, keepdim=True)                             # [B, Hkv, G, Q, 1]
    m_all = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    w = torch.exp(m_blk - m_all)                                         # 0 for empty blocks
    l_tot = (w * l_blk).sum(dim=-1)                                      # [B, Hkv, G, Q]
    o_tot = (w[..., None] * o_blk).sum(dim=-2)                           # [B, Hkv, G, Q, D]
    out = o_tot / l_tot.clamp_min(1e-30)[..., None]
    out = out.permute(0, 3, 1, 2, 4).reshape(b, max_q, hq, d)            # [B, Q, Hq, D]
    return out[row_valid], rows[row_valid]


def paged_attention_torch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal paged attention of a flat varlen batch against the KV cache.

    Args:
        query: ``[N, Hq, D]`` (any float dtype).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``; already hold this step's K/V.
        meta: see :class:`AttentionMetadata`.
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        ``[N, Hq, D]`` in ``query.dtype``. Rows of padding tokens (not covered by
        ``query_start_loc``) are zero.
    """
    qsl = meta.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]                                          # [B]
    q_start = qsl[:-1]                                                   # [B]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    if meta.max_query_len <= 1:
        o, rows = _attend_group(query, k_cache, v_cache, meta.block_tables, q_start, q_lens,
                                meta.context_lens, 1, meta.max_context_len, scale)
        out[rows] = o
        return out.to(query.dtype)
    # Host copies of the lengths (one sync; this is the reference path) to size each group.
    q_lens_h = q_lens.tolist()
    ctx_h = meta.context_lens.tolist()
    # Decode rows grouped by context length in powers of two, each group padded to its own
    # longest context: a decode at 2,000 tokens does not pad four decodes at 70 to 2,000.
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(q_lens_h):
        if n == 1:
            buckets.setdefault(max(ctx_h[i] - 1, 0).bit_length(), []).append(i)
    for rows_i in buckets.values():
        sel = torch.tensor(rows_i, device=query.device)
        o, rows = _attend_group(query, k_cache, v_cache, meta.block_tables[sel], q_start[sel],
                                q_lens[sel], meta.context_lens[sel], 1,
                                max(ctx_h[i] for i in rows_i), scale)
        out[rows] = o
    for i, n in enumerate(q_lens_h):
        if n > 1:
            o, rows = _attend_group(query, k_cache, v_cache, meta.block_tables[i:i + 1],
                                    q_start[i:i + 1], q_lens[i:i + 1], meta.context_lens[i:i + 1],
                                    n, ctx_h[i], scale)
            out[rows] = o
    return out.to(query.dtype)


class TorchPagedAttention:
    """The PyTorch reference backend (``--paged-attention-backend torch``)."""

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_torch(query, k_cache, v_cache, meta, scale)
