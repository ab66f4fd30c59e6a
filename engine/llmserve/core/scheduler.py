"""Iteration-level scheduler: which sequences run in the next step and how many tokens each.

Pure CPU bookkeeping; no tensors. One rule covers prefill, chunked prefill, decode and recompute
after preemption (docs/architecture.md): a step computes ``num_new_tokens`` of a sequence's
not-yet-computed tokens; when ``num_computed_tokens + num_new_tokens == num_tokens`` the engine
samples a new token for it.

A step (:meth:`Scheduler.schedule`) follows the unified token-budget scheme of vLLM v1
(``vllm/v1/core/sched/scheduler.py``) with Orca-style iteration-level batching (Yu et al., OSDI
2022) and Sarathi-Serve-style chunked prefill (Agrawal et al., OSDI 2024):

1. Budget ``B = max_num_batched_tokens`` tokens.
2. Running sequences, in policy order: each gets
   ``n = min(num_tokens - num_computed_tokens, prefill_chunk_size, remaining budget)``
   (decodes: 1). Without chunking (``prefill_chunk_size=None``) a sequence's pending tokens go
   in whole or it waits for a later step; the one exception is a recompute after preemption
   longer than ``B`` (prompt + outputs), which is computed in budget-sized pieces.
   If the blocks for ``n`` tokens are not free, the *last* running sequence in policy order is
   preempted (recompute) until they are, possibly the sequence itself.
3. If nothing was preempted this step, admit waiting sequences in policy order (preempted ones
   first) while ``len(running) < max_num_seqs``, budget remains and the blocks for their first
   ``n`` tokens are free. Admission stops at the first sequence that does not fit (no
   overtaking, so the documented order holds and long requests are not starved).

Static mode replaces step 3: only when nothing is running, the next batch is formed before step
2: up to ``max_num_seqs`` waiting sequences (in policy order, while their whole pending tokens
fit in the free blocks) become running at once, and nothing else is admitted until all of them
finished. Their prompts are then computed by step 2 within the token budget. This is
request-level batching (Orca's baseline): the batch holds its slots until its longest member
finishes. A member that finishes earlier returns at once and its row leaves the following steps
(no compute, its blocks freed); FasterTransformer and HF ``generate`` instead keep computing
finished rows as padding. That costs little on a GPU at small batch sizes (a decode step reads
the weights once whatever its rows) but more where a step's cost grows with its rows (the tiny
model on a CPU), so this is the stronger form of the baseline.

Prefix caching (when the block manager has it on): at admission (step 3, or static batch
formation) a request's longest cached prefix of full blocks is looked up and pinned, its
``num_computed_tokens`` is set to the cached length ("num_computed_tokens catches up" then
covers the rest: only the uncached tokens are scheduled and charged against the token budget,
and only the uncached blocks, plus cached blocks taken out of the evictable pool, against the
free blocks). The lookup is redone every time a request is considered, so a block evicted while
the request waited is simply a miss. At the start of each step, the running sequences' full
blocks computed by earlier steps are registered in the cache; a request admitted in the same
step as another with the same prefix therefore cannot hit blocks whose K/V are not written yet.

Preemption is by recompute (vLLM's default): the victim's blocks are freed, its
``num_computed_tokens`` drops to 0 and it re-enters the waiting queue in a front lane, ahead of
every request that never ran, so it is readmitted before newer requests; it then recomputes its
prompt *and* its outputs so far. Counters: ``num_preemptions`` and ``num_recomputed_tokens``
(the computed tokens thrown away), globally and in ``seq.metrics``.

Requests that can never be served are rejected in :meth:`Scheduler.add_request`
(:class:`RequestRejectedError`): prompt + max_tokens above ``max_model_len`` or above the whole
cache (``blocks_needed(prompt + max_tokens) > num_total_blocks``), and, without chunked
prefill, a prompt longer than ``max_num_batched_tokens``. Hence a sequence running alone always
has its blocks, the first running sequence in policy order is never preempted, and every
admitted request finishes.

Costs per step: O(running) plus O(log waiting) per admission; no tensor ops.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from .admission import RequestLimits, RequestRejectedError, request_rejection
from .block_manager import BlockManager
from .outputs import DraftVerdict, RequestOutput, SampledTokens, StepUpdate, TokenAcceptor
from .policies import SchedulingPolicy, WaitingQueue, get_policy
from .sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute ``num_new_tokens`` tokens starting at
    ``start_position``.

    ``start_position`` and the sequence length are captured when the step is scheduled, so the
    properties stay valid after the engine advances ``seq.num_computed_tokens`` or appends a token.

    Attributes:
        seq: the sequence.
        num_new_tokens: tokens computed this step (>= 1).
        start_position: ``seq.num_computed_tokens`` when scheduled (first new token's position).
        num_tokens: ``seq.num_tokens`` when scheduled.
    """

    seq: Sequence
    num_new_tokens: int
    start_position: int = field(init=False)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.start_position = self.seq.num_computed_tokens
        self.num_tokens = self.seq.num_tokens

    @property
    def end_position(self) -> int:
        """One past the last position computed this step (= context length after the step)."""
        return self.start_position + self.num_new_tokens

    @property
    def is_prefill(self) -> bool:
        """Catching up more than one token (prompt, chunk of it, or recompute); False for a
        decode. A final prompt chunk of exactly one token counts as a decode (one query token
        attending to the cache), even though it yields the first output token."""
        return self.num_tokens - self.start_position > 1

    @property
    def will_sample(self) -> bool:
        """The sequence catches up this step, so a token is sampled from its last position."""
        return self.end_position == self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The ``num_new_tokens`` input ids of this step."""
        return self.seq.token_ids_slice(self.start_position, self.end_position)


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step.

    Attributes:
        scheduled: sequences to run, running ones first (policy order), then newly admitted.
        preempted: sequences preempted (moved back to waiting, blocks freed) in this step.
        num_batched_tokens: sum of ``num_new_tokens`` (<= ``max_num_batched_tokens``).
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing scheduled this step."""
        return not self.scheduled

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of items that catch up more than one token (prompts, chunks, recomputes)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of 1-token decode items."""
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_prefill)


class Scheduler:
    """Continuous (or static) batching over a paged KV cache; see the module docstring.

    Args:
        config: batching limits, mode and policy.
        block_manager: the KV block bookkeeping this scheduler allocates from.

    The engine drives it: ``schedule()``, run the model on ``output.scheduled`` (setting each
    scheduled sequence's ``num_computed_tokens`` to the item's ``end_position``), sample the
    sequences that caught up, then hand their tokens to :meth:`update`, which appends them,
    applies the stop rules and finishes (and frees) the sequences that ended. Aborts must be
    applied between steps (not between ``schedule()`` and the forward pass).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.policy: SchedulingPolicy = get_policy(config.policy)
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Sequence] = []        # kept sorted by policy key
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self._arrival_counter = 0

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission (preempted ones included)."""
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self.running) or bool(self.waiting)

    def stats(self) -> dict:
        """Counters for logs and metrics endpoints."""
        bm = self.block_manager
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "kv_blocks_total": bm.num_total_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_peak": bm.peak_used_blocks,
            "kv_usage": bm.usage,
            "prefix_cache": bm.prefix_cache_stats(),
        }

    # ---- requests -----------------------------------------------------------------------------
    def request_limits(self) -> RequestLimits:
        """The limits every request is checked against (:mod:`llmserve.core.admission`)."""
        cfg, bm = self.config, self.block_manager
        return RequestLimits(cfg.max_model_len, bm.block_size, bm.num_total_blocks,
                             cfg.max_num_batched_tokens, cfg.prefill_chunk_size is not None)

    def check_request(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never be served (a message saying what to change), or None."""
        err = request_rejection(seq.num_prompt_tokens, seq.sampling_params.max_tokens,
                                self.request_limits(), seq.request_id)
        return None if err is None else str(err)

    def add_request(self, seq: Sequence) -> None:
        """Queue a new WAITING sequence.

        Raises:
            RequestRejectedError: the request can never fit (prompt + max_tokens above
                max_model_len or above the whole KV cache, or, without chunked prefill, a prompt
                longer than max_num_batched_tokens) or its id is in use. Its status becomes
                REJECTED and it is not queued. Guarantees that a sequence running alone always
                has the blocks it needs, so admitted requests never fail for lack of memory.
            ValueError: ``seq`` is not a fresh WAITING sequence.
        """
        if seq.status is not SequenceStatus.WAITING or seq.block_ids or seq.num_computed_tokens:
            raise ValueError(f"request {seq.request_id!r} must be a new WAITING sequence with no "
                             f"blocks, got status={seq.status.value}")
        reason = self.check_request(seq)
        if reason is None and seq.request_id in self.requests:
            reason = f"request id {seq.request_id!r} is already in use; choose a unique id"
        if reason is not None:
            seq.status = SequenceStatus.REJECTED
            seq.metrics.finish_time = time.perf_counter()
            raise RequestRejectedError(reason)
        seq._arrival_index = self._arrival_counter
        self._arrival_counter += 1
        self.requests[seq.request_id] = seq
        self.waiting.push(seq)

    def abort_request(self, request_id: str) -> Sequence | None:
        """Abort an unfinished request, waiting or running; its blocks are freed at once.

        Returns:
            The aborted sequence (status FINISHED_ABORTED), or None if the id is unknown or
            already finished.
        """
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self.finish_request(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def finish_request(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark ``seq`` finished with ``status``, record its finish time and free its blocks.

        Removes it from the running list or the waiting queue. A sequence that already finished
        is left as it is.

        Raises:
            ValueError: ``status`` is not a finished status.
        """
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        if seq.status.finished:
            return  # already finished (e.g. aborted): keep its first status and time
        if self.requests.get(seq.request_id) is seq:
            del self.requests[seq.request_id]
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)                      # O(running)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        if seq.metrics.finish_time is None:
            seq.metrics.finish_time = time.perf_counter()

    # ---- the step -----------------------------------------------------------------------------
    def update(self, sampled: SampledTokens, accept: TokenAcceptor | None = None) -> StepUpdate:
        """Record one step's sampled tokens: the post-step half of the scheduler.

        For each row: the token leaves the in-flight count (``seq.num_pending -= 1``); a
        sequence that finished meanwhile (an abort, or a stop read earlier) drops it; otherwise
        the token (and its logprob record when the request asked for logprobs) is appended,
        ``accept`` (the grammar matchers, when some request is constrained) sees it, and the
        stop rules run (:meth:`Sequence.check_stop`: EOS / stop tokens, then length). A
        sequence that ended is finished here (:meth:`finish_request`: status, finish time,
        blocks freed). A row with a :class:`~llmserve.core.outputs.DraftVerdict` appends its
        run token by token and stops at the first token that ends the request (the rest is
        dropped); when it goes on, its computed length falls back to the verified one and the
        blocks past it are released (:meth:`BlockManager.trim`).

        Args:
            sampled: the step's rows (:class:`~llmserve.core.outputs.SampledTokens`).
            accept: a hook run on every appended token before the stop rules (see
                :data:`~llmserve.core.outputs.TokenAcceptor`), or None.

        Returns:
            :class:`~llmserve.core.outputs.StepUpdate`: an output per sequence that received
            tokens (row order) and the sequences that finished.
        """
        now = time.perf_counter()
        if sampled.drafts is not None:
            return self._update_verified(sampled, accept, now)
        max_len = self.config.max_model_len
        outputs: list[RequestOutput] = []
        finished: list[Sequence] = []
        for seq, tok, lp in zip(sampled.seqs, sampled.token_ids, sampled.logprobs):
            seq.num_pending -= 1
            if seq.status.finished:
                continue
            seq.append_token(tok, now)
            if seq.sampling_params.logprobs is not None:
                seq.output_logprobs.append(lp)
            status = (accept(seq, tok) if accept is not None else None) or seq.check_stop(max_len)
            if status is not None:
                self.finish_request(seq, status)
                finished.append(seq)
            outputs.append(RequestOutput.from_seq(seq, [tok]))
        return StepUpdate(outputs, finished)

    def _update_verified(self, sampled: SampledTokens, accept: TokenAcceptor | None,
                         now: float) -> StepUpdate:
        """:meth:`update` of a step with speculative verdicts: a row with one appends its run
        (:meth:`_append_run`), the others their single token."""
        drafts = sampled.drafts
        outputs: list[RequestOutput] = []
        finished: list[Sequence] = []
        for row, (seq, tok, lp) in enumerate(zip(sampled.seqs, sampled.token_ids, sampled.logprobs)):
            seq.num_pending -= 1
            if seq.status.finished:
                continue
            verdict = drafts.get(row)
            if verdict is None:
                verdict = DraftVerdict([tok], [lp], -1)
            new, status = self._append_run(seq, verdict, accept, now)
            if status is not None:
                self.finish_request(seq, status)
                finished.append(seq)
            outputs.append(RequestOutput.from_seq(seq, new))
        return StepUpdate(outputs, finished)

    def _append_run(self, seq: Sequence, verdict: DraftVerdict, accept: TokenAcceptor | None,
                    now: float) -> tuple[list[int], SequenceStatus | None]:
        """Append a run of tokens up to the first one that ends ``seq``; when it goes on and
        the verdict names a computed length (>= 0), roll the computed length and the blocks
        back to it."""
        new: list[int] = []
        status = None
        want_lp = seq.sampling_params.logprobs is not None
        for tok, lp in zip(verdict.token_ids, verdict.logprobs):
            seq.append_token(tok, now)
            new.append(tok)
            if want_lp:
                seq.output_logprobs.append(lp)
            status = (accept(seq, tok) if accept is not None else None) or seq.check_stop(self.config.max_model_len)
            if status is not None:
                break
        if status is None and verdict.num_computed_tokens >= 0:
            seq.num_computed_tokens = verdict.num_computed_tokens
            self.block_manager.trim(seq, verdict.num_computed_tokens)
        return new, status

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring). Allocates the blocks the step writes to."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for seq in self.running:   # K/V of earlier steps is written: offer full blocks to the cache
            self.block_manager.cache_computed_blocks(seq)
        if self.config.mode == "static" and not self.running:
            self._form_static_batch()
        budget = self._schedule_running(out, budget)
        if self.config.mode == "continuous" and not out.preempted:
            budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _num_new_tokens(self, seq: Sequence, budget: int, num_computed: int | None = None) -> int:
        """Tokens ``seq`` computes this step given ``budget`` left (0: not this step), from
        ``num_computed`` tokens already in the cache (default ``seq.num_computed_tokens``)."""
        done = seq.num_computed_tokens if num_computed is None else num_computed
        pending = seq.num_tokens - done
        chunk = self.config.prefill_chunk_size
        if chunk is not None:
            return min(pending, chunk, budget)
        if pending <= budget:
            return pending
        if pending > self.config.max_num_batched_tokens:
            return budget  # a recompute that can never fit one step: budget-sized pieces
        return 0           # fits a whole step, just not this one's remainder

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # asynchronous scheduling: a token still on the device that ends the request by
            # length needs no step (the engine finishes the request when it reads the token)
            n = 0 if seq.will_finish_by_length(self.config.max_model_len) else self._num_new_tokens(seq, budget)
            if n <= 0:
                i += 1
                continue
            preempted_self = False
            while not bm.can_append(seq, n):
                # Victim: the last running sequence in policy order. Everything after index i
                # is not yet scheduled this step, so no scheduled work is ever thrown away.
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                break  # seq was the last one left after i: nothing more to schedule
            bm.append_slots(seq, n)
            self._record_scheduled(out, seq, n)
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            cached = bm.find_cached_prefix(seq)       # looked up now: never a stale count
            n = self._num_new_tokens(seq, budget, len(cached) * bm.block_size)
            if n <= 0 or bm.num_admission_blocks(seq, cached, n) > bm.num_free_blocks:
                break  # head of line does not fit: no overtaking
            self.waiting.pop()
            self._take_prefix(seq, cached)            # pin the hit before allocating
            bm.append_slots(seq, n)
            self._start_running(seq)
            self._record_scheduled(out, seq, n)
            budget -= n
        return budget

    def _form_static_batch(self) -> None:
        bm = self.block_manager
        blocks_left = bm.num_free_blocks
        while len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            cached = bm.find_cached_prefix(seq)
            need = bm.num_admission_blocks(seq, cached, seq.num_tokens - len(cached) * bm.block_size)
            if need > blocks_left:
                break
            blocks_left -= need
            self.waiting.pop()
            self._take_prefix(seq, cached)
            self._start_running(seq)

    def _take_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """Admission with prefix caching: pin the cached blocks and skip their tokens."""
        if self.block_manager.enable_prefix_caching:
            self.block_manager.take_cached_blocks(seq, cached)
            seq.num_computed_tokens = len(cached) * self.block_manager.block_size

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self.policy.key)  # O(running)

    def _record_scheduled(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.scheduled.append(ScheduledSequence(seq, n))
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.perf_counter()

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free all blocks, forget computed tokens, requeue at the front."""
        recomputed = seq.num_computed_tokens
        seq.metrics.preemptions.append((time.perf_counter(), len(seq.block_ids), recomputed))
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        seq.metrics.num_recomputed_tokens += recomputed
        self.num_preemptions += 1
        self.num_recomputed_tokens += recomputed
        self.waiting.push(seq, front=True)
