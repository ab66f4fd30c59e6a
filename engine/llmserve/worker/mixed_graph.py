"""CUDA-graph replay of steps that carry prefill chunks, one graph per token-count bucket.

A decode step is not the only launch-bound step. The fused forward launches about ten kernels
a layer whatever the step's size, so a step with a short prefill chunk (a new turn whose history
came from the prefix cache, a short prompt, the last chunk of a long one, a few decodes riding
along) costs the host's launch time, not the GPU's compute: on Qwen2.5-1.5B shapes (28 layers)
that is on the order of 10 ms a step while the GPU needs one or two. Prefix caching then saves
compute that was never on the critical path. Capturing such steps by *total token count*
removes the launch cost where it dominates; this is the same idea as vLLM's piecewise CUDA
graphs, which are keyed by the number of tokens in the batch rather than by the batch's shape.

A step of ``N`` tokens in ``B`` sequences replays the graph of the smallest bucket ``n >= N``,
captured for ``n`` token rows and ``s = min(n, max_seqs)`` sequences (every sequence has at
least one token, so ``B <= s``). Padding is harmless by construction:

* token rows ``N .. n-1``: id 0, position 0, slot ``-1`` (their K/V land in the scratch block)
  and no sequence owns them, so attention writes zeros there and their hidden states are
  discarded;
* sequences ``B .. s-1``: query length 0 (``query_start_loc`` repeats ``N``), context 1,
  block table row 0, so neither attention kernel does any work for them;
* the prefill kernel runs a tile schedule (``AttentionMetadata.prefill_tiles``, built on the
  host by :func:`~llmserve.kernels.paged_attention.prefill_tile_schedule`) so its grid is
  ``(Hq, ceil(n / BLOCK_M) + s)`` programs, each taking one listed (sequence, query tile) or
  returning at once, rather than ``Hq x tiles(n) x s``; the decode kernel serves the
  one-token sequences with a grid sized for ``max_model_len`` (each sequence reads only its
  own context). In the batch-invariant mode one kernel serves every row
  (:func:`~llmserve.kernels.invariant.invariant_paged_attention`), so the schedule lists the
  one-token sequences too, in tiles of that kernel's query tokens per program.

The graph ends at the final norm's hidden states ``[n, H]``; the LM head runs after the replay
on the rows that are sampled (a gather and one matrix product), so the graph holds no
``[s, vocab]`` logits buffer. Inputs travel as in the eager step (:mod:`.input_builder`): one
pinned staging buffer (two, used in turn, each rewritten only after the copy that last read it
completed) and one host-to-device copy; the in-flight step's tokens (asynchronous scheduling)
are written into the id rows on the device before the replay.

Correctness does not depend on the bucket: every real row computes what the eager step computes
(the same kernels; matrix products of a padded height may round differently, as with any
change of batch size outside the batch-invariant mode). Parity with the eager step is tested
on the GPU in ``tests/test_fast_forward.py``; the host logic on the CPU in
``tests/test_mixed_graph.py``.
"""

from __future__ import annotations

from collections.abc import Sequence as _Seq

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata
from ..kernels.paged_attention import prefill_tile_schedule
from .input_builder import HostInputs, PendingTokens, _even, batch_dims, write_host_inputs

