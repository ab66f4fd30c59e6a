"""Grammar-constrained decoding (structured output) through xgrammar.

The engine side of :class:`~llmserve.core.sampling_params.StructuredOutput`:

- :class:`GrammarCache` compiles a request's grammar once per
  :attr:`StructuredOutput.key <llmserve.core.sampling_params.StructuredOutput.key>` with
  ``xgrammar.GrammarCompiler`` over the tokenizer's vocabulary (``xgrammar.TokenizerInfo`` built
  from our HF tokenizer, sized to the model's LM head: ids past the tokenizer, the padding of
  Qwen2's 151,936-row head, are never allowed) and keeps the compiled grammars in an LRU.
  Compilation may run on any thread (the server compiles off its event loop before
  submitting); lookups never wait for another key's compilation.
- :class:`StructuredOutputManager` holds one ``xgrammar.GrammarMatcher`` per constrained
  sequence (so ``n`` choices have ``n`` matchers). Before a step samples, the host fills a token
  bitmask for the constrained rows only (:meth:`StructuredOutputManager.fill_bitmask`); the
  sampler applies it (:func:`llmserve.worker.sampler.apply_token_bitmask`); after the token is
  read, the matcher accepts it (:meth:`StructuredOutputManager.accept`). A matcher that accepted
  its stop token has terminated: the sequence finishes with ``stop``.

A matcher has accepted exactly the sequence's ``output_token_ids``. Preemption by recompute keeps
those tokens, so it needs no matcher change; the speculative engine advances the matcher
through the drafts to build their masks and rolls it back (:meth:`accept_draft`,
:meth:`rollback`).

The matcher's stop tokens are the sequence's EOS ids and ``stop_token_ids``; EOS counts as a
stop token of the grammar even with ``ignore_eos`` (a complete grammar has nothing else to
emit). Reference: xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models", arXiv:2411.15100), the library vLLM and SGLang use.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from ..core.sampling_params import StructuredOutput
from ..core.sequence import Sequence, SequenceStatus

log = logging.getLogger("llmserve.engine")

INSTALL_HINT = "structured output needs the xgrammar package: pip install 'llmserve[structured]'"

#: xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "
_CPP_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


def _xgrammar():
    """The ``xgrammar`` module. Raises ValueError (the request cannot be served) without it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(INSTALL_HINT) from e
    return xgrammar


def grammar_error_message(e: BaseException) -> str:
    """xgrammar's error text without its source-location prefix."""
    return _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


class GrammarCache:
    """Compiled grammars of one tokenizer, by :attr:`StructuredOutput.key`, in an LRU.

    Args:
        tokenizer: the engine's HF tokenizer.
        vocab_size: rows of the model's LM head (>= the tokenizer's size; the extra ids are
            never allowed).
        stop_token_ids: the model's EOS ids (the default stop tokens of compiled grammars).
        max_entries: compiled grammars kept (least recently used ones are dropped).
        max_threads: compiler threads.

    The tokenizer's xgrammar description is built on first use (about 0.6 s for the Qwen
    vocabulary). Thread-safe.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...] = (),
                 max_entries: int = 256, max_threads: int = 2) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an integer >= 1, got {max_entries!r}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.max_entries = max_entries
        self.max_threads = max_threads
        self._compiler = None
        self._lock = threading.Lock()           # the LRU and the counters
        self._init_lock = threading.Lock()      # building the tokenizer info once
        self._key_locks: dict[tuple, threading.Lock] = {}
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self.num_compiles = 0
        self.num_hits = 0
        self.num_errors = 0
        self.compile_seconds = 0.0

    def _get_compiler(self):
        if self._compiler is None:
            with self._init_lock:
                if self._compiler is None:
                    xgr = _xgrammar()
                    info = xgr.TokenizerInfo.from_huggingface(
                        self.tokenizer, vocab_size=self.vocab_size,
                        stop_token_ids=list(self.stop_token_ids) or None)
                    # our LRU bounds the memory; xgrammar's own cache would keep everything
                    self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                         cache_enabled=False)
        return self._compiler

    def prepare(self) -> None:
        """Build the compiler (it reads the whole tokenizer vocabulary) now, on the caller's
        thread, so later compilations elsewhere never touch the tokenizer."""
        self._get_compiler()

    @property
    def bitmask_words(self) -> int:
        """int32 words of one bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    def get(self, spec: StructuredOutput):
        """The compiled grammar of ``spec`` (compiled now on a miss).

        Raises:
            ValueError: the schema cannot be compiled (the message says why), or xgrammar is
                not installed.
        """
        key = spec.key
        with self._lock:
            hit = self._hit(key)
            if hit is not None:
                return hit
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:                  # one compilation per key; other keys go on
            with self._lock:
                hit = self._hit(key)
                if hit is not None:
                    return hit
            try:
                compiled = self._compile(spec)
                with self._lock:
                    self._entries[key] = compiled
                    while len(self._entries) > self.max_entries:
                        self._entries.popitem(last=False)
            finally:                    # compiled or failed: the key's lock is done with
                with self._lock:
                    self._key_locks.pop(key, None)
        return compiled

    def _hit(self, key: tuple):
        """The cached grammar of ``key`` (marked most recently used, counted) or None; call
        with ``self._lock`` held."""
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            self.num_hits += 1
        return hit

    def _compile(self, spec: StructuredOutput):
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        # compact: one line with json.dumps' separators; any: any JSON whitespace
        ws = {"any_whitespace": spec.whitespace == "any"}
        try:
            if spec.kind == "json_object":
                # any object: not strict, so the object may hold any properties
                compiled = compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
            else:
                compiled = compiler.compile_json_schema(spec.json_schema, strict_mode=True, **ws)
        except (RuntimeError, ValueError, TypeError) as e:
            with self._lock:
                self.num_errors += 1
            raise ValueError("invalid JSON schema (compiled strictly: an object admits only the "
                             f"properties it lists): {grammar_error_message(e)}") from None
        dt = time.perf_counter() - t0
        with self._lock:
            self.num_compiles += 1
            self.compile_seconds += dt
        return compiled

    def stats(self) -> dict:
        with self._lock:
            return {"cached": len(self._entries), "compiles": self.num_compiles, "hits": self.num_hits,
                    "errors": self.num_errors, "compile_seconds": self.compile_seconds}


