"""What a step hands back: the typed interface between the model side and the scheduler.

A step runs ``Scheduler.schedule() -> SchedulerOutput`` (which sequences compute how many
tokens), the model and the sampler, then ``Scheduler.update(SampledTokens) -> StepUpdate``:
the scheduler appends the sampled tokens, applies the stop rules, finishes and frees the
sequences that ended and returns one :class:`RequestOutput` per sequence that received tokens.
Everything here is plain Python (no tensors), so a scheduling policy or a second scheduler can
be written and unit-tested against these types on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .sequence import RequestMetrics, Sequence, SequenceStatus

__all__ = ["DraftVerdict", "RequestOutput", "SampledTokens", "StepUpdate", "TokenAcceptor"]

#: A hook that sees every appended token before the stop rules (the grammar matchers of
#: structured output): ``accept(seq, token_id)`` returns a finished status to end the
#: sequence (``FINISHED_STOPPED`` when its grammar terminated, ``FINISHED_ABORTED`` when the
#: grammar refused the token) or None to go on.
TokenAcceptor = Callable[[Sequence, int], "SequenceStatus | None"]

_FINISHED = frozenset(s for s in SequenceStatus if s.finished)


@dataclass(slots=True)
class RequestOutput:
    """What a request produced so far.

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt.
        output_token_ids: all output tokens so far.
        new_token_ids: tokens produced by the step that made this output.
        finished: whether the request ended.
        finish_reason: ``stop`` | ``length`` | ``abort`` | ``None``.
        metrics: the request's timing record (shared, live object).
        logprobs: per output token ``None`` or ``{"token_logprob", "top"}`` records.
        stop_reason: the stop token id that ended it, if any.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt token:
            ``None`` for the first, then ``{"token_logprob", "top"}`` records (vLLM's layout);
            ``None`` when not asked for or not complete yet.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[dict | None] = field(default_factory=list)
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict | None] | None = None

    @classmethod
    def from_seq(cls, seq: Sequence, new_token_ids: list[int]) -> "RequestOutput":
        """Build from a sequence. ``output_token_ids`` and ``logprobs`` are the sequence's live
        lists while it runs (no per-step copy: at batch 256 the copies cost more than the
        rest of the step's bookkeeping); a finished request's lists no longer change. Copy
        them to keep a snapshot of a running request."""
        finished = seq.status in _FINISHED
        plp = None
        if seq.sampling_params.prompt_logprobs is not None and not seq.needs_prompt_logprobs:
            plp = [None, *seq.prompt_logprobs]
        return cls(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, new_token_ids,
                   finished, seq.status.value if finished else None, seq.metrics,
                   seq.output_logprobs, seq.stop_reason, plp)


@dataclass(slots=True)
class DraftVerdict:
    """One sequence's verified speculative run (draft-and-verify decoding).

    Attributes:
        token_ids: the accepted drafts followed by the target's next token (>= 1 ids); the
            update appends them in order and stops at the first one that ends the request.
        logprobs: one record (or None) per entry of ``token_ids``.
        num_computed_tokens: the sequence's computed length if it goes on: tokens before the
            drafts plus the accepted ones (the K/V of rejected drafts is rolled back).
    """

    token_ids: list[int]
    logprobs: list[dict | None]
    num_computed_tokens: int


@dataclass(slots=True)
class SampledTokens:
    """The tokens one step produced, as :meth:`Scheduler.update` reads them.

    Attributes:
        seqs: the sequences that sampled, in the step's scheduled order (each had
            ``num_pending`` raised by one when its token was launched).
        token_ids: one id per row.
        logprobs: one record (or None) per row.
        drafts: rows (indices into ``seqs``) that verified drafts; their
            :class:`DraftVerdict` replaces ``token_ids[row]``. None on the plain path.
    """

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict | None]
    drafts: dict[int, DraftVerdict] | None = None


@dataclass(slots=True)
class StepUpdate:
    """What :meth:`Scheduler.update` did.

    Attributes:
        outputs: one :class:`RequestOutput` per sequence that received tokens, in row order.
        finished: the sequences that ended in this update (already finished in the scheduler
            and their blocks freed); the engine releases its own per-request state for them.
    """

    outputs: list[RequestOutput]
    finished: list[Sequence]
