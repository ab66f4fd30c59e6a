"""Triton kernels vs PyTorch references: paged attention (KV write, decode, prefill/chunk, mixed
batches) and the INT8 weight-only linear.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (fp32/fp16: the
interpreter's bf16 arithmetic is wrong). ``TRITON_INTERPRET`` must be set before the kernels are
defined; ``conftest.py`` sets it when CUDA is unavailable, and this module sets it too before
importing anything from Triton, so import order across test modules does not matter. Shapes are small but awkward (block boundaries, 1-token contexts, GQA 1/2/6/7, K not a
multiple of the tile) to keep the interpreter fast. ``gpu``-marked tests check bf16 on CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from llmserve.attention import get_attention_backend  # noqa: E402
from llmserve.attention.metadata import AttentionMetadata  # noqa: E402
from llmserve.attention.torch_backend import paged_attention_torch, write_kv_torch  # noqa: E402
from llmserve.kernels import (
    int8_linear,
    int8_linear_reference,
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_triton,
    quantize_int8_per_channel,
    write_kv_triton,
)
from llmserve.kernels.fused import rope_qkv_write_kv  # noqa: E402
from llmserve.kernels.gemv import GemvConfig, gemv, gemv_qkv_rope, gemv_reference  # noqa: E402
from llmserve.kernels.int8_linear import Int8LinearConfig, pack_int8_planes, unpack_int8_planes
from llmserve.kernels.paged_attention import choose_num_splits  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_batch(seqs, block_size, hq, hkv, d, dtype, device=DEVICE, pad_rows=0, seed=0):
    """Random paged batch. ``seqs``: list of ``(context_len, q_len)``. Blocks are a random
    permutation of the pool; every cache entry (unused blocks and scratch too) is random, so a
    read outside the block table shows up as an error."""
    g = torch.Generator().manual_seed(seed)
    nblk = [(c + block_size - 1) // block_size for c, _ in seqs]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    bt = torch.zeros(len(seqs), max(nblk), dtype=torch.int32)
    slots, i = [], 0
    for s, ((c, ql), nb) in enumerate(zip(seqs, nblk)):
        bt[s, :nb] = torch.tensor(perm[i:i + nb], dtype=torch.int32)
        i += nb
        for p in range(c - ql, c):
            slots.append(int(bt[s, p // block_size]) * block_size + p % block_size)
    slots += [-1] * pad_rows
    shape = (num_blocks + 1, block_size, hkv, d)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    q_lens = [ql for _, ql in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    n = sum(q_lens) + pad_rows
    query = torch.randn((n, hq, d), generator=g).to(dtype).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=qsl.to(device),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device),
        block_tables=bt.to(device), max_query_len=max(q_lens), max_context_len=max(c for c, _ in seqs),
        block_size=block_size, is_decode_only=all(ql == 1 for ql in q_lens) and pad_rows == 0)
    return query, k_cache, v_cache, meta


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), f"max abs err {err}"


# ---------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------

DECODE_CASES = [
    # (contexts, block_size, hq, hkv, d, dtype)
    pytest.param([1, 15, 16, 17, 33], 16, 2, 2, 64, torch.float32, id="gqa1-d64-fp32"),
    pytest.param([16, 32, 31, 2], 16, 4, 2, 128, torch.float16, id="gqa2-d128-fp16"),
    pytest.param([1, 24, 25, 23, 40], 8, 12, 2, 64, torch.float32, id="gqa6-d64-bs8"),
    pytest.param([48, 47, 49, 1], 16, 7, 1, 32, torch.float16, id="gqa7-d32-fp16"),
]


@pytest.mark.parametrize("contexts,block_size,hq,hkv,d,dtype", DECODE_CASES)
def test_decode_matches_reference(contexts, block_size, hq, hkv, d, dtype):
    q, kc, vc, meta = make_batch([(c, 1) for c in contexts], block_size, hq, hkv, d, dtype)
    assert meta.is_decode_only
    ref = paged_attention_torch(q, kc, vc, meta, d ** -0.5)
    assert_close(paged_attention_triton(q, kc, vc, meta, d ** -0.5), ref, dtype)


@pytest.mark.parametrize("num_splits,fused", [(1, False), (3, False), (7, False), (3, True)])
def test_decode_split_counts(num_splits, fused):
    """Splits = 1 (direct store), uneven splits, and more splits than some sequences have
    tiles (empty splits must merge as zero weight); the in-kernel (fused) merge too, twice, so
    its arrival counters must have been re-armed."""
    q, kc, vc, meta = make_batch([(1, 1), (17, 1), (64, 1), (100, 1)], 16, 6, 2, 64, torch.float32)
    ref = paged_attention_torch(q, kc, vc, meta, 0.125)
    if fused:
        paged_attention_decode(q, kc, vc, meta, 0.125, num_splits=num_splits, fused_reduce=True)
    out = paged_attention_decode(q, kc, vc, meta, 0.125, num_splits=num_splits, fused_reduce=fused)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("hkv,d", [(2, 128), (1, 64)])
def test_decode_wide_tile_matches_reference(hkv, d):
    """The wide GPU tile (256 positions a program, one split per tile) run in the interpreter:
    one-tile contexts, exactly one tile, one position past it, and the 512-position bound."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32   # the GPU tile is for 16-bit
    q, kc, vc, meta = make_batch([(1, 1), (256, 1), (257, 1), (512, 1)], 16, 6 * hkv, hkv, d, dtype)
    ref = paged_attention_torch(q, kc, vc, meta, d ** -0.5)
    for _ in range(2):                                      # twice: the merge counters re-arm
        out = paged_attention_decode(q, kc, vc, meta, d ** -0.5, block_n=256, num_warps=8, num_stages=1)
        assert_close(out, ref, dtype)


def test_decode_wide_tile_config():
    """The GPU tile choice: few (sequence, KV head) pairs and short contexts take one wide tile
    (8 warps at head_dim 128, 4 below); otherwise, or with ``wide_tile=False``, the default tile
    with ``stages`` pipeline stages (3 by default)."""
    from llmserve.kernels.paged_attention import _decode_config
    assert _decode_config(128, False, 2, 300) == dict(BLOCK_N=256, num_warps=8, num_stages=1, wide=True)
    assert _decode_config(64, False, 4, 512)["num_warps"] == 4
    assert "wide" not in _decode_config(128, False, 5, 300)                # more than 4 pairs
    assert "wide" not in _decode_config(128, False, 2, 513)
    assert "wide" not in _decode_config(256, False, 1, 300)                # head_dim 256
    assert "wide" not in _decode_config(128, False, 2, 2048)
    assert "wide" not in _decode_config(128, False, 2, 300, elt=4)         # fp32 cache: too much smem
    assert _decode_config(128, True, 2, 300)["BLOCK_N"] == 16               # interpreter: small tiles
    assert _decode_config(128, False, 2, 300, wide_tile=False) == dict(BLOCK_N=64, num_warps=4, num_stages=3)
    assert _decode_config(128, False, 8, 300, stages=2)["num_stages"] == 2
    assert _decode_config(256, False, 8, 300)["BLOCK_N"] == 32


def test_decode_options_validated_and_same_results():
    """The decode kernel's options (FastPathConfig's decode_* fields) change only how the work
    is split, never the result; values outside their range raise ValueError naming the option."""
    q, kc, vc, meta = make_batch([(1, 1), (40, 1), (129, 1)], 16, 4, 2, 32, torch.float32)
    ref = paged_attention_torch(q, kc, vc, meta, 0.2)
    for kw in (dict(split_policy="waves"), dict(min_tiles=4), dict(fused_max_splits=1),
               dict(wide_tile=False, early_pages=True, prefetch_kv=False), dict(stages=1)):
        assert_close(paged_attention_decode(q, kc, vc, meta, 0.2, **kw), ref, torch.float32)
    for kw, name in ((dict(split_policy="fast"), "split_policy"), (dict(stages=0), "stages"),
                     (dict(min_tiles=0), "min_tiles"), (dict(fused_max_splits=200), "fused_max_splits")):
        with pytest.raises(ValueError, match=name):
            paged_attention_decode(q, kc, vc, meta, 0.2, **kw)


