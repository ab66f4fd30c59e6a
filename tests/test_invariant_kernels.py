"""The batch-invariant Triton kernels (``llmserve.kernels.invariant``): the same function as the
reference ops, and each row's bits independent of the rows launched with it and of how a prompt
was chunked.

On a CPU the kernels run in Triton's interpreter with fp32 math; the ``gpu`` cases run them in
bf16 on CUDA, where the property matters (the engine's mode on CUDA is built on them).
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_attn_metadata
from llmserve.attention.torch_backend import paged_attention_torch
from llmserve.kernels.invariant import invariant_linear, invariant_linear_config, invariant_paged_attention

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
    if device == "cuda":
        big = torch.randn(300, k, generator=g).to(device, dtype)
        big[123] = x[7]
        assert torch.equal(invariant_linear(big, w, b)[123], full[7])


def test_linear_config_depends_on_the_weight_only():
    assert invariant_linear_config(2048, 1536) == invariant_linear_config(2048, 1536)
    widths = [invariant_linear_config(n, 1536)["BLOCK_N"] for n in (1536, 17920, 151936)]
    assert widths == [16, 64, 128]


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


def test_attention_bad_inputs():
    bs, hkv, hq, d = 16, 2, 6, 32
    k_cache, v_cache = _cache("cpu", torch.float32, hkv=hkv, d=d)
    meta, _ = build_attn_metadata([(0, 4)], [[0]], bs)
    q = torch.randn(4, hq, d)
    with pytest.raises(ValueError, match="block_m"):
        invariant_paged_attention(q, k_cache, v_cache, meta, 1.0, block_m=2)
    meta.prefill_tiles = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="prefill_tiles"):
        invariant_paged_attention(q, k_cache, v_cache, meta, 1.0)
