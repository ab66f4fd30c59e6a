"""One HTTP request's generation: the engine view, per-choice state, incremental detokenization,
stop strings, logprobs and the SSE stream.
"""

from __future__ import annotations
import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Callable
from fastapi import Request
from fastapi.responses import StreamingResponse
from ..core.admission import RequestLimits, request_rejection
from ..core.sampling_params import SamplingParams, StructuredOutput
from .detokenizer import IncrementalDetokenizer, token_bytes, token_text
from .metrics import RequestTracker, ServiceMetrics
from .prompt_limits import TokenBudget, TooManyTokens
from .protocol import APIError, error_body
from .errors import ClientDisconnected, log


#: special tokens that end a chat answer (added to every chat request's stop token ids)
CHATML_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


#: engine requests (prompts x ``n``) one HTTP request may start, by default
MAX_CHOICES = 256

#: seconds a structured-output request waits for its grammar to compile before a 400
GRAMMAR_COMPILE_TIMEOUT_S = 10.0

#: requests the tokenizer routes (/tokenize, /detokenize) may have queued or running on their
#: own thread; more answer 429
MAX_TOKENIZER_ROUTE_PENDING = 8

#: at least this many tokens per /tokenize or /detokenize request are accepted (the default
#: bound is the larger of this and 8 x the context length)
MIN_TOKENIZER_ROUTE_TOKENS = 32768


# ------------------------------------------------------------------------------------------------
# Request fields -> SamplingParams
# ------------------------------------------------------------------------------------------------
#: The names of the :class:`SamplingParams` fields, in declaration order.
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))

#: The :class:`SamplingParams` fields that are not the request field of the same name, and where
#: each one's value comes from (:meth:`Service.sampling_params` sets them). Every other
#: SamplingParams field that the request models (``serve/protocol.py``) declare is copied by
#: name (:func:`request_sampling_fields`), so a new sampling parameter is its field in
#: SamplingParams and in the request model, and nothing here.
TRANSLATED_SAMPLING_FIELDS: dict[str, str] = {
    "max_tokens": "the route's: max_tokens (at least 1; 0 with echo scores the prompt) or, for chat, "
                  "max_completion_tokens, by default the room left in the context",
    "temperature": "the request's, OpenAI's default 1.0 when omitted (SamplingParams' default is greedy)",
    "seed": "the request's plus the choice's sample index (mod 2**63), so n choices differ",
    "stop": "none: the service matches stop strings on the detokenized text",
    "stop_token_ids": "the route's: ChatML's end tokens for chat, none for completions",
    "logprobs": "the route's: logprobs (completions), or top_logprobs (0 by default) when logprobs "
                "is true (chat)",
    "prompt_logprobs": "the route's: logprobs when the prompt is echoed (completions)",
    "logit_bias": "the request's, its token ids (decimal strings) as integers inside the vocabulary",
    "structured_output": "the route's: response_format or forced tool calls (chat)",
    "num_speculative_tokens": "None (the engine's default): not a request field",
}


def request_sampling_fields(request: Any) -> dict[str, Any]:
    """The SamplingParams fields a request sets under their own names.

    Args:
        request: a request model of ``serve/protocol.py`` (pydantic).

    Returns:
        ``{field: value}`` for every :class:`SamplingParams` field that the request's model
        declares too, except those of :data:`TRANSLATED_SAMPLING_FIELDS`, when the client gave
        a value (``None``, the request models' "omitted", leaves the SamplingParams default).
    """
    declared = type(request).model_fields
    out = {}
    for name in SAMPLING_FIELDS:
        if name in declared and name not in TRANSLATED_SAMPLING_FIELDS:
            value = getattr(request, name)
            if value is not None:
                out[name] = value
    return out


