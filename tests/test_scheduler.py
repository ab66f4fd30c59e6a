"""Scheduler + policies on CPU: exact block ids, budgets, admission order, preemption accounting.

``FakeEngine`` plays the engine's part of the contract (docs/architecture.md): after each
``schedule()`` it advances ``num_computed_tokens``, "samples" a deterministic token for
sequences that caught up and finishes them on a stop condition. It also keeps, per request, the
list of token ids a real model would have written to the KV cache, and checks invariants every
step (budget, batch size, block ownership, coverage, recompute of prompt + outputs).
"""

from __future__ import annotations

import random

import pytest

from llmserve.config import SchedulerConfig
from llmserve.core.block_manager import BlockManager
from llmserve.core.policies import POLICY_REGISTRY, WaitingQueue, get_policy
from llmserve.core.sampling_params import SamplingParams
from llmserve.core.scheduler import RequestRejectedError, Scheduler, SchedulerOutput
from llmserve.core.sequence import Sequence, SequenceStatus


# ---- helpers ----------------------------------------------------------------------------------
def make_seq(rid: str, prompt_len: int, max_tokens: int, arrival: float | None = None,
             priority: int = 0) -> Sequence:
    prompt = [(7 * i + len(rid)) % 50 + 1 for i in range(prompt_len)]
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens),
                    arrival_time=0.0 if arrival is None else arrival, priority=priority)


def fake_next_token(seq: Sequence) -> int:
    """Deterministic 'model': a function of the whole history (never an EOS; none configured)."""
    return (sum(seq.all_token_ids) * 31 + seq.num_tokens) % 1000 + 1


class FakeEngine:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.cfg = sched.config
        self.bm = sched.block_manager
        self.kv: dict[str, list[int]] = {}       # token ids "in the cache" per request
        self.first_order: list[str] = []          # request ids in order of first scheduling
        self.steps: list[SchedulerOutput] = []
        self.total_computed = 0

    def step(self) -> SchedulerOutput:
        return self.apply(self.sched.schedule())

    def apply(self, out: SchedulerOutput) -> SchedulerOutput:
        """Check the plan ``out`` of the latest ``schedule()`` and do the engine's update."""
        sched, bm, cfg = self.sched, self.bm, self.cfg
        self.steps.append(out)
        # -- invariants of the plan
        ns = [s.num_new_tokens for s in out.scheduled]
        assert all(n >= 1 for n in ns)
        assert out.num_batched_tokens == sum(ns) <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
        ids = [s.seq.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        if cfg.prefill_chunk_size is not None:
            assert all(n <= cfg.prefill_chunk_size for n in ns)
        owned = [b for seq in sched.running for b in seq.block_ids]
        assert len(owned) == len(set(owned)), "a block owned twice"
        assert len(owned) == bm.num_used_blocks, "allocated blocks not owned by a running sequence"
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.block_ids == []
            assert seq.num_computed_tokens == 0 and seq.request_id not in ids
            self.kv[seq.request_id] = []
        # -- the engine's update
        for s in out.scheduled:
            seq = s.seq
            kv = self.kv.setdefault(seq.request_id, [])
            if seq.request_id not in self.first_order:
                self.first_order.append(seq.request_id)
            assert seq.status is SequenceStatus.RUNNING
            assert seq.metrics.first_scheduled_time is not None
            assert s.start_position == seq.num_computed_tokens == len(kv)
            assert len(seq.block_ids) == bm.blocks_needed(s.end_position)   # lazy, exact
            kv.extend(s.token_ids)
            seq.num_computed_tokens += s.num_new_tokens
            self.total_computed += s.num_new_tokens
            if s.will_sample:
                assert kv == seq.all_token_ids   # the model has seen every token, outputs included
                seq.append_token(fake_next_token(seq))
                status = seq.check_stop(cfg.max_model_len)
                if status is not None:
                    sched.finish_request(seq, status)
            else:
                assert seq.num_computed_tokens < seq.num_tokens
        return out

    def run(self, max_steps: int = 10_000) -> int:
        n = 0
        while self.sched.has_unfinished_requests():
            self.step()
            n += 1
            assert n < max_steps, "scheduler made no progress"
        return n


def table(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


@pytest.fixture
def make():
    """``make(num_blocks, block_size, **scheduler_config) -> (Scheduler, FakeEngine)``.

    Teardown aborts whatever is still unfinished and asserts that every block is free again
    (no leak through finish, abort or preemption) and the queues are empty.
    """
    created: list[Scheduler] = []

    def factory(num_blocks: int = 64, block_size: int = 4, **cfg):
        sched = Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))
        created.append(sched)
        return sched, FakeEngine(sched)

    yield factory
    for sched in created:
        for rid in list(sched.requests):
            assert sched.abort_request(rid) is not None
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks, "leaked KV blocks"
        assert all(bm.allocator.ref_count(b) == 0 for b in range(bm.num_total_blocks))
        assert sched.num_running == 0 and sched.num_waiting == 0
        assert not sched.has_unfinished_requests()


