"""The asyncio front end: ``AsyncLLMEngine`` runs an engine's step loop on a background thread and
streams each request's outputs to an ``asyncio`` consumer (the HTTP server).

Callers talk to the engine thread through typed messages (:class:`AddRequest`,
:class:`AbortRequest`) on one queue; the thread applies them between steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..core.sampling_params import SamplingParams
from ..core.trace import RequestTracer, write_trace
from .llm_engine import LLMEngine, RequestOutput
from .naive import NaiveEngine

__all__ = ["AbortRequest", "AddRequest", "AsyncLLMEngine", "QueueFullError"]

log = logging.getLogger(__name__)

_SENTINEL = object()
_ADMITTED = object()  # the engine thread added the request (delivered before any output)


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Add a validated request to the engine (applied by the engine thread between steps).

    Attributes:
        request_id: the caller's id (unique among requests in flight).
        prompt_token_ids: the prompt, already checked by ``engine.check_request``.
        sampling_params: its decoding rules.
        priority: lower runs first under the ``priority`` policy.
        arrival_time: ``time.perf_counter()`` when the caller submitted it (seconds).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    arrival_time: float


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Abort a request (waiting or running; unknown or finished ids are ignored).

    Attributes:
        request_id: the request to abort.
    """

    request_id: str


