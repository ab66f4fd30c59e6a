"""CUDA-graph replay of decode steps, one graph per batch-size bucket.

A decode step of a small model is launch-bound: hundreds of short kernels whose CPU launch
cost exceeds their GPU time. Capturing the whole step (embedding -> layers -> logits) once per
batch-size bucket and replaying it removes the per-kernel launch cost (the technique vLLM and
SGLang use; CUDA Programming Guide, "CUDA Graphs").

Static inputs live in one device buffer filled by a single host-to-device copy from a pinned
staging buffer: token ids, positions, slot mapping, context lengths and the block table, each a
view into it. A batch of ``b`` sequences runs in the smallest bucket ``>= b``; the padding rows
write their K/V to the scratch block (slot ``-1``) and read a 1-token context, and their logits
are discarded. The attention metadata's ``max_context_len`` is fixed at capture time, so the
kernel grid never changes between replays: to the engine's ``max_model_len``, and for small
batches also to a short context (:data:`SHORT_CONTEXT`, 512 tokens) in a second graph that steps
whose longest context fits replay instead. The decode attention kernel sizes its split count
from ``max_context_len``; at batch 1 a grid sized for 2,048 tokens has 32 splits (64-token
tiles, head_dim <= 128), more than the kernel merges itself, so that graph also holds a
reduction kernel a layer, which a 512-token graph (at most 8 splits, merged in the decode
kernel) does not. ``short_context=0`` (``FastPathConfig.graph_short_context``) captures only
the full-length graphs.
Correctness never depends on the choice: every sequence's tiles come from its own context
length; ``max_context_len`` only sets the split count and the partial buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata


SHORT_CONTEXT = 512     # tokens: 8 tiles of 64 (head_dim <= 128), or 2 of 256 for <= 4 (sequence,
                        # KV head) pairs, merged in the decode kernel
SHORT_MAX_BATCH = 16    # short-context graphs for batch buckets up to this size


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (inclusive)."""
    out = [b for b in (1, 2, 4, 8) if b <= max_batch]
    out += list(range(16, max_batch + 1, 16))
    if not out or out[-1] != max_batch:
        out.append(max_batch)
    return sorted(set(out))


