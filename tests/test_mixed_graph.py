"""Host logic of ``CUDAGraphMixedRunner`` (CUDA-graph replay of steps with prefill chunks) on
the CPU: graphs replaced by objects that run the captured function eagerly, so the bucket
choice, the padding of rows and sequences, the tile schedule, the pending-token fill and the
logits rows are checked against the eager step for random mixes at awkward sizes. The GPU test
in ``test_fast_forward.py`` replays real graphs."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llmserve.kernels.paged_attention import prefill_tile_schedule
from llmserve.worker.mixed_graph import CUDAGraphMixedRunner, mixed_buckets
from llmserve.worker.model_runner import ModelRunner
from test_input_builder import random_step, reference

V = 97


def _row_seq(meta, n):
    """Sequence index of each of ``n`` rows from ``query_start_loc`` (-1: no sequence)."""
    qsl = meta.query_start_loc.long()
    rows = torch.arange(n)
    seq = torch.searchsorted(qsl, rows, right=True) - 1
    return torch.where(rows < qsl[-1], seq, torch.full_like(seq, -1))


def fake_forward(ids, pos, kv, meta):
    """hidden = one-hot((id + 3 * position + 7 * context of the row's sequence + slot) % V);
    rows no sequence owns are zero (as the attention leaves them)."""
    n = ids.shape[0]
    seq = _row_seq(meta, n)
    ctx = torch.where(seq >= 0, meta.context_lens.long()[seq.clamp(min=0)], torch.zeros_like(seq))
    h = torch.nn.functional.one_hot((ids + 3 * pos + 7 * ctx + meta.slot_mapping) % V, V).float()
    return h * (seq >= 0).float()[:, None]


class Model(torch.nn.Module):
    def forward(self, *a):
        return fake_forward(*a)

    def compute_logits(self, h):
        return h * 2.0


def mixed_runner(max_seqs, max_tokens, block_size, max_model_len=256, block_m=16, every_row=False):
    seen = []

    def forward(ids, pos, kv, meta):
        n = ids.shape[0]
        s = meta.context_lens.shape[0]
        tiles = meta.prefill_tiles
        # the graph's shapes are the bucket's, whatever the step
        assert meta.max_query_len == n and meta.max_context_len == max_model_len
        assert tiles.shape[0] == -(-n // block_m) + s and not meta.is_decode_only
        seen.append(dict(n=n, s=s, qsl=meta.query_start_loc.tolist(), ctx=meta.context_lens.tolist(),
                         slots=meta.slot_mapping.tolist(), tiles=tiles.tolist(),
                         table=meta.block_tables.clone()))
        return fake_forward(ids, pos, kv, meta)

    g = CUDAGraphMixedRunner(forward, Model().compute_logits, [], block_size, max_seqs, max_tokens,
                             max_model_len, block_m, torch.device("cpu"), schedule_decode_rows=every_row)

    class EagerGraph:                                 # "replays" the captured function
        def __init__(self, n):
            self.n = n

        def replay(self):
            g.outputs[self.n].copy_(g._run(self.n))

    for n in g.buckets:
        g.graphs[n] = EagerGraph(n)
        g.outputs[n] = torch.zeros(n, V)
    return g, seen


def test_buckets():
    assert mixed_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert mixed_buckets(100) == [16, 32, 64, 100] and mixed_buckets(8) == [8]
    assert mixed_buckets(900) == [16, 32, 64, 128, 256, 512, 768, 900]
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="max_tokens"):
            CUDAGraphMixedRunner(None, None, [], 4, 8, bad, 64, 16, torch.device("cpu"))


@pytest.mark.parametrize("block_m", [1, 16, 128])
def test_tile_schedule_lists_every_tile_once(block_m):
    rng = np.random.default_rng(block_m)
    for _ in range(50):
        qlen = rng.choice([0, 1, 1, 2, 15, 16, 17, 127, 128, 129, 300], size=int(rng.integers(1, 12)))
        qsl = np.concatenate([[0], np.cumsum(qlen)])
        n = int(qsl[-1])
        out = np.full(-(-max(n, 1) // block_m) + len(qlen), 123, dtype=np.int32)
        total = prefill_tile_schedule(qsl, block_m, out)
        want = [(i, t) for i, q in enumerate(qlen) if q > 1 for t in reversed(range(-(-q // block_m)))]
        got = [(int(e) >> 16, int(e) & 0xFFFF) for e in out[:total]]
        assert got == want and (out[total:] == -1).all()
        # without skip_decode the one-token sequences are listed too
        total_all = prefill_tile_schedule(qsl, block_m, out, skip_decode=False)
        assert total_all == sum(-(-int(q) // block_m) for q in qlen if q > 0)
    with pytest.raises(ValueError, match="entries"):
        prefill_tile_schedule(np.array([0, 40]), 16, np.zeros(2, dtype=np.int32))


@pytest.mark.parametrize("bs,every_row", [(1, False), (4, False), (16, False), (16, True)])
def test_replay_matches_the_eager_step(bs, every_row):
    """Random mixes of decodes, whole prompts and chunks (pending tokens included): the graph
    path's logits rows, their owners and the model's inputs equal the eager step's; the padding
    rows and sequences are inert (slot -1, query length 0, context 1, table 0); the bucket is
    the smallest that holds the step; a step over the largest bucket or with explicit logits rows
    runs eagerly."""
    rng = random.Random(bs)
    # the batch-invariant attention's unit (every_row): a tile of 5 query tokens, every row listed
    block_m = 5 if every_row else 16
    g, seen = mixed_runner(max_seqs=12, max_tokens=96, block_size=bs, block_m=block_m, every_row=every_row)
    with_graph = ModelRunner(Model(), [], bs, "cpu", mixed_graphs=g)
    eager = ModelRunner(Model(), [], bs, "cpu")
    graphed = 0
    for step in range(60):
        items, pending = random_step(rng, bs, rng.randint(1, 12), pending_ok=True)
        tokens = sum(i.num_new_tokens for i in items)
        out_g = with_graph.execute(items, pending)
        out_e = eager.execute(items, pending)
        assert out_g.sample_indices == out_e.sample_indices
        assert torch.equal(out_g.logits, out_e.logits), step
        if tokens > g.max_tokens:
            assert not out_g.cuda_graph
            continue
        graphed += 1
        assert out_g.cuda_graph
        rec = seen[-1]
        n = min(b for b in g.buckets if b >= tokens)
        assert rec["n"] == n and rec["s"] == min(n, 12)
        ref = reference(items, bs, pending)
        B = len(items)
        assert rec["qsl"][:B + 1] == ref["query_start_loc"]
        assert rec["qsl"][B + 1:] == [tokens] * (rec["s"] - B)         # padding: query length 0
        assert rec["ctx"][:B] == ref["context_lens"] and rec["ctx"][B:] == [1] * (rec["s"] - B)
        assert rec["slots"][:tokens] == ref["slot_mapping"] and set(rec["slots"][tokens:]) <= {-1}
        w = len(ref["block_tables"][0])
        assert rec["table"][:B, :w].tolist() == ref["block_tables"]
        assert not rec["table"][:B, w:].any() and not rec["table"][B:].any()
        tiles = np.full(len(rec["tiles"]), 0, dtype=np.int32)
        k = prefill_tile_schedule(np.array(rec["qsl"]), block_m, tiles, skip_decode=not every_row)
        assert rec["tiles"] == tiles.tolist() and k <= len(tiles)
        decodes = sum(1 for i in items if i.num_new_tokens == 1)
        listed = {e >> 16 for e in rec["tiles"] if e >= 0}
        assert (len(listed) == B) if every_row else (len(listed) == B - decodes)
    assert graphed > 20 and with_graph.num_mixed_graph_steps == graphed
    # explicit logits rows (speculative verification) never replay a mixed graph
    items, _ = random_step(rng, bs, 3)
    out = with_graph.execute(items, None, [1] * len(items))
    assert not out.cuda_graph


def test_step_without_sampled_rows():
    """A step of middle chunks only (no item catches up) returns empty logits."""
    from llmserve.worker.input_builder import StepItem
    from test_input_builder import make_seq

    rng = random.Random(1)
    g, _ = mixed_runner(max_seqs=4, max_tokens=64, block_size=4)
    seq = make_seq("a", 40, 4, rng)
    out = ModelRunner(Model(), [], 4, "cpu", mixed_graphs=g).execute([StepItem(seq, 0, 20, 40)])
    assert out.cuda_graph and out.logits.shape == (0, 0) and out.sample_indices == []
