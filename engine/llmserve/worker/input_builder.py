"""THE input builder: one step's scheduled sequences -> the tensors of one forward pass.

Every step kind goes through :func:`write_host_inputs` (the eager step, the CUDA-graph decode
step, the speculative target and draft passes), so token ids, positions, slots and block
tables are computed in exactly one place.

For scheduled item ``i`` (sequence ``seq``, ``n`` new tokens from position ``c`` =
``item.start_position``, the position the scheduler planned, never re-read from the sequence)
the flat batch gets rows ``qsl[i] .. qsl[i] + n - 1`` with

* ``input_ids``: ``seq.token_ids_slice(c, c + n)``; a token sampled on the device that the host
  has not read yet (asynchronous scheduling, ``seq.num_pending``) is written as ``0`` and taken
  from the previous step's device tensor after the copy (:class:`PendingTokens`);
* ``positions``: ``c .. c + n - 1``;
* ``slot_mapping``: ``block_ids[p // block_size] * block_size + p % block_size`` per position;
* ``context_lens[i] = c + n`` (tokens in the cache after this step's write);
* ``block_tables[i, :len(block_ids)] = block_ids`` (zero past them);
* ``query_start_loc`` (``cu_seqlens_q``): ``[0, n_0, n_0 + n_1, ...]``.

Logits rows: by default the last row of every item that catches up (``item.will_sample``); a
caller may ask for the last ``m_i`` rows of item ``i`` instead (speculative verification reads
all ``k + 1`` rows of a verified sequence).

Device staging (:class:`InputBuilder`): every array of a step is packed into one persistent
host buffer (pinned on CUDA), copied to one persistent device buffer by a single host-to-device
copy; the tensors handed to the model are views of it. int64 regions first (ids, positions,
slots, logits rows, pending-fill rows and sources), then int32 regions (``query_start_loc``,
``context_lens``, ``block_tables``: the attention kernels' dtype, so no conversion kernel runs).
Every region starts at an even int64 word (16-byte alignment, which Triton specialises pointer
arguments on). Two staging buffers are used in turn, and a buffer is rewritten only after the
copy that last read it has completed (a CUDA event), so the host may plan step ``n + 1`` while
step ``n``'s copy is still queued. The CUDA-graph decode runner keeps its own static buffers
(:mod:`llmserve.worker.cuda_graph`); it is fed the same host arrays.

:meth:`InputBuilder.build` is :meth:`~InputBuilder.pack` (the host arrays, one int64 buffer:
:class:`PackedStep`) then :meth:`~InputBuilder.upload` (the device copy and views). Tensor
parallelism sends the packed buffer from rank 0 to the other ranks between the two
(:mod:`llmserve.worker.step_channel`), which receive it into their own staging buffer
(:meth:`~InputBuilder.staging`) and upload it the same way.
"""

from __future__ import annotations

from collections.abc import Sequence as _Seq
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata

__all__ = [
    "HostInputs",
    "InputBuilder",
    "ModelInput",
    "PackedStep",
    "PendingTokens",
    "ScheduledItem",
    "StepItem",
    "batch_dims",
    "write_host_inputs",
]

#: Input id written for a token whose id is still on the device (overwritten before use).
PENDING_FILL_ID = 0


class ScheduledItem(Protocol):
    """What the builder reads from one scheduled sequence
    (:class:`~llmserve.core.scheduler.ScheduledSequence` and :class:`StepItem` both fit).

    Attributes:
        seq: ``request_id``, ``block_ids`` (physical block ids), ``num_pending`` (sampled
            tokens not yet read by the host) and ``token_ids_slice(start, end)``.
        start_position: position of the first new token (the computed tokens before the step).
        num_new_tokens: tokens computed this step (>= 1).
        will_sample: the item catches up with its sequence (its last row yields the next token).
    """

    seq: Any
    start_position: int
    num_new_tokens: int

    @property
    def will_sample(self) -> bool: ...


