"""Per-request lifecycle events: what the scheduler did to each request, step by step.

A :class:`RequestTracer` attached to an engine (``engine.tracer``) is told three things, each
in O(1) host work:

* a request was queued (:meth:`RequestTracer.on_queued`) or rejected (:meth:`on_rejected`);
* a step was planned (:meth:`RequestTracer.on_step`): the step's start time, its index, the
  planned items (the scheduler's ``ScheduledSequence`` list, kept by reference: each item's
  ``seq``, ``num_new_tokens``, ``start_position`` and ``is_prefill`` are fixed when the step is
  planned) and the sequences preempted while planning it;
* a request ended (:meth:`RequestTracer.on_finished`).

Events are expanded from these records only when they are read (:meth:`RequestTracer.events`,
:meth:`RequestTracer.drain`), so a traced step costs one tuple append, whatever its batch size.

Event kinds (one dict per event; ``t`` in seconds on the ``time.perf_counter`` clock minus the
``origin`` given when reading; every event has ``request_id`` and ``event``):

========== =====================================================================================
arrived    the request's arrival time (open-loop benchmarks: its scheduled arrival);
           ``prompt_tokens``, ``max_tokens``
queued     the engine accepted it into the waiting queue
prefill    one step computed a chunk of its prompt (or, after a preemption, of its recompute):
           ``step``, ``tokens`` computed, ``start`` position, ``cached_tokens`` taken from the
           prefix cache when the chunk is the first after admission, ``recompute`` (bool),
           ``batch_size`` (sequences in the step) and ``batch_tokens`` (tokens in the step)
first_token its first output token was read by the host
decode     one step computed its next token: ``step``, ``batch_size``, ``batch_tokens``
           (the planned tokens; a speculative step verifies more, see below)
preempted  the scheduler took its KV blocks (``reason``: ``out of KV blocks``) and sent it
           back to the waiting queue: ``step``, ``blocks_freed``, ``tokens_dropped`` (computed
           tokens it must recompute)
finished   it ended: ``reason`` (``stop`` | ``length`` | ``abort``), ``output_tokens``
rejected   it could never fit and was not queued: ``reason`` (the error message)
========== =====================================================================================

What the events do not say: with asynchronous scheduling (the CUDA default) the step after
the one that produced a stop token is planned before that token is read, so a request that
ends on EOS or a stop token has one ``decode`` more than its output tokens after the first
(that step's token is dropped, and its ``batch_size`` counts the row); with speculative
decoding a ``decode`` step may append up to 1 + k tokens; a request ended by a stop *string*
in ``serve`` (matched on text by the server, outside the engine) is ``finished`` with reason
``abort`` (the HTTP answer and the metrics say ``stop``). Event times are taken at the start of
a step's scheduling, a few microseconds before ``first_scheduled_time`` (so the trace's queue
span and the report's ``queue_ms`` differ by that much). Request ids must be unique within
one trace: an id reused after its request finished is merged with the earlier one.

:func:`request_spans` turns one request's events into contiguous spans (queued, prefill,
decode, preempted) from arrival to finish, so the spans of a finished request add up to its
end-to-end latency. The event vocabulary follows request lifecycle tracing as production
engines expose it (vLLM's per-request queued / scheduled / first-token / preempted / finished
timestamps); the format is this engine's own.
"""

from __future__ import annotations

import gzip
import io
import json
import time
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EVENT_KINDS", "SPAN_KINDS", "RequestTracer", "Span", "check_trace_path", "request_spans",
           "read_trace", "write_trace"]

#: Every event kind, in the order a request meets them.
EVENT_KINDS = ("arrived", "queued", "prefill", "first_token", "decode", "preempted", "finished",
               "rejected")
#: Span kinds of :func:`request_spans`.
SPAN_KINDS = ("queued", "prefill", "decode", "preempted")

#: Tie-break of events with the same time (a request's own order).
_ORDER = {k: i for i, k in enumerate(EVENT_KINDS)}


