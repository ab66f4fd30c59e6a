"""The batch-invariant Triton kernels (``llmserve.kernels.invariant``): the same function as the
reference ops, and each row's bits independent of the rows launched with it and of how a prompt
was chunked.

On a CPU the kernels run in Triton's interpreter with fp32 math; the ``gpu`` cases run them in
bf16 on CUDA, where the property matters (the engine's mode on CUDA is built on them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import build_attn_metadata
from llmserve.attention.torch_backend import paged_attention_torch
from llmserve.kernels.invariant import (
    decode_segment_programs,
    invariant_linear,
    INVARIANT_LARGE_M,
    INVARIANT_MID_M,
    invariant_linear_config,
    invariant_paged_attention,
    invariant_tile_tokens,
)
from llmserve.attention.metadata import AttentionMetadata
from llmserve.kernels.paged_attention import prefill_tile_schedule

CUDA = torch.cuda.is_available()


def _devices():
    out = [pytest.param("cpu", torch.float32, id="cpu-fp32")]
    out.append(pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu))
    return out


@pytest.mark.parametrize("device,dtype", _devices())
@pytest.mark.parametrize("n,k,bias", [(45, 70, True), (96, 64, False), (40, 33, True)])
def test_linear_is_a_linear(device, dtype, n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    x = torch.randn(37, k, generator=g).to(device, dtype)
    got = invariant_linear(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.float(), ref, **tol)
    assert got.dtype == dtype and got.shape == (37, n)
    assert invariant_linear(x[:0], w, b).shape == (0, n)
    assert invariant_linear(x.view(37, 1, k), w, b).shape == (37, 1, n)


@pytest.mark.parametrize("device,dtype", _devices())
def test_linear_rows_do_not_depend_on_the_batch(device, dtype):
    """Every row of a 70-row product equals the same row computed alone and in batches of
    awkward sizes at awkward offsets (tile boundaries of 16 and 64 rows)."""
    g = torch.Generator().manual_seed(0)
    n, k = 80, 96
    w = torch.randn(n, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    x = torch.randn(70, k, generator=g).to(device, dtype)
    full = invariant_linear(x, w, b)
    for start, m in [(0, 1), (5, 1), (69, 1), (3, 2), (17, 16), (1, 17), (40, 30), (0, 64), (6, 64)]:
        assert torch.equal(invariant_linear(x[start:start + m], w, b), full[start:start + m]), (start, m)
    if device == "cuda":     # across INVARIANT_LARGE_M: other tiles, the same bits
        big = torch.randn(300, k, generator=g).to(device, dtype)
        big[123] = x[7]
        assert torch.equal(invariant_linear(big, w, b)[123], full[7])
        for n2, k2 in [(8200, 96), (33000, 64), (80, 4100), (300, 200)]:   # every configuration's shapes
            w2 = torch.randn(n2, k2, generator=g).to(device, dtype) * 0.05
            x2 = torch.randn(INVARIANT_LARGE_M + 3, k2, generator=g).to(device, dtype)
            whole = invariant_linear(x2, w2)
            for start, m in [(0, 1), (7, 1), (100, 9), (3, INVARIANT_MID_M - 1), (1, INVARIANT_MID_M),
                             (2, INVARIANT_LARGE_M - 1), (0, INVARIANT_LARGE_M)]:
                assert torch.equal(invariant_linear(x2[start:start + m], w2), whole[start:start + m]), \
                    (n2, k2, start, m)


def test_linear_config():
    """Narrow tiles for decode steps, larger ones from INVARIANT_MID_M and INVARIANT_LARGE_M
    rows; every GPU configuration a warpgroup MMA (BLOCK_M a multiple of 64, 4 or 8 warps);
    one configuration on CPU."""
    small = [invariant_linear_config(n, k)["BLOCK_N"] for n, k in ((1536, 1536), (1536, 8960),
                                                                   (17920, 1536), (151936, 1536))]
    assert small == [16, 16, 64, 128]
    assert invariant_linear_config(2048, 1536, m=INVARIANT_MID_M - 1) == invariant_linear_config(2048, 1536)
    assert invariant_linear_config(17920, 1536, m=INVARIANT_MID_M)["BLOCK_M"] == 128
    assert invariant_linear_config(1536, 8960, m=INVARIANT_MID_M)["BLOCK_N"] == 32
    for n, k in [(2048, 1536), (1536, 8960)]:
        assert invariant_linear_config(n, k, m=INVARIANT_LARGE_M)["BLOCK_M"] == 128
    for n, k in [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]:
        for m in (1, 8, INVARIANT_MID_M - 1, INVARIANT_MID_M, INVARIANT_LARGE_M, 8192):
            c = invariant_linear_config(n, k, m=m)
            assert c["BLOCK_M"] % 64 == 0 and c["num_warps"] in (4, 8), (n, k, m, c)
    assert {str(invariant_linear_config(2048, 1536, True, m)) for m in (1, 4096)} == \
        {str(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1))}


def test_linear_bad_inputs():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="disagree"):
        invariant_linear(torch.randn(3, 15), w)
    with pytest.raises(ValueError, match="share dtype"):
        invariant_linear(torch.randn(3, 16, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="bias"):
        invariant_linear(torch.randn(3, 16), w, torch.randn(7))
    with pytest.raises(ValueError, match="bias"):
        invariant_linear(torch.randn(3, 16), w, torch.randn(16)[::2])      # strided
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        invariant_linear(torch.randn(3, 16).to(torch.int32), w.to(torch.int32))
    with pytest.raises(ValueError, match="block_n"):
        invariant_linear(torch.randn(3, 16), w, block_n=24)


def _cache(device, dtype, blocks=24, bs=16, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, bs, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(blocks, bs, hkv, d, generator=g).to(device, dtype)
    return k, v


@pytest.mark.parametrize("device,dtype", _devices())
@pytest.mark.parametrize("hq", [2, 6, 7])
def test_attention_is_attention(device, dtype, hq):
    """Prefill from position 0, a chunk after a cached prefix, decode rows, block boundaries;
    GQA groups of 1, 3 and 7 query heads a KV head (a program's rows are its tokens times the
    group's heads, so 7 leaves rows of the tile unused)."""
    bs, hkv, d = 16, 1 if hq == 7 else 2, 32
    k_cache, v_cache = _cache(device, dtype, hkv=hkv, d=d)
    seqs = [(31, 1), (0, 17), (16, 16), (5, 3), (47, 1), (0, 40)]
    tables = [[0, 1], [2, 3], [4, 5], [6], [7, 8, 9], [10, 11, 12]]
    meta, _ = build_attn_metadata(seqs, tables, bs, device)
    n = sum(q for _, q in seqs)
    q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out = invariant_paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, d ** -0.5)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("device,dtype", _devices())
