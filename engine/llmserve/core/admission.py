"""Request admission: the one check of whether a request can ever be served.

Every entry point uses it: :meth:`Scheduler.add_request <llmserve.core.scheduler.Scheduler.add_request>`,
``LLMEngine.check_request`` / ``add_request``, ``NaiveEngine`` (context only: it keeps no KV
cache), the asynchronous engine (through ``check_request``, before anything is queued) and the
HTTP server (its own, possibly lower, context limit). A request that can never fit is rejected
at once with a :class:`RequestRejectedError` (a ``ValueError``) saying what to change:

1. ``prompt + max_tokens > max_model_len`` (code ``context_length_exceeded``, as OpenAI's API);
2. ``ceil((prompt + max_tokens) / block_size) > num_total_blocks``: more KV blocks than the whole
   cache holds, so it could not finish even alone (``kv_cache_capacity_exceeded``);
3. without chunked prefill, a prompt longer than ``max_num_batched_tokens`` can never be
   scheduled in one step (``prompt_exceeds_step_budget``).

Pure Python (no torch), so the scheduler's unit tests cover it on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestLimits", "RequestRejectedError", "request_rejection", "validate_request"]


class RequestRejectedError(ValueError):
    """A request that can never be served with this configuration (it is never queued).

    Attributes:
        code: ``context_length_exceeded`` | ``kv_cache_capacity_exceeded`` |
            ``prompt_exceeds_step_budget`` | ``request_id_in_use`` | ``None``.
    """

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request is checked against.

    Attributes:
        max_model_len: the most tokens (prompt + output) a sequence may hold, >= 1.
        block_size: tokens per KV block (None: no KV cache to check).
        num_total_blocks: blocks in the whole KV cache (None: no KV cache to check).
        max_num_batched_tokens: one step's token budget (None: not checked).
        chunked_prefill: prompts may be split over steps (then the step budget never rejects).

    Raises:
        ValueError: a limit out of range (names the field).
    """

    max_model_len: int
    block_size: int | None = None
    num_total_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if (self.block_size is None) != (self.num_total_blocks is None):
            raise ValueError("block_size and num_total_blocks must be given together")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_total_blocks is not None and self.num_total_blocks < 0:
            raise ValueError(f"num_total_blocks must be >= 0, got {self.num_total_blocks}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


def request_rejection(num_prompt_tokens: int, max_tokens: int, limits: RequestLimits,
                      request_id: str | None = None) -> RequestRejectedError | None:
    """Why a request of ``num_prompt_tokens`` prompt tokens asking for up to ``max_tokens``
    output tokens can never be served under ``limits`` (the first failing rule of the module
    docstring, as an error to raise), or None when it can."""
    who = f"request {request_id!r}: " if request_id is not None else ""
    total = num_prompt_tokens + max_tokens
    if total > limits.max_model_len:
        return RequestRejectedError(
            f"{who}prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens "
            f"exceeds max_model_len={limits.max_model_len}, the model's context length; shorten the "
            "prompt or lower max_tokens", "context_length_exceeded")
    if limits.block_size is not None:
        need = -(-total // limits.block_size)
        if need > limits.num_total_blocks:
            return RequestRejectedError(
                f"{who}prompt + max_tokens = {total} tokens needs {need} KV blocks of "
                f"{limits.block_size} tokens but the cache has only {limits.num_total_blocks}; lower "
                "max_tokens, shorten the prompt or give the KV cache more memory",
                "kv_cache_capacity_exceeded")
    budget = limits.max_num_batched_tokens
    if not limits.chunked_prefill and budget is not None and num_prompt_tokens > budget:
        return RequestRejectedError(
            f"{who}prompt of {num_prompt_tokens} tokens exceeds max_num_batched_tokens={budget} "
            "with chunked prefill off; set prefill_chunk_size or raise max_num_batched_tokens",
            "prompt_exceeds_step_budget")
    return None


def validate_request(num_prompt_tokens: int, max_tokens: int, limits: RequestLimits,
                     request_id: str | None = None) -> None:
    """Raise the :func:`request_rejection` of a request, if any.

    Raises:
        RequestRejectedError: the request can never be served (message says what to change).
    """
    err = request_rejection(num_prompt_tokens, max_tokens, limits, request_id)
    if err is not None:
        raise err