# ---- exact block ids ----------------------------------------------------------------------------
def test_continuous_exact_block_ids_and_lifo_reuse(make):
    sched, eng = make(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    a, b = make_seq("a", 6, 3), make_seq("b", 3, 3)
    sched.add_request(a)
    sched.add_request(b)
    assert sched.num_waiting == 2 and a.status is SequenceStatus.WAITING

    out = eng.step()
    assert table(out) == [("a", 6), ("b", 3)] and out.num_batched_tokens == 9
    assert all(s.is_prefill and s.will_sample for s in out.scheduled)
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    assert sched.num_running == 2 and sched.num_waiting == 0

    out = eng.step()                      # decodes: a covers 7, b covers 4
    assert table(out) == [("a", 1), ("b", 1)]
    assert not any(s.is_prefill for s in out.scheduled)
    assert a.block_ids == [0, 1] and b.block_ids == [2]

    out = eng.step()                      # a covers 8, b covers 5 -> a new block for b
    assert a.block_ids == [] and b.block_ids == []       # both finished (3 tokens each)
    assert a.status is b.status is SequenceStatus.FINISHED_LENGTH
    assert a.output_token_ids and len(b.output_token_ids) == 3
    assert a.metrics.finish_time is not None
    assert sched.block_manager.peak_used_blocks == 4
    # a freed [0, 1] then b freed [2, 3], each last-to-first: LIFO hands out 2, 3, 0, 1, 4, ...
    c = make_seq("c", 9, 1)
    sched.add_request(c)
    eng.step()
    assert eng.steps[-1].scheduled[0].seq is c
    assert not sched.has_unfinished_requests()
    d = make_seq("d", 17, 1)
    sched.add_request(d)
    sched.schedule()
    assert d.block_ids == [2, 3, 0, 1, 4]   # c's [2, 3, 0] came back first-on-top again


# ---- budget and chunking ------------------------------------------------------------------------
def test_chunked_prefill_shares_budget_with_decode(make):
    sched, eng = make(num_blocks=16, block_size=4, max_num_batched_tokens=4, prefill_chunk_size=4)
    a = make_seq("a", 2, 8)
    sched.add_request(a)
    assert table(eng.step()) == [("a", 2)]
    b = make_seq("b", 10, 2)
    sched.add_request(b)
    plans, b_tables = [], []
    for i in range(4):
        out = eng.step()
        plans.append(table(out))
        b_tables.append(list(b.block_ids))
        assert out.num_batched_tokens == (4 if i < 3 else 2)
    # a decodes every step; b's prompt takes what is left (3, 3, 3, then the last 1)
    assert plans == [[("a", 1), ("b", 3)]] * 3 + [[("a", 1), ("b", 1)]]
    assert b_tables == [[1], [1, 2], [1, 2, 4], [1, 2, 4]]
    assert a.block_ids == [0, 3]
    b_steps = [s for out in eng.steps[1:] for s in out.scheduled if s.seq is b]
    assert [s.will_sample for s in b_steps] == [False, False, False, True]
    # is_prefill means "catching up more than one token": b's last 1-token chunk is decode-like
    assert [s.is_prefill for s in b_steps] == [True, True, True, False]
    assert b.num_output_tokens == 1
    eng.run()


def test_chunk_not_dividing_block_size(make):
    sched, eng = make(num_blocks=16, block_size=4, max_num_batched_tokens=100, prefill_chunk_size=3)
    a, b = make_seq("a", 10, 2), make_seq("b", 5, 1)
    sched.add_request(a)
    sched.add_request(b)
    rows = []
    while sched.has_unfinished_requests():
        out = eng.step()
        rows.append([(s.seq.request_id, s.num_new_tokens, s.start_position, s.is_prefill,
                      s.will_sample, list(s.seq.block_ids)) for s in out.scheduled])
    assert rows == [
        [("a", 3, 0, True, False, [0]), ("b", 3, 0, True, False, [1])],
        [("a", 3, 3, True, False, [0, 2]), ("b", 2, 3, True, True, [])],   # b done, freed
        [("a", 3, 6, True, False, [0, 2, 1])],                           # reuses b's block 1
        [("a", 1, 9, False, True, [0, 2, 1])],                           # catches up at 10
        [("a", 1, 10, False, True, [])],                                 # decode, then done
    ]


def test_no_chunking_whole_prompts_wait_for_budget(make):
    sched, eng = make(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    with pytest.raises(RequestRejectedError, match="set prefill_chunk_size or raise max_num_batched_tokens"):
        sched.add_request(make_seq("huge", 9, 1))
    for rid, p in (("a", 5), ("b", 6), ("c", 2)):
        sched.add_request(make_seq(rid, p, 3))
    # b (6) does not fit the 3 tokens left and c may not overtake it
    assert table(eng.step()) == [("a", 5)]
    assert table(eng.step()) == [("a", 1), ("b", 6)]
    assert table(eng.step()) == [("a", 1), ("b", 1), ("c", 2)]
    eng.run()


def test_no_chunking_recompute_longer_than_budget_runs_in_budget_pieces(make):
    # A recompute catches up prompt + outputs, which can exceed the step budget even though the
    # prompt alone fit. Without chunking it is then computed in budget-sized pieces.
    sched, eng = make(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    s = make_seq("s", 3, 6)
    for t in (11, 12, 13):                  # the state of a sequence preempted after 3 outputs
        s.append_token(t)
    sched.add_request(s)
    out = eng.step()
    assert table(out) == [("s", 4)] and not out.scheduled[0].will_sample
    out = eng.step()
    assert table(out) == [("s", 2)] and out.scheduled[0].will_sample
    assert table(eng.step()) == [("s", 1)]
    eng.run()
    assert s.num_output_tokens == 6


def test_max_num_seqs_respected(make):
    sched, eng = make(num_blocks=64, block_size=4, max_num_seqs=2)
    seqs = [make_seq(f"r{i}", 3 + i, 2 + i) for i in range(5)]
    for s in seqs:
        sched.add_request(s)
    peak = 0
    while sched.has_unfinished_requests():
        out = eng.step()
        peak = max(peak, len(out.scheduled), sched.num_running)
    assert peak == 2
    assert eng.first_order == [s.request_id for s in seqs]
    assert all(s.num_output_tokens == s.sampling_params.max_tokens for s in seqs)


def test_static_mode_admits_only_when_batch_is_empty(make):
    sched, eng = make(num_blocks=64, block_size=4, max_num_seqs=2, mode="static")
    for rid, mt in (("a", 2), ("b", 4), ("c", 3), ("d", 1)):
        sched.add_request(make_seq(rid, 4, mt))
    batches = []
    while sched.has_unfinished_requests():
        batches.append(sorted(s.seq.request_id for s in eng.step().scheduled))
    # a finishes after step 2, but c and d wait until b is done too
    assert batches == [["a", "b"], ["a", "b"], ["b"], ["b"], ["c", "d"], ["c"], ["c"]]

    # the same workload in continuous mode admits c as soon as a leaves
    sched2, eng2 = make(num_blocks=64, block_size=4, max_num_seqs=2)
    for rid, mt in (("a", 2), ("b", 4), ("c", 3), ("d", 1)):
        sched2.add_request(make_seq(rid, 4, mt))
    batches2 = []
    while sched2.has_unfinished_requests():
        batches2.append(sorted(s.seq.request_id for s in eng2.step().scheduled))
    assert batches2[2] == ["b", "c"]


def test_static_batch_prefills_within_budget(make):
    # the batch is formed at once; prompts larger than the leftover budget run in later steps
    sched, eng = make(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=8,
                      mode="static")
    for rid in "abcd":
        sched.add_request(make_seq(rid, 5, 2))
    assert table(eng.step()) == [("a", 5)]
    assert sched.num_running == 3 and sched.num_waiting == 1
    assert table(eng.step()) == [("a", 1), ("b", 5)]
    assert table(eng.step()) == [("b", 1), ("c", 5)]     # a finished
    assert table(eng.step()) == [("c", 1)]
    assert table(eng.step()) == [("d", 5)]               # next batch
    eng.run()


# ---- policies -----------------------------------------------------------------------------------
def test_fcfs_completes_everything_in_arrival_order(make):
    sched, eng = make(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                      prefill_chunk_size=8)
    rng = random.Random(0)
    seqs = [make_seq(f"r{i}", rng.randint(1, 40), rng.randint(1, 12), arrival=float(i)) for i in range(12)]
    # explicit arrival times beat insertion order
    late_added = make_seq("early", 5, 3, arrival=-1.0)
    for s in seqs:
        sched.add_request(s)
    sched.add_request(late_added)
    eng.run()
    assert eng.first_order == ["early"] + [s.request_id for s in seqs]
    for s in seqs + [late_added]:
        assert s.status is SequenceStatus.FINISHED_LENGTH
        assert s.num_output_tokens == s.sampling_params.max_tokens
    assert eng.total_computed == sum(s.num_tokens - 1 for s in seqs + [late_added]) \
        + sched.num_recomputed_tokens


def test_sjf_admits_shortest_max_total_first(make):
    sched, eng = make(num_blocks=64, block_size=4, max_num_seqs=1, policy="sjf")
    for rid, p, mt in (("a", 10, 20), ("b", 5, 5), ("c", 10, 10), ("d", 2, 8)):
        sched.add_request(make_seq(rid, p, mt))
    assert [s.request_id for s in sched.waiting] == ["b", "d", "c", "a"]
    eng.run()
    # b and d both hold at most 10 tokens: arrival (insertion) order breaks the tie
    assert eng.first_order == ["b", "d", "c", "a"]


def test_priority_admits_lower_value_first(make):
    sched, eng = make(num_blocks=64, block_size=4, max_num_seqs=1, policy="priority")
    for rid, prio in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        sched.add_request(make_seq(rid, 4, 2, priority=prio))
    eng.run()
    assert eng.first_order == ["b", "d", "c", "a"]


def test_policy_registry():
    assert sorted(POLICY_REGISTRY) == ["fcfs", "priority", "sjf"]
    assert get_policy("sjf").name == "sjf"
    with pytest.raises(ValueError, match=r"unknown scheduling policy 'lifo'; supported: \['fcfs', 'priority', 'sjf'\]"):
        get_policy("lifo")


def test_waiting_queue_front_lane_and_lazy_remove():
    q = WaitingQueue(get_policy("fcfs"))
    seqs = [make_seq(f"s{i}", 2, 1, arrival=float(i)) for i in range(4)]
    for i, s in enumerate(seqs):
        s._arrival_index = i
    q.push(seqs[1])
    q.push(seqs[2])
    q.push(seqs[3], front=True)       # preempted: ahead of never-run requests
    q.push(seqs[0])
    assert [s.request_id for s in q] == ["s3", "s0", "s1", "s2"]
    assert q.remove(seqs[0]) and not q.remove(seqs[0]) and len(q) == 3
    assert seqs[0] not in q and seqs[1] in q
    assert q.pop() is seqs[3] and q.peek() is seqs[1] and q.pop() is seqs[1]
    with pytest.raises(ValueError, match="already waiting"):
        q.push(seqs[2])
    assert q.pop() is seqs[2] and q.peek() is None and not q
    with pytest.raises(IndexError):
        q.pop()


# ---- rejection and abort ------------------------------------------------------------------------
def test_too_large_requests_rejected_while_rest_finish(make):
    sched, eng = make(num_blocks=4, block_size=4, max_model_len=32, max_num_batched_tokens=64)
    ok = [make_seq("ok1", 6, 4), make_seq("ok2", 3, 5)]
    sched.add_request(ok[0])
    too_long = make_seq("long", 30, 5)
    with pytest.raises(RequestRejectedError, match=r"= 35 tokens exceeds max_model_len=32"):
        sched.add_request(too_long)
    too_big = make_seq("big", 10, 10)          # 20 tokens -> 5 blocks of 4 > 4 blocks
    with pytest.raises(ValueError, match="needs 5 KV blocks of 4 tokens but the cache has only 4"):
        sched.add_request(too_big)
    dup = make_seq("ok1", 2, 1)
    with pytest.raises(RequestRejectedError, match="already in use"):
        sched.add_request(dup)
    sched.add_request(ok[1])
    for s in (too_long, too_big, dup):
        assert s.status is SequenceStatus.REJECTED and s.block_ids == []
        assert s.metrics.first_scheduled_time is None
    assert sched.num_waiting == 2
    with pytest.raises(ValueError, match="new WAITING sequence"):
        sched.add_request(too_long)             # a rejected sequence cannot be re-added
    eng.run()
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in ok)
    assert ok[0].status is SequenceStatus.FINISHED_LENGTH   # the original "ok1" is untouched


def test_abort_waiting_running_and_unknown(make):
    sched, eng = make(num_blocks=16, block_size=4, max_num_seqs=2)
    a, b, c = make_seq("a", 6, 5), make_seq("b", 4, 5), make_seq("c", 4, 5)
    for s in (a, b, c):
        sched.add_request(s)
    eng.step()
    assert a.block_ids == [0, 1] and b.block_ids == [2] and sched.num_waiting == 1
    assert sched.abort_request("a") is a
    assert a.status is SequenceStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.block_ids == [] and sched.block_manager.num_free_blocks == 15
    assert sched.abort_request("c") is c              # waiting
    assert sched.num_waiting == 0 and c.status is SequenceStatus.FINISHED_ABORTED
    assert sched.abort_request("a") is None           # already finished
    assert sched.abort_request("nope") is None
    assert sched.num_running == 1
    sched.finish_request(a, SequenceStatus.FINISHED_STOPPED)   # no effect on a finished one
    assert a.status is SequenceStatus.FINISHED_ABORTED
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_request(b, SequenceStatus.RUNNING)
    eng.run()
    assert b.status is SequenceStatus.FINISHED_LENGTH


# ---- preemption ---------------------------------------------------------------------------------
def test_preemption_exact_ids_counts_and_readmission_before_newer(make):
    sched, eng = make(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    a, b = make_seq("a", 3, 4), make_seq("b", 2, 4)
    sched.add_request(a)
    sched.add_request(b)
    eng.step()
    assert (a.block_ids, b.block_ids) == ([0, 1], [2])
    eng.step()
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    assert b.num_computed_tokens == 3 and b.num_output_tokens == 2

    out = eng.step()                         # a needs a 3rd block: b (last in FCFS) is preempted
    assert out.preempted == [b] and table(out) == [("a", 1)]
    assert a.block_ids == [0, 1, 2]         # b freed [2, 3] last-to-first: 2 is on top
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert (sched.num_preemptions, sched.num_recomputed_tokens) == (1, 3)
    assert (b.metrics.num_preemptions, b.metrics.num_recomputed_tokens) == (1, 3)
    first_sched_b = b.metrics.first_scheduled_time

    c = make_seq("c", 1, 1)                  # newer and small enough for the 1 free block
    sched.add_request(c)
    out = eng.step()
    assert table(out) == [("a", 1)]         # b (front, needs 2 blocks) blocks c: no overtaking
    assert a.status is SequenceStatus.FINISHED_LENGTH

    out = eng.step()                         # b recomputes prompt (2) + its 2 outputs
    assert table(out) == [("b", 4), ("c", 1)]
    sb = out.scheduled[0]
    assert sb.is_prefill and sb.will_sample and b.num_output_tokens == 3
    assert b.block_ids == [0, 1] and c.status is SequenceStatus.FINISHED_LENGTH
    eng.run()
    assert b.block_ids == [] and b.num_output_tokens == 4
    assert b.metrics.first_scheduled_time == first_sched_b
    assert (a.metrics.num_preemptions, a.metrics.num_recomputed_tokens) == (0, 0)
    assert (sched.num_preemptions, sched.num_recomputed_tokens) == (1, 3)
    assert eng.total_computed == (6 + 5 + 1) + 3
    assert eng.first_order == ["a", "b", "c"]


@pytest.mark.parametrize("policy, victim, survivor_blocks", [
    ("priority", "low", [2, 3, 0]),   # low (priority 5) admitted first, still the victim
    ("fcfs", "high", [0, 1, 2]),      # fcfs: the later arrival is the victim
])
def test_preemption_victim_is_last_in_policy_order(make, policy, victim, survivor_blocks):
    sched, eng = make(num_blocks=4, block_size=2, policy=policy)
    low = make_seq("low", 2, 5, priority=5)
    sched.add_request(low)
    eng.step()
    high = make_seq("high", 3, 3, priority=0)
    sched.add_request(high)
    eng.step()
    assert (low.block_ids, high.block_ids) == ([0, 1], [2, 3])
    expected_order = ["high", "low"] if policy == "priority" else ["low", "high"]
    assert [s.request_id for s in sched.running] == expected_order
    eng.step()
    out = sched.schedule()                   # the first in order needs a 3rd block
    assert [s.request_id for s in out.preempted] == [victim]
    survivor = high if victim == "low" else low
    assert table(out) == [(survivor.request_id, 1)]
    assert out.scheduled[0].end_position == 5 and survivor.block_ids == survivor_blocks
    assert sched.num_recomputed_tokens == 4
    eng.apply(out)
    eng.run()
    for s in (low, high):
        assert s.num_output_tokens == s.sampling_params.max_tokens
    assert sched.num_preemptions == 1


def test_preempted_sequence_can_preempt_itself_when_last(make):
    # a and b both grow; b is last, so when b itself needs a block and a holds the rest, b goes
    sched, eng = make(num_blocks=3, block_size=2, max_num_batched_tokens=64)
    a, b = make_seq("a", 2, 4), make_seq("b", 2, 4)
    sched.add_request(a)
    sched.add_request(b)
    eng.step()                                # a [0], b [1]
    eng.step()                                # a covers 3 -> [0, 2]; b covers 3 needs a block: none
    out = eng.steps[-1]
    assert out.preempted == [b] and table(out) == [("a", 1)]
    assert sched.num_recomputed_tokens == 2
    eng.run()
    assert b.num_output_tokens == 4 and sched.num_preemptions >= 1
    assert sum(s.metrics.num_preemptions for s in (a, b)) == sched.num_preemptions


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
@pytest.mark.parametrize("mode", ["continuous", "static"])
@pytest.mark.parametrize("chunk", [None, 3])
def test_forced_preemption_tiny_cache_completes_all(make, policy, mode, chunk):
    sched, eng = make(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                      prefill_chunk_size=chunk, policy=policy, mode=mode, max_model_len=64)
    rng = random.Random(f"{policy}-{mode}-{chunk}")  # str seeds are stable across runs
    seqs = [make_seq(f"r{i}", rng.randint(1, 12), rng.randint(1, 12), arrival=float(i),
                     priority=rng.randint(0, 3)) for i in range(16)]
    for s in seqs:
        sched.add_request(s)
    eng.run()
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED_LENGTH
        assert s.num_output_tokens == s.sampling_params.max_tokens
        assert s.block_ids == []
    if mode == "continuous":
        assert sched.num_preemptions > 0
    assert sched.num_preemptions == sum(s.metrics.num_preemptions for s in seqs)
    assert sched.num_recomputed_tokens == sum(s.metrics.num_recomputed_tokens for s in seqs)
    # every computed token is either kept or recomputed after a preemption
    assert eng.total_computed == sum(s.num_tokens - 1 for s in seqs) + sched.num_recomputed_tokens
    assert sched.block_manager.peak_used_blocks <= 6


# ---- the post-step update ---------------------------------------------------------------------
def test_update_appends_stops_finishes_and_frees():
    """``Scheduler.update`` is the engine's whole post-step half: tokens appended with their
    logprob records, stop tokens and length end requests (finished and freed in the update),
    a grammar hook can end one, and rows finished while in flight drop their token."""
    from llmserve.core.outputs import SampledTokens

    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=[9], logprobs=0))
    b = Sequence("b", [4, 5], SamplingParams(max_tokens=1))
    c = Sequence("c", [6], SamplingParams(max_tokens=5))
    d = Sequence("d", [7, 8], SamplingParams(max_tokens=5))
    for s in (a, b, c, d):
        sched.add_request(s)
    out = sched.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens = item.end_position
        item.seq.num_pending += 1
    assert sched.abort_request("d") is d                              # finished while in flight
    grammar_ends = lambda seq, tok: SequenceStatus.FINISHED_STOPPED if seq is c else None  # noqa: E731
    upd = sched.update(SampledTokens([a, b, c, d], [11, 12, 13, 14], [{"token_logprob": -1.0, "top": []},
                                                                       None, None, None]), grammar_ends)
    assert [o.request_id for o in upd.outputs] == ["a", "b", "c"]
    assert [o.new_token_ids for o in upd.outputs] == [[11], [12], [13]]
    assert a.output_logprobs == [{"token_logprob": -1.0, "top": []}] and d.output_token_ids == []
    assert {s.request_id for s in upd.finished} == {"b", "c"}
    assert b.finish_reason == "length" and c.finish_reason == "stop" and b.block_ids == [] == c.block_ids
    assert upd.outputs[1].finished and not upd.outputs[0].finished
    assert all(s.num_pending == 0 for s in (a, b, c, d)) and sched.num_running == 1
    sched.schedule()
    a.num_computed_tokens, a.num_pending = a.num_tokens, 1
    upd = sched.update(SampledTokens([a], [9], [None]))
    assert a.finish_reason == "stop" and a.stop_reason == 9 and bm.num_free_blocks == bm.num_total_blocks


def test_update_of_a_verified_run_truncates_at_a_stop_and_rolls_back():
    """A speculative verdict appends its run up to the first stop; a run that goes on sets the
    computed length to the verified one and releases the blocks past it."""
    from llmserve.core.outputs import DraftVerdict, SampledTokens

    bm = BlockManager(num_blocks=16, block_size=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    go = Sequence("go", [1, 2, 3], SamplingParams(max_tokens=10))
    stop = Sequence("stop", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    plain = Sequence("plain", [5], SamplingParams(max_tokens=10))
    for s in (go, stop, plain):
        sched.add_request(s)
    for item in sched.schedule().scheduled:
        item.seq.num_computed_tokens = item.end_position
    for s in (go, stop):                       # 3 tokens and 3 drafts reserved: 6 slots, 3 blocks
        bm.append_slots(s, 3)
        s.num_computed_tokens, s.num_pending = 6, 1
    plain.num_pending = 1
    verdicts = {0: DraftVerdict([20, 21], [None, None], 4), 2: DraftVerdict([6, 7, 8], [None] * 3, 6)}
    upd = sched.update(SampledTokens([go, plain, stop], [20, 30, 6], [None] * 3, verdicts))
    assert [o.new_token_ids for o in upd.outputs] == [[20, 21], [30], [6, 7]]
    assert go.num_computed_tokens == 4 and len(go.block_ids) == 2 and not go.is_finished
    assert stop.finish_reason == "stop" and stop.output_token_ids == [6, 7] and stop.block_ids == []
    assert plain.output_token_ids == [30] and [s.request_id for s in upd.finished] == ["stop"]