def test_attention_rows_do_not_depend_on_batch_or_chunking(device, dtype):
    """A 40-token prompt computed whole, as chunks of 16 + 16 + 8 and of 1 + 39, token by token
    (decode rows), and next to other sequences: the same bits for every row."""
    bs, hkv, hq, d = 16, 2, 6, 32
    k_cache, v_cache = _cache(device, dtype, hkv=hkv, d=d)
    table = [10, 11, 12]
    q = torch.randn(40, hq, d, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    scale = d ** -0.5
    whole, _ = build_attn_metadata([(0, 40)], [table], bs, device)
    ref = invariant_paged_attention(q, k_cache, v_cache, whole, scale)
    for cuts in ([16, 16, 8], [1, 39], [8] * 5, [1] * 40, [33, 7]):
        pos, parts = 0, []
        for c in cuts:
            meta, _ = build_attn_metadata([(pos, c)], [table], bs, device)
            parts.append(invariant_paged_attention(q[pos:pos + c], k_cache, v_cache, meta, scale))
            pos += c
        assert torch.equal(torch.cat(parts), ref), cuts
    # next to a decode row and another prompt, in the middle of the batch
    other = torch.randn(1 + 23, hq, d, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    meta, _ = build_attn_metadata([(30, 1), (16, 24), (0, 23)], [[0, 1], table, [5, 6]], bs, device)
    mixed = invariant_paged_attention(torch.cat([other[:1], q[16:40], other[1:]]), k_cache, v_cache,
                                      meta, scale)
    assert torch.equal(mixed[1:25], ref[16:40])


@pytest.mark.parametrize("device,dtype", _devices())
def test_decode_rows_match_prompt_rows(device, dtype):
    """Decode steps spread a row's context segments over programs and fold them in a second
    kernel; steps with a prompt token fold them in one program. A token at a context just
    under, at and over segment and tile boundaries gets the same bits both ways, and whatever
    decodes beside it (batches of 1, 5 and 6, with a longer context sizing the grid)."""
    bs, hkv, hq, d = 16, 2, 6, 32
    seg = 32 if device == "cpu" else 128
    ctxs = [1, seg - 1, seg, seg + 1, 2 * seg + 17, 3 * seg]
    tables, nxt = [], 0
    for c in ctxs:
        tables.append(list(range(nxt, nxt - (-c // bs))))
        nxt = tables[-1][-1] + 1
    k_cache, v_cache = _cache(device, dtype, blocks=nxt + 1, hkv=hkv, d=d)
    q = torch.randn(len(ctxs), hq, d, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    scale = d ** -0.5
    decode, _ = build_attn_metadata([(c - 1, 1) for c in ctxs], tables, bs, device)
    assert decode.is_decode_only
    batched = invariant_paged_attention(q, k_cache, v_cache, decode, scale, segment=seg)
    ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), decode, scale)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched.float(), ref, **tol)
    prompt = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    for i, c in enumerate(ctxs):
        alone, _ = build_attn_metadata([(c - 1, 1)], [tables[i]], bs, device)
        assert torch.equal(invariant_paged_attention(q[i:i + 1], k_cache, v_cache, alone, scale,
                                                     segment=seg), batched[i:i + 1]), c
        # the same token in a step with a prompt (the one-kernel path)
        mixed, _ = build_attn_metadata([(0, 3), (c - 1, 1)], [tables[-1], tables[i]], bs, device)
        assert not mixed.is_decode_only
        got = invariant_paged_attention(torch.cat([prompt, q[i:i + 1]]), k_cache, v_cache, mixed, scale,
                                        segment=seg)
        assert torch.equal(got[3:], batched[i:i + 1]), c
    for programs in (1, 2):         # the one-kernel path, and segments strided over programs
        # (the default gives every segment its own program)
        assert torch.equal(invariant_paged_attention(q, k_cache, v_cache, decode, scale, segment=seg,
                                                     decode_programs=programs), batched), programs
    part, _ = build_attn_metadata([(c - 1, 1) for c in ctxs[:5]], tables[:5], bs, device)
    assert torch.equal(invariant_paged_attention(q[:5], k_cache, v_cache, part, scale, segment=seg),
                       batched[:5])


def test_decode_flag_with_longer_query_takes_the_one_kernel_path():
    """A caller that marks a step decode-only while a sequence has two query tokens gets the
    one-kernel path (the split path serves one token a sequence), so the rows stay right."""
    bs, hkv, hq, d = 16, 2, 6, 32
    k_cache, v_cache = _cache("cpu", torch.float32, hkv=hkv, d=d)
    meta, _ = build_attn_metadata([(40, 2), (20, 1)], [[0, 1, 2], [3, 4]], bs)
    meta.is_decode_only = True
    q = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(7))
    got = invariant_paged_attention(q, k_cache, v_cache, meta, d ** -0.5, segment=32)
    ref = paged_attention_torch(q, k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_understated_max_context_stays_in_the_workspace():
    """The decode workspace is sized from meta.max_context_len; a context past it is cut there
    (documented), never written past the workspace."""
    bs, hkv, hq, d = 16, 2, 6, 32
    k_cache, v_cache = _cache("cpu", torch.float32, blocks=40, hkv=hkv, d=d)
    meta, _ = build_attn_metadata([(99, 1), (299, 1)], [list(range(7)), list(range(7, 26))], bs)
    meta.max_context_len = 40
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(8))
    out = invariant_paged_attention(q, k_cache, v_cache, meta, d ** -0.5, segment=32, decode_programs=2)
    assert torch.isfinite(out).all()


def test_decode_segment_programs():
    """About four programs an SM, at most one a segment; 1 (the one-kernel path) when the
    pairs fill the GPU or the workspace would be large."""
    assert decode_segment_programs(8, 2, 256, 12, 128, 132) == 33
    assert decode_segment_programs(8, 2, 4, 12, 128, 132) == 4
    assert decode_segment_programs(256, 2, 4, 12, 128, 132) == 1
    assert decode_segment_programs(64, 2, 256, 12, 128, 132) == 1      # 102 MB of workspace


def test_attention_bad_inputs():
    bs, hkv, hq, d = 16, 2, 6, 32
    k_cache, v_cache = _cache("cpu", torch.float32, hkv=hkv, d=d)
    meta, _ = build_attn_metadata([(0, 4)], [[0]], bs)
    q = torch.randn(4, hq, d)
    with pytest.raises(ValueError, match="block_m"):
        invariant_paged_attention(q, k_cache, v_cache, meta, 1.0, block_m=2)
    for bad in (24, 8, 0):
        with pytest.raises(ValueError, match="segment"):
            invariant_paged_attention(q, k_cache, v_cache, meta, 1.0, segment=bad)
    with pytest.raises(ValueError, match="decode_programs"):
        invariant_paged_attention(q, k_cache, v_cache, meta, 1.0, decode_programs=0)
    for kw in (dict(block_m=16.0), dict(num_warps=0), dict(num_stages="x")):
        with pytest.raises(ValueError):
            invariant_paged_attention(q, k_cache, v_cache, meta, 1.0, **kw)
    empty, _ = build_attn_metadata([(0, 0)], [[0]], bs)
    with pytest.raises(ValueError, match="decode_programs"):      # checked before any early return
        invariant_paged_attention(q[:0], k_cache, v_cache, empty, 1.0, decode_programs=-5)
    meta.prefill_tiles = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="prefill_tiles"):
        invariant_paged_attention(q, k_cache, v_cache, meta, 1.0, block_m=16)
    meta.prefill_tiles = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(ValueError, match="prefill_tiles"):
        invariant_paged_attention(q, k_cache, v_cache, meta, 1.0)
    with pytest.raises(ValueError, match="num_q_heads"):
        invariant_tile_tokens(6, 4, "cpu")
    with pytest.raises(ValueError, match="block_m"):
        invariant_tile_tokens(128, 1, "cpu")


@pytest.mark.parametrize("device,dtype", _devices())
def test_tile_schedule_gives_the_same_bits(device, dtype):
    """A captured graph of a step with prefill chunks runs the kernel over a fixed grid with a
    work list (every row's tiles, decode rows included) and padding: sequences of no query row,
    padding token rows, unused list entries. Every real row gets the bits of the unscheduled
    launch and of its own sequence launched alone; padding rows stay zero."""
    bs, hkv, hq, d = 16, 2, 6, 32
    k_cache, v_cache = _cache(device, dtype, blocks=40, hkv=hkv, d=d)
    scale = d ** -0.5
    # (context before the step, query tokens): a chunk crossing blocks, decode rows at awkward
    # contexts, a whole prompt one past a tile of TOK tokens, a one-token prompt
    tok = invariant_tile_tokens(hq, hkv, device)
    seqs = [(33, 21), (16, 1), (0, tok + 1), (47, 1), (0, 1)]
    tables, nxt = [], 0
    for c, q_len in seqs:
        nb = -(-(c + q_len) // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    n_real = sum(q for _, q in seqs)
    q = torch.randn(n_real, hq, d, generator=torch.Generator().manual_seed(11)).to(device, dtype)
    meta, _ = build_attn_metadata(seqs, tables, bs, device)
    ref = invariant_paged_attention(q, k_cache, v_cache, meta, scale)
    # the bucket: 64 token rows, 8 sequences, a schedule as long as a graph's
    n, s = 64, 8
    width = max(len(t) for t in tables)
    qsl = torch.full((s + 1,), n_real, dtype=torch.int32)
    qsl[:len(seqs) + 1] = meta.query_start_loc.cpu()
    ctx = torch.ones(s, dtype=torch.int32)
    ctx[:len(seqs)] = meta.context_lens.cpu()
    table = torch.zeros(s, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t)
    sched = np.zeros(-(-n // tok) + s, dtype=np.int32)
    used = prefill_tile_schedule(qsl.numpy(), tok, sched, skip_decode=False)
    assert used == sum(-(-q_len // tok) for _, q_len in seqs) and (sched[used:] == -1).all()
    qpad = torch.zeros(n, hq, d, dtype=dtype, device=device)
    qpad[:n_real] = q
    slots = torch.full((n,), -1, dtype=torch.int64, device=device)
    graph_meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=qsl.to(device), context_lens=ctx.to(device),
        block_tables=table.to(device), max_query_len=n, max_context_len=bs * width, block_size=bs,
        prefill_tiles=torch.from_numpy(sched).to(device))
    got = invariant_paged_attention(qpad, k_cache, v_cache, graph_meta, scale)
    assert torch.equal(got[:n_real], ref)
    assert not got[n_real:].any()
    # an int64 list works the same; an entry naming a sequence past the step's is skipped
    wide = torch.from_numpy(sched.astype(np.int64))
    wide[used] = (s + 3) << 16
    graph_meta.prefill_tiles = wide.to(device)
    assert torch.equal(invariant_paged_attention(qpad, k_cache, v_cache, graph_meta, scale), got)
    # a list too short for the step is refused (rows would stay uncomputed)
    graph_meta.prefill_tiles = torch.from_numpy(sched[:used]).to(device)
    with pytest.raises(ValueError, match="needs"):
        invariant_paged_attention(qpad, k_cache, v_cache, graph_meta, scale)
    start = 0
    for (c, q_len), t in zip(seqs, tables):
        alone, _ = build_attn_metadata([(c, q_len)], [t], bs, device)
        assert torch.equal(invariant_paged_attention(q[start:start + q_len], k_cache, v_cache, alone, scale),
                           ref[start:start + q_len]), (c, q_len)
        start += q_len
