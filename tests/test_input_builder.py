"""THE input builder against a straightforward reference computed token by token from the block
tables, for random mixes of prefill chunks and decodes at awkward sizes (block boundaries
``k * block_size`` and ``+-1``, batch 1 and odd batches, chunk boundaries), through the eager
device staging (one packed copy, regions 16-byte aligned, buffers reused and grown), the
CUDA-graph decode runner's host arrays, the pending-token fill of asynchronous scheduling, and
every pass the engines run (continuous, chunked, asynchronous, speculative target and draft)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from llmserve.core.sampling_params import SamplingParams
from llmserve.core.sequence import Sequence
from llmserve.worker import input_builder as ib
from llmserve.worker.input_builder import InputBuilder, PendingTokens, StepItem
from llmserve.worker.model_runner import ModelRunner, ModelRunnerOutput


# ---------------------------------------------------------------------------------------------
# The reference: one token at a time, from the block table
# ---------------------------------------------------------------------------------------------
def reference(items, block_size, pending=None, num_logits=None):
    ids, pos, slots, qsl, ctx, rows, owners = [], [], [], [0], [], [], []
    tables, fill = [], []
    for i, it in enumerate(items):
        seq, c, n = it.seq, it.start_position, it.num_new_tokens
        known = seq.token_ids_slice(0, c + n)
        for p in range(c, c + n):
            tok = known[p]
            if tok < 0:                                    # pending: from the device tensor
                src = pending.index[seq.request_id]
                fill.append((len(ids), src))
                tok = int(pending.token_ids[src])
            ids.append(tok)
            pos.append(p)
            slots.append(seq.block_ids[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        ctx.append(c + n)
        tables.append(list(seq.block_ids))
        m = (1 if it.will_sample else 0) if num_logits is None else num_logits[i]
        rows += list(range(qsl[-1] - m, qsl[-1]))
        owners += [i] * m
    w = max(len(t) for t in tables)
    table = [t + [0] * (w - len(t)) for t in tables]
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl,
                context_lens=ctx, block_tables=table, logit_rows=rows, logit_items=owners, fill=fill,
                max_query_len=max(it.num_new_tokens for it in items), max_context_len=max(ctx))


def make_seq(rid, num_tokens, block_size, rng, num_outputs=0, pending=False, num_blocks=None):
    """A sequence of ``num_tokens`` tokens (the last ``num_outputs`` are outputs, the newest one
    pending when asked) holding random distinct blocks for ``num_blocks`` (default: all)."""
    prompt = [rng.randrange(1, 1000) for _ in range(num_tokens - num_outputs)]
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=64))
    for _ in range(num_outputs - int(pending)):
        seq.append_token(rng.randrange(1, 1000))
    seq.num_pending = int(pending)
    nb = -(-num_tokens // block_size) if num_blocks is None else num_blocks
    seq.block_ids = rng.sample(range(1, 4 * nb + 64), nb)
    return seq


def awkward_len(rng, bs):
    k = rng.randint(1, 5)
    return max(1, k * bs + rng.choice([-1, 0, 1, rng.randint(-bs + 1, bs - 1)]))


def random_step(rng, bs, batch, pending_ok=False):
    """``batch`` items: decodes, whole prompts, first / middle / last chunks at awkward sizes."""
    items, pend = [], {}
    for i in range(batch):
        kind = rng.choice(["decode", "prompt", "chunk", "last_chunk", "one_token_tail"])
        T = awkward_len(rng, bs)
        rid = f"r{i}"
        if kind == "decode" or T == 1:
            T = max(T, 2)
            is_pending = pending_ok and rng.random() < 0.6
            seq = make_seq(rid, T, bs, rng, num_outputs=1, pending=is_pending)
            if is_pending:
                pend[rid] = len(pend)
            items.append(StepItem(seq, T - 1, 1, T))
            continue
        seq = make_seq(rid, T, bs, rng)
        if kind == "prompt":
            c, n = 0, T
        elif kind == "chunk":                     # ends on / next to a chunk boundary
            c = rng.choice([0, bs, max(0, T // 2 - 1)]) if T > bs else 0
            c = min(c, T - 1)
            n = max(1, min(T - c - 1, rng.choice([bs - 1, bs, bs + 1]))) if T - c > 1 else 1
        elif kind == "last_chunk":
            c = rng.randint(0, T - 1)
            n = T - c
        else:                                     # the final chunk is exactly one token
            c, n = T - 1, 1
        items.append(StepItem(seq, c, n, T))
    pending = None
    if pend:
        order = list(pend)
        rng.shuffle(order)                        # the in-flight step's rows in another order
        index = {rid: j for j, rid in enumerate(order)}
        pending = PendingTokens(torch.tensor([7000 + j for j in range(len(order))]), index)
    return items, pending


def assert_host_equal(h, ref):
    """``h`` equals ``ref`` with 0 at the rows filled on the device (checked as fill rows)."""
    assert list(zip(h.fill_rows.tolist(), h.fill_src.tolist())) == ref["fill"]
    filled = set(h.fill_rows.tolist())
    ref = {**ref, "input_ids": [0 if r in filled else t for r, t in enumerate(ref["input_ids"])]}
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "context_lens",
                 "block_tables", "logit_rows"):
        assert getattr(h, name).tolist() == ref[name], name
    assert h.logit_items == ref["logit_items"]
    assert (h.max_query_len, h.max_context_len) == (ref["max_query_len"], ref["max_context_len"])


def assert_device_equal(inp, ref, pending_filled=True):
    m = inp.attn_metadata
    assert inp.input_ids.tolist() == ref["input_ids"]
    assert inp.positions.tolist() == ref["positions"]
    assert m.slot_mapping.tolist() == ref["slot_mapping"]
    assert m.query_start_loc.tolist() == ref["query_start_loc"]
    assert m.context_lens.tolist() == ref["context_lens"]
    assert m.block_tables.tolist() == ref["block_tables"]
    assert inp.sample_rows.tolist() == ref["logit_rows"]
    assert inp.sample_seq_indices == ref["logit_items"]
    assert (m.max_query_len, m.max_context_len) == (ref["max_query_len"], ref["max_context_len"])
    assert m.is_decode_only == (ref["max_query_len"] == 1)
    for t, dt in ((inp.input_ids, torch.int64), (inp.positions, torch.int64), (m.slot_mapping, torch.int64),
                  (inp.sample_rows, torch.int64), (m.query_start_loc, torch.int32),
                  (m.context_lens, torch.int32), (m.block_tables, torch.int32)):
        assert t.dtype == dt and t.is_contiguous()
        assert t.data_ptr() % 16 == 0, "regions start 16-byte aligned (Triton specialises on it)"


# ---------------------------------------------------------------------------------------------
# Host arrays and eager device staging
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [4, 16])
def test_random_mixes_match_reference(bs):
    rng = random.Random(bs)
    builder = InputBuilder(bs, "cpu", initial_words=8)       # tiny: forces the buffers to grow
    for trial in range(60):
        batch = rng.choice([1, 1, 2, 3, 5, 7, 9])
        items, pending = random_step(rng, bs, batch, pending_ok=trial % 2 == 1)
        ref = reference(items, bs, pending)
        assert_host_equal(builder.build_host(items, pending), ref)
        assert_device_equal(builder.build(items, pending), ref)


def test_pending_rows_and_sources():
    """Pending ids are taken from the in-flight step's tensor: rows 0..F-1 from rows 0..F-1
    (the copy shortcut) and scattered rows / sources (the index copy); host arrays hold 0."""
    rng = random.Random(1)
    bs = 4
    seqs = [make_seq(f"r{i}", 5 + i, bs, rng, num_outputs=1, pending=True) for i in range(3)]
    items = [StepItem(s, s.num_tokens - 1, 1, s.num_tokens) for s in seqs]
    tok = torch.tensor([11, 22, 33])
    b = InputBuilder(bs, "cpu")
    inp = b.build(items, PendingTokens(tok, {"r0": 0, "r1": 1, "r2": 2}))
    assert inp.input_ids.tolist() == [11, 22, 33]
    inp = b.build(items, PendingTokens(tok, {"r0": 2, "r1": 0, "r2": 1}))
    assert inp.input_ids.tolist() == [33, 11, 22]
    h = b.build_host(items, PendingTokens(tok, {"r0": 2, "r1": 0, "r2": 1}))
    assert h.input_ids.tolist() == [0, 0, 0] and h.fill_rows.tolist() == [0, 1, 2]
    assert h.fill_src.tolist() == [2, 0, 1]
    # a prefill chunk before a pending decode, so the decode's row is not row 0
    pre = make_seq("p", 9, bs, rng)
    inp = b.build([StepItem(pre, 0, 9, 9), items[1]], PendingTokens(tok, {"r1": 2}))
    assert inp.input_ids.tolist()[-1] == 33 and inp.input_ids.tolist()[:9] == pre.token_ids_slice(0, 9)
    with pytest.raises(RuntimeError, match="no in-flight step holds it"):
        b.build(items)
    with pytest.raises(RuntimeError, match="no in-flight step holds it"):
        b.build(items, PendingTokens(tok, {"r0": 0}))


def test_explicit_logits_rows_and_validation():
    """Speculative verification asks for every row of a sequence; bad requests raise."""
    rng = random.Random(2)
    bs = 8
    a, c = make_seq("a", 17, bs, rng), make_seq("c", 9, bs, rng, num_outputs=1)
    items = [StepItem(a, 14, 3, 17), StepItem(c, 8, 1, 9)]
    ref = reference(items, bs, num_logits=[3, 0])
    assert ref["logit_rows"] == [0, 1, 2] and ref["logit_items"] == [0, 0, 0]
    assert_device_equal(InputBuilder(bs, "cpu").build(items, num_logits=[3, 0]), ref)
    with pytest.raises(ValueError, match="num_logits"):
        InputBuilder(bs, "cpu").build(items, num_logits=[4, 0])
    with pytest.raises(ValueError, match="num_logits"):
        InputBuilder(bs, "cpu").build(items, num_logits=[1])
    with pytest.raises(ValueError, match="at least one"):
        InputBuilder(bs, "cpu").build([])


def test_packed_copy_is_one_buffer_and_staging_alternates():
    """All device tensors are views of one buffer (one host-to-device copy); consecutive
    builds use the two staging buffers in turn."""
    rng = random.Random(3)
    b = InputBuilder(16, "cpu")
    items, _ = random_step(rng, 16, 5)
    inp = b.build(items)
    base = b._dev.untyped_storage().data_ptr()
    m = inp.attn_metadata
    for t in (inp.input_ids, inp.positions, m.slot_mapping, inp.sample_rows, m.query_start_loc,
              m.context_lens, m.block_tables):
        assert t.untyped_storage().data_ptr() == base
    t0 = b._turn
    b.build(items)
    assert b._turn != t0


def test_scheduler_positions_not_live_sequence_state():
    """The builder reads the scheduled start position, not ``seq.num_computed_tokens``."""
    from llmserve.core.scheduler import ScheduledSequence

    rng = random.Random(4)
    seq = make_seq("s", 20, 4, rng)
    seq.num_computed_tokens = 8
    item = ScheduledSequence(seq, 5)
    seq.num_computed_tokens = 13                   # advanced after scheduling
    ref = reference([StepItem(seq, 8, 5, 20)], 4)
    assert ref["positions"] == list(range(8, 13))
    assert_device_equal(InputBuilder(4, "cpu").build([item]), ref)


# ---------------------------------------------------------------------------------------------
# The CUDA-graph decode path: same host arrays, the graph runner's own staging
# ---------------------------------------------------------------------------------------------
class RecordingGraphs:
    """Stand-in for ``CUDAGraphDecodeRunner``: records what ``run`` receives."""

    def __init__(self, max_batch, max_blocks, vocab=8):
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.calls = []
        self.vocab = vocab
        self.last_argmax = None
        self.num_short_replays = 0

    def run(self, ids, pos, slots, ctx, table, fill=None):
        ids_dev = torch.from_numpy(np.array(ids))
        if fill is not None:
            fill(ids_dev)
        self.calls.append(dict(input_ids=ids_dev.tolist(), positions=pos.tolist(),
                               slot_mapping=slots.tolist(), context_lens=ctx.tolist(),
                               block_tables=table.tolist()))
        self.last_argmax = torch.zeros(len(ids), dtype=torch.int64)
        return torch.zeros(len(ids), self.vocab)


def _runner(bs, graphs=None):
    class Model(torch.nn.Module):
        def forward(self, ids, pos, kv, meta):
            self.seen = (ids.clone(), pos.clone(), meta)
            return torch.nn.functional.one_hot(ids % 8, 8).float()

        def compute_logits(self, h):
            return h

    return ModelRunner(Model(), [], bs, "cpu", cuda_graphs=graphs)


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_graph_path_gets_the_reference_arrays(batch):
    bs = 4
    rng = random.Random(batch)
    g = RecordingGraphs(max_batch=8, max_blocks=16)
    runner = _runner(bs, g)
    for trial in range(10):
        seqs, pend = [], {}
        for i in range(batch):
            T = max(2, awkward_len(rng, bs))
            p = trial % 2 == 1 and rng.random() < 0.5
            seqs.append(make_seq(f"r{i}", T, bs, rng, num_outputs=1, pending=p))
            if p:
                pend[f"r{i}"] = len(pend)
        pending = PendingTokens(torch.arange(500, 500 + len(pend)), pend) if pend else None
        items = [StepItem(s, s.num_tokens - 1, 1, s.num_tokens) for s in seqs]
        out = runner.execute(items, pending)
        assert isinstance(out, ModelRunnerOutput) and out.cuda_graph
        assert out.sample_indices == list(range(batch)) and out.device_argmax is g.last_argmax
        ref = reference(items, bs, pending)
        got = g.calls[-1]
        for name in ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables"):
            assert got[name] == ref[name], name
    assert runner.num_graph_steps == 10 and runner.num_eager_steps == 0


def test_graph_and_eager_paths_feed_the_model_identically():
    """A decode batch replayed through the real graph runner (graphs replaced by eager calls of
    the captured function, as in test_cuda_graph.py) and run eagerly give the model the same
    ids, positions, slots, context lengths and block tables (the graph's padded to its bucket)."""
    from llmserve.worker.cuda_graph import CUDAGraphDecodeRunner

    bs, V = 4, 50
    seen = {}

    def forward(ids, pos, kv, meta):
        seen["x"] = (ids.clone(), pos.clone(), meta.slot_mapping.clone(), meta.context_lens.clone(),
                     meta.block_tables.clone())
        return torch.nn.functional.one_hot((ids + pos) % V, V).float()

    g = CUDAGraphDecodeRunner(forward, lambda h: h, [], bs, 8, 64, torch.device("cpu"), short_context=0)

    class EagerGraph:
        def __init__(self, b):
            self.b = b

        def replay(self):
            g.outputs[(self.b, False)].copy_(g._run(self.b, False))

    for b in g.buckets:
        g.graphs[(b, False)] = EagerGraph(b)
        g.outputs[(b, False)] = torch.zeros(b, V)

    class Model(torch.nn.Module):
        def forward(self, *a):
            return forward(*a)

        def compute_logits(self, h):
            return h

    rng = random.Random(5)
    with_graph, eager = ModelRunner(Model(), [], bs, "cpu", cuda_graphs=g), ModelRunner(Model(), [], bs, "cpu")
    for batch in (1, 3, 5, 7):
        seqs = [make_seq(f"r{i}", max(2, awkward_len(rng, bs)), bs, rng, num_outputs=1) for i in range(batch)]
        items = [StepItem(s, s.num_tokens - 1, 1, s.num_tokens) for s in seqs]
        out_g = with_graph.execute(items)
        ids, pos, slots, ctx, table = seen["x"]
        out_e = eager.execute(items)
        e = seen["x"]
        assert out_g.cuda_graph and not out_e.cuda_graph
        assert torch.equal(out_g.logits, out_e.logits)
        for a, b_ in zip((ids, pos, slots, ctx), e[:4]):
            assert a[:batch].tolist() == b_.tolist()
        w = e[4].shape[1]
        assert table[:batch, :w].tolist() == e[4].tolist() and not table[:batch, w:].any()


def test_non_decode_steps_run_eagerly():
    g = RecordingGraphs(max_batch=2, max_blocks=2)
    runner = _runner(4, g)
    rng = random.Random(6)
    s = make_seq("a", 6, 4, rng, num_outputs=1)
    long = make_seq("b", 13, 4, rng, num_outputs=1)                  # 4 blocks > max_blocks
    runner.execute([StepItem(s, 0, 6, 6)])                            # a prefill
    runner.execute([StepItem(long, 12, 1, 13)])                       # too wide for the graphs
    runner.execute([StepItem(s, 5, 1, 6)] * 3)                        # batch above the graphs'
    assert runner.num_eager_steps == 3 and not g.calls
    runner.execute([StepItem(s, 5, 1, 6)])
    assert runner.num_graph_steps == 1
    runner.reset_stats()
    assert runner.num_graph_steps == runner.num_eager_steps == 0


# ---------------------------------------------------------------------------------------------
# Every pass of the engines goes through the one builder, and matches the reference
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def checked_builds(monkeypatch):
    """Wrap :func:`write_host_inputs`: every call's arrays are compared with the reference."""
    calls = []
    real = ib.write_host_inputs

    def spy(scheduled, block_size, out, pending=None, num_logits=None):
        h = real(scheduled, block_size, out, pending, num_logits)
        assert_host_equal(h, reference(scheduled, block_size, pending, num_logits))
        calls.append((len(scheduled), sum(it.num_new_tokens for it in scheduled), len(h.fill_rows)))
        return h

    monkeypatch.setattr(ib, "write_host_inputs", spy)
    return calls


def _awkward_requests(n, bs, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.choice([1, 2, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 2 * bs + 1, 3 * bs + 1])
        out.append(([rng.randrange(10, 5000) for _ in range(plen)],
                    SamplingParams(max_tokens=rng.choice([1, 2, bs - 1, bs + 2]), ignore_eos=True)))
    return out


@pytest.mark.parametrize("async_", [False, True])
def test_llm_engine_steps_use_the_builder(checked_builds, async_):
    from llmserve.engine.llm_engine import LLMEngine
    from test_engine import BLOCK, engine_config

    eng = LLMEngine(dataclasses.replace(engine_config(max_seqs=5, chunk=BLOCK + 1, budget=3 * BLOCK),
                                        async_scheduling=async_))
    reqs = _awkward_requests(9, BLOCK, seed=7)
    seqs = [eng.add_request(p, sp) for p, sp in reqs]
    while eng.has_unfinished_requests():
        eng.step()
    assert all(s.is_finished for s in seqs)
    assert len(checked_builds) == eng.runner.num_eager_steps == eng.num_steps
    assert any(f for _, _, f in checked_builds) == async_      # async decodes fill on the device
    ref = LLMEngine(engine_config(max_seqs=5, chunk=BLOCK + 1, budget=3 * BLOCK))
    assert [s.output_token_ids for s in seqs] == [o.output_token_ids for o in ref.generate(
        [p for p, _ in reqs], [sp for _, sp in reqs])]


def test_speculative_passes_use_the_builder(checked_builds):
    """Target verification (``k + 1`` rows a sequence), plain decodes and the draft's passes
    are all built by the same function as the eager step."""
    from llmserve.engine.speculative import SpeculativeEngine
    from test_engine import BLOCK, engine_config

    eng = SpeculativeEngine(engine_config(max_seqs=4, budget=4 * BLOCK), draft_model="target",
                            num_speculative_tokens=3)
    reqs = _awkward_requests(5, BLOCK, seed=8)
    outs = [eng.add_request(p, dataclasses.replace(sp, max_tokens=sp.max_tokens + 4)) for p, sp in reqs]
    while eng.has_unfinished_requests():
        eng.step()
    assert all(s.is_finished for s in outs)
    st = eng.spec_stats
    assert st.num_verifications > 0
    assert len(checked_builds) == eng.runner.num_eager_steps + eng.draft_runner.num_eager_steps
    assert eng.runner.num_eager_steps == st.num_target_steps
    assert eng.draft_runner.num_eager_steps == st.num_draft_passes
    eng.reset_stats()
    assert eng.num_steps == eng.runner.num_eager_steps == eng.draft_runner.num_eager_steps == 0
    assert eng.spec_stats.num_target_steps == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_matches_reference_without_syncs():
    """On CUDA (pinned staging, events guarding the two staging buffers): many builds queued
    back to back, each step's device tensors copied out on the stream, all equal the reference."""
    rng = random.Random(9)
    bs = 16
    b = InputBuilder(bs, "cuda", initial_words=8)
    kept = []
    for trial in range(40):
        items, pending = random_step(rng, bs, rng.choice([1, 3, 7, 33]), pending_ok=trial % 2 == 0)
        if pending is not None:
            pending = PendingTokens(pending.token_ids.cuda(), pending.index)
        inp = b.build(items, pending)
        m = inp.attn_metadata
        kept.append((reference(items, bs, pending), [t.clone() for t in (
            inp.input_ids, inp.positions, m.slot_mapping, m.query_start_loc, m.context_lens,
            m.block_tables, inp.sample_rows)]))
    torch.cuda.synchronize()
    for ref, ts in kept:
        names = ("input_ids", "positions", "slot_mapping", "query_start_loc", "context_lens",
                 "block_tables", "logit_rows")
        for name, t in zip(names, ts):
            assert t.tolist() == ref[name], name


def test_stats_count_steps_by_path():
    """``stats()['steps_by_path']`` splits the runner's steps into replayed decode graphs,
    replayed mixed graphs and eager forwards (all eager on a CPU), and resets with the rest."""
    from llmserve.core.sampling_params import SamplingParams
    from llmserve.engine.llm_engine import LLMEngine
    from test_engine import BLOCK, engine_config

    eng = LLMEngine(engine_config(max_seqs=3, budget=4 * BLOCK))
    for i in range(3):
        eng.add_request(list(range(5, 5 + BLOCK + i)), SamplingParams(max_tokens=4 + i, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    paths = eng.stats()["steps_by_path"]
    assert paths == {"decode_graph": 0, "mixed_graph": 0, "eager": eng.num_steps} and eng.num_steps > 0
    eng.reset_stats()
    assert eng.stats()["steps_by_path"] == {"decode_graph": 0, "mixed_graph": 0, "eager": 0}
