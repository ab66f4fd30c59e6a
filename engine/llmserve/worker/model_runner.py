"""ModelRunner: the only place that turns scheduled sequences into tensors.

For each scheduled sequence with ``n`` new tokens starting at ``c = num_computed_tokens`` it
emits the token ids ``all_token_ids[c:c+n]``, their positions ``c..c+n-1``, and the flat cache
slot of each (``block_ids[p // block_size] * block_size + p % block_size``). The batch is
flat (varlen): ``query_start_loc`` marks where each sequence's rows start. Logits are computed
only for the last row of each sequence that catches up this step (the rows that sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata


@dataclass(slots=True)
class ModelInput:
    """Host-built tensors of one step (already on the model's device).

    Attributes:
        input_ids: ``[N]`` int64.
        positions: ``[N]`` int64.
        attn_metadata: see :class:`AttentionMetadata`.
        sample_rows: ``[S]`` int64 rows of the flat batch whose logits are sampled.
        sample_seq_indices: for each sampled row, the index into the scheduled list.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor
    sample_seq_indices: list[int]


class ModelRunner:
    """Builds inputs and runs the model's paged forward pass.

    Args:
        model: a ``Qwen2ForCausalLM`` (``forward(input_ids, positions, kv_caches, meta)`` and
            ``compute_logits(hidden)``).
        kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks + 1, block_size, Hkv, D]``.
        block_size: tokens per block.
        device: the model's device.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device | str, forward=None, cuda_graphs=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        # ``forward``: the fused path (models/fast_forward.py) when enabled, else the model.
        self.forward = forward or model
        # ``cuda_graphs``: a CUDAGraphDecodeRunner replaying decode-only steps, or None.
        self.cuda_graphs = cuda_graphs
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        # The last execute's greedy tokens when a decode graph computed them ([S] int64, rows
        # of its logits), else None.
        self.last_argmax: torch.Tensor | None = None

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(array).to(dtype)
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    @staticmethod
    def _pending_source(seq, pending) -> int:
        """Index of ``seq``'s pending token in the in-flight step's sampled ids."""
        if pending is None or seq.request_id not in pending[1]:
            raise RuntimeError(f"sequence {seq.request_id!r} has a pending token but no in-flight "
                               "step holds it")
        return pending[1][seq.request_id]

    def _fill_pending(self, input_ids: torch.Tensor, rows: list[int], src: list[int], pending) -> None:
        """``input_ids[rows] = pending_ids[src]`` on the device (ids the host has not read)."""
        tok = pending[0]
        if rows == src == list(range(len(rows))):
            input_ids[:len(rows)].copy_(tok[:len(rows)])
            return
        r = self._to_device(np.asarray(rows, dtype=np.int64), torch.int64)
        s = self._to_device(np.asarray(src, dtype=np.int64), torch.int64)
        input_ids.index_copy_(0, r, tok.index_select(0, s))

    def prepare(self, scheduled: list, pending=None) -> ModelInput:
        """Build the step's tensors from ``ScheduledSequence``-like items (``.seq``,
        ``.num_new_tokens``). Python work is per sequence, not per token (numpy slices).

        ``pending``: ``(token_ids_device [P] int64, {request_id: index})`` of the step still in
        flight (asynchronous scheduling); a sequence whose newest token is pending takes it as
        its input id straight from that device tensor."""
        bs = self.block_size
        fill_rows, fill_src = [], []
        ids_parts, pos_parts, slot_parts = [], [], []
        q_lens, ctx_lens, tables = [], [], []
        sample_rows, sample_idx = [], []
        row = 0
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_new_tokens
            c = seq.num_computed_tokens
            table = np.asarray(seq.block_ids, dtype=np.int64)
            pos = np.arange(c, c + n, dtype=np.int64)
            ids_parts.append(np.asarray(seq.token_ids_slice(c, c + n), dtype=np.int64))
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            q_lens.append(n)
            ctx_lens.append(c + n)
            tables.append(table)
            row += n
            if c + n == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_idx.append(i)
                if seq.num_pending:
                    fill_rows.append(row - 1)
                    fill_src.append(self._pending_source(seq, pending))
        b = len(scheduled)
        max_blocks = max(len(t) for t in tables)
        block_tables = np.zeros((b, max_blocks), dtype=np.int64)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        meta = AttentionMetadata(
            slot_mapping=self._to_device(np.concatenate(slot_parts), torch.int64),
            query_start_loc=self._to_device(qsl, torch.int32),
            context_lens=self._to_device(np.asarray(ctx_lens, dtype=np.int64), torch.int32),
            block_tables=self._to_device(block_tables, torch.int32),
            max_query_len=max(q_lens),
            max_context_len=max(ctx_lens),
            block_size=bs,
            is_decode_only=max(q_lens) == 1,
        )
        input_ids = self._to_device(np.concatenate(ids_parts), torch.int64)
        if fill_rows:
            self._fill_pending(input_ids, fill_rows, fill_src, pending)
        return ModelInput(
            input_ids=input_ids,
            positions=self._to_device(np.concatenate(pos_parts), torch.int64),
            attn_metadata=meta,
            sample_rows=self._to_device(np.asarray(sample_rows, dtype=np.int64), torch.int64),
            sample_seq_indices=sample_idx,
        )

    def _try_graph(self, scheduled: list, pending=None) -> tuple[torch.Tensor, list[int]] | None:
        """Replay a captured graph when every sequence decodes exactly one token."""
        g = self.cuda_graphs
        b = len(scheduled)
        if g is None or b > g.max_batch:
            return None
        bs = self.block_size
        ids = np.empty(b, dtype=np.int64)
        pos = np.empty(b, dtype=np.int64)
        slots = np.empty(b, dtype=np.int64)
        tables = []
        fill_rows, fill_src = [], []
        for i, item in enumerate(scheduled):
            seq = item.seq
            c = seq.num_computed_tokens
            if item.num_new_tokens != 1 or c + 1 != seq.num_tokens:
                return None
            if seq.num_pending:
                ids[i] = 0
                fill_rows.append(i)
                fill_src.append(self._pending_source(seq, pending))
            else:
                ids[i] = seq.output_token_ids[-1] if seq.output_token_ids else seq.prompt_token_ids[-1]
            pos[i] = c
            slots[i] = seq.block_ids[c // bs] * bs + c % bs
            tables.append(seq.block_ids)
        width = max(len(t) for t in tables)
        if width > g.max_blocks:
            return None
        table = np.zeros((b, width), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        fill = None
        if fill_rows:
            fill = lambda input_ids: self._fill_pending(input_ids, fill_rows, fill_src, pending)  # noqa: E731
        logits = g.run(ids, pos, slots, pos + 1, table, fill=fill)
        self.num_graph_steps += 1
        return logits, list(range(b))

    @torch.inference_mode()
    def execute(self, scheduled: list, pending=None) -> tuple[torch.Tensor, list[int]]:
        """Run one forward pass (a CUDA-graph replay for decode-only steps when available).
        ``pending``: the in-flight step's sampled ids, see :meth:`prepare`.

        Returns:
            ``(logits [S, vocab] float32, sample_seq_indices)``: logits for the sequences that
            caught up this step, and their indices in ``scheduled``. :attr:`last_argmax` is
            their argmax when a decode graph computed it.
        """
        self.last_argmax = None
        replay = self._try_graph(scheduled, pending)
        if replay is not None:
            self.last_argmax = self.cuda_graphs.last_argmax
            return replay
        self.num_eager_steps += 1
        inp = self.prepare(scheduled, pending)
        hidden = self.forward(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)  # [N, H]
        if not inp.sample_seq_indices:
            return hidden.new_empty((0, 0), dtype=torch.float32), []
        logits = self.model.compute_logits(hidden[inp.sample_rows])                            # [S, V]
        return logits, inp.sample_seq_indices