class RequestTracer:
    """Collects the lifecycle records of every request an engine sees (module docstring).

    Records hold references to the engine's sequences and step plans until read; a long-running
    server reads them with :meth:`drain` (which forgets what it returned) so memory stays
    bounded by the unread steps.
    """

    __slots__ = ("_queued", "_steps", "_ended", "_rejected", "_state", "num_steps")

    def __init__(self) -> None:
        self._queued: list[tuple[float, Any]] = []          # (time, seq)
        self._steps: list[tuple[float, int, Seq, Seq]] = []  # (start time, step, items, preempted)
        self._ended: list[Any] = []                          # finished sequences
        self._rejected: list[tuple[float, str | None, str]] = []  # (time, request id, message)
        # request id -> True once its first step after (re)admission was expanded (carried
        # across drains, so cached_tokens is reported once per admission)
        self._state: dict[str, bool] = {}
        self.num_steps = 0

    # ---- hooks (engine side; O(1) each) ----------------------------------------------------
    def on_queued(self, seq: Any, now: float | None = None) -> None:
        """``seq`` (a :class:`~llmserve.core.sequence.Sequence`) entered the waiting queue."""
        self._queued.append((time.perf_counter() if now is None else now, seq))

    def on_rejected(self, request_id: str | None, reason: str, now: float | None = None) -> None:
        """A request (``request_id``, None when it had none yet) was refused at admission with
        message ``reason``."""
        self._rejected.append((time.perf_counter() if now is None else now, request_id, str(reason)))

    def on_step(self, start: float, step: int, items: Seq, preempted: Seq = ()) -> None:
        """A step was planned at ``start`` (perf_counter seconds).

        Args:
            start: when the step's scheduling began.
            step: the engine's step index.
            items: the planned items; each has ``seq``, ``num_new_tokens``, ``start_position``
                and ``is_prefill`` (fixed once planned; kept by reference, not copied).
            preempted: sequences preempted while planning the step.
        """
        self._steps.append((start, step, items, preempted))
        self.num_steps += 1

    def on_finished(self, seq: Any) -> None:
        """``seq`` finished (stop, length or abort); its metrics hold the finish time."""
        self._ended.append(seq)

    # ---- reading -----------------------------------------------------------------------------
    def events(self, origin: float = 0.0) -> list[dict]:
        """Every event recorded so far, sorted by time (records are kept).

        Args:
            origin: perf_counter time subtracted from every ``t``.
        """
        state = dict(self._state)
        return _expand(self._queued, self._steps, self._ended, self._rejected, origin, state)

    def drain(self, origin: float = 0.0) -> list[dict]:
        """Like :meth:`events`, then forget the records it expanded (a server's periodic
        flush). Step events of a request keep their prefill/decode state across drains."""
        return self.expand(self.take(), origin)

    def take(self) -> tuple:
        """Hand over the records made since the last :meth:`take` (O(1): the lists are
        swapped, not copied). Call it on the thread that feeds the tracer; :meth:`expand` may
        then run on another thread, so a server's engine thread never serialises events."""
        records = (self._queued, self._steps, self._ended, self._rejected)
        self._queued, self._steps, self._ended, self._rejected = [], [], [], []
        return records

    def expand(self, records: tuple, origin: float = 0.0) -> list[dict]:
        """The events of records from :meth:`take`, in order (one caller at a time: it keeps
        each request's admission state between calls)."""
        queued, steps, ended, rejected = records
        out = _expand(queued, steps, ended, rejected, origin, self._state)
        for seq in ended:
            self._state.pop(seq.request_id, None)
        return out


def _expand(queued, steps, ended, rejected, origin: float, state: dict[str, bool]) -> list[dict]:
    """Turn the records into event dicts (see the module docstring). ``state`` maps a request id
    to True once its first chunk after (re)admission was seen, so ``cached_tokens`` is given
    only there; it is updated in place."""
    ev: list[dict] = []
    for t, seq in queued:
        m = seq.metrics
        ev.append({"t": m.arrival_time - origin, "request_id": seq.request_id, "event": "arrived",
                   "prompt_tokens": seq.num_prompt_tokens,
                   "max_tokens": seq.sampling_params.max_tokens})
        ev.append({"t": t - origin, "request_id": seq.request_id, "event": "queued"})
    for start, step, items, preempted in steps:
        t = start - origin
        batch, batch_tokens = len(items), sum(i.num_new_tokens for i in items)
        for seq in preempted:
            state.pop(seq.request_id, None)
            record = _preemption_record(seq, start)
            ev.append({"t": t, "request_id": seq.request_id, "event": "preempted", "step": step,
                       "reason": "out of KV blocks",
                       "blocks_freed": record[1] if record else None,
                       "tokens_dropped": record[2] if record else None})
        for item in items:
            rid = item.seq.request_id
            admitted = not state.get(rid, False)
            state[rid] = True
            if item.is_prefill or admitted:
                ev.append({"t": t, "request_id": rid, "event": "prefill", "step": step,
                           "tokens": item.num_new_tokens, "start": item.start_position,
                           "cached_tokens": item.start_position if admitted else 0,
                           "recompute": any(r[0] < start for r in item.seq.metrics.preemptions),
                           "batch_size": batch, "batch_tokens": batch_tokens})
            else:
                ev.append({"t": t, "request_id": rid, "event": "decode", "step": step,
                           "batch_size": batch, "batch_tokens": batch_tokens})
    for t, rid, reason in rejected:
        ev.append({"t": t - origin, "request_id": rid, "event": "rejected", "reason": reason})
    for seq in ended:
        m = seq.metrics
        rid = seq.request_id
        if m.first_token_time is not None:
            ev.append({"t": m.first_token_time - origin, "request_id": rid, "event": "first_token"})
        ev.append({"t": (m.finish_time if m.finish_time is not None else time.perf_counter()) - origin,
                   "request_id": rid, "event": "finished", "reason": seq.finish_reason,
                   "output_tokens": seq.num_output_tokens})
    ev.sort(key=lambda e: (e["t"], _ORDER[e["event"]]))
    return ev