class CUDAGraphDecodeRunner:
    """Captures and replays decode steps.

    Args:
        forward: ``(input_ids, positions, kv_caches, meta) -> hidden [N, H]``.
        compute_logits: ``hidden [N, H] -> logits [N, V]`` float32.
        kv_caches: per-layer ``(k, v)`` cache tensors.
        block_size: tokens per block.
        max_batch: largest bucket (the scheduler's ``max_num_seqs``).
        max_model_len: longest sequence; fixes the block-table width and the attention grid of
            the full-length graphs.
        device: a CUDA device.
        short_context: context length of the second, short-context graph captured for batch
            buckets up to :data:`SHORT_MAX_BATCH`, tokens (default :data:`SHORT_CONTEXT`;
            ``0`` or ``>= max_model_len``: none).
        greedy: optional ``(logits [N, V], out=[2, N] int64, out_row=[1] int64)`` writing the
            argmax of each row to ``out[out_row[0]]`` (e.g.
            :meth:`~llmserve.models.fused_forward.FastQwen2Forward.greedy`), captured after the
            logits so the step's greedy tokens come out of the graph (:attr:`last_argmax`);
            replays alternate between the two rows.

    Raises:
        ValueError: ``short_context`` is not an integer >= 0.
    """

    def __init__(self, forward, compute_logits, kv_caches, block_size: int, max_batch: int,
                 max_model_len: int, device: torch.device, short_context: int = SHORT_CONTEXT,
                 greedy=None) -> None:
        if type(short_context) is not int or short_context < 0:
            raise ValueError(f"short_context must be an integer >= 0 (tokens; 0: none), got {short_context!r}")
        self.forward = forward
        self.compute_logits = compute_logits
        self.greedy = greedy
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.buckets = default_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        b, nb = self.max_batch, self.max_blocks
        # Layout of the packed input buffer, in int64 words: ids + the argmax parity word (+ one
        # spare word, so the regions after it keep the 16-byte alignment of the other regions,
        # which Triton specialises its pointer arguments on) | positions | slots (int64) |
        # ctx_lens | table (int32, the attention kernels' dtype; each region is sized in int64
        # words and half used), so one H2D copy fills every input and no conversion kernel
        # runs inside the graph.
        self._sizes = [b + 2, b, b, b, b * nb]
        self._offsets = np.cumsum([0] + self._sizes)
        total = int(self._offsets[-1])
        # Two pinned staging buffers used in turn: with asynchronous scheduling the host fills
        # step n+1's inputs while step n's copy may still be queued behind step n-1 on the
        # device; the buffer written now was last read by the copy of step n-1, which has
        # completed once the engine read step n-1's sampled tokens.
        self._hosts = [torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
                       for _ in range(2)]
        self._hosts_np = [h.numpy() for h in self._hosts]
        o = self._offsets
        self._hosts_i32 = [h[o[3]:].view(torch.int32).numpy() for h in self._hosts]  # ctx | table
        self._turn = 0                                     # the staging buffer in use
        self._dev = torch.zeros(total, dtype=torch.int64, device=device)
        self.input_ids = self._dev[o[0]:o[0] + b]
        # Greedy tokens alternate between the two rows of one buffer shared by every graph:
        # replay j writes row j % 2 (the parity word of its inputs). The copy of replay j's
        # tokens to the host may then run on another stream without holding up replay j + 1,
        # which writes the other row; replay j + 2 is launched only after the host has read
        # replay j's tokens (asynchronous scheduling reads a step's tokens before it launches
        # the step after next). The one way around it is an exception between a replay and
        # the engine taking over its sample (``LLMEngine.step``): the step before stays unread
        # while the next replay runs; by then its copy has long finished, and the front end
        # aborts every request on a step error, so no token is delivered from it.
        self._parity_word = int(o[0]) + b
        self.argmax_parity = self._dev[self._parity_word:self._parity_word + 1]         # [1] int64
        self.argmax_out = torch.zeros(2, b, dtype=torch.int64, device=device)
        self._replays = 0
        self.positions = self._dev[o[1]:o[2]]
        self.slots = self._dev[o[2]:o[3]]
        self.ctx_lens = self._dev[o[3]:o[4]].view(torch.int32)[:b]                 # [b] int32
        self.block_tables = self._dev[o[4]:o[5]].view(torch.int32)[:b * nb].view(b, nb)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.short_context = short_context if 0 < short_context < max_model_len else 0
        # keyed (bucket, short): short=False sized for max_model_len, True for short_context
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}              # static logits [b, V]
        self.pool = None
        self.num_short_replays = 0
        self.last_graph: torch.cuda.CUDAGraph | None = None
        self.last_argmax: torch.Tensor | None = None

    def _meta(self, b: int, short: bool) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b], query_start_loc=self.query_start_loc[:b + 1],
            context_lens=self.ctx_lens[:b], block_tables=self.block_tables[:b],
            max_query_len=1, max_context_len=self.short_context if short else self.max_model_len,
            block_size=self.block_size, is_decode_only=True)

    def _run(self, b: int, short: bool) -> torch.Tensor:
        hidden = self.forward(self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b, short))
        logits = self.compute_logits(hidden)                                  # [b, V]
        if self.greedy is not None:                                           # into argmax_out[parity, :b]
            self.greedy(logits, out=self.argmax_out[:, :b], out_row=self.argmax_parity)
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool): its
        full-length graph, and for buckets up to :data:`SHORT_MAX_BATCH` its short-context one."""
        # Padding values: slot -1 (scratch), context 1, block 0 -> harmless reads.
        self._fill_padding(0)
        self._dev.copy_(self._hosts[self._turn])
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                variants = [False] + ([True] if self.short_context and b <= SHORT_MAX_BATCH else [])
                for short in variants:
                    # one eager run: compiles this shape's Triton variants and sets up cuBLAS's
                    # workspace on this stream (nothing autotunes, so a second run only repeats it)
                    self._run(b, short)
                    torch.cuda.synchronize(self.device)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=stream):
                        self.outputs[(b, short)] = self._run(b, short)
                    if self.pool is None:
                        self.pool = g.pool()
                    self.graphs[(b, short)] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        """Return to the state :meth:`capture` leaves (staging turn 0, no replay yet, counters
        zero), for an engine that takes these graphs over from another; the device must be
        idle (no replay in flight)."""
        self._turn = 0
        self._replays = 0
        self.num_short_replays = 0
        self.last_graph = None
        self.last_argmax = None

    def _fill_padding(self, start: int) -> None:
        o, h = self._offsets, self._hosts_np[self._turn]
        h[o[0] + start:o[0] + self.max_batch] = 0                # ids (not the parity word)
        h[o[1] + start:o[2]] = 0
        h[o[2] + start:o[3]] = -1
        ctx, table = self._host_ctx_table()
        ctx[start:] = 1
        table[start:] = 0

    def _host_ctx_table(self) -> tuple[np.ndarray, np.ndarray]:
        """The int32 context lengths ``[max_batch]`` and block table ``[max_batch, max_blocks]``
        in the staging buffer in use."""
        b, nb = self.max_batch, self.max_blocks
        h32 = self._hosts_i32[self._turn]
        return h32[:b], h32[2 * b:2 * b + b * nb].reshape(b, nb)

    def bucket_for(self, b: int) -> int | None:
        for s in self.buckets:
            if s >= b:
                return s
        return None

    def run(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            context_lens: np.ndarray, block_tables: np.ndarray, fill=None) -> torch.Tensor:
        """Replay the bucket's graph for ``b = len(token_ids)`` decode rows: the short-context
        graph when every context fits in it, else the full-length one (``last_graph`` records
        which).

        Args:
            token_ids, positions, slots, context_lens: ``[b]`` int64 arrays.
            block_tables: ``[b, w]`` int64 with ``w <= max_blocks``.
            fill: optional callable given the graph's ``input_ids`` buffer after the inputs are
                copied in, to write ids that live on the device (asynchronous scheduling).

        Returns:
            logits ``[b, V]`` float32 (a view of the graph's static output: consume before the
            next replay); with ``greedy``, :attr:`last_argmax` is their argmax ``[b]`` int64
            (static too: valid until the replay after next), else ``None``.
        """
        b = len(token_ids)
        bucket = self.bucket_for(b)
        self._turn ^= 1
        o, h = self._offsets, self._hosts_np[self._turn]
        h[o[0]:o[0] + b] = token_ids
        h[o[1]:o[1] + b] = positions
        h[o[2]:o[2] + b] = slots
        parity = self._replays % 2
        h[self._parity_word] = parity
        ctx, table = self._host_ctx_table()
        ctx[:b] = context_lens
        table[:b] = 0
        table[:b, :block_tables.shape[1]] = block_tables
        self._fill_padding(b)
        n = int(o[4] + (bucket * self.max_blocks + 1) // 2)  # the table's int32 rows < bucket
        self._dev[:n].copy_(self._hosts[self._turn][:n], non_blocking=True)               # one H2D copy
        if fill is not None:
            fill(self.input_ids)
        short = (bucket, True) in self.graphs and int(context_lens.max()) <= self.short_context
        self.last_graph = self.graphs[(bucket, short)]
        self.last_graph.replay()
        self._replays += 1
        self.num_short_replays += short
        self.last_argmax = self.argmax_out[parity, :b] if self.greedy is not None else None
        return self.outputs[(bucket, short)][:b]
