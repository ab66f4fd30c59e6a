"""A request as the engine tracks it: tokens, progress, KV blocks, status and timing records.

The central invariant (``docs/architecture.md``, "The invariant"): ``num_computed_tokens``
catches up with ``num_tokens``.
Prefill, chunked prefill, decode and recompute after preemption are all "compute the next
``num_tokens - num_computed_tokens`` tokens (or a chunk of them)"; a new token is sampled
only in the step where a sequence catches up.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


#: Placeholder id of a token sampled on the device but not yet read by the host.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    """Where a request stands; a finished status's value is its OpenAI ``finish_reason``."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"      # EOS or a stop token / stop string
    FINISHED_LENGTH = "length"     # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"     # cancelled by the caller (disconnect, abort_request)
    REJECTED = "rejected"          # could never fit; never admitted

    @property
    def finished(self) -> bool:
        """Any status but WAITING and RUNNING (the request will take no more steps)."""
        return self is not SequenceStatus.WAITING and self is not SequenceStatus.RUNNING


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (seconds, ``time.perf_counter`` clock) and counters of one request.

    ``token_times[i]`` is when output token i was produced, so TTFT = token_times[0] -
    arrival_time and the inter-token latencies are the differences of consecutive entries.
    ``preemptions`` holds one ``(time, blocks freed, computed tokens dropped)`` record per
    preemption (recompute).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    preemptions: list[tuple[float, int, int]] = field(default_factory=list)


class Sequence:
    """One request's state. Mutated only by the scheduler (status, blocks, progress) and the
    engine (appending sampled tokens); the model never sees it.

    Args:
        request_id: unique id (string).
        prompt_token_ids: the prompt, at least one token id.
        sampling_params: decoding and stopping rules.
        arrival_time: ``time.perf_counter()`` at arrival (defaults to now).
        priority: lower runs first under the ``priority`` policy.
        eos_token_ids: ids that end the request unless ``ignore_eos``.
    """

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params",
                 "priority", "eos_token_ids", "num_computed_tokens", "block_ids", "status",
                 "metrics", "output_logprobs", "stop_reason", "_arrival_index", "num_pending",
                 "block_hashes", "num_committed_blocks", "prompt_logprobs")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float | None = None, priority: int = 0,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.priority = priority
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        self.output_logprobs: list[dict] = []
        self.stop_reason: int | str | None = None
        self._arrival_index = 0
        # Tokens sampled on the device whose ids the host has not read yet (asynchronous
        # scheduling: the next step is launched first and takes them as input on the device).
        # They count in num_tokens (so the scheduler plans the step that consumes them) but
        # are not in output_token_ids; token_ids_slice shows them as PENDING_TOKEN.
        self.num_pending = 0
        # Prefix caching (BlockManager): hashes of the full blocks of known tokens, chained
        # (they depend on token ids only, so they survive preemption), and how many leading
        # blocks of block_ids were already offered to the cache.
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        # Prompt logprobs (sampling_params.prompt_logprobs): entry p is the record of prompt
        # token p + 1 ({"token_logprob", "top"}), scored by the logits row at position p. Rows
        # are scored once: a recompute after preemption skips positions already recorded, and
        # the prefix cache is not used past them (BlockManager.find_cached_prefix).
        self.prompt_logprobs: list[dict] = []

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has read (pending ones on the device not included)."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens (with sampled ones still on the device); the KV cache must
        eventually hold all but the newest."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    def will_finish_by_length(self, max_model_len: int) -> bool:
        """True when a pending (sampled, not yet read) token already ends the request by
        ``max_tokens`` or ``max_model_len``: no step needs to be planned for it."""
        return self.num_pending > 0 and self._reaches_length(
            len(self.output_token_ids) + self.num_pending, max_model_len)

    def _reaches_length(self, num_outputs: int, max_model_len: int) -> bool:
        """The length stop rule for a sequence with ``num_outputs`` output tokens."""
        return (num_outputs >= self.sampling_params.max_tokens
                or self.num_prompt_tokens + num_outputs >= max_model_len)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some prompt position is not scored yet."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    def prompt_logprob_rows(self, start: int, end: int) -> tuple[int, int]:
        """The positions ``[lo, hi)`` of a step computing positions ``[start, end)`` whose
        logits score a prompt token not recorded yet (``lo == hi``: none). Position ``p``
        scores prompt token ``p + 1``, so at most positions ``0 .. num_prompt_tokens - 2``."""
        if self.sampling_params.prompt_logprobs is None:
            return start, start
        lo = max(start, len(self.prompt_logprobs))
        hi = min(end, len(self.prompt_token_ids) - 1)
        if lo > len(self.prompt_logprobs) or lo >= hi:   # a gap would misplace records
            return start, start
        return lo, hi

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output ids the host knows (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole prompt and output (the
        model runner calls this every step for every sequence)."""
        p = len(self.prompt_token_ids)
        known = p + len(self.output_token_ids)
        if end > known:  # pending tokens: their ids are still on the device
            return self.token_ids_slice(start, known) + [PENDING_TOKEN] * (end - max(start, known))
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold (prompt + max_tokens)."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the status is a finished one."""
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason: ``stop``, ``length``, ``abort`` or ``None`` while running."""
        return self.status.value if self.status.finished else None

    # ---- mutation by the engine ------------------------------------------------------------
    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Record a sampled token and its time (does not check stop conditions)."""
        now = time.perf_counter() if now is None else now
        self.output_token_ids.append(int(token_id))
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)

    def check_stop(self, max_model_len: int) -> SequenceStatus | None:
        """Finished status implied by the newest token, or None to keep going.

        Order: EOS / stop token ids (kept in the output) beat the length limit.
        """
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        sp = self.sampling_params
        if (not sp.ignore_eos and last in self.eos_token_ids) or last in sp.stop_token_ids:
            self.stop_reason = last
            return SequenceStatus.FINISHED_STOPPED
        if self._reaches_length(self.num_output_tokens, max_model_len):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Sequence(id={self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={self.block_ids})")
