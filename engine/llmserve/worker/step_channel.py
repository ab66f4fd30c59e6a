"""How rank 0 hands each step to the other tensor-parallel ranks.

Rank 0 runs the scheduler and packs the step's inputs (:meth:`InputBuilder.pack
<llmserve.worker.input_builder.InputBuilder.pack>`: ids, positions, slots, logits rows, pending
fill rows and sources, ``query_start_loc``, ``context_lens``, block tables, all in one int64
buffer). Per step it broadcasts, over a gloo group of CPU tensors (the *control* group):

1. one message of :data:`HEADER_WORDS` + :data:`INLINE_WORDS` int64 words: the header (the
   operation, ``(N, B, W, R)``, the number of pending fill rows ``F``, ``max_query_len``,
   ``max_context_len``, the length ``P`` of the in-flight step's token ids and the packed
   length in words) followed by the packed buffer itself when it fits (``total`` int64 words;
   a decode step of ``B`` sequences whose block tables are ``W`` wide is about
   ``5B + B*W/2`` words, so decode batches up to about 32 at 512 tokens of context fit);
2. a larger packed buffer as a second message;
3. with asynchronous scheduling, when ``F > 0``: the in-flight step's sampled ids (``[P]``
   int64, on the device) over the device group (NCCL on GPUs), so no rank waits for the host
   to read them.

One message rather than a header and then the payload: a gloo send completes only once the
receiver has posted its receive, so the receiver's work between two messages would be paid
by rank 0 on every step (measured on 2 shared CPU cores: two messages about 0.8-1 ms a step,
one message about 0.13-0.15 ms).

Every rank then uploads the same buffer (:meth:`InputBuilder.upload
<llmserve.worker.input_builder.InputBuilder.upload>`) and runs the same forward. Tensors, not
pickled objects: the header is fixed-size, the payload one contiguous buffer that already
exists on rank 0, and the receivers write it straight into their own staging buffer.

Workers wait for the next header without a time limit (the control group's timeout is
:data:`IDLE_TIMEOUT`), so a server may sit idle; a rank that dies closes its sockets and the
peers' collectives fail at once.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch

from .input_builder import InputBuilder, PackedStep, PendingTokens

__all__ = ["HEADER_WORDS", "IDLE_TIMEOUT", "INLINE_WORDS", "OP_STEP", "OP_STOP", "ReceivedStep", "StepChannel"]

HEADER_WORDS = 10
#: Packed words sent inside the header's message (8 KiB); larger steps take a second message.
INLINE_WORDS = 1024
OP_STOP = 0
OP_STEP = 1
#: How long a worker waits for rank 0's next step (the control group's timeout).
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(slots=True)
class ReceivedStep:
    """What a non-zero rank received for one step.

    Attributes:
        op: :data:`OP_STEP` or :data:`OP_STOP` (then the other fields are None).
        packed: the step's packed inputs in this rank's staging buffer.
        pending: the in-flight step's token ids (``[P]`` int64 on this rank's device) when the
            step has pending fill rows, else None.
    """

    op: int
    packed: PackedStep | None = None
    pending: PendingTokens | None = None


class StepChannel:
    """Rank 0's sends and the other ranks' receives of one step (module docstring).

    Args:
        control_group: gloo process group (CPU tensors) of the headers and payloads.
        device_group: the model's process group (pending token ids on the device).
        device: this rank's device.
        rank: this rank (0 sends, the others receive).

    Attributes:
        num_sends, send_seconds, send_bytes: steps sent by rank 0, the host wall seconds of
            their broadcasts and the bytes broadcast (header + payload + pending ids).
    """

    def __init__(self, control_group, device_group, device: torch.device | str, rank: int) -> None:
        self.control_group = control_group
        self.device_group = device_group
        self.device = torch.device(device)
        self.rank = rank
        self._message = torch.zeros(HEADER_WORDS + INLINE_WORDS, dtype=torch.int64)
        self._header = self._message[:HEADER_WORDS]
        self.num_sends = 0
        self.send_seconds = 0.0
        self.send_bytes = 0

    def reset_stats(self) -> None:
        self.num_sends = 0
        self.send_seconds = 0.0
        self.send_bytes = 0

    def _broadcast(self, t: torch.Tensor, group) -> None:
        import torch.distributed as dist

        dist.broadcast(t, src=0, group=group)

    def send_step(self, packed: PackedStep, pending: PendingTokens | None) -> None:
        """Rank 0: broadcast one packed step (and the pending ids it reads)."""
        t0 = time.perf_counter()
        h = packed.host
        nfill = len(h.fill_rows)
        tok = pending.token_ids.contiguous() if nfill else None
        p = int(tok.shape[0]) if tok is not None else 0
        n, b, w, r = packed.dims
        total = int(packed.words.shape[0])
        self._header.copy_(torch.tensor([OP_STEP, n, b, w, r, nfill, h.max_query_len,
                                         h.max_context_len, p, total], dtype=torch.int64))
        inline = total <= INLINE_WORDS
        if inline:
            self._message[HEADER_WORDS:HEADER_WORDS + total].copy_(packed.words)
        self._broadcast(self._message, self.control_group)
        if not inline:
            self._broadcast(packed.words, self.control_group)
        if tok is not None:
            self._broadcast(tok, self.device_group)
        self.send_seconds += time.perf_counter() - t0
        self.num_sends += 1
        self.send_bytes += 8 * (HEADER_WORDS + INLINE_WORDS + (0 if inline else total) + p)

    def send_stop(self) -> None:
        """Rank 0: tell the other ranks to leave their loop."""
        self._header.zero_()
        self._header[0] = OP_STOP
        self._broadcast(self._message, self.control_group)

    def recv(self, builder: InputBuilder) -> ReceivedStep:
        """Other ranks: wait for rank 0's next message and receive its step into ``builder``'s
        staging buffer.

        Raises:
            RuntimeError: from ``torch.distributed`` when rank 0 is gone; ValueError for a
                header this code does not know (ranks running different versions).
        """
        self._broadcast(self._message, self.control_group)
        op, n, b, w, r, nfill, max_q, max_ctx, p, total = (int(v) for v in self._header.tolist())
        if op == OP_STOP:
            return ReceivedStep(OP_STOP)
        if op != OP_STEP:
            raise ValueError(f"unknown tensor-parallel step header operation {op}")
        packed = builder.staging((n, b, w, r))
        if int(packed.words.shape[0]) != total:
            raise ValueError(f"packed step of {total} words does not match its dimensions "
                             f"{(n, b, w, r)} ({int(packed.words.shape[0])} words)")
        if total <= INLINE_WORDS:
            packed.words.copy_(self._message[HEADER_WORDS:HEADER_WORDS + total])
        else:
            self._broadcast(packed.words, self.control_group)
        h = packed.host
        h.fill_rows, h.fill_src = h.fill_rows[:nfill], h.fill_src[:nfill]
        h.max_query_len, h.max_context_len = max_q, max_ctx
        pending = None
        if nfill:
            tok = torch.empty(p, dtype=torch.int64, device=self.device)
            self._broadcast(tok, self.device_group)
            pending = PendingTokens(tok, {})
        return ReceivedStep(OP_STEP, packed, pending)