@pytest.mark.parametrize("fused", [False, True])
def test_decode_many_splits(fused):
    """More than 16 splits: the reduction merges them in several chunks."""
    q, kc, vc, meta = make_batch([(300, 1), (5, 1)], 16, 2, 1, 32, torch.float32)
    ref = paged_attention_torch(q, kc, vc, meta, 0.17)
    out = paged_attention_decode(q, kc, vc, meta, 0.17, num_splits=19, fused_reduce=fused)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits,fused", [(8, False), (8, True), (40, True), (40, False),
                                               (None, None)])
def test_decode_grid_sized_for_a_longer_context(num_splits, fused):
    """A CUDA graph sizes the grid for ``max_model_len``: every sequence spreads its own tiles
    over the splits (1-token, block-boundary and one-tile contexts use one split and skip the
    partials; longer ones several), and empty splits exit without writing partials. Run twice
    so the fused merge's counters must have been re-armed. ``None``: the default split count
    and at least ``min_tiles`` (1) tiles a split."""
    q, kc, vc, meta = make_batch([(1, 1), (16, 1), (17, 1), (33, 1), (200, 1), (129, 1)], 16, 6, 2, 64,
                                 torch.float32)
    ref = paged_attention_torch(q, kc, vc, meta, 0.125)
    meta.max_context_len = 4096                                   # as the graph runner does
    if num_splits is None:   # > fused_max_splits splits: short contexts merge in the decode
        import llmserve.kernels.paged_attention as pa    # kernel, long ones in the reduction
        out = paged_attention_decode(q, kc, vc, meta, 0.125, num_splits=40)
        assert_close(out, ref, torch.float32)
        assert pa.FUSED_REDUCE_INLINE < 13        # the 200-token context: 13 tiles, the reduction
    for _ in range(2):
        out = paged_attention_decode(q, kc, vc, meta, 0.125, num_splits=num_splits, fused_reduce=fused)
        assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (40, 16), (None, 256)])
def test_decode_early_pages_matches_reference(num_splits, block_n):
    """The first tile's block-table entries read before the PDL wait (a peeled, masked first
    tile): one-position, block-boundary, one-tile and multi-tile contexts, empty splits of a
    grid sized for a longer context, the wide tile; the merge counters re-armed (twice)."""
    q, kc, vc, meta = make_batch([(1, 1), (16, 1), (17, 1), (33, 1), (200, 1), (257, 1)], 16, 6, 2, 64,
                                 torch.float32)
    ref = paged_attention_torch(q, kc, vc, meta, 0.125)
    meta.max_context_len = 1024
    for _ in range(2):
        out = paged_attention_decode(q, kc, vc, meta, 0.125, num_splits=num_splits, block_n=block_n,
                                     early_pages=True)
        assert_close(out, ref, torch.float32)


def test_early_pages_default_follows_the_wide_tile():
    """Early block-table reads are on by default (``early_pages=None``) only with the wide
    (batch-1) tile; ``True``/``False`` force them on or off for every tile."""
    from llmserve.kernels.paged_attention import _use_early_pages
    assert _use_early_pages(True) and not _use_early_pages(False)
    assert _use_early_pages(False, True)
    assert not _use_early_pages(True, False)


def test_choose_num_splits_fills_the_gpu():
    assert choose_num_splits(64, 2, 2048, 64, 132) == 3  # one wave of ~3 programs per SM
    assert choose_num_splits(256, 2, 2048, 64, 132) == 3  # 3.9 waves rather than 1.3
    assert choose_num_splits(1, 2, 2048, 64, 132) <= 32  # never more splits than tiles
    assert choose_num_splits(512, 8, 2048, 64, 132) <= 2  # already ~10 waves
    assert choose_num_splits(4, 2, 10, 64, 132) == 1


PREFILL_CASES = [
    # (seqs [(context, q_len)], block_size, hq, hkv, d, dtype)
    pytest.param([(16, 16), (17, 17), (5, 5)], 16, 4, 2, 64, torch.float32, id="fresh-gqa2"),
    pytest.param([(40, 9), (33, 17), (32, 16)], 16, 12, 2, 128, torch.float16, id="chunk-prefix-gqa6"),
    pytest.param([(1, 1), (20, 1), (31, 15), (64, 32), (9, 2)], 8, 7, 1, 32, torch.float32,
                 id="mixed-gqa7"),
    pytest.param([(18, 18), (1, 1)], 16, 2, 2, 128, torch.float16, id="mixed-gqa1-d128"),
]


@pytest.mark.parametrize("seqs,block_size,hq,hkv,d,dtype", PREFILL_CASES)
def test_prefill_and_mixed_match_reference(seqs, block_size, hq, hkv, d, dtype):
    q, kc, vc, meta = make_batch(seqs, block_size, hq, hkv, d, dtype)
    ref = paged_attention_torch(q, kc, vc, meta, d ** -0.5)
    assert_close(paged_attention_triton(q, kc, vc, meta, d ** -0.5), ref, dtype)