class _Constrained:
    """One constrained sequence's matcher."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher


class StructuredOutputManager:
    """The grammar matchers of an engine's constrained sequences (module docstring).

    Args:
        tokenizer, vocab_size, eos_token_ids, max_entries: as :class:`GrammarCache`.
        pin_memory: allocate bitmasks in pinned host memory (a CUDA engine: asynchronous copies).
        parallel_fill_rows: a step with at least this many constrained rows fills their
            bitmasks on xgrammar's thread pool (``BatchGrammarMatcher``); fewer are filled one
            after another on the calling thread (a single row always is). Waking a pool
            costs more than a few rows' fills, and a pool's fill waits for its slowest thread,
            so it suffers most from a busy host
            (:class:`~llmserve.config.EngineConfig` ``grammar_parallel_fill_rows``).
        fill_threads: the pool's threads (``None``: xgrammar's choice, half the host's cores).

    Only the engine's step thread calls the per-sequence methods; :meth:`check` may run on
    any thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] = (),
                 max_entries: int = 256, pin_memory: bool = False, parallel_fill_rows: int = 16,
                 fill_threads: int | None = None) -> None:
        self.cache = GrammarCache(tokenizer, vocab_size, eos_token_ids, max_entries)
        self.vocab_size = int(vocab_size)
        self.pin_memory = pin_memory
        self.parallel_fill_rows = int(parallel_fill_rows)
        self.fill_threads = fill_threads
        self._active: dict[str, _Constrained] = {}
        self._batch = None
        # The step bitmasks (fill_bitmask without ``out``): two host buffers used in turn, grown
        # to the largest step and never cleared (xgrammar writes every word of a row it fills;
        # clearing a [128, 4,748] buffer with torch would wake torch's CPU thread pool, whose
        # spinning threads slow xgrammar's own). A buffer is filled again two fills later; by
        # then the sampler has copied it (the engine reads a step's tokens, which come after
        # the copy on the device, before it fills the next step's masks).
        self._step_masks: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self.num_requests = 0
        self.num_mask_rows = 0
        self.mask_seconds = 0.0
        self.num_rejected_tokens = 0

    def __len__(self) -> int:
        """Constrained sequences alive."""
        return len(self._active)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._active

    # ---- requests ------------------------------------------------------------------------
    def check(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` (cached), so an invalid schema fails before the request is queued.

        Raises:
            ValueError: the schema cannot be compiled or xgrammar is missing.
        """
        self.cache.get(spec)

    def stop_token_ids(self, seq: Sequence) -> list[int]:
        """The tokens that end ``seq``'s grammar: its EOS ids and ``stop_token_ids``."""
        ids = set(seq.eos_token_ids) | set(seq.sampling_params.stop_token_ids)
        return sorted(t for t in ids if 0 <= t < self.vocab_size)

    def add(self, seq: Sequence) -> None:
        """Create ``seq``'s matcher, advanced over any output tokens it already has.

        Raises:
            ValueError: as :meth:`check`; an existing output the grammar does not accept.
        """
        spec = seq.sampling_params.structured_output
        if spec is None:
            return
        xgr = _xgrammar()
        stops = self.stop_token_ids(seq)
        matcher = xgr.GrammarMatcher(self.cache.get(spec), override_stop_tokens=stops or None,
                                     terminate_without_stop_token=not stops)
        for t in seq.output_token_ids:
            if not matcher.accept_token(int(t)):
                raise ValueError(f"request {seq.request_id!r}: its output so far does not follow its grammar")
        self._active[seq.request_id] = _Constrained(matcher)
        self.num_requests += 1

    def remove(self, request_id: str) -> None:
        """Forget a finished sequence's matcher (unknown ids are ignored)."""
        self._active.pop(request_id, None)

    def is_terminated(self, request_id: str) -> bool:
        c = self._active.get(request_id)
        return c is not None and c.matcher.is_terminated()

    # ---- steps ---------------------------------------------------------------------------
    def new_bitmask(self, rows: int) -> torch.Tensor:
        """``[rows, ceil(V / 32)]`` int32 on the host, every token allowed."""
        return torch.full((rows, self.cache.bitmask_words), -1, dtype=torch.int32, pin_memory=self.pin_memory)

    def _step_bitmask(self, rows: int) -> torch.Tensor:
        """``[rows, ceil(V / 32)]`` int32 host rows of the next step buffer (stale contents:
        the caller fills every row)."""
        buf = self._step_masks[self._turn]
        if buf is None or buf.shape[0] < rows:   # grown by doubling: few allocations as a batch ramps up
            grown = max(rows, 8, 2 * buf.shape[0] if buf is not None else 0)
            buf = torch.empty((grown, self.cache.bitmask_words), dtype=torch.int32,
                              pin_memory=self.pin_memory)
            self._step_masks[self._turn] = buf
        self._turn ^= 1
        return buf[:rows]

    def fill_bitmask(self, request_ids: list[str], out: torch.Tensor | None = None,
                     start: int = 0) -> torch.Tensor:
        """The next-token bitmasks of the given constrained sequences, one row each.

        Args:
            request_ids: constrained sequences.
            out: bitmask to fill (rows ``start ..``), from :meth:`new_bitmask`. Default: rows of
                one of two reused host buffers, valid until the second fill after this one
                without ``out`` (an engine's sampler has copied it to the device by then).

        Returns:
            ``out``, or ``[len(request_ids), ceil(V / 32)]`` int32 on the host (see
            :class:`~llmserve.worker.sampler.TokenBitmask`).

        Raises:
            KeyError: a request without a matcher.
        """
        t0 = time.perf_counter()
        matchers = [self._active[r].matcher for r in request_ids]
        bitmask = self._step_bitmask(len(matchers)) if out is None else out
        if len(matchers) < max(2, self.parallel_fill_rows):
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, start + i)
        else:
            if self._batch is None:
                threads = "auto" if self.fill_threads is None else int(self.fill_threads)
                self._batch = _xgrammar().BatchGrammarMatcher(max_threads=threads)
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask,
                                                      list(range(start, start + len(matchers))))
        self.num_mask_rows += len(matchers)
        self.mask_seconds += time.perf_counter() - t0
        return bitmask

    def accept(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """Advance ``seq``'s matcher by the token just appended to it.

        Returns:
            ``FINISHED_STOPPED`` when the matcher terminated (it accepted a stop token; the
            sequence's ``stop_reason`` becomes that token), ``FINISHED_ABORTED`` when the grammar
            refused the token (a bitmask was not applied: an engine bug, logged), else None.
        """
        c = self._active.get(seq.request_id)
        if c is None:
            return None
        if not c.matcher.accept_token(int(token_id)):
            self.num_rejected_tokens += 1
            log.error("request %s: token %d is not allowed by its grammar; the request is aborted",
                      seq.request_id, token_id)
            return SequenceStatus.FINISHED_ABORTED
        if c.matcher.is_terminated():
            seq.stop_reason = int(token_id)
            return SequenceStatus.FINISHED_STOPPED
        return None

    def accept_draft(self, request_id: str, token_id: int) -> bool:
        """Advance the matcher by a speculative draft token (undone by :meth:`rollback`);
        False when the grammar refuses it or has terminated."""
        m = self._active[request_id].matcher
        return not m.is_terminated() and bool(m.accept_token(int(token_id)))

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` :meth:`accept_draft` calls."""
        if num_tokens:
            self._active[request_id].matcher.rollback(num_tokens)

    def stats(self) -> dict:
        """Counters: constrained requests, bitmask rows filled and their host seconds,
        rejected tokens, and the grammar cache's (``compiles``, ``hits``, ``compile_seconds``)."""
        return {"active": len(self._active), "requests": self.num_requests,
                "mask_rows": self.num_mask_rows, "mask_seconds": self.mask_seconds,
                "rejected_tokens": self.num_rejected_tokens, "grammar_cache": self.cache.stats()}

    def reset_stats(self) -> None:
        """Zero the request and bitmask counters (the compiled grammars stay)."""
        self.num_requests = self.num_mask_rows = self.num_rejected_tokens = 0
        self.mask_seconds = 0.0