__all__ = ["CUDAGraphMixedRunner", "mixed_buckets"]


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets up to ``max_tokens`` (inclusive): powers of two from 16 to 512, then
    multiples of 256 (the padding of a step stays under a quarter of it past 64 tokens)."""
    out = [n for n in (16, 32, 64, 128, 256, 512) if n <= max_tokens]
    out += list(range(768, max_tokens + 1, 256))
    if not out or out[-1] != max_tokens:
        out.append(max_tokens)
    return sorted(set(out))


class CUDAGraphMixedRunner:
    """Captures and replays steps with prefill chunks, keyed by token count (module docstring).

    Args:
        forward: ``(input_ids [n], positions [n], kv_caches, meta) -> hidden [n, H]``.
        compute_logits: ``hidden [R, H] -> logits [R, V]`` float32 (run after the replay).
        kv_caches: per-layer ``(k, v)`` cache tensors.
        block_size: tokens per block.
        max_seqs: most sequences in a step (the scheduler's ``max_num_seqs``).
        max_tokens: largest step captured, tokens (``FastPathConfig.mixed_graph_max_tokens``);
            larger steps run eagerly.
        max_model_len: longest sequence; fixes the block-table width and the decode kernel's
            grid.
        block_m: query rows per prefill-kernel tile
            (:func:`~llmserve.kernels.paged_attention.prefill_block_m`), or query tokens per
            program of the batch-invariant attention
            (:func:`~llmserve.kernels.invariant.invariant_tile_tokens`).
        device: where the model runs (CUDA for real graphs; the CPU tests replace the graphs).
        schedule_decode_rows: list the one-token sequences in the tile schedule too (the
            batch-invariant attention serves every row of a step in one kernel); default: only
            sequences with more than one query row (the Triton backend's decode kernel takes
            the others).

    Raises:
        ValueError: ``max_tokens``, ``max_seqs`` or ``block_m`` below 1.
    """

    def __init__(self, forward, compute_logits, kv_caches, block_size: int, max_seqs: int,
                 max_tokens: int, max_model_len: int, block_m: int, device: torch.device,
                 schedule_decode_rows: bool = False) -> None:
        for name, v in (("max_tokens", max_tokens), ("max_seqs", max_seqs), ("block_m", block_m)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.forward = forward
        self.compute_logits = compute_logits
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_m = block_m
        self.schedule_decode_rows = schedule_decode_rows
        self.device = device
        self.buckets = mixed_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.max_seqs = max_seqs
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        n, s, nb = self.max_tokens, min(self.max_tokens, max_seqs), self.max_blocks
        self._max_tiles = -(-n // block_m) + s
        # int64 regions: ids | positions | slots | logit rows | fill rows | fill sources;
        # int32 regions (sized in int64 words, each starting on an even word): query_start_loc |
        # context lens | tile schedule | block table (last, so a step copies only its rows)
        i64 = [n, n, n, s, s, s]
        i32 = [s + 1, s, self._max_tiles, s * nb]
        self._i64, self._i32, o = [], [], 0
        for size in i64:
            self._i64.append((o, size))
            o += _even(size)
        for size in i32:
            self._i32.append((o, size))
            o += _even((size + 1) // 2)
        self._total = o
        pin = torch.device(device).type == "cuda"
        self._hosts = [torch.zeros(o, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if pin else [None, None]
        self._turn = 0
        self._dev = torch.zeros(o, dtype=torch.int64, device=device)
        (self.input_ids, self.positions, self.slots, self.logit_rows, self.fill_rows,
         self.fill_src) = [self._dev[a:a + k] for a, k in self._i64]
        qsl, ctx, tiles, table = [self._dev[a:a + _even((k + 1) // 2)].view(torch.int32)[:k]
                                  for a, k in self._i32]
        self.query_start_loc, self.context_lens, self.tiles = qsl, ctx, tiles
        self.block_tables = table.view(s, nb)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}                  # static hidden [n, H]
        self.pool = None
        self.num_replays = 0

    def reset(self) -> None:
        """Return to the state :meth:`capture` leaves (staging turn 0, no replay counted), for
        an engine that takes these graphs over from another; the device must be idle."""
        self._turn = 0
        self.num_replays = 0

    # ---- shapes ----------------------------------------------------------------------------
    def seqs_for(self, n: int) -> int:
        """Sequences the graph of bucket ``n`` is captured for."""
        return min(n, self.max_seqs)

    def tiles_for(self, n: int) -> int:
        """Length of the tile schedule of bucket ``n``."""
        return -(-n // self.block_m) + self.seqs_for(n)

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket holding ``num_tokens``, or None when it exceeds every bucket."""
        for n in self.buckets:
            if n >= num_tokens:
                return n
        return None

    def _meta(self, n: int) -> AttentionMetadata:
        s = self.seqs_for(n)
        return AttentionMetadata(
            slot_mapping=self.slots[:n], query_start_loc=self.query_start_loc[:s + 1],
            context_lens=self.context_lens[:s], block_tables=self.block_tables[:s],
            max_query_len=n, max_context_len=self.max_model_len, block_size=self.block_size,
            is_decode_only=False, prefill_tiles=self.tiles[:self.tiles_for(n)])

    def _run(self, n: int) -> torch.Tensor:
        return self.forward(self.input_ids[:n], self.positions[:n], self.kv_caches, self._meta(n))

    # ---- host staging ----------------------------------------------------------------------
    def _host_views(self, turn: int) -> list[np.ndarray]:
        h = self._hosts[turn].numpy()
        out = [h[a:a + k] for a, k in self._i64]
        out += [h[a:a + _even((k + 1) // 2)].view(np.int32)[:k] for a, k in self._i32]
        return out

    def _next_staging(self) -> list[np.ndarray]:
        self._turn ^= 1
        ev = self._events[self._turn]
        if ev is not None:                  # the copy that last read this buffer has completed
            ev.synchronize()
        return self._host_views(self._turn)

    def _pad(self, views: list[np.ndarray], num_tokens: int, num_seqs: int, n: int) -> None:
        """Padding rows ``num_tokens .. n-1`` and sequences ``num_seqs .. s-1`` of bucket ``n``."""
        ids, pos, slots, _, _, _, qsl, ctx, tiles, table = views
        s = self.seqs_for(n)
        ids[num_tokens:n] = 0
        pos[num_tokens:n] = 0
        slots[num_tokens:n] = -1
        qsl[num_seqs + 1:s + 1] = num_tokens
        ctx[num_seqs:s] = 1
        table.reshape(-1, self.max_blocks)[num_seqs:s] = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller graphs reuse its memory pool), with
        every sequence padding (the kernels' grids depend only on the bucket)."""
        views = self._host_views(self._turn)
        views[6][0] = 0
        self._pad(views, 0, 0, self.max_tokens)
        views[8][:] = -1
        self._dev.copy_(self._hosts[self._turn])
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for n in reversed(self.buckets):
                self._run(n)           # one eager run: compiles this shape's kernels (none autotunes)
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self.outputs[n] = self._run(n)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[n] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    # ---- replay ----------------------------------------------------------------------------
    def eligible(self, scheduled: _Seq, num_logits: _Seq[int] | None) -> bool:
        """The step fits a captured graph: at most :attr:`max_tokens` tokens, at most
        ``max_seqs`` sequences, block tables within ``max_model_len``, default logits rows."""
        if num_logits is not None or not self.graphs or len(scheduled) > self.max_seqs:
            return False
        tokens, _, width, _ = batch_dims(scheduled)
        return tokens <= self.max_tokens and width <= self.max_blocks

    def run(self, scheduled: _Seq, pending: PendingTokens | None = None
            ) -> tuple[torch.Tensor, list[int]]:
        """Replay the step's bucket and compute the logits of its sampled rows.

        Args:
            scheduled: the step's items (:meth:`eligible`).
            pending: the in-flight step's tokens (asynchronous scheduling), or None.

        Returns:
            ``(logits [R, V] float32, index into ``scheduled`` of each row)``; ``[0, 0]`` logits
            when no item samples this step.

        Raises:
            ValueError/RuntimeError: malformed items or a pending token nobody holds (see
                :func:`~llmserve.worker.input_builder.write_host_inputs`).
        """
        num_tokens, num_seqs, _, num_rows = batch_dims(scheduled)
        n = self.bucket_for(num_tokens)
        views = self._next_staging()
        ids, pos, slots, lrows, frows, fsrc, qsl, ctx, tiles, table = views
        table2 = table.reshape(-1, self.max_blocks)
        host = HostInputs(ids[:num_tokens], pos[:num_tokens], slots[:num_tokens],
                          qsl[:num_seqs + 1], ctx[:num_seqs], table2[:num_seqs], lrows[:num_rows],
                          [], frows, fsrc, 0, 0)
        write_host_inputs(scheduled, self.block_size, host, pending)
        self._pad(views, num_tokens, num_seqs, n)
        s = self.seqs_for(n)
        prefill_tile_schedule(qsl[:s + 1], self.block_m, tiles[:self.tiles_for(n)],
                              skip_decode=not self.schedule_decode_rows)
        # one copy: everything up to the block table's last row of this bucket
        a, _ = self._i32[3]
        words = a + _even((s * self.max_blocks + 1) // 2)
        self._dev[:words].copy_(self._hosts[self._turn][:words], non_blocking=True)
        ev = self._events[self._turn]
        if ev is not None:
            ev.record(torch.cuda.current_stream(self.device))
        nfill = len(host.fill_rows)
        if nfill:
            tok = pending.token_ids
            src = self.fill_src[:nfill]
            self.input_ids.index_copy_(0, self.fill_rows[:nfill], tok.index_select(0, src))
        self.graphs[n].replay()
        self.num_replays += 1
        if not num_rows:
            return self.outputs[n].new_empty((0, 0), dtype=torch.float32), []
        hidden = self.outputs[n]
        return self.compute_logits(hidden[self.logit_rows[:num_rows]]), host.logit_items
