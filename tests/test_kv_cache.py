"""BlockAllocator, BlockManager and KVCache: exact block ids, accounting and tensor geometry."""

from __future__ import annotations

import pytest
import torch

from llmserve.config import CacheConfig, ModelConfig
from llmserve.core.block_manager import BlockAllocator, BlockManager, MemoryStats, NoFreeBlocksError
from llmserve.worker.kv_cache import KVCache
from llmserve.core.sampling_params import SamplingParams
from llmserve.core.sequence import Sequence


def make_seq(rid: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    arrival_time=0.0)


def tiny_model_config(**kw) -> ModelConfig:
    d = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    d.update(kw)
    return ModelConfig(**d)


# ---- BlockAllocator ---------------------------------------------------------------------------
def test_allocator_fresh_ids_in_order_and_lifo_reuse():
    a = BlockAllocator(4)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    assert a.num_free == 1 and a.num_used == 3
    a.free(1)
    a.free(0)
    # LIFO: the most recently freed block comes back first
    assert a.allocate() == 0
    assert a.allocate() == 1
    assert a.allocate() == 3
    assert a.num_free == 0
    with pytest.raises(NoFreeBlocksError, match="all 4 KV cache blocks are in use"):
        a.allocate()
    for b in range(4):
        a.free(b)
    assert a.num_free == 4


def test_allocator_reference_counts():
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    assert a.ref_count(b) == 2
    assert a.decref(b) is False          # still owned once
    assert a.num_free == 1 and not a.is_free(b)
    assert a.decref(b) is True           # back on the free list
    assert a.is_free(b) and a.num_free == 2
    assert a.allocate() == b             # LIFO