@dataclass(slots=True)
class StepItem:
    """A :class:`ScheduledItem` built outside the scheduler (speculative passes over draft
    tokens or the draft model's cache).

    Attributes:
        seq: see :class:`ScheduledItem`.
        start_position: first new token's position.
        num_new_tokens: tokens computed (>= 1).
        num_tokens: the sequence's length as this pass sees it (``will_sample`` iff
            ``start_position + num_new_tokens == num_tokens``).
    """

    seq: Any
    start_position: int
    num_new_tokens: int
    num_tokens: int

    @property
    def end_position(self) -> int:
        return self.start_position + self.num_new_tokens

    @property
    def will_sample(self) -> bool:
        return self.start_position + self.num_new_tokens == self.num_tokens


@dataclass(slots=True)
class PendingTokens:
    """Token ids of the step still in flight (asynchronous scheduling).

    Attributes:
        token_ids: ``[P]`` int64 on the model's device, the in-flight step's sampled ids.
        index: ``request_id -> row`` of ``token_ids``.
    """

    token_ids: torch.Tensor
    index: dict[str, int]

    def source(self, request_id: str) -> int:
        """Row of ``request_id``'s pending token.

        Raises:
            RuntimeError: no in-flight step holds a token of that request."""
        try:
            return self.index[request_id]
        except KeyError:
            raise RuntimeError(f"sequence {request_id!r} has a pending token but no in-flight "
                               "step holds it") from None


@dataclass(slots=True)
class HostInputs:
    """One step's host arrays (numpy views; valid until the builder's next call).

    Attributes:
        input_ids: ``[N]`` int64 (``0`` at pending rows, see :attr:`fill_rows`).
        positions: ``[N]`` int64.
        slot_mapping: ``[N]`` int64 flat cache slots.
        query_start_loc: ``[B+1]`` int32.
        context_lens: ``[B]`` int32.
        block_tables: ``[B, W]`` int32, ``W`` = the longest block table of the step.
        logit_rows: ``[R]`` int64 rows of the flat batch whose logits are computed.
        logit_items: length ``R``, the scheduled item of each logits row.
        fill_rows: ``[F]`` int64 rows whose id is the in-flight step's token.
        fill_src: ``[F]`` int64 their rows in :attr:`PendingTokens.token_ids`.
        max_query_len: longest query (tokens).
        max_context_len: longest context after the step (tokens).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    logit_rows: np.ndarray
    logit_items: list[int]
    fill_rows: np.ndarray
    fill_src: np.ndarray
    max_query_len: int
    max_context_len: int


@dataclass(slots=True)
class ModelInput:
    """Device tensors of one step (views of the builder's device buffer: valid until its next
    call).

    Attributes:
        input_ids: ``[N]`` int64.
        positions: ``[N]`` int64.
        attn_metadata: see :class:`AttentionMetadata` (int64 slots, int32 rest).
        sample_rows: ``[R]`` int64 rows of the flat batch whose logits are computed.
        sample_seq_indices: for each of those rows, the index into the scheduled list.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor
    sample_seq_indices: list[int]


def _check_num_logits(scheduled: _Seq, num_logits: _Seq[int]) -> None:
    if len(num_logits) != len(scheduled):
        raise ValueError(f"num_logits has {len(num_logits)} entries for {len(scheduled)} items")
    for item, m in zip(scheduled, num_logits):
        if not 0 <= m <= item.num_new_tokens:
            raise ValueError(f"num_logits must be in [0, num_new_tokens={item.num_new_tokens}], got {m}")


def batch_dims(scheduled: _Seq, num_logits: _Seq[int] | None = None) -> tuple[int, int, int, int]:
    """``(N tokens, B sequences, W block-table width, R logits rows)`` of a step.

    Raises:
        ValueError: an empty step, an item with no new tokens, or bad ``num_logits``."""
    if not scheduled:
        raise ValueError("a step needs at least one scheduled sequence")
    n = w = r = 0
    for item in scheduled:
        if item.num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {item.num_new_tokens}")
        n += item.num_new_tokens
        w = max(w, len(item.seq.block_ids))
        if num_logits is None and item.will_sample:
            r += 1
    if num_logits is not None:
        _check_num_logits(scheduled, num_logits)
        r = sum(num_logits)
    return n, len(scheduled), w, r