def _preemption_record(seq: Any, start: float) -> tuple[float, int, int] | None:
    """The (time, blocks freed, tokens dropped) record of ``seq``'s preemption in the step that
    began at ``start`` (the first one at or after it), or None."""
    for rec in getattr(seq.metrics, "preemptions", ()):
        if rec[0] >= start:
            return rec
    return None


@dataclass(frozen=True, slots=True)
class Span:
    """One stretch of a request's life: ``kind`` (:data:`SPAN_KINDS`) from ``start`` to ``end``
    (seconds, the trace's clock)."""

    request_id: str
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start


def request_spans(events: Iterable[dict]) -> dict[str, list[Span]]:
    """Contiguous spans of every request, from its events (any order; one trace).

    A request is ``queued`` from arrival to its first prefill step, in ``prefill`` until its
    first token is read (after a preemption: until its first decode step; with asynchronous
    scheduling the next step is planned before the first token is read, so that decode step
    may start before the prefill span ends), in ``decode`` until it
    finishes or is preempted, and ``preempted`` (waiting to be recomputed) until its next
    prefill step. Spans are contiguous, so for a finished request they add up to
    ``finished.t - arrived.t``, its end-to-end latency. Rejected requests have no spans; a
    request without a ``finished`` event ends at its last event.

    Returns:
        ``{request_id: [Span, ...]}`` in time order, requests in order of arrival.
    """
    by_req: dict[str, list[dict]] = {}
    for e in events:
        by_req.setdefault(e["request_id"], []).append(e)
    spans: dict[str, list[Span]] = {}
    for rid, evs in sorted(by_req.items(), key=lambda kv: min(e["t"] for e in kv[1])):
        evs.sort(key=lambda e: (e["t"], _ORDER[e["event"]]))
        if any(e["event"] == "rejected" for e in evs):
            continue
        out: list[Span] = []
        kind, since, seen_first = None, None, False

        def switch(new: str | None, t: float) -> None:
            nonlocal kind, since
            if kind is not None and since is not None:
                out.append(Span(rid, kind, since, max(t, since)))
            kind, since = new, t

        for e in evs:
            k = e["event"]
            if k == "arrived":
                switch("queued", e["t"])
            elif k == "prefill" and kind in ("queued", "preempted", None):
                switch("prefill", e["t"])
            elif k == "first_token":
                seen_first = True
                if kind == "prefill":
                    switch("decode", e["t"])
            elif k == "decode" and kind == "prefill" and seen_first:
                switch("decode", e["t"])   # a recompute ends at its first decode step
            elif k == "preempted":
                switch("preempted", e["t"])
            elif k == "finished":
                switch(None, e["t"])
        if kind is not None and since is not None:
            switch(None, max(e["t"] for e in evs))
        spans[rid] = out
    return spans


def write_trace(path: str | Path, events: Iterable[dict], append: bool = False) -> int:
    """Write events as JSON lines (one object per line; gzip-compressed when ``path`` ends in
    ``.gz``). Returns the number of lines written.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    events = list(events)
    if append and not events:
        return 0                 # nothing to add: not even an empty gzip member
    n = 0
    if path.suffix == ".gz":     # no timestamp in the header: the same events, the same bytes
        raw = gzip.GzipFile(filename=str(path), mode="ab" if append else "wb", mtime=0)
        f = io.TextIOWrapper(raw, encoding="utf-8")
    else:
        f = open(path, "a" if append else "w", encoding="utf-8")
    with f:
        for e in events:
            f.write(json.dumps(e, separators=(",", ":")) + "\n")
            n += 1
    return n


def check_trace_path(path: str | Path, flag: str = "--trace") -> None:
    """Create (or empty) the trace file now, so a path that cannot be written is refused before
    a model loads or a run starts.

    Raises:
        ValueError: the file cannot be written (the message names ``flag`` and the path).
    """
    try:
        write_trace(path, [])
    except OSError as e:
        raise ValueError(f"{flag} {str(path)!r} cannot be written: {e}") from None


def read_trace(path: str | Path) -> list[dict]:
    """The events of a JSON-lines trace (gzip when the name ends in ``.gz``).

    Raises:
        OSError: the file cannot be read.
        EOFError: a ``.gz`` file ends mid-stream (a server still writing it).
        ValueError: a line is not a JSON object with ``t``, ``request_id`` and ``event``.
    """
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    out = []
    for no, line in enumerate(io.StringIO(raw.decode("utf-8")), 1):
        if not line.strip():
            continue
        e = json.loads(line)
        if not isinstance(e, dict) or not {"t", "request_id", "event"} <= e.keys():
            raise ValueError(f"{path}:{no}: not a trace event (needs t, request_id, event)")
        out.append(e)
    return out
