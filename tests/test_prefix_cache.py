"""Automatic prefix caching: block hashes, sharing, reference counts, LRU eviction, and the known
failure cases of prefix caches, with exact block ids (CPU, no model), then greedy parity on the
tiny model with caching on and off.

``KVCheckEngine`` plays the engine and, instead of a model, a *physical* KV cache: each slot
records the exact prefix (token ids up to and including its position) whose K/V it holds. Every
step, before any write, each scheduled sequence must read the right prefix in every slot below
its start position (a hit on a wrong or not-yet-written block fails); then its writes must go to
blocks that it alone owns and that hold no hash (a write into a shared or cached block fails).
"""

from __future__ import annotations

import random

import pytest

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.block_manager import ROOT_BLOCK_HASH, BlockAllocator, BlockManager, hash_block_tokens
from llmserve.core.sampling_params import SamplingParams
from llmserve.core.scheduler import Scheduler, SchedulerOutput
from llmserve.core.sequence import Sequence, SequenceStatus


def seq_of(rid: str, prompt: list[int], max_tokens: int = 1) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def fake_next_token(seq: Sequence) -> int:
    return (sum(seq.all_token_ids) * 31 + seq.num_tokens) % 997 + 1


class KVCheckEngine:
    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.bm = sched, sched.block_manager
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.steps: list[SchedulerOutput] = []
        self.starts: dict[str, list[int]] = {}     # start positions of each request's steps
        self.readmit_starts: list[int] = []        # start position when a preempted one resumes
        self._preempted: set[str] = set()

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.steps.append(out)
        self._preempted |= {q.request_id for q in out.preempted}
        bs, alloc = self.bm.block_size, self.bm.allocator
        for s in out.scheduled:                    # reads first: nothing written this step counts
            seq = s.seq
            toks = seq.token_ids_slice(0, s.start_position)
            for p in range(s.start_position):
                assert self.slots.get((seq.block_ids[p // bs], p % bs)) == tuple(toks[:p + 1]), \
                    f"{seq.request_id} reads wrong or unwritten K/V at position {p}"
            self.starts.setdefault(seq.request_id, []).append(s.start_position)
            if seq.request_id in self._preempted:
                self._preempted.discard(seq.request_id)
                self.readmit_starts.append(s.start_position)
        for s in out.scheduled:
            seq = s.seq
            prefix = seq.token_ids_slice(0, s.end_position)
            for p in range(s.start_position, s.end_position):
                b = seq.block_ids[p // bs]
                assert alloc.ref_count(b) == 1 and alloc.block_hash(b) is None, \
                    f"{seq.request_id} writes into shared/cached block {b}"
                self.slots[(b, p % bs)] = tuple(prefix[:p + 1])
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            if s.will_sample:
                seq.append_token(fake_next_token(seq))
                status = seq.check_stop(self.sched.config.max_model_len)
                if status is not None:
                    self.sched.finish_request(seq, status)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("no progress")


def make(num_blocks=16, block_size=4, caching=True, **cfg):
    cfg.setdefault("max_num_batched_tokens", 64)
    sched = Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, enable_prefix_caching=caching))
    return sched, KVCheckEngine(sched)


def assert_baseline(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(bm.allocator.ref_count(b) == 0 for b in range(bm.num_total_blocks))


P8 = [11, 12, 13, 14, 15, 16, 17, 18]


# ---- hashes -----------------------------------------------------------------------------------
def test_hash_chain_over_parent_and_tokens():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    s = seq_of("a", P8 + [19, 20])
    h = bm.block_hashes(s)
    assert len(h) == 2                             # only full blocks of known tokens
    assert h[0] == hash_block_tokens(None, P8[:4]) == hash_block_tokens(ROOT_BLOCK_HASH, P8[:4])
    assert h[1] == hash_block_tokens(h[0], P8[4:])
    # the same block tokens behind a different first block: a different identity
    other = bm.block_hashes(seq_of("b", [1, 2, 3, 4] + P8[4:]))
    assert other[1] != h[1] and other[1] == hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), P8[4:])
    s.append_token(21)
    s.append_token(22)
    assert len(bm.block_hashes(s)) == 3 and bm.block_hashes(s)[2] == hash_block_tokens(h[1], [19, 20, 21, 22])


def test_allocator_lru_eviction_order_and_plain_blocks_first():
    a = BlockAllocator(4)
    ids = [a.allocate() for _ in range(4)]
    assert ids == [0, 1, 2, 3]
    for b, tag in ((0, b"x"), (1, b"y"), (2, b"z")):
        assert a.register(b, tag * 32)
    assert not a.register(3, b"x" * 32)            # duplicate hash: stays a plain block
    for b in (2, 0, 3, 1):
        a.decref(b)
    assert a.num_free == 4 and a.num_cached == 3 and a.evictable_order() == [2, 0, 1]
    assert a.allocate() == 3                       # a never-cached block first
    assert a.allocate() == 2 and a.lookup(b"z" * 32) is None  # then least recently freed
    assert a.num_evictions == 1
    a.acquire_cached(1)                            # a hit leaves the LRU
    assert a.evictable_order() == [0] and a.ref_count(1) == 1
    assert a.allocate() == 0 and a.num_evictions == 2
    with pytest.raises(ValueError, match="not cached"):
        a.acquire_cached(0)


# ---- sharing and reference counts ------------------------------------------------------------
def test_sharing_exact_ids_and_ref_counts():
    sched, eng = make(num_blocks=16, block_size=4)
    bm = sched.block_manager
    a = seq_of("a", P8 + [1, 2], max_tokens=4)
    sched.add_request(a)
    eng.step()                                     # a computes 10 tokens into 0, 1, 2
    assert a.block_ids == [0, 1, 2] and bm.allocator.num_cached == 0   # not registered yet
    b = seq_of("b", P8 + [3, 4, 5], max_tokens=2)
    sched.add_request(b)
    out = eng.step()                               # registers a's 0, 1; b hits them
    assert [(s.seq.request_id, s.start_position, s.num_new_tokens) for s in out.scheduled] == \
        [("a", 10, 1), ("b", 8, 3)]
    assert b.block_ids == [0, 1, 3]
    assert [bm.allocator.ref_count(i) for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    st = bm.prefix_cache_stats()
    assert (st["queries"], st["hits"], st["cached_blocks"]) == (10 + 11, 8, 2)   # a queried 10 (no hit), b 11
    eng.run()
    assert_baseline(sched)
    # freed last-to-first: deepest blocks first in the LRU; a's block 2 (full by then) cached too
    assert bm.allocator.evictable_order()[-2:] == [1, 0]


def test_full_prompt_of_k_blocks_recomputes_last_block_not_last_token():
    sched, eng = make(num_blocks=16, block_size=4)
    bm = sched.block_manager
    a = seq_of("a", list(P8))
    sched.add_request(a)
    eng.run()
    assert bm.allocator.num_cached == 2            # both full blocks of a cached
    b = seq_of("b", list(P8), max_tokens=3)
    sched.add_request(b)
    out = eng.step()
    (s,) = out.scheduled
    # the hit is capped at (8 - 1) // 4 = 1 block: the last block is recomputed, privately
    assert (s.start_position, s.num_new_tokens, s.will_sample) == (4, 4, True)
    assert b.block_ids[0] == 0 and b.block_ids[1] != 1
    priv = b.block_ids[1]
    eng.run()
    assert bm.allocator.block_hash(priv) is None   # duplicate of block 1: never registered
    assert bm.allocator.block_hash(1) is not None
    # one token past the boundary: both blocks hit, one query token
    c = seq_of("c", P8 + [9], 2)
    sched.add_request(c)
    (s,) = eng.step().scheduled
    assert (s.start_position, s.num_new_tokens) == (8, 1) and c.block_ids[:2] == [0, 1]
    eng.run()
    assert_baseline(sched)


def test_same_step_admission_cannot_hit_unwritten_blocks():
    sched, eng = make(num_blocks=16, block_size=4)
    a, b = seq_of("a", P8 + [1], 2), seq_of("b", P8 + [2], 2)
    sched.add_request(a)
    sched.add_request(b)
    out = eng.step()
    assert [(s.seq.request_id, s.start_position) for s in out.scheduled] == [("a", 0), ("b", 0)]
    assert set(a.block_ids).isdisjoint(b.block_ids)
    c = seq_of("c", P8 + [3], 1)
    sched.add_request(c)
    out = eng.step()                               # a's blocks registered first, b's duplicates not
    assert c.block_ids[:2] == a.block_ids[:2] and eng.starts["c"] == [8]
    eng.run()
    assert_baseline(sched)


def test_chunked_prefill_hits_only_computed_chunks():
    sched, eng = make(num_blocks=16, block_size=4, prefill_chunk_size=4, max_num_batched_tokens=8)
    a = seq_of("a", P8 + [1, 2, 3, 4, 5], 2)
    sched.add_request(a)
    eng.step()                                     # a: tokens 0..3
    b = seq_of("b", P8 + [6], 1)
    sched.add_request(b)
    eng.step()                                     # a: 4..7; b hits block 0 only (1 not written)
    assert eng.starts["b"] == [4] and b.block_ids[0] == a.block_ids[0]
    assert b.block_ids[1] != a.block_ids[1]
    eng.run()
    assert_baseline(sched)


def test_pins_hit_before_allocating_so_it_cannot_evict_its_own_hit():
    sched, eng = make(num_blocks=3, block_size=4)
    bm = sched.block_manager
    sched.add_request(seq_of("a", P8 + [1]))
    eng.run()                                      # 0, 1 cached (LRU [1, 0]); 2 plain
    sched.add_request(seq_of("c", [40, 41, 42, 43]))
    eng.run()                                      # c takes 2 and caches it: LRU [1, 0, 2]
    assert bm.allocator.evictable_order() == [1, 0, 2] and bm.allocator._free == []
    b = seq_of("b", P8 + [2], 2)
    sched.add_request(b)
    eng.step()                                     # allocating before pinning would evict 1
    assert b.block_ids == [0, 1, 2] and bm.allocator.num_evictions == 1
    eng.run()
    assert_baseline(sched)


def test_block_evicted_while_request_waits_is_a_miss_at_admission():
    sched, eng = make(num_blocks=6, block_size=4, max_num_seqs=4)
    bm = sched.block_manager
    sched.add_request(seq_of("a", P8 + [1]))
    eng.run()                                      # P8's blocks 0, 1 cached, evictable
    d = seq_of("d", list(range(100, 116)), max_tokens=4)   # 4 blocks, then grows to a 5th
    w = seq_of("w", P8 + [2], max_tokens=2)
    sched.add_request(d)
    sched.add_request(w)
    eng.step()
    # w needed 1 new + 2 evictable hits = 3 blocks; 2 were free: it waits (nothing pinned)
    assert w.status is SequenceStatus.WAITING and w.block_ids == []
    eng.step()                                     # d's 17th token needs a 5th block: evicts 1
    assert bm.allocator.num_evictions == 1 and bm.allocator.lookup(bm.block_hashes(w)[1]) is None
    eng.run()
    assert eng.starts["w"][0] == 4                 # block 0 still hit, block 1 recomputed
    assert_baseline(sched)


def test_preempted_sequence_readmitted_with_prefix_hit():
    def run(caching):
        sched, eng = make(num_blocks=8, block_size=4, caching=caching, max_num_seqs=4,
                          prefill_chunk_size=4, max_num_batched_tokens=8)
        seqs = [seq_of(f"r{i}", [i + 1] * 3 + list(range(20, 29)), max_tokens=9) for i in range(3)]
        for s in seqs:
            sched.add_request(s)
        eng.run()
        assert_baseline(sched)
        return sched, eng, seqs

    sched, eng, seqs = run(True)
    assert sched.num_preemptions > 0
    assert eng.readmit_starts and max(eng.readmit_starts) > 0   # resumed from its cached prefix
    _, _, off = run(False)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in off]


def test_aborts_return_blocks_to_baseline():
    sched, eng = make(num_blocks=16, block_size=4)
    sched.add_request(seq_of("a", P8 + [1], 4))
    eng.step()
    b, c = seq_of("b", P8 + [2], 4), seq_of("c", P8 + [3], 4)
    sched.add_request(b)
    sched.add_request(c)
    eng.step()
    assert b.block_ids[:2] == c.block_ids[:2] and sched.block_manager.allocator.ref_count(b.block_ids[0]) == 3
    for rid in ("b", "a"):
        sched.abort_request(rid)
    assert sched.block_manager.allocator.ref_count(c.block_ids[0]) == 1
    sched.add_request(seq_of("w", P8 + [4], 4))   # waiting, then aborted
    sched.abort_request("w")
    sched.abort_request("c")
    assert_baseline(sched)
    assert sched.block_manager.allocator.num_cached >= 2   # the prefix stays cached


def test_static_batching_with_prefix_hits():
    def run(caching):
        sched, eng = make(num_blocks=32, block_size=4, caching=caching, mode="static", max_num_seqs=2)
        seqs = [seq_of(f"r{i}", P8 + [i, i + 1, i + 2], max_tokens=3) for i in range(5)]
        for s in seqs:
            sched.add_request(s)
        eng.run()
        assert_baseline(sched)
        return sched, seqs

    on, seqs_on = run(True)
    _, seqs_off = run(False)
    assert [s.output_token_ids for s in seqs_on] == [s.output_token_ids for s in seqs_off]
    assert on.block_manager.prefix_cache_hits >= 3 * 8


@pytest.mark.parametrize("seed", range(6))
def test_random_shared_prefixes_match_no_caching(seed):
    """Shared prefixes, chunking, preemption (small cache) and aborts: caching on and off give
    the same tokens; KVCheckEngine checks every read and write; no block leaks."""
    def run(caching):
        rng = random.Random(seed)
        chunk = rng.choice([None, 3, 4, 8])
        sched, eng = make(num_blocks=rng.choice([12, 16, 40]), block_size=4, caching=caching,
                          max_num_seqs=rng.choice([2, 4]), prefill_chunk_size=chunk,
                          max_num_batched_tokens=rng.choice([16, 32]),
                          mode="continuous" if seed % 3 else "static")
        roots = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 9]))] for _ in range(3)]
        seqs, aborted = [], set()
        for i in range(14):
            prompt = rng.choice(roots) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 6))]
            seqs.append(seq_of(f"r{i}", prompt, rng.randint(1, 6)))
            sched.add_request(seqs[-1])
            for _ in range(rng.randint(0, 2)):
                if sched.has_unfinished_requests():
                    eng.step()
            if rng.random() < 0.15:
                victim = rng.choice(seqs).request_id
                if sched.abort_request(victim) is not None:
                    aborted.add(victim)
        eng.run()
        assert_baseline(sched)
        return {s.request_id: s.output_token_ids for s in seqs if s.request_id not in aborted}, sched

    on, sched_on = run(True)
    off, _ = run(False)
    common = on.keys() & off.keys()
    assert common and all(on[k] == off[k] for k in common)
    assert sched_on.block_manager.prefix_cache_hits > 0


