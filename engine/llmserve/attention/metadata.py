"""Attention metadata: how the flat token batch of one step maps onto paged KV storage.

Layout (varlen, as in vLLM/FlashAttention): the step's tokens from all sequences are
concatenated into one flat batch of ``N`` tokens. Sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` (a prefill chunk or a single decode token) and,
after this step's K/V are written, has ``context_lens[i]`` tokens in the cache. Query row ``j``
of sequence ``i`` sits at position ``context_lens[i] - q_len_i + j`` and attends causally to
cache positions ``0 .. that position``. Cache position ``p`` of sequence ``i`` lives in
physical block ``block_tables[i, p // block_size]`` at offset ``p % block_size``; the flat
slot is ``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Tensors describing one step's attention (built only by ``ModelRunner``).

    Attributes:
        slot_mapping: ``[N]`` int64, flat cache slot for each new token's K/V (``-1`` = padding;
            it lands in the cache's scratch last block, which no sequence owns).
        query_start_loc: ``[B+1]`` int32, cumulative query lengths (``cu_seqlens_q``).
        context_lens: ``[B]`` int32, tokens in the cache per sequence after this step's write.
        block_tables: ``[B, max_blocks]`` int32, physical block ids (unused entries are 0).
        max_query_len: max over sequences of the query length (Python int, no sync needed).
        max_context_len: max over sequences of ``context_lens`` (Python int), or an upper bound
            on it (CUDA graphs pass the length they were captured for; kernels size their grids
            from it, each sequence still reads only its own context).
        block_size: tokens per block.
        is_decode_only: every sequence has exactly one query token (decode kernels apply).
        prefill_tiles: ``[T]`` int32 work list of the Triton prefill kernel, or of the
            batch-invariant attention kernel, which lists decode rows too
            (:func:`~llmserve.kernels.paged_attention.prefill_tile_schedule`), or None: the
            grid then spans every (sequence, query tile of ``max_query_len``) pair. Set by the
            CUDA-graph runner of prefill steps, whose grid is fixed at capture.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_context_len: int
    block_size: int
    is_decode_only: bool = False
    prefill_tiles: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])