class AsyncLLMEngine:
    """asyncio front end: many concurrent callers, one background step loop.

    The wrapped engine is owned by one background thread that alternates between applying
    queued commands (add, abort) and calling ``step()``; new tokens reach each caller's
    ``asyncio.Queue`` through ``loop.call_soon_threadsafe``. Validation happens in the caller
    (``check_request``), so a request that can never fit raises ``ValueError`` at once. An abort
    is applied before the next step, so a cancelled request frees its blocks within one step.

    Args:
        engine: an ``LLMEngine`` or ``NaiveEngine``.
        max_waiting: bound on queued (not yet running) requests; ``None`` = unbounded.
        trace_path: write every request's lifecycle events (:mod:`llmserve.core.trace`) to this
            JSON-lines file (gzip when it ends in ``.gz``), appended about once a second and at
            shutdown; ``t`` counts seconds from the engine's construction. The engine thread
            only hands the records over (a list swap); a writer thread expands and writes them.
            A request's ``first_token`` and ``finished`` events are written when it finishes, so
            lines are in time order within a flush, not across flushes. ``None`` (the
            default): no trace.

    Raises:
        OSError: ``trace_path`` cannot be written.
    """

    #: seconds between two trace flushes of the engine thread
    TRACE_FLUSH_S = 1.0

    def __init__(self, engine: LLMEngine | NaiveEngine, max_waiting: int | None = None,
                 trace_path: str | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.trace_path = trace_path
        self._trace_origin = time.perf_counter()
        self._last_flush = self._trace_origin
        self._trace_q: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if trace_path is not None:
            write_trace(trace_path, [])          # created (or emptied) now: a bad path fails here
            engine.tracer = RequestTracer()
            self._writer = threading.Thread(target=self._write_trace_loop, name="llmserve-trace",
                                            daemon=True)
            self._writer.start()
        self._commands: queue.SimpleQueue[AddRequest | AbortRequest] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.errored: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background step loop (idempotent; :meth:`generate` calls it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="llmserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort everything in flight and stop the loop (waits at most ``timeout`` seconds),
        then shut the engine down (with tensor parallelism its other ranks stop)."""
        for rid in list(self._queues):
            self._commands.put(AbortRequest(rid))
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            alive = self._thread.is_alive()
            self._thread = None
            if alive:                  # a step still running: leave the engine to it
                return
        else:
            self.flush_trace()         # the loop never ran: hand over what there is
        if self._writer is not None:   # the loop's last flush is queued: write it, then stop
            self._trace_q.put(None)
            self._writer.join(timeout)
            self._writer = None
        stop = getattr(self.engine, "shutdown", None)
        if callable(stop):
            stop()

    @property
    def is_running(self) -> bool:
        """Whether the background step loop is alive."""
        return self._thread is not None and self._thread.is_alive()

    def num_in_flight(self) -> int:
        """Requests submitted through :meth:`generate` and not yet finished or cancelled."""
        return len(self._queues)

    def stats(self) -> dict:
        """The engine's :meth:`stats`, with requests queued for the engine thread counted as
        waiting."""
        s = dict(self.engine.stats())
        s["num_waiting"] = (s.get("num_waiting") or 0) + self._pending
        return s

    # ---- background thread ---------------------------------------------------------------------
    def _deliver(self, rid: str, item) -> None:
        entry = self._queues.get(rid)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # loop closed
            self._queues.pop(rid, None)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                with self._pending_lock:
                    self._pending -= 1
                rid = cmd.request_id
                if rid not in self._queues:      # cancelled before it was added
                    continue
                try:
                    self.engine.add_request(cmd.prompt_token_ids, cmd.sampling_params, request_id=rid,
                                            arrival_time=cmd.arrival_time, priority=cmd.priority)
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    self._deliver(rid, e)
                else:
                    self._deliver(rid, _ADMITTED)
            elif isinstance(cmd, AbortRequest):
                if self.engine.abort_request(cmd.request_id):
                    self._deliver(cmd.request_id, _SENTINEL)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                if self._trace_due():
                    self.flush_trace()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails every caller, loop survives
                self.errored = e
                for rid in list(self._queues):
                    self.engine.abort_request(rid)
                    self._deliver(rid, e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            if self._trace_due():
                self.flush_trace()
        self._apply_commands()
        self.flush_trace()

    def _trace_due(self) -> bool:
        """A trace is written and its last flush is more than :attr:`TRACE_FLUSH_S` old."""
        return self.trace_path is not None and time.perf_counter() - self._last_flush > self.TRACE_FLUSH_S

    def flush_trace(self) -> None:
        """Hand the trace records made since the last flush to the writer thread (the engine
        thread calls it; O(1)). No-op without a trace."""
        tracer = getattr(self.engine, "tracer", None)
        if self.trace_path is None or tracer is None:
            return
        self._last_flush = time.perf_counter()
        self._trace_q.put(tracer.take())

    def _write_trace_loop(self) -> None:
        """Writer thread: expand each handed-over batch of records and append its events;
        ``None`` ends it. A write error (a full disk) stops tracing, never serving."""
        tracer = self.engine.tracer
        while True:
            records = self._trace_q.get()
            if records is None:
                return
            if self.trace_path is None:
                continue
            try:
                write_trace(self.trace_path, tracer.expand(records, self._trace_origin), append=True)
            except OSError as e:
                log.error("request trace disabled: cannot write %s (%s)", self.trace_path, e)
                self.trace_path = None
                self.engine.tracer = None

    # ---- public async API --------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       on_admitted: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield a :class:`RequestOutput` after every new token.

        ``on_admitted`` (optional) is called, on the event loop, once the engine has added the
        request to its scheduler: from then on nothing but a failed step can reject it. A
        server uses it to answer an admission error with a 4xx before it starts a stream.

        Raises:
            ValueError: invalid or never-fitting request (before anything is queued).
            RuntimeError: the waiting queue is full (``max_waiting``).
        Cancelling or closing the iterator aborts the request.
        """
        self.start()
        sp = sampling_params or SamplingParams()
        ids = self.engine.check_request(prompt, sp)
        if self.max_waiting is not None and self.stats().get("num_waiting", 0) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        with self._pending_lock:
            self._pending += 1
        self._commands.put(AddRequest(rid, ids, sp, priority, time.perf_counter()))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if item is _ADMITTED:
                    if on_admitted is not None:
                        on_admitted()
                    continue
                if item is _SENTINEL:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._commands.put(AbortRequest(rid))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Abort a request (applied before the next engine step)."""
        self._commands.put(AbortRequest(request_id))
        self._wake.set()


class QueueFullError(RuntimeError):
    """The asynchronous engine's waiting queue is at its configured bound."""
