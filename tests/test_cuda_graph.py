"""Host-side logic of ``CUDAGraphDecodeRunner`` on the CPU: graphs replaced by objects that run
the captured function eagerly, so the packed input buffer, the padding and the alternating
greedy-token rows are checked without a GPU (the GPU tests in ``test_fast_forward.py`` replay
real graphs)."""
from __future__ import annotations

import numpy as np
import torch

from llmserve.worker.cuda_graph import CUDAGraphDecodeRunner

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


def test_short_context_argument():
    """The short-context graphs' length is a constructor argument (``FastPathConfig.
    graph_short_context``): default 512 tokens, none when 0 or not below ``max_model_len``;
    a negative or non-integer length is a ValueError naming it."""
    import pytest

    from llmserve.worker.cuda_graph import SHORT_CONTEXT

    def make(max_model_len, **kw):
        return CUDAGraphDecodeRunner(lambda *a: None, lambda h: h, [], 4, 2, max_model_len,
                                     torch.device("cpu"), **kw)

    assert SHORT_CONTEXT == 512 and make(1024).short_context == 512
    assert make(64).short_context == 0 and make(1024, short_context=0).short_context == 0
    assert make(1024, short_context=128).short_context == 128
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="short_context"):
            make(1024, short_context=bad)