@pytest.mark.parametrize("seqs,block_size,hq,hkv,d,dtype", PREFILL_CASES)
def test_scheduled_prefill_in_a_padded_graph_shape(seqs, block_size, hq, hkv, d, dtype):
    """The shapes a CUDA graph of a mixed step replays (``worker/mixed_graph.py``): extra token
    rows owned by no sequence, extra sequences of query length 0 and context 1,
    ``max_query_len`` the bucket's row count, ``max_context_len`` the model's, and the prefill
    kernel run from a tile schedule (grid ``(Hq, T)``). The real rows equal the reference; the
    padding rows are zero."""
    import numpy as np

    from llmserve.kernels.paged_attention import prefill_block_m, prefill_tile_schedule

    pad_rows, pad_seqs = 5, 3
    q, kc, vc, meta = make_batch(seqs, block_size, hq, hkv, d, dtype, pad_rows=pad_rows)
    ref = paged_attention_torch(q, kc, vc, meta, d ** -0.5)
    n, b = q.shape[0], len(seqs)
    real = int(meta.query_start_loc[-1])
    qsl = torch.cat([meta.query_start_loc.cpu(), torch.full((pad_seqs,), real, dtype=torch.int32)])
    ctx = torch.cat([meta.context_lens.cpu(), torch.ones(pad_seqs, dtype=torch.int32)])
    table = torch.cat([meta.block_tables.cpu(), torch.zeros(pad_seqs, meta.block_tables.shape[1],
                                                            dtype=torch.int32)])
    block_m = prefill_block_m(d, DEVICE)
    tiles = np.zeros(-(-n // block_m) + b + pad_seqs, dtype=np.int32)
    prefill_tile_schedule(qsl.numpy(), block_m, tiles)
    padded = AttentionMetadata(
        slot_mapping=meta.slot_mapping, query_start_loc=qsl.to(DEVICE), context_lens=ctx.to(DEVICE),
        block_tables=table.to(DEVICE), max_query_len=n, max_context_len=4 * max(c for c, _ in seqs),
        block_size=block_size, prefill_tiles=torch.from_numpy(tiles).to(DEVICE))
    out = paged_attention_triton(q, kc, vc, padded, d ** -0.5)
    assert_close(out[:real], ref[:real], dtype)
    assert (out[real:] == 0).all()
    # a schedule is for the kernel's own tile height and next to the decode kernel only
    with pytest.raises(ValueError, match="BLOCK_M"):
        paged_attention_prefill(q, kc, vc, padded, d ** -0.5, skip_decode=True, block_m=2 * block_m)
    with pytest.raises(ValueError, match="skip_decode"):
        paged_attention_prefill(q, kc, vc, padded, d ** -0.5)
    with pytest.raises(ValueError, match="block_m"):
        prefill_tile_schedule(qsl.numpy(), 0, tiles)


def test_prefill_kernel_alone_serves_decode_rows_too():
    """The varlen kernel is correct for q_len == 1 sequences as well (no decode fast path)."""
    q, kc, vc, meta = make_batch([(1, 1), (23, 1), (20, 6)], 8, 4, 2, 32, torch.float32)
    ref = paged_attention_torch(q, kc, vc, meta, 0.2)
    assert_close(paged_attention_prefill(q, kc, vc, meta, 0.2), ref, torch.float32)


def test_padding_rows_are_zero():
    q, kc, vc, meta = make_batch([(9, 3), (5, 1)], 4, 2, 1, 32, torch.float32, pad_rows=3)
    out = paged_attention_triton(q, kc, vc, meta, 0.3)
    ref = paged_attention_torch(q, kc, vc, meta, 0.3)
    assert_close(out, ref, torch.float32)
    assert (out[-3:] == 0).all()


def test_write_kv_matches_reference_and_skips_padding():
    hq, hkv, d = 4, 2, 32
    q, kc, vc, meta = make_batch([(10, 10), (7, 1)], 4, hq, hkv, d, torch.float16, pad_rows=2)
    n = q.shape[0]
    qkv = torch.randn(n, hq + 2 * hkv, d, device=DEVICE).to(torch.float16)  # fused projection
    key, value = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]                      # strided views
    kc_t, vc_t = kc.clone(), vc.clone()
    write_kv_torch(key, value, kc, vc, meta.slot_mapping)
    write_kv_triton(key, value, kc_t, vc_t, meta.slot_mapping)
    # The torch reference lets slot -1 land in the scratch block; Triton skips it.
    assert torch.equal(kc_t[:-1], kc[:-1]) and torch.equal(vc_t[:-1], vc[:-1])


def test_backend_end_to_end_chunked_then_decode():
    """Backend object: write this step's K/V then attend, chunk by chunk, against torch."""
    hq, hkv, d, bs = 6, 2, 64, 8
    torch_be, triton_be = get_attention_backend("torch"), get_attention_backend("triton")
    assert triton_be.name == "triton"
    q, kc, vc, meta = make_batch([(19, 19)], bs, hq, hkv, d, torch.float32)
    kc.zero_()
    vc.zero_()
    kc_t, vc_t = kc.clone(), vc.clone()
    k_new = torch.randn(19, hkv, d, device=DEVICE)
    v_new = torch.randn(19, hkv, d, device=DEVICE)
    bt = meta.block_tables
    for lo, hi in ((0, 12), (12, 18), (18, 19)):  # two chunks, then one decode-like token
        slots = torch.tensor([int(bt[0, p // bs]) * bs + p % bs for p in range(lo, hi)],
                             dtype=torch.int64, device=DEVICE)
        m = AttentionMetadata(slots, torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE),
                              torch.tensor([hi], dtype=torch.int32, device=DEVICE), bt, hi - lo, hi, bs,
                              is_decode_only=hi - lo == 1)
        torch_be.write_kv(k_new[lo:hi], v_new[lo:hi], kc, vc, slots)
        triton_be.write_kv(k_new[lo:hi], v_new[lo:hi], kc_t, vc_t, slots)
        ref = torch_be.forward(q[lo:hi], kc, vc, m, d ** -0.5)
        assert_close(triton_be.forward(q[lo:hi], kc_t, vc_t, m, d ** -0.5), ref, torch.float32)


def test_attention_input_errors():
    q, kc, vc, meta = make_batch([(5, 1)], 4, 2, 1, 32, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        bad = torch.zeros(kc.shape[:-1] + (48,), device=DEVICE)
        paged_attention_triton(torch.zeros(1, 2, 48, device=DEVICE), bad, bad, meta, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(q.half(), kc, vc, meta, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_triton(q[:, :1].expand(1, 3, 32).contiguous(), kc.expand(-1, -1, 2, -1).contiguous(),
                               vc.expand(-1, -1, 2, -1).contiguous(), meta, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        wide = torch.zeros(kc.shape[:-1] + (64,), device=DEVICE)[..., :32]  # strided, not contiguous
        paged_attention_triton(q, wide, wide, meta, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        meta.block_size = 8
        paged_attention_triton(q, kc, vc, meta, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(q[:, :1], q[:, :1], kc, vc, torch.zeros(1, dtype=torch.float32, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# INT8 weight-only linear
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.float16, False)])
@pytest.mark.parametrize("planes", [False, True])
def test_int8_linear_matches_dequant_matmul(m, dtype, bias, planes):
    """Row-major int8 and the same weights as byte planes (25 words a row: not a multiple of
    any tile) give the dequantize-then-matmul result at every M (every kernel kind)."""
    g = torch.Generator().manual_seed(m)
    n, k = 48, 100  # K not a multiple of the 32-wide tile, N not of 32
    w = torch.randn(n, k, generator=g) * 0.05
    w_q, scale = quantize_int8_per_channel(w)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    w_q, scale = w_q.to(DEVICE), scale.to(DEVICE)
    ref = int8_linear_reference(x, w_q, scale, b)
    if planes:
        w_q = pack_int8_planes(w_q)
        assert_close(int8_linear_reference(x, w_q, scale, b), ref, dtype)
    y = int8_linear(x, w_q, scale, b)
    assert_close(y, ref, dtype)


def test_int8_planes_whole_steps():
    """Byte planes whose word count is a multiple of every step (32 words: the tensor-core kind's
    unmasked loop with and without split-K, the matrix-vector kernel's unmasked loop), with
    -128 and 127 in the weights (sign extension of every byte position)."""
    g = torch.Generator().manual_seed(5)
    n, k = 24, 128
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)
    q[1, ::32] = -128                                   # the same word's four bytes
    scale = (torch.rand(n, generator=g) * 1e-2 + 1e-3).to(DEVICE)
    q = q.to(DEVICE)
    p = pack_int8_planes(q)
    x = torch.randn(5, k, generator=g).to(DEVICE)
    ref = int8_linear_reference(x, q, scale)
    for cfg in (Int8LinearConfig(16, 32, 64, num_warps=1, num_stages=1),
                Int8LinearConfig(16, 16, 64, split_k=2, num_warps=1, num_stages=1, fused_reduce=True),
                Int8LinearConfig(1, 1, 1, kind="dequant")):
        assert_close(int8_linear(x, p, scale, config=cfg), ref, torch.float32)
    for m in (1, 4):
        assert_close(gemv(x[:m], p, scale=scale, config=GemvConfig(2, 16, 1, 1)), ref[:m], torch.float32)


def test_int8_planes_config_rules(monkeypatch, tmp_path):
    """The GPU routing, checked without a GPU (device name and SM count faked). Without tuned
    entries: byte planes take the matrix-vector kind for M = 2 when K <= 4096 and for M <= 4 up
    to 4 Mi weights (inclusive), row-major int8 only at M = 1, the tensor-core kind otherwise;
    the gemv rule's words tile keeps 2 KB a row and step. On the H200 a tuned M = 2..4 entry
    (M = 3: M = 4's, and only for M = 3) routes that shape to the matrix-vector kind with its
    tile and ``red``; untuned shapes (the engine's packed gate-up, o_proj) keep the tensor-core
    kind; CPU devices keep it too."""
    import importlib
    import json

    gemv_mod = importlib.import_module("llmserve.kernels.gemv")   # the modules, not the
    il = importlib.import_module("llmserve.kernels.int8_linear")  # functions re-exported

    monkeypatch.setattr(gemv_mod, "_gpu_name", lambda device: "no such GPU")
    monkeypatch.setattr(il, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    kinds = {(m, n, k, planes): il.choose_int8_config(m, n, k, cuda, planes=planes).kind
             for m, n, k in ((1, 8960, 1536), (2, 8960, 1536), (3, 8960, 1536), (4, 2048, 1536),
                             (2, 1536, 8960), (8, 2048, 1536), (3, 2048, 2048), (3, 2049, 2048))
             for planes in (False, True)}
    assert kinds[(1, 8960, 1536, False)] == kinds[(1, 8960, 1536, True)] == "vec"
    assert kinds[(2, 8960, 1536, True)] == "vec" and kinds[(2, 8960, 1536, False)] == "mma"
    assert kinds[(3, 8960, 1536, True)] == kinds[(3, 8960, 1536, False)] == "mma"  # 13.8 Mi weights
    assert kinds[(4, 2048, 1536, True)] == "vec" and kinds[(4, 2048, 1536, False)] == "mma"
    assert kinds[(2, 1536, 8960, True)] == "mma"                 # K > 4096 and 13.8 Mi weights
    assert kinds[(8, 2048, 1536, True)] == "mma"                 # above GEMV_MAX_M
    assert kinds[(3, 2048, 2048, True)] == "vec" and kinds[(3, 2049, 2048, True)] == "mma"  # 4 Mi: inclusive
    # M = 64: dequantize + cuBLAS for k <= 4096, the tensor-core tiles for larger k; M = 32 tiles
    assert il.choose_int8_config(64, 8960, 1536, cuda).kind == "dequant"
    assert il.choose_int8_config(64, 1536, 8960, cuda).kind == "mma"
    assert il.choose_int8_config(32, 8960, 1536, cuda).kind == "mma"
    assert il.choose_int8_config(65, 1536, 8960, cuda).kind == "dequant"
    f = gemv_mod.choose_gemv_config(1, 8960, 1536, torch.bfloat16, cuda)
    w = gemv_mod.choose_gemv_config(1, 8960, 1536, torch.int32, cuda)
    assert (w.block_n, w.block_k * 4 * 1) == (f.block_n, f.block_k * 2)   # same bytes a row and step
    assert gemv_mod.choose_gemv_config(1, 40, 96, torch.int32, cuda).block_k == 32  # <= pow2(96 / 4)

    monkeypatch.setattr(gemv_mod, "_gpu_name", lambda device: "NVIDIA H200")
    down2 = il.choose_int8_config(2, 1536, 8960, cuda)
    assert (down2.kind, down2.block_n, down2.block_k, down2.num_warps, down2.red) == ("vec", 1, 1024, 4, 16)
    seen = []
    monkeypatch.setattr(il, "gemv", lambda *a, config, **kw: seen.append(config) or torch.zeros(2, 1536))
    il.int8_linear(torch.zeros(2, 8960, device=DEVICE), torch.zeros(1536, 8960, dtype=torch.int8, device=DEVICE),
                   torch.ones(1536, device=DEVICE), config=down2)
    assert seen[0].red == 16 and (seen[0].block_n, seen[0].block_k, seen[0].num_warps) == (1, 1024, 4)
    qkv3, qkv4 = (il.choose_int8_config(m, 2048, 1536, cuda) for m in (3, 4))   # M = 3: M = 4's tile
    assert qkv3 == qkv4 and (qkv3.kind, qkv3.block_n, qkv3.red) == ("vec", 2, 16)
    for m, n, k in ((2, 17920, 1536), (2, 1536, 1536), (4, 1536, 1536), (2, 2048, 1536)):
        want = "vec" if (n, k) == (2048, 1536) else "mma"    # untuned: packed gate-up, o_proj
        assert il.choose_int8_config(m, n, k, cuda).kind == want, (m, n, k)
        assert il.choose_int8_config(m, n, k, torch.device("cpu")).kind == "mma"
        assert il.choose_int8_config(m, n, k, torch.device("cpu"), planes=True).kind == "mma"
    # the M = 3 fallback is M = 4's entry, for M = 3 only (a table with nothing else)
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"configs": {"NVIDIA H200|int8|none|4|1024|512": [2, 256, 2, 1, 0, 4]}}))
    monkeypatch.setattr(gemv_mod, "_DEFAULT_TABLE", str(table))
    assert gemv_mod.tuned_gemv_config(3, 512, 1024, torch.int8, cuda).as_list() == [2, 256, 2, 1, 0, 4]
    assert gemv_mod.tuned_gemv_config(4, 512, 1024, torch.int8, cuda).red == 4
    assert all(gemv_mod.tuned_gemv_config(m, 512, 1024, torch.int8, cuda) is None for m in (1, 2))
    assert gemv_mod.tuned_gemv_config(3, 512, 1024, torch.int8, torch.device("cpu")) is None
    assert [il.choose_int8_config(m, 512, 1024, cuda).kind for m in (2, 3, 4)] == ["mma", "vec", "vec"]


def test_int8_planes_layout_and_errors():
    """Byte j of word i of a row is column j * K/4 + i (little-endian bytes); unpack inverts."""
    q = torch.randint(-127, 128, (3, 20), dtype=torch.int8)
    p = pack_int8_planes(q)
    assert p.dtype == torch.int32 and p.shape == (3, 5) and p.is_contiguous()
    for i in range(5):
        for j in range(4):
            byte = ((p[:, i] >> (8 * j)) & 0xFF).to(torch.int16)
            assert torch.equal(torch.where(byte > 127, byte - 256, byte), q[:, j * 5 + i].to(torch.int16))
    assert torch.equal(unpack_int8_planes(p), q)
    with pytest.raises(ValueError, match="divisible by 4"):
        pack_int8_planes(q[:, :18])
    with pytest.raises(ValueError, match="int8"):
        pack_int8_planes(q.float())
    with pytest.raises(ValueError, match="int32"):
        unpack_int8_planes(q)
    x = torch.randn(2, 20, device=DEVICE)
    with pytest.raises(ValueError, match="K=20"):
        int8_linear(torch.randn(2, 5, device=DEVICE), p.to(DEVICE), torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="scale"):
        gemv(x, p.to(DEVICE))
    with pytest.raises(ValueError, match="needs 20"):
        gemv(x[:, :16], p.to(DEVICE), scale=torch.ones(3, device=DEVICE))


@pytest.mark.parametrize("cfg", [
    Int8LinearConfig(16, 32, 32, split_k=3, swap_ab=True, num_warps=1, num_stages=1),
    Int8LinearConfig(16, 16, 64, split_k=1, swap_ab=True, num_warps=1, num_stages=1),
    Int8LinearConfig(32, 16, 32, split_k=2, swap_ab=False, group_m=2, num_warps=1, num_stages=1),
    Int8LinearConfig(16, 32, 32, split_k=3, swap_ab=True, num_warps=1, num_stages=1, fused_reduce=True),
    Int8LinearConfig(1, 1, 1, kind="dequant"),
    Int8LinearConfig(1, 2, 64, num_warps=1, num_stages=1, kind="vec"),
])
@pytest.mark.parametrize("planes", [False, True])
def test_int8_linear_configs(cfg, planes):
    """Every kernel kind: split-K with an uneven last split, swap-AB without split, non-swapped
    split-K with grouped ordering, fused split-K reduction, multi-row gemv (fused and reduce
    kernel), dequantize + matmul, the matrix-vector kind (M = 3); a 3-D input (M = 18) with a
    bf16 scale. ``planes``: the weight as byte planes (34 words a row; the tensor-core kinds
    step 16 words, four products a step)."""
    g = torch.Generator().manual_seed(1)
    n, k = 40, 136
    w_q, scale = quantize_int8_per_channel(torch.randn(n, k, generator=g))
    scale = scale.to(torch.bfloat16).to(DEVICE)
    w_q = w_q.to(DEVICE)
    ref_w = w_q
    if planes:
        w_q = pack_int8_planes(w_q)
    x = torch.randn(2, 9, k, generator=g).to(DEVICE)
    if cfg.kind == "vec":   # the matrix-vector kernel serves M <= 4
        x = x[:1, :3]
    y = int8_linear(x, w_q, scale, config=cfg)
    if cfg.fused_reduce:  # twice: the per-tile arrival counters must have been re-armed
        y = int8_linear(x, w_q, scale, config=cfg)
    assert y.shape == (*x.shape[:-1], n)
    assert_close(y, int8_linear_reference(x, ref_w, scale), torch.float32)


def test_quantize_int8_per_channel():
    w = torch.randn(24, 33)
    w[3] = 0
    w_q, scale = quantize_int8_per_channel(w)
    assert w_q.dtype == torch.int8 and w_q.shape == w.shape and scale.shape == (24,)
    assert w_q.abs().max() <= 127 and scale[3] == 1.0 and (w_q[3] == 0).all()
    err = (w_q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    assert (w_q.abs().amax(dim=1)[torch.arange(24) != 3] == 127).all()


def test_int8_linear_input_errors():
    w_q, scale = quantize_int8_per_channel(torch.randn(8, 16))
    w_q, scale = w_q.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="in_features"):
        int8_linear(torch.randn(2, 15, device=DEVICE), w_q, scale)
    with pytest.raises(ValueError, match="int8"):
        int8_linear(x, w_q.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        int8_linear(x, w_q, scale[:4])
    with pytest.raises(ValueError, match="bias"):
        int8_linear(x, w_q, scale, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="row-major"):
        int8_linear(x, w_q.t().contiguous().t(), scale)
    with pytest.raises(ValueError, match="kind"):
        int8_linear(x, w_q, scale, config=Int8LinearConfig(16, 16, 16, kind="cutlass"))
    with pytest.raises(ValueError, match="vec"):
        int8_linear(torch.randn(5, 16, device=DEVICE), w_q, scale,
                    config=Int8LinearConfig(1, 16, 16, kind="vec"))


# ---------------------------------------------------------------------------------------------
# matrix-vector kernel with fused prologues / epilogues (decode of 1..4 tokens)
# ---------------------------------------------------------------------------------------------


def _gemv_case(m, n, k, prologue, int8, dtype, glu=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(2 * n if glu else n, k, generator=g) * 0.1
    scale = None
    if int8:                      # True: row-major int8; "planes": int8 byte planes
        w, scale = quantize_int8_per_channel(w)
        scale = scale.to(DEVICE)
        if int8 == "planes":
            w = pack_int8_planes(w)
    w = w.to(DEVICE) if int8 else w.to(dtype).to(DEVICE)
    gw = (torch.randn(k, generator=g).to(dtype).to(DEVICE) if prologue == "rmsnorm" else None)
    return x, w, scale, gw


@pytest.mark.parametrize("m,n,k,prologue,int8,dtype,cfg", [
    (1, 37, 100, "none", False, torch.float32, None),              # K, N not tile multiples
    (1, 64, 96, "rmsnorm", False, torch.float16, None),
    (3, 21, 64, "none", False, torch.float32, GemvConfig(4, 16, 1, 2)),   # pipelined loop
    (4, 40, 72, "rmsnorm", True, torch.float32, GemvConfig(2, 32, 1, 3)),
    (2, 9, 33, "none", True, torch.float16, GemvConfig(1, 16, 1, 1)),
    (3, 37, 100, "rmsnorm", True, torch.float32, GemvConfig(4, 32, 1, 1, 1)),  # persistent: 2 programs
    (1, 37, 100, "rmsnorm", "planes", torch.float32, None),        # 25 words a row
    (4, 40, 72, "rmsnorm", "planes", torch.float32, GemvConfig(2, 8, 1, 1)),  # 18 words, 8 a step
    (3, 37, 100, "none", "planes", torch.float16, GemvConfig(4, 16, 1, 1, 1)),  # persistent
    # red: runs of adjacent K columns summed before they reach the accumulator
    (3, 37, 100, "rmsnorm", True, torch.float32, GemvConfig(4, 32, 1, 1, 0, 8)),
    (1, 37, 100, "none", False, torch.float16, GemvConfig(2, 16, 1, 1, 0, 16)),   # red = block_k
    (2, 21, 64, "rmsnorm", False, torch.float32, GemvConfig(4, 32, 1, 1, 1, 4)),  # persistent
    (4, 40, 72, "rmsnorm", "planes", torch.float32, GemvConfig(2, 8, 1, 1, 0, 4)),
])
@pytest.mark.parametrize("early", [False, True, 2])
def test_gemv_matches_reference(m, n, k, prologue, int8, dtype, cfg, early):
    """``early``: the epilogue's operands (scales, bias, residual) requested before the K loop."""
    x, w, scale, gw = _gemv_case(m, n, k, prologue, int8, dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    res = torch.randn(m, n, device=DEVICE).to(dtype)
    kw = dict(scale=scale, bias=bias, residual=res, prologue=prologue, norm_weight=gw, eps=1e-5,
              early_epilogue=early)
    ref_kw = {k: v for k, v in kw.items() if k != "early_epilogue"}
    ref = gemv_reference(x, w, **ref_kw)
    assert_close(gemv(x, w, config=cfg, **kw), ref, dtype)
    out = res.clone()                                       # in place: out is the residual
    gemv(x, w, config=cfg, out=out, **{**kw, "residual": out})
    assert_close(out, ref, dtype)
    late = gemv(x, w, config=cfg, **{**kw, "early_epilogue": not early})
    assert torch.equal(gemv(x, w, config=cfg, **kw), late)  # same arithmetic, loads moved
    kw.update(bias=None, residual=None)
    ref_kw.update(bias=None, residual=None)
    assert_close(gemv(x, w, config=cfg, **kw), gemv_reference(x, w, **ref_kw), dtype)


@pytest.mark.parametrize("m,n,k,prologue,int8,dtype,cfg", [
    (1, 19, 100, "rmsnorm", False, torch.float32, None),           # the engine's MLP call
    (4, 24, 64, "rmsnorm", True, torch.float32, GemvConfig(2, 32, 1, 1)),
    (2, 33, 40, "none", False, torch.float16, GemvConfig(4, 16, 1, 2)),
    (1, 19, 100, "rmsnorm", False, torch.float32, GemvConfig(2, 32, 1, 1, 2)),  # persistent
    (4, 24, 64, "rmsnorm", "planes", torch.float32, GemvConfig(2, 8, 1, 1)),
    (1, 19, 100, "rmsnorm", "planes", torch.float16, None),
    (1, 19, 100, "rmsnorm", False, torch.float32, GemvConfig(2, 32, 1, 1, 0, 8)),
    (4, 24, 64, "rmsnorm", True, torch.float32, GemvConfig(2, 32, 1, 1, 0, 8)),
])
@pytest.mark.parametrize("early", [False, True, 2])
def test_gemv_swiglu_epilogue(m, n, k, prologue, int8, dtype, cfg, early):
    """``silu(gate) * up`` of a packed ``[gate; up]`` projection, gate row n and up row N + n
    in one program (int8: each half with its own scales, loaded before or after the K loop)."""
    x, w, scale, gw = _gemv_case(m, n, k, prologue, int8, dtype, glu=True)
    kw = dict(scale=scale, prologue=prologue, norm_weight=gw, glu=True)
    y = gemv(x, w, config=cfg, early_epilogue=early, **kw)
    assert y.shape == (m, n)
    assert_close(y, gemv_reference(x, w, **kw), dtype)
    wq = unpack_int8_planes(w) if int8 == "planes" else w
    wf = (wq.float() * scale[:, None]) if int8 else w.float()         # independent check
    xf = x.float()
    if prologue == "rmsnorm":
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * gw.float()
    p = xf @ wf.T
    assert_close(y, (torch.nn.functional.silu(p[:, :n]) * p[:, n:]).to(dtype), dtype)


@pytest.mark.parametrize("m,hq,hkv,d,int8,dtype,cfg", [
    (1, 12, 2, 32, False, torch.float32, None),      # Qwen2.5-1.5B head ratio, small D
    (3, 7, 1, 16, True, torch.float32, GemvConfig(2, 16, 1, 1)),   # GQA 7, K not a tile multiple
    (4, 2, 2, 64, False, torch.float16, GemvConfig(4, 32, 1, 1)),
    (2, 6, 2, 32, False, torch.float32, GemvConfig(2, 16, 1, 1, 1)),   # persistent: 2 programs
    (3, 7, 1, 16, "planes", torch.float32, GemvConfig(2, 4, 1, 1)),   # 10 words a row, 4 a step
    (1, 12, 2, 32, "planes", torch.float16, None),
    (3, 7, 1, 16, True, torch.float32, GemvConfig(2, 16, 1, 1, 0, 8)),
    (1, 12, 2, 32, False, torch.float16, GemvConfig(1, 32, 1, 1, 0, 8)),
])
@pytest.mark.parametrize("early", [False, True, 2])
def test_gemv_qkv_rope_matches_unfused(m, hq, hkv, d, int8, dtype, cfg, early):
    """RMSNorm + packed QKV + bias + RoPE + K/V cache write in one kernel against the unfused
    pair ``gemv`` then ``rope_qkv_write_kv`` (padding slot -1 goes to the scratch block)."""
    h = 40
    x, w, scale, gw = _gemv_case(m, (hq + 2 * hkv) * d, h, "rmsnorm", int8, dtype, seed=m)
    bias = torch.randn((hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    half = d // 2
    ang = torch.arange(64.0)[:, None] / (10000.0 ** (torch.arange(half) / half))[None, :]
    cos, sin = ang.cos().contiguous().to(DEVICE), ang.sin().contiguous().to(DEVICE)
    shape = (6, 4, hkv, d)                                  # 5 blocks + scratch, block size 4
    kc, vc = torch.randn(shape).to(dtype).to(DEVICE), torch.randn(shape).to(dtype).to(DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    pos = torch.tensor([5, 63, 0, 17][:m], device=DEVICE)
    slots = torch.tensor([3, 19, -1, 4][:m], device=DEVICE)
    kw = dict(scale=scale, bias=bias, prologue="rmsnorm", norm_weight=gw, eps=1e-6)
    qkv = gemv(x, w, config=cfg, **kw)
    q_ref = rope_qkv_write_kv(qkv, pos, slots, cos, sin, kc_ref, vc_ref, hq, hkv)
    q = gemv_qkv_rope(x, w, bias=bias, norm_weight=gw, eps=1e-6, positions=pos, slot_mapping=slots,
                      cos=cos, sin=sin, k_cache=kc, v_cache=vc, num_heads=hq, num_kv_heads=hkv,
                      scale=scale, config=cfg, early_epilogue=early)
    assert q.shape == (m, hq, d)
    assert_close(q, q_ref, dtype)
    assert_close(kc, kc_ref, dtype)
    assert_close(vc, vc_ref, dtype)
    with pytest.raises(ValueError, match="Hq"):
        gemv_qkv_rope(x, w, bias=bias, norm_weight=gw, eps=1e-6, positions=pos, slot_mapping=slots,
                      cos=cos, sin=sin, k_cache=kc, v_cache=vc, num_heads=hq + 1, num_kv_heads=hkv,
                      scale=scale)


def test_gemv_float32_output():
    """A plain projection may write fp32 (the LM head's logits) from fp16 activations."""
    x, w, _, _ = _gemv_case(2, 50, 64, "none", False, torch.float16)
    out = torch.empty(2, 50, device=DEVICE)
    gemv(x, w, out=out)
    ref = x.float() @ w.float().T
    assert (out - ref).abs().max().item() < 1e-3 * max(1.0, ref.abs().max().item())
    with pytest.raises(ValueError, match="float32"):
        gemv(x, w, out=out, residual=torch.zeros(2, 50, device=DEVICE, dtype=torch.float16))


def test_gemv_input_errors():
    x, w, scale, gw = _gemv_case(2, 8, 16, "rmsnorm", True, torch.float32)
    with pytest.raises(ValueError, match="M <= 4"):
        gemv(torch.randn(5, 16, device=DEVICE), w, scale=scale)
    with pytest.raises(ValueError, match="scale"):
        gemv(x, w)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, scale=scale, prologue="rmsnorm")
    with pytest.raises(ValueError, match="needs 16"):
        gemv(torch.randn(2, 32, device=DEVICE), w, scale=scale)
    with pytest.raises(ValueError, match="prologue"):
        gemv(x, w, scale=scale, prologue="gelu")
    with pytest.raises(ValueError, match="dtype"):
        gemv(x, w.float().half())
    with pytest.raises(ValueError, match="residual"):
        gemv(x, w, scale=scale, residual=torch.zeros(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="glu"):
        gemv(x, w[:7], scale=scale[:7], glu=True)
    with pytest.raises(ValueError, match="contiguous"):              # strided scale / bias / gain
        gemv(x, w, scale=torch.rand(16, device=DEVICE)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, w, scale=scale, bias=torch.rand(16, device=DEVICE)[::2])
    with pytest.raises(ValueError, match="floating"):
        gemv(x, w, scale=scale, bias=torch.ones(8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="only for int8"):
        gemv(x, torch.randn(8, 16, device=DEVICE), scale=scale)
    xx = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="share memory"):
        gemv(xx, torch.randn(16, 16, device=DEVICE), residual=xx, out=xx)
    with pytest.raises(ValueError, match="eps"):
        gemv(x, w, scale=scale, prologue="rmsnorm", norm_weight=gw, eps=None)
    with pytest.raises(ValueError, match="early_epilogue"):
        gemv(x, w, scale=scale, early_epilogue=3)
    for bad in (dict(block_n=3, block_k=32), dict(block_n=0, block_k=32), dict(block_n=2, block_k=48),
                dict(block_n=2, block_k=32, stages=0), dict(block_n=2, block_k=32, red=3),
                dict(block_n=2, block_k=32, red=64), dict(block_n=2, block_k=32, red=0)):
        with pytest.raises(ValueError, match="GemvConfig"):
            GemvConfig(**bad)


@pytest.mark.parametrize("int8", [False, True, "planes"])
def test_gemv_gathered_rows(int8):
    """``x_rows`` / ``residual_rows``: x and the residual read as tables (an embedding lookup
    inside the kernel), repeated and out-of-order ids, int32 and int64 ids, early and late
    epilogue operands, a persistent grid, a SwiGLU epilogue; equal to gathering first (bit for
    bit in the interpreter; on a GPU the two compiled variants may contract multiply-adds
    differently: ~1e-6), in the QKV+RoPE kernel too; bad arguments are errors."""
    tol = dict(rtol=0, atol=0) if DEVICE == "cpu" else dict(rtol=1e-5, atol=1e-5)
    torch.manual_seed(3)
    table = torch.randn(50, 40, device=DEVICE)
    w = torch.randn(24, 40, device=DEVICE)
    scale = None
    if int8:
        w, scale = quantize_int8_per_channel(w)
        if int8 == "planes":
            w = pack_int8_planes(w)
    res_table = torch.randn(50, 24, device=DEVICE)
    g = torch.rand(40, device=DEVICE) + 0.5
    for cfg, early in ((GemvConfig(8, 16, 1, 1), False), (GemvConfig(8, 16, 1, 1), True),
                       (GemvConfig(4, 8, 1, 1, programs_per_sm=1), True)):
        for ids in (torch.tensor([7], device=DEVICE), torch.tensor([31, 2, 31], device=DEVICE, dtype=torch.int32)):
            x = table[ids.long()]
            kw = dict(scale=scale, config=cfg, early_epilogue=early)
            ref = gemv(x, w, residual=res_table[ids.long()], prologue="rmsnorm", norm_weight=g, **kw)
            got = gemv(table, w, residual=res_table, prologue="rmsnorm", norm_weight=g, x_rows=ids,
                       residual_rows=ids, **kw)
            torch.testing.assert_close(got, ref, **tol)
            got = gemv(x, w, residual=res_table, residual_rows=ids, **kw)
            torch.testing.assert_close(got, gemv(x, w, residual=res_table[ids.long()], **kw), **tol)
            glu_w = torch.cat([w, w.flip(0)])
            glu_s = None if scale is None else torch.cat([scale, scale.flip(0)])
            torch.testing.assert_close(gemv(table, glu_w, scale=glu_s, glu=True, x_rows=ids, config=cfg),
                                       gemv(x, glu_w, scale=glu_s, glu=True, config=cfg), **tol)
    ids = torch.tensor([3, 3], device=DEVICE)
    with pytest.raises(ValueError, match="x_rows must be a contiguous 1-D int32/int64"):
        gemv(table, w, scale=scale, x_rows=ids.float())
    with pytest.raises(ValueError, match="x_rows must be a contiguous"):
        gemv(table, w, scale=scale, x_rows=torch.tensor([3, 0, 17, 0], device=DEVICE)[::2])
    with pytest.raises(ValueError, match="same tensor"):
        gemv(table, w, scale=scale, residual=res_table, x_rows=ids, residual_rows=ids.clone())
    with pytest.raises(ValueError, match="one entry per row"):
        gemv(table[:3], w, scale=scale, residual=res_table, residual_rows=ids)
    with pytest.raises(ValueError, match="needs a residual table"):
        gemv(table[:2], w, scale=scale, residual_rows=ids)
    with pytest.raises(ValueError, match=r"\[R, N=24\]"):
        gemv(table[:2], w, scale=scale, residual=res_table[:, :5], residual_rows=ids)
    with pytest.raises(ValueError, match="residual table"):
        gemv(table[:2], w, scale=scale, residual=res_table, residual_rows=ids, out=res_table[:2])
    # QKV + RoPE: row m of x is table[ids[m]]
    hq, hkv, d = 2, 1, 8
    wq = torch.randn((hq + 2 * hkv) * d, 40, device=DEVICE)
    kc = torch.zeros(3, 4, hkv, d, device=DEVICE)
    ids = torch.tensor([9, 4], device=DEVICE)
    pos = torch.tensor([1, 5], device=DEVICE)
    slots = torch.tensor([0, 6], device=DEVICE)
    cos, sin = torch.rand(8, d // 2, device=DEVICE), torch.rand(8, d // 2, device=DEVICE)
    kw = dict(bias=None, norm_weight=torch.rand(40, device=DEVICE) + 0.5, eps=1e-6, positions=pos,
              slot_mapping=slots, cos=cos, sin=sin, num_heads=hq, num_kv_heads=hkv, config=GemvConfig(4, 16, 1, 1))
    k1, v1, k2, v2 = kc.clone(), kc.clone(), kc.clone(), kc.clone()
    q1 = gemv_qkv_rope(table[ids], wq, k_cache=k1, v_cache=v1, **kw)
    q2 = gemv_qkv_rope(table, wq, k_cache=k2, v_cache=v2, x_rows=ids, **kw)
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("kind", ["float", "int8", "planes"])
def test_gemv_pre_wait_tiles(monkeypatch, kind):
    """``GemvConfig.pre``: weight tiles requested before the PDL wait change only when loads
    are issued, not the sum's order: the results of ``pre=1`` (bit for bit in the interpreter;
    on a GPU the unrolled and the looped variants may contract multiply-adds differently: the
    H200 run of the bit-exact version failed at K = 32, pre 2, so the GPU compares to 1e-5) for plain, RMSNorm + residual,
    SwiGLU and QKV+RoPE launches, K a multiple of the tile or not, and a ``pre`` above the
    row's tile count. The launches carry ``PRE`` as configured, capped at
    the tile count, 1 on a persistent grid; bad values are
    errors."""
    from llmserve.kernels import gemv as gm
    tol = dict(rtol=0, atol=0) if DEVICE == "cpu" else dict(rtol=1e-5, atol=1e-5)
    torch.manual_seed(11)
    for k in (32, 64, 72):                     # 2 tiles of 16 (pre 3, 4 capped) / 4 / 4.5 tiles
        x = torch.randn(2, k, device=DEVICE)
        w = torch.randn(24, k, device=DEVICE)
        glu_w = torch.randn(48, k, device=DEVICE)
        scale = glu_s = None
        if kind != "float":
            w, scale = quantize_int8_per_channel(w)
            glu_w, glu_s = quantize_int8_per_channel(glu_w)
            if kind == "planes":
                w, glu_w = pack_int8_planes(w), pack_int8_planes(glu_w)
        g = torch.rand(k, device=DEVICE) + 0.5
        res = torch.randn(2, 24, device=DEVICE)
        bk = 4 if kind == "planes" else 16                    # words for planes
        base = GemvConfig(4, bk, 1, 1)
        ref = (gemv(x, w, scale=scale, config=base),
               gemv(x, w, scale=scale, residual=res, prologue="rmsnorm", norm_weight=g, config=base,
                    early_epilogue=True),
               gemv(x, glu_w, scale=glu_s, glu=True, prologue="rmsnorm", norm_weight=g, config=base))
        for pre in (2, 3, 4):
            cfg = GemvConfig(4, bk, 1, 1, 0, 1, pre)
            got = (gemv(x, w, scale=scale, config=cfg),
                   gemv(x, w, scale=scale, residual=res, prologue="rmsnorm", norm_weight=g, config=cfg,
                        early_epilogue=True),
                   gemv(x, glu_w, scale=glu_s, glu=True, prologue="rmsnorm", norm_weight=g, config=cfg))
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, **tol, msg=lambda m: f"k={k} pre={pre}: {m}")
    hq, hkv, d = 2, 1, 8
    wq = torch.randn((hq + 2 * hkv) * d, 40, device=DEVICE)
    kc = torch.zeros(3, 4, hkv, d, device=DEVICE)
    cos, sin = torch.rand(8, d // 2, device=DEVICE), torch.rand(8, d // 2, device=DEVICE)
    kw = dict(bias=torch.randn((hq + 2 * hkv) * d, device=DEVICE), norm_weight=torch.rand(40, device=DEVICE) + 0.5,
              eps=1e-6, positions=torch.tensor([1, 5], device=DEVICE), slot_mapping=torch.tensor([0, 6], device=DEVICE),
              cos=cos, sin=sin, num_heads=hq, num_kv_heads=hkv)
    xq = torch.randn(2, 40, device=DEVICE)
    k1, v1, k2, v2 = kc.clone(), kc.clone(), kc.clone(), kc.clone()
    q1 = gemv_qkv_rope(xq, wq, k_cache=k1, v_cache=v1, config=GemvConfig(4, 16, 1, 1), **kw)
    q2 = gemv_qkv_rope(xq, wq, k_cache=k2, v_cache=v2, config=GemvConfig(4, 16, 1, 1, 0, 1, 3), **kw)
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        torch.testing.assert_close(a, b, **tol)
    # launch arguments
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw["PRE"])

    monkeypatch.setattr(gm, "_gemv_kernel", Recorder())
    x, w = torch.randn(1, 40, device=DEVICE), torch.randn(24, 40, device=DEVICE)
    sms = gm.num_sms(x.device, cpu_default=2)
    wp = torch.randn(2 * (sms + 4), 40, device=DEVICE)
    gm.gemv(x, w, config=GemvConfig(2, 16, 1, 1, 0, 1, 2))          # 3 tiles of 16: 2
    gm.gemv(x, w, config=GemvConfig(2, 16, 1, 1, 0, 1, 4))          # capped at 3
    gm.gemv(x, wp, config=GemvConfig(2, 16, 1, 1, 1, 1, 3))         # persistent: 1
    gm.gemv(x, w, config=GemvConfig(2, 32, 1, 1, 0, 1, 2))          # 2 (2 tiles of 32)
    assert seen == [2, 3, 1, 2]
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="GemvConfig.pre"):
            GemvConfig(2, 32, 1, 1, 0, 1, bad)
    assert GemvConfig(2, 32, 1, 1, 0, 1, 3).as_list() == [2, 32, 1, 1, 0, 1, 3]
    assert GemvConfig(*GemvConfig(2, 32, 1, 1, 0, 4, 2).as_list()) == GemvConfig(2, 32, 1, 1, 0, 4, 2)


def test_gemv_launch_arguments_red_and_early(monkeypatch):
    """``red`` and ``early_epilogue`` reach the kernel as launched (both change only the order
    of a sum or of loads, so comparisons of results cannot see them): the config's ``red``,
    mode 2 (1 on a persistent grid),
    in ``gemv`` and ``gemv_qkv_rope``; bad ``early_epilogue`` values are errors, even for M = 0."""
    from llmserve.kernels import gemv as gm
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw)

    monkeypatch.setattr(gm, "_gemv_kernel", Recorder())
    x, w = torch.randn(1, 40, device=DEVICE), torch.randn(24, 40, device=DEVICE)
    gm.gemv(x, w, config=GemvConfig(2, 32, 1, 1, 0, 8), early_epilogue=2)
    sms = gm.num_sms(x.device, cpu_default=2)
    wp = torch.randn(2 * (sms + 4), 40, device=DEVICE)                          # sms + 4 row blocks
    gm.gemv(x, wp, config=GemvConfig(2, 32, 1, 1, 1, 4), early_epilogue=2)     # persistent: > 1 a SM
    gm.gemv(x, w, config=GemvConfig(2, 32, 1, 1), early_epilogue=True)
    gm.gemv(x, w, config=GemvConfig(2, 32, 1, 1, 0, 32), early_epilogue=False)
    assert [(k["RED"], k["EARLY_EPI"], k["PERSISTENT"]) for k in seen] == \
        [(8, 2, False), (4, 1, True), (1, 1, False), (32, 0, False)]
    seen.clear()
    hq, hkv, d = 2, 1, 8
    kc = torch.zeros(3, 4, hkv, d, device=DEVICE)
    cos = torch.rand(8, d // 2, device=DEVICE)
    qkv_kw = dict(bias=None, norm_weight=torch.ones(40, device=DEVICE), eps=1e-6,
                  positions=torch.tensor([1], device=DEVICE), slot_mapping=torch.tensor([0], device=DEVICE),
                  cos=cos, sin=cos, k_cache=kc, v_cache=kc.clone(), num_heads=hq, num_kv_heads=hkv)
    wq = torch.randn((hq + 2 * hkv) * d, 40, device=DEVICE)
    gm.gemv_qkv_rope(x, wq, config=GemvConfig(1, 64, 2, 1, 0, 4), early_epilogue=2, **qkv_kw)
    assert (seen[0]["RED"], seen[0]["EARLY_EPI"], seen[0]["ROPE"]) == (4, 2, True)
    for bad in (3, 2.7, "2", None, -1):
        with pytest.raises(ValueError, match="early_epilogue"):
            gm.gemv(x, w, early_epilogue=bad)
        with pytest.raises(ValueError, match="early_epilogue"):
            gm.gemv(x[:0], w, early_epilogue=bad)                               # M = 0 too
        with pytest.raises(ValueError, match="early_epilogue"):
            gm.gemv_qkv_rope(x[:0], wq, early_epilogue=bad, **{**qkv_kw, "positions": qkv_kw["positions"][:0],
                                                              "slot_mapping": qkv_kw["slot_mapping"][:0]})
    assert gm._early_mode(2, persistent=False) == 2 and gm._early_mode(2, persistent=True) == 1
    assert gm._early_mode(True, persistent=True) == 1 and gm._early_mode(False, persistent=False) == 0


def test_qkv_early_mode():
    """The decode QKV kernel's mode: 2 with PDL and the pre-wait (FastPathConfig.gemv_pre_wait;
    its size rule: hidden <= 2048), else the other kernels' early-epilogue setting."""
    from llmserve.models.fused_forward import qkv_early_mode
    assert qkv_early_mode(True, True, True) == 2
    assert qkv_early_mode(True, False, False) == 0           # 7B's rule: measured slower with it
    assert qkv_early_mode(False, True, True) == 1            # no PDL: no wait to read before
    assert qkv_early_mode(True, False, True) == 1


def test_gemv_qkv_rope_shipped_combination():
    """The H200 table's Qwen2.5-1.5B QKV+RoPE launch in miniature: a tile wider than K (the
    whole row read before the PDL wait), ``red`` 4, the RoPE operands read before the wait
    (mode 2), x gathered from the embedding table; against the unfused fp32 reference
    (``gemv_reference`` then ``rope_qkv_write_kv``), not another configuration of the kernel."""
    torch.manual_seed(5)
    hq, hkv, d, h = 6, 2, 16, 40
    table = torch.randn(30, h, device=DEVICE)
    w = torch.randn((hq + 2 * hkv) * d, h, device=DEVICE) / 8
    bias = torch.randn((hq + 2 * hkv) * d, device=DEVICE)
    g = torch.rand(h, device=DEVICE) + 0.5
    ids = torch.tensor([17, 3, 17], device=DEVICE)
    pos = torch.tensor([4, 0, 11], device=DEVICE)
    slots = torch.tensor([2, 9, -1], device=DEVICE)
    ang = torch.arange(16.0)[:, None] / (10000.0 ** (torch.arange(d // 2) / (d // 2)))[None, :]
    cos, sin = ang.cos().contiguous().to(DEVICE), ang.sin().contiguous().to(DEVICE)
    shape = (4, 4, hkv, d)
    kc, vc = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qkv = gemv_reference(table[ids], w, bias=bias, prologue="rmsnorm", norm_weight=g, eps=1e-6)
    q_ref = rope_qkv_write_kv(qkv, pos, slots, cos, sin, kc_ref, vc_ref, hq, hkv)
    q = gemv_qkv_rope(table, w, bias=bias, norm_weight=g, eps=1e-6, positions=pos, slot_mapping=slots,
                      cos=cos, sin=sin, k_cache=kc, v_cache=vc, num_heads=hq, num_kv_heads=hkv,
                      config=GemvConfig(1, 64, 1, 1, 0, 4), early_epilogue=2, x_rows=ids)
    for a, b in ((q, q_ref), (kc, kc_ref), (vc, vc_ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gemv_config_table(monkeypatch, tmp_path):
    """Tuned tables: malformed entries are skipped, good ones kept (``programs_per_sm`` fifth,
    ``red`` sixth, ``pre`` seventh); an untuned ``+rope`` key takes the plain projection's tile
    with half the rows; each file is its own table; an unreadable one gives no entries (the
    rules apply); the package's own table parses completely."""
    from llmserve.kernels import gemv as gm
    monkeypatch.setattr(gm, "_TABLES", {})
    table = tmp_path / "t.json"
    table.write_text('{"configs": {"a": [1, 2], "b": [2, 48, 4, 1], "c": [2, 256, 4, 1], '
                     '"d": [1, 512, 2, 1, 8], "e": [1, 512, 2, 1, -1]}}')
    assert gm._table(str(table)) == {"c": GemvConfig(2, 256, 4, 1), "d": GemvConfig(1, 512, 2, 1, 8)}
    assert gm._table(str(table))["d"].as_list() == [1, 512, 2, 1, 8]
    table_r = tmp_path / "tr.json"              # a sixth value: red (with programs_per_sm 0 fifth)
    table_r.write_text('{"configs": {"r": [2, 256, 2, 1, 0, 8], "bad": [2, 256, 2, 1, 0, 512], '
                       '"p": [2, 256, 2, 1, 0, 1, 3], "badp": [2, 256, 2, 1, 0, 1, 7]}}')   # seventh: pre
    assert gm._table(str(table_r)) == {"r": GemvConfig(2, 256, 2, 1, 0, 8), "p": GemvConfig(2, 256, 2, 1, 0, 1, 3)}
    assert gm._table(str(table_r))["r"].as_list() == [2, 256, 2, 1, 0, 8]
    table_rope = tmp_path / "trope.json"         # an untuned "+rope" key: half the rows, red kept
    table_rope.write_text('{"configs": {"G|float|rmsnorm|1|40|64": [4, 2048, 2, 1, 0, 8], '
                          '"G|float|rmsnorm|1|40|128": [4, 512, 2, 1, 0, 8, 2]}}')
    monkeypatch.setattr(gm, "_DEFAULT_TABLE", str(table_rope))
    assert gm._tuned("G", "float", "rmsnorm+rope", 1, 40, 32) == GemvConfig(2, 2048, 2, 1, 0, 8)
    assert gm._tuned("G", "float", "rmsnorm+rope", 1, 40, 64) == GemvConfig(2, 512, 2, 1, 0, 8, 2)  # pre kept
    for bad, text in (("t3.json", "[1, 2, 3]"), ("t4.json", "{not json"), ("missing.json", None)):
        if text is not None:
            (tmp_path / bad).write_text(text)
        assert gm._table(str(tmp_path / bad)) == {}
    monkeypatch.undo()
    shipped = gm._table()                         # the package's own table parses completely
    import json
    import os
    raw = json.load(open(os.path.join(os.path.dirname(gm.__file__), "gemv_configs.json")))["configs"]
    assert len(shipped) == len(raw) > 0


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at real (Qwen2.5-1.5B) shapes
# ---------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("seqs", [
    [(c, 1) for c in (1, 15, 16, 17, 255, 256, 257, 2048, 3001)],
    [(300, 300), (1000, 211), (64, 1), (17, 17), (2048, 1)],
])
def test_gpu_bf16_attention_qwen15b_layout(seqs):
    q, kc, vc, meta = make_batch(seqs, 16, 12, 2, 128, torch.bfloat16, device=torch.device("cuda"))
    ref = paged_attention_torch(q, kc, vc, meta, 128 ** -0.5)
    assert_close(paged_attention_triton(q, kc, vc, meta, 128 ** -0.5), ref, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("k,n", [(1536, 8960), (8960, 1536), (1536, 2048)])
@pytest.mark.parametrize("m", [1, 2, 16, 300])
@pytest.mark.parametrize("planes", [False, True])
def test_gpu_bf16_int8_linear(k, n, m, planes):
    dev = torch.device("cuda")
    w_q, scale = quantize_int8_per_channel(torch.randn(n, k, device=dev) * 0.02)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    y = int8_linear(x, pack_int8_planes(w_q) if planes else w_q, scale)
    ref = int8_linear_reference(x.float(), w_q, scale)
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


@gpu
@needs_cuda
@pytest.mark.parametrize("k,n", [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)])
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_bf16_gemv(k, n, m):
    dev = torch.device("cuda")
    for prologue, int8, glu in (("none", False, False), ("rmsnorm", False, False),
                                ("rmsnorm", False, True), ("none", True, False),
                                ("none", "planes", False), ("rmsnorm", "planes", True)):
        if glu and n > 17920:
            continue
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(2 * n if glu else n, k, device=dev) * 0.02
        scale = None
        if int8:
            w, scale = quantize_int8_per_channel(w)
            if int8 == "planes":
                w = pack_int8_planes(w)
        else:
            w = w.to(torch.bfloat16)
        gw = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5 if prologue == "rmsnorm" else None
        res = None if glu else torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        kw = dict(scale=scale, residual=res, prologue=prologue, norm_weight=gw, glu=glu)
        y = gemv(x, w, **kw).float()
        ref = gemv_reference(x.float(), w if int8 else w.float(), **kw).float()
        rel = ((y - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (prologue, int8, glu, rel)
