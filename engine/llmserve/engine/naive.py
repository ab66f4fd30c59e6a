"""The sequential control engine: one request at a time, the whole prefix recomputed every step
(no KV cache). Its greedy tokens are the reference the batched engines are compared with.
"""

from __future__ import annotations
import collections
import threading
import time
import torch
from ..config import EngineConfig
from ..core.sequence import Sequence, SequenceStatus
from ..worker.sampler import TokenHistory
from .llm_engine import RequestOutput, TokenCallback, _EngineBase


class _NaiveStepItem:
    """The naive engine's step as a trace item (the fields a scheduled item has): the first
    step of a request is its prefill (the whole prompt), every later one a decode, although
    each recomputes the whole prefix."""

    __slots__ = ("seq", "num_new_tokens", "start_position", "is_prefill")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.is_prefill = not seq.output_token_ids
        self.num_new_tokens = seq.num_prompt_tokens if self.is_prefill else 1
        self.start_position = 0 if self.is_prefill else seq.num_tokens - 1


class NaiveEngine(_EngineBase):
    """The control: one request at a time, a full-prefix forward pass per generated token.

    No KV cache and no batching: each new token re-runs the reference (SDPA) path over the
    whole prompt + output so far. A lock makes concurrent callers of ``step()``/``generate``
    wait, so it can never turn into a batched baseline.
    """

    def warmup(self, force: bool = False) -> dict:
        """Nothing to warm up: the reference path runs no Triton kernels and no graphs."""
        return {"skipped": "the naive engine runs only the reference path", "seconds": 0.0,
                "triton_compiles": 0, "requests": 0}

    def __init__(self, config: EngineConfig, **kw) -> None:
        if config.batch_invariant and config.device.startswith("cuda"):
            # its reference forward's invariant attention is PyTorch ops, whose CUDA reductions
            # split by shape: on a GPU the mode lives in the paged engine's Triton kernels
            raise ValueError("NaiveEngine supports batch_invariant=True on a CPU only; on CUDA "
                             "compare with LLMEngine at max_num_seqs=1 in the mode")
        super().__init__(config, **kw)
        self._lock = threading.RLock()
        self._queue: collections.deque[Sequence] = collections.deque()
        self._current: Sequence | None = None
        self._callbacks: dict[str, TokenCallback] = {}
        self.num_steps = 0

    def add_request(self, prompt, sampling_params=None, request_id=None, arrival_time=None,
                    priority=0, callback=None) -> Sequence:
        seq = self._new_seq(prompt, sampling_params, request_id, arrival_time, priority)
        with self._lock:
            self._queue.append(seq)
            if self.tracer is not None:
                self.tracer.on_queued(seq)
            if callback is not None:
                self._callbacks[seq.request_id] = callback
        return seq

    def abort_request(self, request_id: str) -> bool:
        with self._lock:
            for seq in list(self._queue) + ([self._current] if self._current else []):
                if seq.request_id == request_id:
                    if seq is self._current:
                        self._current = None
                    else:
                        self._queue.remove(seq)
                    seq.status = SequenceStatus.FINISHED_ABORTED
                    seq.metrics.finish_time = time.perf_counter()
                    if self.tracer is not None:
                        self.tracer.on_finished(seq)
                    cb = self._callbacks.pop(request_id, None)
                    if cb:
                        cb(RequestOutput.from_seq(seq, []))
                    return True
        return False

    def reset_stats(self) -> None:
        """Zero the step counter (what :meth:`stats` counts)."""
        self.num_steps = 0

    def has_unfinished_requests(self) -> bool:
        return self._current is not None or bool(self._queue)

    def stats(self) -> dict:
        return {"num_running": int(self._current is not None), "num_waiting": len(self._queue),
                "num_preemptions": 0, "num_recomputed_tokens": 0, "num_steps": self.num_steps,
                "kv_cache_usage": None}

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Generate one token of the current request (full-prefix forward, batch 1)."""
        with self._lock:
            t0 = time.perf_counter()
            if self._current is None:
                if not self._queue:
                    return []
                self._current = self._queue.popleft()
                self._current.status = SequenceStatus.RUNNING
                self._current.metrics.first_scheduled_time = t0
            seq = self._current
            if self.tracer is not None:
                self.tracer.on_step(t0, self.num_steps + 1, (_NaiveStepItem(seq),))
            ids = torch.tensor([seq.all_token_ids], dtype=torch.long, device=self.device)     # [1, T]
            logits = self.model.forward_reference(ids, last_only=True)[:, -1, :]                               # [1, V]
            self.num_steps += 1
            res = self.sampler.sample(logits.float(), [seq.sampling_params], [seq.request_id],
                                      history=[TokenHistory(seq.prompt_token_ids, seq.output_token_ids)])
            tok = res.token_ids[0]
            seq.append_token(tok)
            if seq.sampling_params.logprobs is not None:
                seq.output_logprobs.append(res.logprobs[0])
            status = seq.check_stop(self.max_model_len)
            if status is not None:
                seq.status = status
                seq.metrics.finish_time = time.perf_counter()
                self._current = None
                if self.tracer is not None:
                    self.tracer.on_finished(seq)
                self.sampler.release(seq.request_id)
            ro = RequestOutput.from_seq(seq, [tok])
            cb = self._callbacks.get(seq.request_id)
            if cb:
                cb(ro)
            if status is not None:
                self._callbacks.pop(seq.request_id, None)
            return [ro]
