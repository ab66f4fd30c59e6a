"""Paged attention (torch backend) against dense causal SDPA, at awkward sizes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmserve.attention import AttentionMetadata, get_attention_backend
from llmserve.attention.torch_backend import paged_attention_torch, write_kv_torch


def dense_reference(q, k, v, scale):
    """q: [Tq, Hq, D] at positions ctx-Tq..ctx-1; k, v: [ctx, Hkv, D]. fp64 SDPA."""
    tq, hq, d = q.shape
    ctx, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1).transpose(0, 1)          # [Hq, ctx, D]
    vv = v.double().repeat_interleave(g, dim=1).transpose(0, 1)
    qq = q.double().transpose(0, 1)                                      # [Hq, Tq, D]
    qpos = torch.arange(ctx - tq, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    mask = kpos <= qpos                                                  # [Tq, ctx]
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)                                           # [Tq, Hq, D]


def build_case(seqs, block_size, hq, hkv, d, dtype=torch.float32, seed=0):
    """seqs: list of (context_len, query_len). Returns q, caches, meta, and dense k/v per seq."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()           # scattered physical blocks
    k_cache = torch.randn(num_blocks + 1, block_size, hkv, d, generator=gen).to(dtype)  # garbage
    v_cache = torch.randn(num_blocks + 1, block_size, hkv, d, generator=gen).to(dtype)
    tables, qs, slots, dense = [], [], [], []
    for (ctx, ql), nb in zip(seqs, blocks_per_seq):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(ctx, hkv, d, generator=gen).to(dtype)
        v = torch.randn(ctx, hkv, d, generator=gen).to(dtype)
        # the prefix (ctx - ql tokens) is already cached; this step's ql tokens are written now
        pos = torch.arange(ctx)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        write_kv_torch(k[: ctx - ql], v[: ctx - ql], k_cache, v_cache, slot[: ctx - ql])
        slots.append(slot[ctx - ql:])
        qs.append(torch.randn(ql, hq, d, generator=gen).to(dtype))
        dense.append((k, v))
    max_blocks = max(len(t) for t in tables)
    bt = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    qlens = [ql for _, ql in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).long(),
        query_start_loc=torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        block_tables=bt, max_query_len=max(qlens), max_context_len=max(c for c, _ in seqs),
        block_size=block_size, is_decode_only=max(qlens) == 1)
    new_k = torch.cat([k[c - ql:] for (k, _), (c, ql) in zip(dense, seqs)])
    new_v = torch.cat([v[c - ql:] for (_, v), (c, ql) in zip(dense, seqs)])
    return torch.cat(qs), new_k, new_v, k_cache, v_cache, meta, dense


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (7, 1)])
def test_paged_matches_sdpa(block_size, hq, hkv):
    d = 32
    bs = block_size
    seqs = [(1, 1), (bs, bs), (2 * bs - 1, 2 * bs - 1), (3 * bs + 1, 1), (2 * bs, 5),
            (4 * bs + 1, bs + 1), (bs + 1, 1)]
    q, nk, nv, kc, vc, meta, dense = build_case(seqs, bs, hq, hkv, d, seed=block_size + hq)
    backend = get_attention_backend("torch")
    backend.write_kv(nk, nv, kc, vc, meta.slot_mapping)
    scale = d ** -0.5
    out = backend.forward(q, kc, vc, meta, scale)
    start = 0
    for (ctx, ql), (k, v) in zip(seqs, dense):
        ref = dense_reference(q[start:start + ql], k, v, scale)
        torch.testing.assert_close(out[start:start + ql].double(), ref, atol=1e-5, rtol=1e-5)
        start += ql


def test_decode_only_batch():
    seqs = [(c, 1) for c in (1, 15, 16, 17, 33, 64)]
    q, nk, nv, kc, vc, meta, dense = build_case(seqs, 16, 8, 2, 64, seed=3)
    write_kv_torch(nk, nv, kc, vc, meta.slot_mapping)
    assert meta.is_decode_only
    out = paged_attention_torch(q, kc, vc, meta, 0.125)
    for i, ((ctx, _), (k, v)) in enumerate(zip(seqs, dense)):
        torch.testing.assert_close(out[i:i + 1].double(), dense_reference(q[i:i + 1], k, v, 0.125),
                                   atol=1e-5, rtol=1e-5)


def test_padding_slot_goes_to_scratch_block():
    """slot -1 lands in the last (scratch) block and touches no real block."""
    kc = torch.zeros(3, 4, 1, 2)
    vc = torch.zeros(3, 4, 1, 2)
    write_kv_torch(torch.ones(2, 1, 2), torch.ones(2, 1, 2), kc, vc, torch.tensor([1, -1]))
    assert kc[0, 1].sum() == 2 and kc[1].sum() == 0 and kc[2, 3].sum() == 2


def test_unknown_backend_lists_supported():
    with pytest.raises(ValueError, match="supported"):
        get_attention_backend("cuda-magic")


def test_mixed_step_work_is_the_sum_of_its_sequences(monkeypatch):
    """Varlen: decode rows are padded only to the longest decode context and each prefill chunk
    is attended at its own size, so one long prompt does not inflate its neighbours' work."""
    import llmserve.attention.torch_backend as tb

    seqs = [(9, 1), (17, 1), (3, 3), (300, 300), (33, 4), (2000, 1), (1500, 1)]
    q, nk, nv, kc, vc, meta, dense = build_case(seqs, 16, 4, 2, 16, seed=5)
    write_kv_torch(nk, nv, kc, vc, meta.slot_mapping)
    calls = []
    real = tb._attend_group

    def spy(q_, k_, v_, bt, qs, ql, cl, max_q, max_ctx, scale):
        calls.append((bt.shape[0], max_q, max_ctx))
        return real(q_, k_, v_, bt, qs, ql, cl, max_q, max_ctx, scale)

    monkeypatch.setattr(tb, "_attend_group", spy)
    out = tb.paged_attention_torch(q, kc, vc, meta, 0.25)
    # work (query rows x context positions) summed over groups: no max x max padding
    assert sorted(calls) == sorted([(1, 1, 9), (1, 1, 17), (2, 1, 2000), (1, 3, 3), (1, 300, 300), (1, 4, 33)])
    start = 0
    for (ctx, ql), (k, v) in zip(seqs, dense):
        torch.testing.assert_close(out[start:start + ql].double(), dense_reference(q[start:start + ql], k, v, 0.25),
                                   atol=1e-5, rtol=1e-5)
        start += ql
