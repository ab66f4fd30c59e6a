"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs.

All rows are processed on the logits' device; the only host synchronisation is the final
transfer of the chosen ids (and logprobs when asked for). Sampling uses the exponential-race
form of the categorical draw (argmax of ``p_i / E_i`` with ``E_i ~ Exp(1)``, equivalent to
``torch.multinomial``; the Gumbel-max trick in another guise), which needs no sort and lets
every row draw its noise from its own generator.

The distribution itself is shaped in :mod:`llmserve.worker.shaping` (logit bias and
penalties, grammar bitmasks, temperature, top-k and top-p, from persistent per-row arrays);
this module decides which rows need which part (greedy rows without processing take the
argmax, possibly the decode graph's), draws, computes logprob records and brings the ids to
the host behind an event.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..core.sampling_params import SamplingParams
from .shaping import (RowParams, SamplingRows, TokenBitmask, TokenHistory, _unpack_disallowed_torch,  # noqa: F401
                      apply_logits_processing, apply_token_bitmask, apply_top_k_top_p, sampling_probs)


@dataclass(slots=True)
class SampleResult:
    """Chosen ids and, for rows that asked, logprob records.

    Attributes:
        token_ids: one int per row.
        logprobs: per row ``None`` or ``{"token_logprob": float, "top": [(id, logprob), ...]}``.
    """

    token_ids: list[int]
    logprobs: list[dict | None]


class Sampler:
    """Turns one step's logits into one token per sequence.

    Seeded requests own a ``torch.Generator`` (created on first use, keyed by request id), so
    their streams are reproducible whatever else is in the batch. Unseeded requests share the
    engine's generator.
    """

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        # Copies of sampled ids to the host on a side stream (CUDA; see _copy_stream).
        self.copy_stream = _copy_stream(self.device) if self.device.type == "cuda" else None
        self._engine_gen = torch.Generator(device=self.device)
        self._engine_gen.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        #: per-request temperature / top-k / top-p / penalties (persistent arrays)
        self.rows = SamplingRows(self.device)

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator and its sampling-parameter slot."""
        self._generators.pop(request_id, None)
        self.rows.release(request_id)

    def generator(self, request_id: str, seed: int | None) -> torch.Generator:
        """The generator a request draws from: its own (seeded, created on first use) or the
        engine's shared one (``seed`` None)."""
        return self._generator(request_id, seed)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self._engine_gen
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               request_ids: list[str], history: list[TokenHistory | None] | None = None,
               token_bitmask: TokenBitmask | None = None) -> SampleResult:
        """Pick the next token for each row and wait for the result (see :meth:`sample_async`).

        Args:
            logits: ``[B, V]`` float32 model logits, row i for ``params[i]``.
            params: sampling parameters per row.
            request_ids: request id per row (keys for per-request generators).
            history: per row the sequence's tokens (:class:`TokenHistory`), needed by rows with
                presence/frequency/repetition penalties.
            token_bitmask: the allowed tokens of grammar-constrained rows (:class:`TokenBitmask`);
                those rows of ``logits`` are masked in place.

        Returns:
            :class:`SampleResult` with ``B`` token ids.
        """
        return self.sample_async(logits, params, request_ids, history=history,
                                 token_bitmask=token_bitmask).result()

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, params: list[SamplingParams],
                     request_ids: list[str], argmax: torch.Tensor | None = None,
                     history: list[TokenHistory | None] | None = None,
                     pending_token_ids: torch.Tensor | None = None,
                     token_bitmask: TokenBitmask | None = None) -> "PendingSample":
        """Queue the sampling of one step on the logits' device without waiting for it.

        The chosen ids stay on the device (``PendingSample.token_ids_device``, which the next
        step can read as its input ids) and are copied to pinned host memory behind a CUDA
        event, so the host can launch the next step before it reads them
        (:meth:`PendingSample.result`). No host synchronisation happens here.

        Args/shapes as :meth:`sample`; ``argmax``: ``logits.argmax(-1)`` ``[B]`` int64 when the
        caller has it already (the decode graph computes it), used for the greedy rows without
        logits processing; ``history`` / ``pending_token_ids``: see :func:`apply_logits_processing`;
        ``token_bitmask``: grammar masks of some rows (:func:`apply_token_bitmask`, after the
        logits processing; the rows of ``logits`` it names are overwritten when no processing
        copied them first).

        Raises:
            ValueError: a bad ``argmax`` or bitmask; from :func:`apply_logits_processing`.
        """
        b = logits.shape[0]
        if b == 0:
            return PendingSample(logits.new_empty((0,), dtype=torch.long), None)
        greedy = [p.greedy for p in params]
        if argmax is not None and (argmax.shape != (b,) or argmax.dtype != torch.int64
                                   or argmax.device != logits.device):
            raise ValueError(f"argmax must be int64 [{b}] on {logits.device}, got {argmax.dtype} "
                             f"{tuple(argmax.shape)} on {argmax.device}")
        processed = [i for i, p in enumerate(params) if p.needs_logits_processing]
        masked = token_bitmask is not None and bool(token_bitmask.rows)
        if processed:
            logits = apply_logits_processing(logits, params, history, pending_token_ids,
                                             self.rows, request_ids)                        # [B, V]
        if masked:
            logits = apply_token_bitmask(logits, token_bitmask)                             # [B, V]
            processed = sorted(set(processed) | set(token_bitmask.rows))
        if argmax is None:
            chosen = logits.argmax(dim=-1)      # [B], after processing: right for every row
        else:
            chosen = argmax
            fix = [i for i in processed if greedy[i]]
            if fix:
                chosen = chosen.clone()          # never write into the caller's (graph's) buffer
                argmax = None
                if len(fix) == b:
                    chosen = logits.argmax(dim=-1)
                else:
                    fix_t = torch.tensor(fix, dtype=torch.long, device=logits.device)
                    chosen[fix_t] = logits[fix_t].argmax(dim=-1)
        if not all(greedy):
            if argmax is not None:
                chosen = chosen.clone()          # never write into the caller's (graph's) buffer
            rows = [i for i, g in enumerate(greedy) if not g]
            shape = self.rows.view([request_ids[i] for i in rows], [params[i] for i in rows], key="sampled")
            probs = sampling_probs(logits[rows], shape)                           # [S, V]
            noise = torch.empty_like(probs)
            for j, i in enumerate(rows):
                noise[j].exponential_(generator=self._generator(request_ids[i], params[i].seed))
            chosen[rows] = (probs / noise).argmax(dim=-1)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp_parts = None
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)                         # [W, V]
            kmax = max(params[i].logprobs for i in want)
            tok_lp = lp.gather(1, chosen[want][:, None]).squeeze(1)               # [W]
            top_vals, top_ids = lp.topk(kmax, dim=-1) if kmax > 0 else (None, None)
            lp_parts = (want, [params[i].logprobs for i in want], tok_lp, top_vals, top_ids)
        return PendingSample(chosen, lp_parts, copy_stream=self.copy_stream)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start a copy of ``t`` to (pinned) host memory; returns the host tensor."""
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that copies a CUDA step's sampled ids to the host, one per device (two
    engines on one GPU share it: their copies queue behind each other, a false dependency of a
    few microseconds).

    Why: a copy to pinned host memory holds its stream ~5 us after it ends (H200 engine
    profile), so on the compute stream it sat between one decode graph and the next step's
    input copy; on a side stream the compute stream goes straight on. Whatever the copy reads
    must not be overwritten by the next step: fresh tensors are kept alive for it
    (``record_stream``), and the decode graphs alternate their greedy output buffer
    (:class:`~llmserve.worker.cuda_graph.CUDAGraphDecodeRunner`)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _COPY_STREAMS:
        _COPY_STREAMS[idx] = torch.cuda.Stream(device)
    return _COPY_STREAMS[idx]


class PendingSample:
    """One step's sampled ids (and logprobs) on their way to the host: the copies to pinned
    memory are queued at construction, on ``copy_stream`` (after it waits for the current
    stream's work) when one is given, else on the current stream; :meth:`wait` waits for
    them, :meth:`result` returns them.

    Attributes:
        token_ids_device: ``[B]`` int64 on the logits' device (the next step's input ids); for a
            greedy decode-graph step a view of the graph's token buffer, valid until the replay
            after next (:class:`~llmserve.worker.cuda_graph.CUDAGraphDecodeRunner`).
    """

    __slots__ = ("token_ids_device", "_host", "_lp", "_event")

    def __init__(self, chosen: torch.Tensor, lp_parts,
                 copy_stream: torch.cuda.Stream | None = None) -> None:
        self.token_ids_device = chosen
        side = copy_stream              # set by a CUDA sampler only
        if side is not None:        # the copies wait for this step's work on a side stream
            side.wait_stream(torch.cuda.current_stream(chosen.device))
            for t in (chosen, *(lp_parts[2:] if lp_parts is not None else ())):
                if t is not None:
                    t.record_stream(side)   # not reused by the allocator before the copy ran
        with torch.cuda.stream(side) if side is not None else nullcontext():
            self._host = _to_host(chosen)
            self._lp = None
            if lp_parts is not None:
                want, ks, tok_lp, top_vals, top_ids = lp_parts
                self._lp = (want, ks, _to_host(tok_lp), _to_host(top_vals), _to_host(top_ids))
            self._event = None
            if chosen.device.type == "cuda":
                self._event = torch.cuda.Event()
                self._event.record()

    def wait(self) -> None:
        """Block until this step's sampled ids are on the host (only its own work, not later
        launches); a no-op once it returned."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def result(self) -> SampleResult:
        """Wait for this step's sampling (:meth:`wait`) and return the ids and logprob
        records."""
        self.wait()
        ids = self._host.tolist()
        records: list[dict | None] = [None] * len(ids)
        if self._lp is not None:
            want, ks, tok_lp, top_vals, top_ids = self._lp
            tok = tok_lp.tolist()
            for j, i in enumerate(want):
                top = []
                if ks[j]:   # tokens a grammar disallowed (-inf) are not alternatives
                    top = [(t, v) for t, v in zip(top_ids[j, :ks[j]].tolist(), top_vals[j, :ks[j]].tolist())
                           if v != float("-inf")]
                records[i] = {"token_logprob": tok[j], "top": top}
        return SampleResult(ids, records)