def write_host_inputs(scheduled: _Seq, block_size: int, out: HostInputs,
                      pending: PendingTokens | None = None,
                      num_logits: _Seq[int] | None = None) -> HostInputs:
    """Fill ``out``'s arrays (sized by :func:`batch_dims`; ``fill_rows``/``fill_src`` hold at
    least ``B`` entries) for ``scheduled``; see the module docstring for the formulas.

    Python work is per sequence (a decode row is a few scalar writes, a prefill chunk numpy
    slices), not per token.

    Args:
        scheduled: :class:`ScheduledItem` s.
        block_size: tokens per KV block.
        out: the arrays to write (their exact lengths: ``N``, ``B+1``, ``B``, ``[B, W]``, ``R``).
        pending: the in-flight step's token ids (asynchronous scheduling), or None.
        num_logits: logits rows per item (the last ones), default 1 for items that catch up.

    Returns:
        ``out``, with ``fill_rows``/``fill_src`` cut to the ``F`` filled rows, ``logit_items``,
        ``max_query_len`` and ``max_context_len`` set.

    Raises:
        RuntimeError: a sequence's newest token is pending but ``pending`` does not hold it,
            or more than one of its tokens is pending.
    """
    bs = block_size
    if num_logits is not None:
        _check_num_logits(scheduled, num_logits)
    ids, pos, slots = out.input_ids, out.positions, out.slot_mapping
    qsl, ctx, table = out.query_start_loc, out.context_lens, out.block_tables
    lrows, fill_rows, fill_src = out.logit_rows, out.fill_rows, out.fill_src
    table[:] = 0
    qsl[0] = 0
    logit_items: list[int] = []
    row = r = f = 0
    max_q = max_ctx = 0
    for i, item in enumerate(scheduled):
        seq = item.seq
        c, n = item.start_position, item.num_new_tokens
        e = c + n
        blocks = seq.block_ids
        table[i, :len(blocks)] = blocks
        pend = seq.num_pending and item.will_sample      # its newest token is on the device
        if n == 1:                                        # decode: scalar writes
            ids[row] = PENDING_FILL_ID if pend else seq.token_ids_slice(c, e)[0]
            pos[row] = c
            slots[row] = blocks[c // bs] * bs + c % bs
        else:
            toks = seq.token_ids_slice(c, e)
            if pend:
                toks[-1] = PENDING_FILL_ID
            ids[row:row + n] = toks
            p = np.arange(c, e, dtype=np.int64)                                    # [n]
            pos[row:row + n] = p
            slots[row:row + n] = np.asarray(blocks, dtype=np.int64)[p // bs] * bs + p % bs
        if pend:
            if seq.num_pending != 1:
                raise RuntimeError(f"sequence {seq.request_id!r} has {seq.num_pending} pending "
                                   "tokens; at most one step may be in flight")
            if pending is None:
                raise RuntimeError(f"sequence {seq.request_id!r} has a pending token but no "
                                   "in-flight step holds it")
            fill_rows[f] = row + n - 1
            fill_src[f] = pending.source(seq.request_id)
            f += 1
        row += n
        qsl[i + 1] = row
        ctx[i] = e
        m = (1 if item.will_sample else 0) if num_logits is None else num_logits[i]
        if m == 1:
            lrows[r] = row - 1
            logit_items.append(i)
        elif m:
            lrows[r:r + m] = np.arange(row - m, row, dtype=np.int64)
            logit_items.extend([i] * m)
        r += m
        max_q = max(max_q, n)
        max_ctx = max(max_ctx, e)
    out.fill_rows, out.fill_src = fill_rows[:f], fill_src[:f]
    out.logit_items = logit_items
    out.max_query_len, out.max_context_len = max_q, max_ctx
    return out


@dataclass(slots=True)
class PackedStep:
    """One step's host arrays packed in a staging buffer (:meth:`InputBuilder.pack` or
    :meth:`InputBuilder.staging`), ready for :meth:`InputBuilder.upload`.

    Attributes:
        dims: ``(N tokens, B sequences, W block-table width, R logits rows)``.
        words: ``[total]`` int64 host tensor, the whole packed step (a view of the staging
            buffer: valid until the builder's call after next).
        host: numpy views of ``words`` region by region (:class:`HostInputs`).
        turn: which of the two staging buffers holds it.
    """

    dims: tuple[int, int, int, int]
    words: torch.Tensor
    host: HostInputs
    turn: int


def _even(words: int) -> int:
    return words + (words & 1)


class _Packed:
    """Offsets (int64 words) of one step's regions in the packed buffer."""

    __slots__ = ("dims", "i64", "i32", "total")

    def __init__(self, n: int, b: int, w: int, r: int) -> None:
        self.dims = (n, b, w, r)
        o = 0
        self.i64 = []
        for size in (n, n, n, r, b, b):            # ids | positions | slots | logit rows | fill rows | fill src
            self.i64.append((o, size))
            o += _even(size)
        self.i32 = []
        for size in (b + 1, b, b * w):              # query_start_loc | context_lens | block table
            self.i32.append((o, size))
            o += _even((size + 1) // 2)
        self.total = o


class InputBuilder:
    """Persistent host staging + device buffers for the eager step (module docstring).

    Args:
        block_size: tokens per KV block.
        device: where the model runs; on CUDA the staging buffers are pinned.
        initial_words: starting capacity in int64 words (buffers grow, doubling, on demand).

    The tensors of :meth:`build` are views of one device buffer: consume them before the next
    call (the engine runs one step at a time). :meth:`build_host` fills plain numpy scratch for
    callers with their own device staging (the CUDA-graph decode runner).
    """

    def __init__(self, block_size: int, device: torch.device | str, initial_words: int = 4096) -> None:
        self.block_size = int(block_size)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._capacity = 0
        self._hosts: list[torch.Tensor] = []
        # the copy that last read each staging buffer (an unrecorded event is complete)
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self._cuda else [None, None]
        self._turn = 0
        self._dev: torch.Tensor | None = None
        self._scratch = np.zeros(0, dtype=np.int64)
        self._grow(initial_words)

    # ---- buffers -------------------------------------------------------------------------------
    def _grow(self, words: int) -> None:
        if words <= self._capacity:
            return
        cap = max(64, 1 << (int(words) - 1).bit_length())
        for ev in self._events:                      # no queued copy reads the old buffers
            if ev is not None:
                ev.synchronize()
        self._hosts = [torch.zeros(cap, dtype=torch.int64, pin_memory=self._cuda) for _ in range(2)]
        self._dev = torch.zeros(cap, dtype=torch.int64, device=self.device)
        self._capacity = cap

    @staticmethod
    def _views(buf, lay: _Packed, i32_of) -> list:
        """Region views of ``buf`` (int64 1-D); ``i32_of(lo, hi)`` views words as int32."""
        n, b, w, r = lay.dims
        out = [buf[o:o + s] for o, s in lay.i64]
        for o, s in lay.i32:
            out.append(i32_of(buf, o, _even((s + 1) // 2))[:s])
        out[-1] = out[-1].reshape(b, w) if isinstance(out[-1], np.ndarray) else out[-1].view(b, w)
        return out

    @staticmethod
    def _host_inputs(views: list) -> HostInputs:
        ids, pos, slots, lrows, frows, fsrc, qsl, ctx, table = views
        return HostInputs(ids, pos, slots, qsl, ctx, table, lrows, [], frows, fsrc, 0, 0)

    # ---- building ------------------------------------------------------------------------------
    def build_host(self, scheduled: _Seq, pending: PendingTokens | None = None,
                   num_logits: _Seq[int] | None = None) -> HostInputs:
        """The step's host arrays in numpy scratch (no device copy).

        Raises:
            ValueError/RuntimeError: see :func:`batch_dims` and :func:`write_host_inputs`."""
        lay = _Packed(*batch_dims(scheduled, num_logits))
        if self._scratch.shape[0] < lay.total:
            self._scratch = np.zeros(max(64, 1 << (lay.total - 1).bit_length()), dtype=np.int64)
        views = self._views(self._scratch, lay, lambda a, o, k: a[o:o + k].view(np.int32))
        return write_host_inputs(scheduled, self.block_size, self._host_inputs(views), pending, num_logits)

    def build(self, scheduled: _Seq, pending: PendingTokens | None = None,
              num_logits: _Seq[int] | None = None) -> ModelInput:
        """Build the step's tensors on the device: pack the host arrays into the staging buffer,
        one host-to-device copy, then write the pending ids (device to device).

        Args:
            scheduled: :class:`ScheduledItem` s of the step.
            pending: the in-flight step's ids (asynchronous scheduling), or None.
            num_logits: logits rows per item (default: the last row of items that catch up).

        Returns:
            :class:`ModelInput` whose tensors are views of the device buffer.

        Raises:
            ValueError/RuntimeError: see :func:`batch_dims` and :func:`write_host_inputs`.
        """
        return self.upload(self.pack(scheduled, pending, num_logits), pending)

    def staging(self, dims: tuple[int, int, int, int]) -> PackedStep:
        """The next staging buffer, sized for a step of ``dims`` ``(N, B, W, R)``, once the
        copy that last read it has completed; its arrays are not written (a receiving rank
        fills ``words`` and sets the ``host`` fields that are not regions)."""
        lay = _Packed(*dims)
        self._grow(lay.total)
        self._turn ^= 1
        ev = self._events[self._turn]
        if ev is not None:                  # the copy that last read this staging buffer is done
            ev.synchronize()
        host = self._hosts[self._turn]
        hv = self._views(host.numpy(), lay, lambda a, o, k: a[o:o + k].view(np.int32))
        return PackedStep(lay.dims, host[:lay.total], self._host_inputs(hv), self._turn)

    def pack(self, scheduled: _Seq, pending: PendingTokens | None = None,
             num_logits: _Seq[int] | None = None) -> PackedStep:
        """The step's host arrays written into the next staging buffer (no device work).

        Raises:
            ValueError/RuntimeError: see :func:`batch_dims` and :func:`write_host_inputs`.
        """
        packed = self.staging(batch_dims(scheduled, num_logits))
        write_host_inputs(scheduled, self.block_size, packed.host, pending, num_logits)
        return packed

    def upload(self, packed: PackedStep, pending: PendingTokens | None = None) -> ModelInput:
        """Copy a packed step to the device (one host-to-device copy), write the pending ids
        (``pending.token_ids[fill_src]`` into ``input_ids[fill_rows]``, device to device) and
        return its tensors (views of the device buffer, valid until the next upload)."""
        lay = _Packed(*packed.dims)
        h = packed.host
        dev = self._dev
        dev[:lay.total].copy_(packed.words, non_blocking=True)                      # one H2D copy
        ev = self._events[packed.turn]
        if ev is not None:
            ev.record(torch.cuda.current_stream(self.device))
        ids, pos, slots, lrows, frows, fsrc, qsl, ctx, table = self._views(
            dev, lay, lambda t, o, k: t[o:o + k].view(torch.int32))
        nfill = len(h.fill_rows)
        if nfill:
            tok = pending.token_ids
            first = np.arange(nfill)
            if np.array_equal(h.fill_rows, first) and np.array_equal(h.fill_src, first):
                ids[:nfill].copy_(tok[:nfill])           # rows 0..F-1 take tokens 0..F-1
            else:
                ids.index_copy_(0, frows[:nfill], tok.index_select(0, fsrc[:nfill]))
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=qsl, context_lens=ctx, block_tables=table,
            max_query_len=h.max_query_len, max_context_len=h.max_context_len,
            block_size=self.block_size, is_decode_only=h.max_query_len == 1)
        return ModelInput(input_ids=ids, positions=pos, attn_metadata=meta, sample_rows=lrows,
                          sample_seq_indices=h.logit_items)