def test_cache_config_flag_validated():
    assert CacheConfig().enable_prefix_caching is True
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(enable_prefix_caching="yes")


# ---- the engine on the tiny model: caching on and off give the same greedy tokens -------------
def _engine(caching: bool, num_blocks: int | None = None, **sched):
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine

    sched.setdefault("max_num_seqs", 4)
    sched.setdefault("max_num_batched_tokens", 1024)
    return LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                  cache=CacheConfig(block_size=16, num_blocks=num_blocks, memory_bytes=32 << 20,
                                                    enable_prefix_caching=caching),
                                  scheduler=SchedulerConfig(**sched)))


def _workload(kind: str, n: int):
    from llmserve.bench.workload import build_workload, load_profile, validate_profile
    from llmserve.tokenizer import load_tokenizer

    prof, _ = load_profile("multiturn" if kind == "multi-turn" else "sharegpt")
    prof = validate_profile({**prof, "prompt_len": {"distribution": "dataset", "min": 4, "max": 384},
                             "output_len": {"distribution": "fixed", "value": 6},
                             "workload": {**prof["workload"], "kind": kind, "system_prompt_len": 64}})
    return build_workload(prof, num_requests=n, tokenizer=load_tokenizer(None))


def _run_turns(engine, workload):
    """Submit turn by turn: every request of turn k once turn k-1 of its conversation finished
    (single-turn workloads: in two waves, so the second finds the first's blocks)."""
    reqs = workload.requests
    waves: dict[int, list] = {}
    for i, r in enumerate(reqs):
        waves.setdefault(r.turn if r.conversation is not None else int(i >= len(reqs) // 2), []).append(r)
    out = {}
    for k in sorted(waves):
        seqs = [(r.index, engine.add_request(r.prompt_token_ids,
                                             SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)))
                for r in waves[k]]
        while engine.has_unfinished_requests():
            engine.step()
        out.update({i: s.output_token_ids for i, s in seqs})
    return out


@pytest.fixture(scope="module")
def workloads():
    return {"multi-turn": _workload("multi-turn", 14), "shared-prefix": _workload("shared-prefix", 8)}


@pytest.mark.parametrize("kind", ["multi-turn", "shared-prefix"])
def test_engine_outputs_identical_with_and_without_caching(kind, workloads):
    wl = workloads[kind]
    if kind == "multi-turn":
        later = [r for r in wl.requests if r.turn > 0]
        assert later, "the workload has no second turns"
        for r in later:                            # each turn extends the previous one's prompt
            prev = next(q for q in wl.requests if q.conversation == r.conversation and q.turn == r.turn - 1)
            common = next((i for i, (a, b) in enumerate(zip(prev.prompt_token_ids, r.prompt_token_ids))
                           if a != b), prev.prompt_len)
            assert common >= prev.prompt_len - 4
    on, off = _engine(True), _engine(False)
    free0 = on.block_manager.num_free_blocks
    assert _run_turns(on, wl) == _run_turns(off, wl)
    st = on.stats()["prefix_cache"]
    assert st["hits"] > 0 and 0 < st["hit_rate"] < 1
    assert off.stats()["prefix_cache"]["queries"] == 0
    assert on.block_manager.num_free_blocks == free0   # cached blocks are free (evictable)


def test_engine_chunked_preemption_and_aborts_with_caching(workloads):
    wl = workloads["shared-prefix"]
    kw = dict(prefill_chunk_size=48, max_num_batched_tokens=96, num_blocks=40)
    on, off = _engine(True, **kw), _engine(False, **kw)
    assert _run_turns(on, wl) == _run_turns(off, wl)
    assert on.stats()["num_preemptions"] > 0 and on.stats()["prefix_cache"]["hits"] > 0
    free0 = on.block_manager.num_total_blocks
    rids = [on.add_request(r.prompt_token_ids, SamplingParams(max_tokens=8, ignore_eos=True)).request_id
            for r in wl.requests[:4]]
    on.step()
    on.step()
    for rid in rids:
        on.abort_request(rid)
    assert on.block_manager.num_free_blocks == free0
    assert all(on.block_manager.allocator.ref_count(b) == 0 for b in range(free0))


def test_speculative_and_async_scheduling_with_caching(workloads):
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.engine.speculative import SpeculativeEngine

    wl = workloads["shared-prefix"]

    def cfg(caching):
        return EngineConfig(model="tiny", device="cpu", dtype="float32",
                            cache=CacheConfig(block_size=16, num_blocks=256, enable_prefix_caching=caching),
                            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024))

    ref = _run_turns(LLMEngine(cfg(False)), wl)
    spec = SpeculativeEngine(cfg(True), draft_model="tiny", num_speculative_tokens=3)
    assert _run_turns(spec, wl) == ref
    assert spec.stats()["prefix_cache"]["hits"] > 0
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_total_blocks
    asy = LLMEngine(EngineConfig(**{**{f: getattr(cfg(True), f) for f in ("model", "device", "dtype", "cache",
                                                                          "scheduler")},
                                    "async_scheduling": True}))
    assert _run_turns(asy, wl) == ref and asy.stats()["prefix_cache"]["hits"] > 0