def test_allocator_errors():
    a = BlockAllocator(2)
    with pytest.raises(ValueError, match="double free"):
        a.free(0)
    with pytest.raises(ValueError, match="is free"):
        a.incref(1)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        a.free(2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        a.ref_count(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    assert issubclass(NoFreeBlocksError, RuntimeError)


# ---- BlockManager -----------------------------------------------------------------------------
@pytest.fixture
def bm():
    manager = BlockManager(num_blocks=8, block_size=4)
    yield manager
    assert manager.num_free_blocks == manager.num_total_blocks, "leaked blocks"
    assert all(manager.allocator.ref_count(b) == 0 for b in range(manager.num_total_blocks))


def test_blocks_needed(bm):
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_append_slots_exact_ids_and_lazy_growth(bm):
    a, b = make_seq("a", 6), make_seq("b", 3)
    bm.append_slots(a, 6)                 # covers 6 tokens -> 2 blocks
    bm.append_slots(b, 3)
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    a.num_computed_tokens = 6
    bm.append_slots(a, 2)                 # 8 tokens: still 2 blocks
    assert a.block_ids == [0, 1]
    a.num_computed_tokens = 8
    assert bm.num_new_blocks(a, 1) == 1
    bm.append_slots(a, 1)                 # 9 tokens: a third block
    assert a.block_ids == [0, 1, 3]
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 4 and bm.usage == 0.5
    assert bm.peak_used_blocks == 4
    assert bm.slot(a, 0) == 0 and bm.slot(a, 5) == 5 and bm.slot(a, 8) == 12
    assert bm.slots(b, 0, 3) == [8, 9, 10]
    with pytest.raises(IndexError):
        bm.slot(b, 4)
    bm.free(a)
    assert a.block_ids == []
    # a is released last-to-first, so a new 3-block table gets a's ids back in order
    c = make_seq("c", 12)
    bm.append_slots(c, 12)
    assert c.block_ids == [0, 1, 3]
    bm.free(b)
    bm.free(c)
    assert bm.peak_used_blocks == 4
    bm.reset_peak()
    assert bm.peak_used_blocks == 0


def test_can_append_and_all_or_nothing(bm):
    big = make_seq("big", 28)
    bm.append_slots(big, 28)             # 7 of 8 blocks
    s = make_seq("s", 8)
    assert bm.can_append(s, 4) and not bm.can_append(s, 5)
    with pytest.raises(NoFreeBlocksError, match="needs 2 more blocks"):
        bm.append_slots(s, 8)
    assert s.block_ids == [] and bm.num_free_blocks == 1   # nothing was taken
    bm.append_slots(s, 4)
    assert s.block_ids == [7]
    bm.free(big)
    bm.free(s)


def test_memory_stats_hand_computed(bm):
    # block_size 4, 8 blocks, 100 bytes per token slot.
    a = make_seq("a", 5, max_tokens=3)    # max 8 tokens, 5 computed -> 2 blocks (8 slots)
    b = make_seq("b", 2, max_tokens=10)   # max 12 tokens, 2 computed -> 1 block (4 slots)
    bm.append_slots(a, 5)
    a.num_computed_tokens = 5
    bm.append_slots(b, 2)
    b.num_computed_tokens = 2
    st = bm.memory_stats([a, b], bytes_per_token_slot=100)
    assert isinstance(st, MemoryStats)
    assert st.reserved_bytes == 8 * 4 * 100 == 3200
    assert st.used_bytes == 3 * 4 * 100 == 1200
    assert st.peak_used_bytes == 1200
    assert st.num_used_blocks == 3 and st.num_free_blocks == 5 and st.num_seqs == 2
    assert st.filled_slots == 7
    assert st.paged_slots == 12 and st.paged_bytes == 1200
    assert st.fragmentation_slots == 5 and st.fragmentation_bytes == 500   # 3 in a's, 2 in b's
    assert st.contiguous_slots == 8 + 12 and st.contiguous_bytes == 2000
    assert st.reduction == pytest.approx(1 - 12 / 20)
    # max_model_len caps each contiguous reservation: min(8, 10) + min(12, 10) = 18
    assert bm.memory_stats([a, b], 100, max_model_len=10).contiguous_slots == 18
    assert bm.memory_stats([], 100).reduction == 0.0
    assert st.as_dict()["fragmentation_bytes"] == 500
    bm.free(a)
    bm.free(b)


# ---- KVCache ----------------------------------------------------------------------------------
def test_kv_cache_shapes_and_bytes():
    mc = tiny_model_config()
    kv = KVCache.from_config(mc, CacheConfig(block_size=4, num_blocks=5), torch.float32, "cpu")
    assert len(kv) == 2 and len(kv.kv_caches) == 2
    for k, v in kv.kv_caches:
        assert k.shape == v.shape == (6, 4, 2, 8)          # num_blocks + 1 scratch
        assert k.dtype == torch.float32 and k.device.type == "cpu"
        assert k.data_ptr() != v.data_ptr()
    assert kv.scratch_block_id == 5
    # 2 (K,V) * 2 layers * 4 slots * 2 kv heads * 8 dims * 4 bytes
    assert KVCache.bytes_per_block(mc, 4, torch.float32) == 1024 == kv.block_bytes
    assert KVCache.bytes_per_token(mc, "bf16") == 2 * 2 * 2 * 8 * 2 == kv.bytes_per_token_slot // 2
    assert kv.total_bytes == 6 * 1024
    assert sum(t.numel() * t.element_size() for pair in kv.kv_caches for t in pair) == kv.total_bytes


def test_kv_cache_scratch_block_takes_padding_slot():
    mc = tiny_model_config(num_hidden_layers=1)
    kv = KVCache.from_config(mc, CacheConfig(block_size=4, num_blocks=3), "float32", "cpu")
    k_cache, _ = kv[0]
    flat = k_cache.view(-1, 2, 8)                  # [(num_blocks + 1) * block_size, H, D]
    flat[torch.tensor([-1])] = 1.0                  # a padding slot_mapping entry
    assert k_cache[:3].abs().sum() == 0            # allocatable blocks untouched
    assert k_cache[3, 3].eq(1.0).all()             # landed in the scratch block


def test_num_blocks_for_budget_and_resolution(monkeypatch):
    mc = tiny_model_config()
    bpb = KVCache.bytes_per_block(mc, 4, torch.float32)   # 1024
    assert KVCache.num_blocks_for_budget(11 * bpb, mc, 4, torch.float32) == 10   # one is scratch
    assert KVCache.num_blocks_for_budget(11 * bpb + bpb - 1, mc, 4, torch.float32) == 10
    with pytest.raises(ValueError, match="too small"):
        KVCache.num_blocks_for_budget(bpb * 2 - 1, mc, 4, torch.float32)
    res = KVCache.resolve_num_blocks
    assert res(mc, CacheConfig(block_size=4, num_blocks=7), torch.float32, "cpu") == 7
    assert res(mc, CacheConfig(block_size=4, memory_bytes=21 * bpb), torch.float32, "cpu") == 20
    assert res(mc, CacheConfig(block_size=4), torch.float32, "cpu") == 256 * 2**20 // bpb - 1
    # CUDA: a fraction of the free memory (queried, not allocated)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * bpb, 200 * bpb))
    cc = CacheConfig(block_size=4, gpu_memory_utilization=0.5)
    assert res(mc, cc, torch.float32, "cuda") == 50 - 1
    assert res(mc, cc, torch.bfloat16, "cuda:0") == 100 - 1


def test_kv_cache_rejects_bad_geometry():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(1, 0, 4, 2, 8)
    with pytest.raises(ValueError, match="dtype"):
        KVCache(1, 2, 4, 2, 8, dtype=torch.int8)
