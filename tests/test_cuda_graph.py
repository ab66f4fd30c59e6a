"""Host-side logic of ``CUDAGraphDecodeRunner`` on the CPU: graphs replaced by objects that run
the captured function eagerly, so the packed input buffer, the padding and the alternating
greedy-token rows are checked without a GPU (the GPU tests in ``test_fast_forward.py`` replay
real graphs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.cuda_graph import CUDAGraphDecodeRunner

V = 50


def _runner(max_batch: int) -> CUDAGraphDecodeRunner:
    def forward(ids, pos, kv, meta):               # hidden = one-hot((ids + pos + ctx) % V)
        return torch.nn.functional.one_hot((ids + pos + meta.context_lens.long()) % V, V).float()

    def greedy(logits, out, out_row):
        out[int(out_row[0])] = logits.argmax(-1)
        return out

    r = CUDAGraphDecodeRunner(forward, lambda h: h, [], 4, max_batch, 64, torch.device("cpu"),
                              short_context=0, greedy=greedy)

    class EagerGraph:                                # "replays" the captured function
        def __init__(self, b):
            self.b = b

        def replay(self):
            r._run(self.b, False)

    for b in r.buckets:
        r.graphs[(b, False)] = EagerGraph(b)
        r.outputs[(b, False)] = torch.zeros(b, V)
    return r


def test_graph_runner_alternates_greedy_rows():
    """Each replay writes its greedy tokens to the other row of the shared buffer (the parity
    word travels in the packed inputs and survives the padding of smaller batches), so the
    previous step's tokens stay readable during the next replay; every bucket reads the right
    inputs (ids, positions, context lengths) from the packed buffer, whose regions after the
    parity word stay 16-byte aligned."""
    r = _runner(20)
    assert all(int(o) % 2 == 0 for o in r._offsets[1:])              # 16-byte aligned regions
    rng = np.random.default_rng(0)
    held = []
    for step in range(14):
        b = int(rng.integers(1, 21))
        ids, pos = rng.integers(0, V, b), rng.integers(0, 60, b)
        r.run(ids, pos, np.zeros(b, np.int64), pos + 1, np.zeros((b, 2), np.int64))
        want = (ids + 2 * pos + 1) % V
        assert int(r._dev[r._parity_word]) == step % 2
        assert np.array_equal(r.last_argmax.numpy(), want), step
        held.append((r.last_argmax, want))
        if step:                                     # the previous step's view is untouched
            prev, prev_want = held[-2]
            assert np.array_equal(prev.numpy(), prev_want), step
    assert r._replays == 14


def test_graph_runner_pending_ids():
    """A pending input id (the previous replay's greedy token, still on the device) travels
    as ``-1 - k`` (flat entry ``k`` of the greedy-token buffer) for buckets whose forward
    resolves it (``resolves_pending_ids``), so no copy kernel runs before the replay; other
    buckets, and tokens that are not a view of that buffer (a step with sampled rows), get
    ``None`` and keep the copy; negative ids for a bucket without it are an error. The fake
    forward resolves negative ids from ``id_source`` as the first layer's gather does."""
    class Forward:
        id_source = None

        def resolves_pending_ids(self, n):
            return n <= 2

        def __call__(self, ids, pos, kv, meta):
            if self.id_source is not None:
                ids = torch.where(ids < 0, self.id_source[(-1 - ids).clamp(min=0)], ids)
            assert bool((ids >= 0).all())
            return torch.nn.functional.one_hot((ids + pos + meta.context_lens.long()) % V, V).float()

    def greedy(logits, out, out_row):
        out[int(out_row[0])] = logits.argmax(-1)
        return out

    fwd = Forward()
    r = CUDAGraphDecodeRunner(fwd, lambda h: h, [], 4, 8, 64, torch.device("cpu"), short_context=0,
                              greedy=greedy, pending_ids=True)
    off = CUDAGraphDecodeRunner(Forward(), lambda h: h, [], 4, 8, 64, torch.device("cpu"), short_context=0,
                                greedy=greedy, pending_ids=False)
    off._attach_id_source()
    assert off.pending_buckets == set() and off.pending_id(off.argmax_out[0, :1], 0, 1) is None
    r._attach_id_source()          # what capture() does first (the fake graphs keep it attached)
    assert r.pending_buckets == {1, 2} and fwd.id_source.data_ptr() == r.argmax_out.data_ptr()

    class EagerGraph:
        def __init__(self, b):
            self.b = b

        def replay(self):
            r._run(self.b, False)

    for b in r.buckets:
        r.graphs[(b, False)] = EagerGraph(b)
        r.outputs[(b, False)] = torch.zeros(b, V)
    ids, pos = np.array([3, 8]), np.array([5, 9])
    r.run(ids, pos, np.zeros(2, np.int64), pos + 1, np.zeros((2, 2), np.int64))
    prev = r.last_argmax                                       # [2], row 0 of argmax_out
    assert prev.tolist() == ((ids + 2 * pos + 1) % V).tolist()
    refs = [r.pending_id(prev, j, 2) for j in range(2)]
    assert refs == [-1, -2]
    assert r.pending_id(prev, 1, 1) == -2 and r.pending_id(prev, 2, 2) is None
    assert r.pending_id(prev, 0, 3) is None                    # bucket 4: no pending ids
    assert r.pending_id(prev.clone(), 0, 2) is None            # not the graph's buffer
    pos2 = np.array([6, 10])
    r.run(np.array(refs[::-1]), pos2, np.zeros(2, np.int64), pos2 + 1, np.zeros((2, 2), np.int64))
    want = (prev.flip(0).numpy() + 2 * pos2 + 1) % V           # the swapped pending tokens as input
    assert r.last_argmax.tolist() == want.tolist()
    r2 = r.last_argmax                                          # row 1 now
    assert r.pending_id(r2, 0, 1) == -1 - r.max_batch
    with pytest.raises(ValueError, match="does not resolve pending ids"):
        r.run(np.array([-1, 0, 0]), np.zeros(3, np.int64), np.zeros(3, np.int64), np.ones(3, np.int64),
              np.zeros((3, 1), np.int64))