def test_multi_turn_system_prompt_opens_every_conversation():
    """``multi_turn_system_prompt_len``: every turn of every conversation starts with the same
    rendered system prompt of at least that many tokens; 0 leaves the conversations as they were."""
    from llmserve.bench.workload import build_workload, load_profile, validate_profile
    from llmserve.tokenizer import load_tokenizer

    base, _ = load_profile("multiturn")
    tok = load_tokenizer(None)

    def wl(system_len):
        prof = validate_profile({**base, "prompt_len": {"distribution": "dataset", "min": 4, "max": 1024},
                                 "workload": {**base["workload"], "multi_turn_system_prompt_len": system_len}})
        return build_workload(prof, num_requests=12, tokenizer=tok).requests

    plain, with_system = wl(0), wl(300)
    heads = {tuple(r.prompt_token_ids[:300]) for r in with_system}
    assert len(heads) == 1                                   # one shared prefix across conversations
    assert len({r.conversation for r in with_system}) > 1
    assert all(r.prompt_len > 300 for r in with_system)
    assert all(r.prompt_len <= 1024 for r in with_system)
    assert len({tuple(r.prompt_token_ids[:300]) for r in plain}) > 1
    with pytest.raises(ValueError, match="multi_turn_system_prompt_len"):
        validate_profile({**base, "workload": {**base["workload"], "multi_turn_system_prompt_len": -1}})
    with pytest.raises(ValueError, match="leaves no room for a conversation"):
        validate_profile({**base, "workload": {**base["workload"], "multi_turn_system_prompt_len": 1024}})