# ------------------------------------------------------------------------------------------------
# Engine adapter
# ------------------------------------------------------------------------------------------------
class EngineView:
    """What the service needs from an AsyncLLMEngine (and its wrapped LLMEngine), read tolerantly
    so a test fake implementing only the documented interface works too.

    Args:
        async_engine: the served engine (``generate``, ``abort``; ``.engine`` the wrapped one).
        tokenizer: HF tokenizer (default: the engine's).
        max_model_len: context length in tokens; the served one is the smaller of this and the
            engine's (4096 when neither is known).
        vocab_size: token ids accepted in prompts and ``logit_bias`` are ``[0, vocab_size)``
            (default: the model config's, else the tokenizer's length).

    Raises:
        ValueError: no tokenizer given and none on the engine.
    """

    def __init__(self, async_engine: Any, tokenizer: Any = None, max_model_len: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.async_engine = async_engine
        inner = getattr(async_engine, "engine", None)
        self.inner = inner
        self.tokenizer = tokenizer if tokenizer is not None else getattr(inner, "tokenizer", None) \
            or getattr(async_engine, "tokenizer", None)
        if self.tokenizer is None:
            raise ValueError("no tokenizer: pass tokenizer= or an engine with a .tokenizer")
        engine_len = getattr(inner, "max_model_len", None) or getattr(async_engine, "max_model_len", None)
        lens = [int(v) for v in (max_model_len, engine_len) if v]
        self.max_model_len = min(lens) if lens else 4096
        mc = getattr(inner, "model_config", None) or getattr(async_engine, "model_config", None)
        self.vocab_size = int(vocab_size or getattr(mc, "vocab_size", 0) or len(self.tokenizer))
        cfg = getattr(inner, "config", None) or getattr(async_engine, "config", None)
        #: whether outputs carry the batch-invariant guarantee (EngineConfig.batch_invariant)
        self.batch_invariant = bool(getattr(cfg, "batch_invariant", False))
        #: the engine's start-up record (seconds per phase, KV pool size), if it keeps one
        self.startup = getattr(inner, "startup", None)

    def stats(self) -> dict:
        """The engine's ``stats()`` (queue lengths, KV blocks, ...); ``{}`` when it has none."""
        for obj in (self.async_engine, self.inner):
            fn = getattr(obj, "stats", None)
            if callable(fn):
                return dict(fn())
        return {}

    def capacity_tokens(self) -> int | None:
        """Tokens the KV pool holds (blocks x block size), or None when the engine does not say."""
        s = self.stats()
        total, bs = s.get("num_total_blocks"), s.get("block_size")
        return int(total) * int(bs) if total and bs else None

    def check_request(self, prompt_ids: list[int], sp: SamplingParams) -> None:
        """The engine's admission check of one request, when it has one.

        Raises:
            ValueError: the engine would refuse the request (too long for the KV pool, an
                unsupported parameter, ...).
        """
        fn = getattr(self.inner, "check_request", None)
        if callable(fn):
            fn(prompt_ids, sp)  # raises ValueError

    def check_structured(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` in the engine (cached there).

        Raises:
            NotImplementedError: the engine does not enforce structured output.
            ValueError: the schema cannot be compiled.
        """
        fn = getattr(self.inner, "check_structured_output", None)
        if not callable(fn) or getattr(self.inner, "structured", True) is None:
            name = type(self.inner if self.inner is not None else self.async_engine).__name__
            raise NotImplementedError(f"structured output and forced tool calls are not supported by the "
                                      f"served engine ({name}); serve with the paged engine")
        fn(spec)

    @property
    def max_waiting(self) -> int | None:
        """The engine's bound on waiting requests (None: unbounded or unknown)."""
        return getattr(self.async_engine, "max_waiting", None)


# ------------------------------------------------------------------------------------------------
# One choice = one engine request
# ------------------------------------------------------------------------------------------------
@dataclass
class ChoiceEvent:
    """What one engine output added to one choice.

    Attributes:
        index: the choice's index in the answer (prompt index x ``n`` + sample index).
        text: newly decoded text (may be empty: bytes of an incomplete UTF-8 character or a
            possible stop string are held back).
        token_ids: the output token ids this event consumed.
        logprobs: logprob records delivered with this event, each ``(token id, logprob,
            [(top id, logprob), ...], text offset)``; the offset is in characters of the
            choice's text.
        finish_reason: ``stop``, ``length`` or ``abort`` on the choice's last event, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]], int]]   # (id, logprob, top, text offset)
    finish_reason: str | None


@dataclass
class Choice:
    """One choice of an answer: one engine request and what it has produced so far.

    The routes read, once the generation has run: ``text_parts`` (joined: the choice's text),
    ``logprobs`` (records as in :class:`ChoiceEvent`), ``finish_reason``,
    ``prompt_logprobs`` (the engine's per-prompt-token records, when asked for), ``first`` (the
    first engine output) and :attr:`num_output_tokens`. The other fields are the generation's
    bookkeeping.
    """

    index: int
    request_id: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    detok: IncrementalDetokenizer
    tracker: RequestTracker | None
    gen: Any = None
    first: Any = None
    first_task: Any = None     # the wait for ``first``, when ``start`` returned before it came
    admitted: bool = False     # the engine has added the request
    num_seen: int = 0
    finish_reason: str | None = None
    done: bool = False
    engine_finished: bool = False
    text_parts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    undelivered: list = field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def num_output_tokens(self) -> int:
        """Completion tokens so far (the usage's count; tokens cut by a stop string included)."""
        return self.detok.num_tokens


async def _safe_abort(engine: Any, request_id: str) -> None:
    try:
        await engine.abort(request_id)
    except Exception:  # noqa: BLE001 - aborting an unknown/finished request is fine
        log.debug("abort(%s) failed", request_id, exc_info=True)


async def _cancel_and_wait(tasks) -> None:
    tasks = [t for t in tasks if t is not None]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


class Generation:
    """All choices of one HTTP request, and their lifecycle: :meth:`start` submits them,
    :meth:`events` (streamed answers) or :meth:`collect` (whole answers) runs them, and
    :meth:`close` aborts whatever has not finished.

    Args:
        service: the app's :class:`Service`.
        choices: from :meth:`Service.build_choices`.
    """

    def __init__(self, service: "Service", choices: list[Choice]) -> None:
        self.service = service
        self.engine = service.view.async_engine
        self.choices = choices
        self.tasks: list[asyncio.Task] = []
        self.closed = False
        self._closing: asyncio.Future | None = None

    async def _first(self, ch: Choice, admitted: asyncio.Event | None) -> None:
        def on_admitted() -> None:
            ch.admitted = True
            if all(c.admitted for c in self.choices):
                admitted.set()

        # the admission callback only when it is waited for (an engine without it still serves)
        extra = {"on_admitted": on_admitted} if admitted is not None else {}
        ch.gen = self.engine.generate(ch.prompt_ids, ch.sampling_params, request_id=ch.request_id,
                                      priority=ch.priority, **extra)
        self.service.in_flight.add(ch.request_id)
        try:
            ch.first = await ch.gen.__anext__()
        except StopAsyncIteration:
            ch.first = None

    async def start(self, request: Request | None, until_admitted: bool = False) -> None:
        """Submit every choice and wait for each first output (or an admission error).

        With ``until_admitted`` (a streamed answer) it returns as soon as the engine has added
        every choice, so a stream of more choices than run at once starts when the first ones
        produce tokens instead of when the last one does; the remaining first outputs are
        awaited by :meth:`events`.

        Raises:
            APIError: 400 (engine ValueError), 429 (queue full); every choice is aborted.
            ClientDisconnected: the client went away meanwhile; every choice is aborted.
        """
        admitted = asyncio.Event() if until_admitted else None
        firsts = [asyncio.ensure_future(self._first(ch, admitted)) for ch in self.choices]
        watch = asyncio.ensure_future(_wait_disconnect(request)) if request is not None else None
        gate = asyncio.ensure_future(admitted.wait()) if admitted is not None else None
        pending = set(firsts)
        error: BaseException | None = None
        try:    # cancelled anywhere in here (the client left, shutdown): release every choice
            while pending and error is None:
                done, _ = await asyncio.wait(pending | {t for t in (watch, gate) if t is not None},
                                             return_when=asyncio.FIRST_COMPLETED)
                if watch is not None and watch in done:
                    error = ClientDisconnected()
                    break
                for f in done - {gate}:
                    pending.discard(f)
                    if f.exception() is not None and error is None:
                        error = f.exception()
                if gate is not None and gate in done and error is None:
                    for ch, f in zip(self.choices, firsts):
                        if f in pending:
                            ch.first_task = f
                    break
            await _cancel_and_wait([watch, gate])
        except BaseException:
            await _cancel_and_wait([*firsts, watch, gate])
            await self.close()
            raise
        if error is None:
            return
        await _cancel_and_wait(firsts)
        await self.close()
        if isinstance(error, ClientDisconnected):
            # admitted and queued, then abandoned before the first token: an abort
            for ch in self.choices:
                if ch.tracker is None:
                    ch.tracker = self.service.metrics.tracker(len(ch.prompt_ids))
                ch.tracker.on_finish("abort")
        if isinstance(error, ValueError):
            ch0 = self.choices[0]
            raise self.service.engine_error(error, len(ch0.prompt_ids), "prompt") from error
        if type(error).__name__ == "QueueFullError":
            raise APIError(str(error), status_code=429, type="rate_limit_exceeded", code="queue_full") from error
        raise error

    def _process(self, ch: Choice, out: Any) -> ChoiceEvent | None:
        """Feed one RequestOutput through the choice's detokenizer."""
        if ch.done:
            return None
        plp = getattr(out, "prompt_logprobs", None)
        if plp is not None and ch.prompt_logprobs is None:
            ch.prompt_logprobs = list(plp)
        ids = getattr(out, "output_token_ids", None)
        new = list(ids[ch.num_seen:]) if ids is not None else list(getattr(out, "new_token_ids", None) or [])
        lp_list = getattr(out, "logprobs", None) or []
        text_parts: list[str] = []
        used: list[int] = []
        lps: list = []
        for tok in new:
            pos = ch.num_seen
            ch.num_seen += 1
            used.append(tok)
            offset = ch.detok.num_decoded_chars   # where this token's text starts
            text_parts.append(ch.detok.add_token(tok))
            if ch.sampling_params.logprobs is not None:
                rec = lp_list[pos] if pos < len(lp_list) else None
                lps.append(_norm_logprob(tok, rec) + (offset,))
            if ch.detok.stopped:
                break
        if ch.tracker is not None:
            ch.tracker.on_output(out, len(used))
        finish = None
        if ch.detok.stopped:
            finish = "stop"
        elif getattr(out, "finished", False):
            ch.engine_finished = True
            text_parts.append(ch.detok.finish())
            finish = "stop" if ch.detok.stopped else (getattr(out, "finish_reason", None) or "stop")
        if finish is not None:
            ch.done = True
            ch.finish_reason = finish
            if ch.tracker is not None:
                ch.tracker.on_finish(finish, out)
        text = "".join(text_parts)
        ch.text_parts.append(text)
        # Logprob records are delivered with the next event that has text or a finish reason
        # (streamed and whole answers alike), their offsets capped at the text emitted by then:
        # held-back text may still be cut by a stop string.
        ch.undelivered.extend(lps)
        lps = []
        if text or finish is not None:
            end = len(ch.detok.text)
            lps = [(t, lp, top, min(off, end)) for t, lp, top, off in ch.undelivered]
            ch.undelivered = []
        ch.logprobs.extend(lps)
        return ChoiceEvent(ch.index, text, used, lps, finish)

    async def _run_choice(self, ch: Choice, put: Callable[[Any], None]) -> None:
        try:
            if ch.first_task is not None:
                task, ch.first_task = ch.first_task, None
                await task   # its error (a failed step) is reported in-band like any other
            if ch.first is not None:
                ev = self._process(ch, ch.first)
                if ev is not None:
                    put(ev)
            while not ch.done and ch.gen is not None:
                try:
                    out = await ch.gen.__anext__()
                except StopAsyncIteration:
                    break
                ev = self._process(ch, out)
                if ev is not None:
                    put(ev)
            if not ch.done:  # the iterator ended without a finished output (aborted by the engine)
                text = ch.detok.finish()
                ch.done = True
                ch.finish_reason = "stop" if ch.detok.stopped else "abort"
                ch.text_parts.append(text)
                if ch.tracker is not None:
                    ch.tracker.on_finish(ch.finish_reason)
                end = len(ch.detok.text)
                lps = [(t, lp, top, min(off, end)) for t, lp, top, off in ch.undelivered]
                ch.undelivered = []
                ch.logprobs.extend(lps)
                put(ChoiceEvent(ch.index, text, [], lps, ch.finish_reason))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            put(e)
        finally:
            await self._close_choice(ch)

    async def _close_choice(self, ch: Choice) -> None:
        gen, ch.gen = ch.gen, None
        if gen is not None:
            try:
                await gen.aclose()  # the engine iterator aborts the request when closed early
            except BaseException:  # noqa: BLE001 - includes 'already running' while cancelled
                pass
        if not ch.engine_finished:
            # stop string matched / cancelled / failed: make sure the engine drops it now
            await _safe_abort(self.engine, ch.request_id)
        if not ch.done:
            ch.done = True
            ch.finish_reason = ch.finish_reason or "abort"
            if ch.tracker is not None:
                ch.tracker.on_finish("abort")
        self.service.in_flight.discard(ch.request_id)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Merge the choices' events in arrival order; closing it aborts everything left."""
        q: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._run_choice(ch, q.put_nowait)) for ch in self.choices]
        remaining = len(self.choices)
        try:
            while remaining:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel the choice tasks and abort every engine request that has not finished.

        Idempotent. Runs in its own task (shielded), so it completes even when the caller is
        being cancelled, as a handler is when its client disconnects.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close_impl())
        await asyncio.shield(self._closing)

    async def collect(self, request: Request) -> None:
        """Run the generation to the end without streaming, then close it; the results are on
        the :class:`Choice` objects.

        Raises:
            ClientDisconnected: the client went away first; every choice is aborted.
            Exception: a choice failed (e.g. an engine step raised); every choice is aborted.
        """

        async def consume() -> None:
            async for _ in self.events():
                pass

        task = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                raise ClientDisconnected()
            task.result()
        finally:
            await _cancel_and_wait([watch, task])
            await self.close()

    async def _close_impl(self) -> None:
        self.closed = True
        await _cancel_and_wait(self.tasks + [ch.first_task for ch in self.choices])
        for ch in self.choices:
            if ch.gen is not None or not ch.done or not ch.engine_finished:
                await self._close_choice(ch)


class SSEResponse(StreamingResponse):
    """SSE response of one generation. Frames the chunk iterator: an exception after the
    headers went out becomes an in-band OpenAI error chunk, and the stream always ends with
    ``data: [DONE]``. Releases the generation however the response ends, including when the
    client disconnects before the body iterator ever started.

    Args:
        chunks: the answer's SSE frames (:func:`sse_event`), in order.
        generation: the generation the chunks come from (closed when the response ends).
        request_id: the answer's id, for the log.
    """

    def __init__(self, chunks: AsyncIterator[str], generation: Generation, request_id: str) -> None:
        super().__init__(self._framed(chunks, generation, request_id), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generation = generation

    @staticmethod
    async def _framed(chunks: AsyncIterator[str], generation: Generation, request_id: str) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            log.exception("error while streaming %s", request_id)
            yield sse_event(error_body(f"internal error: {type(e).__name__}: {e}", "internal_server_error"))
        finally:
            await chunks.aclose()
            await generation.close()
        yield "data: [DONE]\n\n"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generation.close()


def _norm_logprob(tok: int, rec: Any) -> tuple[int, float, list[tuple[int, float]]]:
    """Engine logprob record -> (token id, logprob, [(id, logprob), ...])."""
    if rec is None:
        return (tok, float("nan"), [])
    if isinstance(rec, dict):
        lp = rec.get("token_logprob", rec.get("logprob"))
        top = rec.get("top") or rec.get("top_logprobs") or []
        if isinstance(top, dict):
            top = list(top.items())
        return (tok, float(lp) if lp is not None else float("nan"), [(int(i), float(v)) for i, v in top])
    return (tok, float(rec), [])


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


def _json_float(x: float) -> float | None:
    return None if x != x or x in (float("inf"), float("-inf")) else x


# ------------------------------------------------------------------------------------------------
# The service
# ------------------------------------------------------------------------------------------------
class Service:
    """State shared by the routes of one app: the engine, the served model's names, metrics,
    the tokenizer and grammar threads, and the checks and conversions every route applies.

    Args:
        view: the served engine.
        served_model_name: the ``model`` clients name; ``aliases`` are accepted too.
        metrics: the app's metrics.
        max_waiting: answer 429 while this many requests wait (None: unbounded).
        max_tokenize_tokens: most tokens one ``/tokenize`` or ``/detokenize`` request may count
            (default: the larger of ``MIN_TOKENIZER_ROUTE_TOKENS`` and 8 x the context).
    """

    def __init__(self, view: EngineView, served_model_name: str, aliases: tuple[str, ...],
                 metrics: ServiceMetrics, max_waiting: int | None, max_tokenize_tokens: int | None = None) -> None:
        self.view = view
        self.tokenizer = view.tokenizer
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, *aliases}
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.in_flight: set[str] = set()
        self.draining = False
        self.created = int(time.time())
        self.chat_stop_ids = self._special_ids(CHATML_STOP_TOKENS)
        # Prompt tokenization, chat rendering and echo decoding of the generation routes run
        # here, off the event loop, one at a time; each job is bounded (a prompt too long for
        # the context is refused from its length or a prefix: prompt_limits).
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-tokenize")
        # /tokenize and /detokenize on their own thread (the tokenizer is only read, so the two
        # threads may use it at once): however many arrive, generation requests never queue
        # behind them; at most MAX_TOKENIZER_ROUTE_PENDING wait, each at most
        # ``max_tokenize_tokens`` long.
        self._route_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-tokenize-api")
        self._route_pending = 0
        self.max_tokenize_tokens = max_tokenize_tokens or max(MIN_TOKENIZER_ROUTE_TOKENS, 8 * view.max_model_len)
        self.budget = TokenBudget(self.tokenizer)
        # Grammar compilation (structured output) on its own threads: a slow schema must not hold
        # up the tokenization of every other request; a compilation that outlasts
        # GRAMMAR_COMPILE_TIMEOUT_S answers 400 (the thread finishes it in the background).
        self._grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmserve-grammar")
        self._grammar_ready = False

    async def drain(self, timeout: float) -> None:
        """Shut down gracefully: refuse new requests (503 ``shutting_down``), wait up to
        ``timeout`` seconds for the in-flight ones, then abort the rest in the engine."""
        self.draining = True
        deadline = time.monotonic() + max(0.0, timeout)
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.in_flight):
            log.warning("shutdown: aborting in-flight request %s", rid)
            await _safe_abort(self.view.async_engine, rid)

    def close(self) -> None:
        """Stop the tokenizer and grammar threads (after the app stopped serving)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._route_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def compile_structured(self, plan) -> None:
        """:meth:`check_structured` on the grammar threads, bounded by
        ``GRAMMAR_COMPILE_TIMEOUT_S``.

        Raises:
            APIError: as :meth:`check_structured`; 400 ``invalid_schema`` when compiling takes
                longer than the bound (both grammar threads busy count against it too).
        """
        prepare = getattr(self.view.inner, "prepare_structured_output", None)
        if callable(prepare) and not self._grammar_ready:
            try:                       # the compiler reads the tokenizer: on the tokenizer thread
                await self.run_blocking(prepare)
            except ValueError as e:
                raise APIError(str(e), param="response_format", code="unsupported_parameter") from None
            self._grammar_ready = True
        fut = asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.check_structured, plan)
        try:
            await asyncio.wait_for(asyncio.shield(fut), GRAMMAR_COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            param = "tools" if plan.mode == "tools" else "response_format"
            raise APIError(f"{param}: the schema did not compile within {GRAMMAR_COMPILE_TIMEOUT_S:g} s; "
                           "simplify it (long patterns, deep nesting and wide alternations are costly)",
                           param=param, code="invalid_schema") from None

    async def run_blocking(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on the tokenizer thread; exceptions (APIError included) propagate."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def run_tokenizer_route(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on the tokenizer routes' own thread; exceptions propagate.

        Raises:
            APIError: 429 ``tokenizer_busy`` when ``MAX_TOKENIZER_ROUTE_PENDING`` jobs are queued
                or running (a job whose client left still counts until it ends).
        """
        if self._route_pending >= MAX_TOKENIZER_ROUTE_PENDING:
            raise APIError(f"the tokenizer routes are busy ({self._route_pending} requests queued or running); "
                           "retry later", status_code=429, type="rate_limit_exceeded", code="tokenizer_busy")
        loop = asyncio.get_running_loop()
        job = self._route_pool.submit(fn, *args)
        self._route_pending += 1

        def done(_: Any) -> None:      # on the worker thread, once the job has really ended
            try:
                loop.call_soon_threadsafe(self._job_ended)
            except RuntimeError:       # the loop is closed: nothing is counted any more
                pass

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    def _job_ended(self) -> None:
        self._route_pending -= 1

    def prompt_limit(self, max_tokens: int) -> int:
        """Prompt tokens that leave no room for ``max_tokens`` (at least 1) completion tokens."""
        return max(1, self.view.max_model_len - max(1, max_tokens) + 1)

    def precheck_prompt(self, num_chars: int, max_tokens: int, param: str) -> None:
        """Refuse, on the event loop and in O(1), a prompt whose length in characters already
        proves it too long for the context (:meth:`TokenBudget.quick_lower_bound`); it never
        reaches the tokenizer.

        Raises:
            APIError: 400 ``context_length_exceeded``.
        """
        at_least = self.budget.quick_lower_bound(num_chars)
        if at_least and at_least >= self.prompt_limit(max_tokens):
            raise self.context_error(at_least, max_tokens, param, exact=False)

    def _special_ids(self, tokens) -> list[int]:
        ids = []
        for t in tokens:
            try:
                i = self.tokenizer.convert_tokens_to_ids(t)
            except Exception:  # noqa: BLE001
                continue
            unk = getattr(self.tokenizer, "unk_token_id", None)
            if isinstance(i, int) and i >= 0 and i != unk:
                ids.append(i)
        return ids

    # ---- validation ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """Accept the served model's names and an omitted ``model``.

        Raises:
            APIError: 400 ``model_not_found`` for any other name.
        """
        if model is not None and model not in self.model_names:
            raise APIError(f"model {model!r} does not exist; this server serves {self.served_model_name!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    def check_capacity(self, num_new: int) -> None:
        """Refuse new work while the server shuts down or the engine's waiting queue is full
        (``num_new``: the engine requests about to be added; the bound is checked as it stands).

        Raises:
            APIError: 503 ``shutting_down``; 429 ``queue_full``.
        """
        if self.draining:
            raise APIError("the server is shutting down", status_code=503, type="service_unavailable",
                           code="shutting_down")
        bound = self.max_waiting
        if bound is None:
            return
        waiting = self.view.stats().get("num_waiting") or 0
        if waiting >= bound:
            raise APIError(f"the waiting queue is full ({waiting} requests waiting, bound {bound}); retry later",
                           status_code=429, type="rate_limit_exceeded", code="queue_full")

    def tokenize_prompt(self, prompt: str | list[int], param: str = "prompt", max_tokens: int = 1) -> list[int]:
        """A prompt's token ids (on the tokenizer thread). Text is tokenized no further than
        needed to prove it leaves no room for ``max_tokens`` completion tokens
        (:class:`~llmserve.serve.prompt_limits.TokenBudget`).

        Raises:
            APIError: 400: empty, untokenizable, ids outside the vocabulary, or too long for the
                context (``context_length_exceeded``).
        """
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("prompt must not be empty", param=param)
            try:
                ids = self.budget.encode(prompt, self.prompt_limit(max_tokens))
            except TooManyTokens as e:
                raise self.context_error(e.at_least, max_tokens, param, exact=False) from None
            except (TypeError, UnicodeError, ValueError) as e:  # text the tokenizer cannot take
                raise APIError(f"{param} could not be tokenized ({type(e).__name__}); send valid UTF-8 text",
                               param=param) from e
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.view.vocab_size]
            if bad:
                raise APIError(f"prompt token ids must be in [0, {self.view.vocab_size}), got {bad[:5]}",
                               param=param, code="invalid_token_id")
        if not ids:
            raise APIError("prompt must contain at least one token", param=param)
        return ids

    def context_error(self, num_prompt: int, max_tokens: int, param: str, exact: bool = True) -> APIError:
        """The 400 ``context_length_exceeded`` error, in OpenAI's wording (``exact`` False: the
        prompt was refused before it was counted in full, and has at least ``num_prompt``
        tokens)."""
        limit = self.view.max_model_len
        has = f"{num_prompt}" if exact else f"at least {num_prompt}"
        total = f"{num_prompt + max_tokens}" if exact else f"at least {num_prompt + max_tokens}"
        return APIError(
            f"this model's maximum context length is {limit} tokens; the request has {has} prompt "
            f"tokens and asks for {max_tokens} completion tokens ({total} in total); "
            "shorten the prompt or lower max_tokens",
            param="max_tokens" if num_prompt < limit else param, code="context_length_exceeded")

    def check_context(self, num_prompt: int, max_tokens: int, param: str) -> None:
        """The served context limit (possibly below the engine's), by the engine's admission
        rule, with OpenAI's wording and error code.

        Raises:
            APIError: 400 ``context_length_exceeded`` (:meth:`context_error`).
        """
        limit = self.view.max_model_len
        err = request_rejection(num_prompt, max_tokens, RequestLimits(limit))
        if err is not None:
            raise self.context_error(num_prompt, max_tokens, param)

    def sampling_params(self, req, max_tokens: int, logprobs: int | None, seed_offset: int,
                        stop_token_ids: list[int], prompt_logprobs: int | None = None,
                        structured_output: StructuredOutput | None = None) -> SamplingParams:
        """One choice's :class:`SamplingParams`: the fields of
        :data:`TRANSLATED_SAMPLING_FIELDS` as described there, every other one from the request
        field of the same name (:func:`request_sampling_fields`).

        Args:
            req: the request (:class:`~llmserve.serve.protocol.CompletionRequest` or
                :class:`~llmserve.serve.protocol.ChatCompletionRequest`).
            max_tokens: completion tokens to generate at most (>= 1).
            logprobs: top alternatives per output token (None: no logprobs).
            seed_offset: the choice's sample index, added to the request's seed.
            stop_token_ids: token ids that end the choice.
            prompt_logprobs: top alternatives per prompt token (None: none).
            structured_output: the grammar the output must follow (None: free text).

        Raises:
            APIError: 400: a ``logit_bias`` id that is not a token of the vocabulary
                (``invalid_logit_bias``), or a value SamplingParams refuses.
        """
        seed = req.seed
        if seed is not None:
            seed = (seed + seed_offset) % (2**63)
        translated = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "seed": seed,
            "stop": [],
            "stop_token_ids": list(stop_token_ids),
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "logit_bias": self.logit_bias(req),
            "structured_output": structured_output,
            "num_speculative_tokens": None,
        }
        try:
            return SamplingParams(**request_sampling_fields(req), **translated)
        except ValueError as e:
            raise APIError(str(e)) from e

    def logit_bias(self, req) -> dict[int, float] | None:
        """The request's ``logit_bias`` with integer ids inside the vocabulary (APIError otherwise)."""
        try:
            bias = req.logit_bias_ids()
        except ValueError as e:
            raise APIError(str(e), param="logit_bias", code="invalid_logit_bias") from e
        if bias:
            bad = sorted(t for t in bias if not 0 <= t < self.view.vocab_size)
            if bad:
                raise APIError(f"logit_bias token ids must be in [0, {self.view.vocab_size}), got {bad[:5]}",
                               param="logit_bias", code="invalid_logit_bias")
        return bias

    def check_structured(self, plan) -> None:
        """Compile the grammars of a chat request's :class:`~llmserve.serve.structured.ChatPlan`
        (each function's parameters alone first, so an error names its field); runs on the
        tokenizer thread. Compiled grammars are cached by the engine.

        Raises:
            APIError: 400: the served engine does not enforce structured output, or a schema
                cannot be compiled (``param`` names it, code ``invalid_schema``).
        """
        checks = list(plan.checks)
        if plan.spec is not None and all(spec is not plan.spec for _, spec in checks):
            checks.append(("tools" if plan.mode == "tools" else "response_format", plan.spec))
        for param, spec in checks:
            try:
                self.view.check_structured(spec)
            except NotImplementedError as e:
                raise APIError(str(e), param=param.split(".")[0].split("[")[0],
                               code="unsupported_parameter") from None
            except ValueError as e:
                raise APIError(f"{param}: {e}", param=param, code="invalid_schema") from None

    def unsupported(self, req) -> None:
        """Parameters accepted by the schema but not implemented (none at present)."""

    def engine_error(self, e: ValueError, num_prompt_tokens: int, prompt_param: str) -> APIError:
        """An engine admission ``ValueError`` as an OpenAI error; the KV-pool capacity check
        names ``max_tokens`` (or the prompt when it alone does not fit) and
        ``context_length_exceeded``."""
        msg = str(e)
        if "KV blocks" in msg:
            cap = self.view.capacity_tokens()
            param = prompt_param if cap is not None and num_prompt_tokens >= cap else "max_tokens"
            return APIError(msg, param=param, code="context_length_exceeded")
        return APIError(msg, code=getattr(e, "code", None))

    def build_choices(self, prompts: list[list[int]], n: int, make_sp: Callable[[int, int], SamplingParams],
                      stop: list[str], priority: int, kind: str, prompt_param: str = "prompt") -> list[Choice]:
        """``n`` choices per prompt, checked by the engine's admission rule, none submitted yet.

        Args:
            prompts: token ids of each prompt.
            n: choices per prompt; choice ``p * n + i`` is sample ``i`` of prompt ``p``.
            make_sp: ``(prompt index, sample index) -> SamplingParams``.
            stop: stop strings, matched on each choice's detokenized text.
            priority: the engine priority (lower is served first under the priority policy).
            kind: the request ids' prefix (``cmpl``, ``chat``).
            prompt_param: the request field an error about the prompt names.

        Raises:
            APIError: 400, the engine refuses a request (:meth:`engine_error`).
        """
        base = uuid.uuid4().hex
        choices = []
        for p_idx, ids in enumerate(prompts):
            for i in range(n):
                sp = make_sp(p_idx, i)
                try:
                    self.view.check_request(ids, sp)
                except ValueError as e:
                    raise self.engine_error(e, len(ids), prompt_param) from e
                choices.append(Choice(index=p_idx * n + i, request_id=f"{kind}-{base}-{p_idx * n + i}",
                                       prompt_ids=ids, sampling_params=sp, priority=priority,
                                       detok=IncrementalDetokenizer(self.tokenizer, stop),
                                       tracker=None))
        return choices

    def start_tracking(self, choices: list[Choice]) -> None:
        """Start each choice's metrics (time to first token and the rest) from now."""
        for ch in choices:
            ch.tracker = self.metrics.tracker(len(ch.prompt_ids))


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage``: prompt, completion and total token counts."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse_event(obj: Any) -> str:
    """One server-sent event: ``data: <compact JSON of obj>`` and a blank line."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ------------------------------------------------------------------------------------------------
# Logprob formatting
# ------------------------------------------------------------------------------------------------
def completion_logprobs(tokenizer, entries, start_offset: int) -> dict:
    """OpenAI's completion ``logprobs`` object. ``text_offset`` is each token's start in the
    returned text (``start_offset`` = the echoed prompt's length): the characters decoded before
    it, so a token that ends inside a UTF-8 character starts where that character does; offsets
    never decrease and never pass the end of the text, in streams and whole answers alike."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, lp, top, off in entries:
        s = token_text(tokenizer, tok)
        tokens.append(s)
        token_lps.append(_json_float(lp))
        tops.append({token_text(tokenizer, t): _json_float(v) for t, v in top} if top else None)
        offsets.append(start_offset + off)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echoed_prompt_logprobs(tokenizer, prompt_ids: list[int], records: list | None, text_len: int) -> dict:
    """OpenAI's legacy completion ``logprobs`` of an echoed prompt: one entry per prompt token,
    the first token's logprob and top alternatives ``null`` (nothing precedes it), offsets into
    the echoed text (characters decoded before each token, capped at ``text_len``)."""
    from .detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, [])
    tokens, token_lps, tops, offsets = [], [], [], []
    for i, tok in enumerate(prompt_ids):
        offsets.append(min(detok.num_decoded_chars, text_len))
        detok.add_token(tok)
        tokens.append(token_text(tokenizer, tok))
        rec = records[i] if records is not None and i < len(records) else None
        if i == 0 or rec is None:
            token_lps.append(None)
            tops.append(None)
            continue
        _, lp, top = _norm_logprob(tok, rec)
        token_lps.append(_json_float(lp))
        tops.append({token_text(tokenizer, t): _json_float(v) for t, v in top} if top else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Concatenate two completion ``logprobs`` objects (echoed prompt, then the output); either
    may be None (the other is returned)."""
    if first is None or second is None:
        return first or second
    return {k: first[k] + second[k] for k in first}


def chat_logprobs(tokenizer, entries) -> dict:
    """OpenAI's chat ``logprobs`` object, ``{"content": [...]}``: per token its text, logprob
    (``null`` when not finite), UTF-8 bytes and ``top_logprobs``. ``entries`` are logprob
    records as in :class:`ChoiceEvent` (the text offset is not used)."""
    content = []
    for tok, lp, top, _ in entries:
        content.append({
            "token": token_text(tokenizer, tok), "logprob": _json_float(lp), "bytes": token_bytes(tokenizer, tok),
            "top_logprobs": [{"token": token_text(tokenizer, t), "logprob": _json_float(v),
                              "bytes": token_bytes(tokenizer, t)} for t, v in top],
        })
    return {"content": content}
