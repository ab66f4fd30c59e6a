"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs.

All rows are processed on the logits' device; the only host synchronisation is the final
transfer of the chosen ids (and logprobs when asked for). Sampling uses the exponential-race
form of the categorical draw (argmax of ``p_i / E_i`` with ``E_i ~ Exp(1)``, equivalent to
``torch.multinomial``; the Gumbel-max trick in another guise), which needs no sort and lets
every row draw its noise from its own generator.

Top-p follows Holtzman et al. 2020 ("The Curious Case of Neural Text Degeneration"): keep the
smallest set of most-likely tokens whose mass reaches ``top_p`` (the token that crosses the
threshold is kept).

Logits processing before the draw (rows that ask for it only, batched on the logits' device,
in vLLM's order): ``logit_bias`` (OpenAI: added to the raw logits), then the repetition penalty
(Keskar et al. 2019, "CTRL", as in HF ``RepetitionPenaltyLogitsProcessor`` and vLLM: over prompt
and output tokens, positive logits divided, negative multiplied), then OpenAI's frequency and
presence penalties over output tokens (``logit -= frequency * count + presence * (count > 0)``).
Token counts are rebuilt every step from the sequence's tokens (:class:`TokenHistory`), so they
are right after preemption and recompute; a token still on the device (asynchronous scheduling)
is added from the previous step's id tensor, with no host synchronisation.

Grammar-constrained rows (structured output) come with a token bitmask (:class:`TokenBitmask`,
filled on the host by the engine's grammar matchers): after the penalties, every token the
grammar does not allow gets logit ``-inf`` in those rows only, so temperature, top-k/top-p,
the draw and the logprobs all see the constrained distribution (vLLM and SGLang apply
xgrammar's bitmasks at the same point). A batch without constrained rows pays nothing.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..core.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleResult:
    """Chosen ids and, for rows that asked, logprob records.

    Attributes:
        token_ids: one int per row.
        logprobs: per row ``None`` or ``{"token_logprob": float, "top": [(id, logprob), ...]}``.
    """

    token_ids: list[int]
    logprobs: list[dict | None]


class TokenHistory(NamedTuple):
    """The tokens of one row's sequence, for penalties.

    Attributes:
        prompt: prompt token ids.
        output: output token ids the host knows.
        pending_row: row in the previous step's sampled-id tensor holding one more output token
            that the host has not read yet (asynchronous scheduling), else ``None``.
    """

    prompt: Sequence[int]
    output: Sequence[int]
    pending_row: int | None = None


class TokenBitmask(NamedTuple):
    """Allowed tokens of some rows of a step, one bit per token.

    Attributes:
        rows: the logits rows the masks belong to (distinct, ascending or not).
        bitmask: ``[len(rows), ceil(V / 32)]`` int32 on the host (pinned for a CUDA sampler, so
            the copy is asynchronous); bit ``t % 32`` of word ``t // 32`` of row ``j`` is 1 when
            token ``t`` is allowed in ``rows[j]`` (xgrammar's layout). Bits past the logits'
            vocabulary are ignored; a vocabulary wider than the mask leaves the extra ids
            disallowed.
    """

    rows: list[int]
    bitmask: torch.Tensor


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """``[32]`` int32 ``1 << i`` (bit 31 as the int32 minimum), cached per device."""
    t = _BIT_VALUES.get(device)
    if t is None:
        t = torch.tensor([1 << i if i < 31 else -(1 << 31) for i in range(32)], dtype=torch.int32, device=device)
        _BIT_VALUES[device] = t
    return t


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """Set the logits of disallowed tokens to ``-inf`` in the rows ``mask.rows``, in place.

    Args:
        logits: ``[B, V]`` float logits (any device); rows not in ``mask.rows`` are untouched.
        mask: :class:`TokenBitmask`, bitmask ``[R, W]`` int32 with ``R = len(mask.rows)``.

    Returns:
        ``logits`` (modified in place).

    Raises:
        ValueError: a bitmask of the wrong dtype or shape, or a row outside ``[0, B)``.
    """
    rows, bm = list(mask.rows), mask.bitmask
    b, vocab = logits.shape
    if bm.dtype != torch.int32 or bm.dim() != 2 or bm.shape[0] != len(rows):
        raise ValueError(f"the token bitmask must be int32 [{len(rows)}, W], got {bm.dtype} {tuple(bm.shape)}")
    if not rows:
        return logits
    if min(rows) < 0 or max(rows) >= b or len(set(rows)) != len(rows):
        raise ValueError(f"token bitmask rows must be distinct and in [0, {b}), got {rows[:8]}")
    dev = logits.device
    words = min(bm.shape[1], (vocab + 31) // 32)
    disallowed = _unpack_disallowed(bm[:, :words], dev)                                # [R, 32 W]
    disallowed = disallowed[:, :vocab]                                                 # [R, V'] (V' <= V)
    if disallowed.shape[1] < vocab:     # ids past the mask: never allowed
        disallowed = torch.nn.functional.pad(disallowed, (0, vocab - disallowed.shape[1]), value=True)
    if rows == list(range(b)):
        return logits.masked_fill_(disallowed, float("-inf"))
    idx = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    sub = logits.index_select(0, idx).masked_fill_(disallowed, float("-inf"))          # [R, V]
    return logits.index_copy_(0, idx, sub)


def _unpack_disallowed(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[R, W]`` int32 host bitmask -> ``[R, 32 W]`` bool on ``device``, True where a token is
    NOT allowed. On a CPU numpy's ``unpackbits`` of the inverted bytes (little-endian bit order:
    bit ``i`` of a word is token ``32 w + i``) makes it without an int32 temporary; elsewhere
    the words are copied to the device and unpacked there (:func:`_unpack_disallowed_torch`)."""
    if device.type == "cpu" and bitmask.device.type == "cpu":
        import numpy as np

        words = np.ascontiguousarray((~bitmask).numpy())                                # [R, W] int32
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")           # [R, 32 W] uint8
        return torch.from_numpy(bits).view(torch.bool)
    return _unpack_disallowed_torch(bitmask.to(device, non_blocking=True))


def _unpack_disallowed_torch(bitmask: torch.Tensor) -> torch.Tensor:
    """``[R, W]`` int32 -> ``[R, 32 W]`` bool, True where a bit is 0 (on the bitmask's device)."""
    r, w = bitmask.shape
    return ((bitmask[:, :, None] & _bit_values(bitmask.device)) == 0).view(r, w * 32)   # [R, 32 W]


def _penalty_counts(rows: list[int], history: list[TokenHistory], vocab: int, device: torch.device,
                    pending_ids: torch.Tensor | None, with_prompt: bool):
    """Output-token counts ``[R, V]`` float32 and (``with_prompt``) a prompt-token mask ``[R, V]``
    bool for the rows ``rows``; one host-to-device copy per tensor."""
    r_idx, t_idx, pr_idx, pt_idx, pend_r, pend_src = [], [], [], [], [], []
    for j, i in enumerate(rows):
        h = history[i]
        r_idx.extend([j] * len(h.output))
        t_idx.extend(h.output)
        if with_prompt:
            pr_idx.extend([j] * len(h.prompt))
            pt_idx.extend(h.prompt)
        if h.pending_row is not None:
            pend_r.append(j)
            pend_src.append(h.pending_row)
    counts = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)            # [R, V]
    if t_idx:
        idx = torch.tensor([r_idx, t_idx], dtype=torch.long).to(device, non_blocking=True)  # [2, N]
        counts.index_put_((idx[0], idx[1]), torch.ones(idx.shape[1], device=device), accumulate=True)
    if pend_r:
        if pending_ids is None:
            raise ValueError("a row has a pending token but no pending_token_ids were given")
        src = torch.tensor(pend_src, dtype=torch.long).to(device, non_blocking=True)
        dst = torch.tensor(pend_r, dtype=torch.long).to(device, non_blocking=True)
        toks = pending_ids.to(device)[src]                                                  # [P]
        counts.index_put_((dst, toks), torch.ones(len(pend_r), device=device), accumulate=True)
    prompt_mask = None
    if with_prompt:
        prompt_mask = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)      # [R, V]
        if pt_idx:
            idx = torch.tensor([pr_idx, pt_idx], dtype=torch.long).to(device, non_blocking=True)
            prompt_mask[idx[0], idx[1]] = True
    return counts, prompt_mask


def apply_logits_processing(logits: torch.Tensor, params: list[SamplingParams],
                            history: list[TokenHistory | None] | None,
                            pending_token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logit bias, repetition, frequency and presence penalties (module docstring), batched.

    Args:
        logits: ``[B, V]`` float32 raw model logits (not modified).
        params: per row; rows with neither penalties nor bias are left as they are.
        history: per row the sequence's tokens (needed by rows with penalties).
        pending_token_ids: ``[S]`` int64, the previous step's sampled ids on the device, read
            at ``history[i].pending_row``.

    Returns:
        ``logits`` itself when no row needs processing, else a processed copy ``[B, V]``.

    Raises:
        ValueError: a ``logit_bias`` token id outside ``[0, V)``; a row with penalties and no history.
    """
    rows = [i for i, p in enumerate(params) if p.needs_logits_processing]
    if not rows:
        return logits
    vocab, dev = logits.shape[-1], logits.device
    out = logits.clone()                                                              # [B, V]
    b_rows, b_ids, b_vals = [], [], []
    for i in rows:
        for tok, v in (params[i].logit_bias or {}).items():
            if not 0 <= tok < vocab:
                raise ValueError(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab})")
            b_rows.append(i)
            b_ids.append(tok)
            b_vals.append(v)
    if b_rows:
        idx = torch.tensor([b_rows, b_ids], dtype=torch.long).to(dev, non_blocking=True)
        vals = torch.tensor(b_vals, dtype=torch.float32).to(dev, non_blocking=True)
        out.index_put_((idx[0], idx[1]), vals.to(out.dtype), accumulate=True)
    pen = [i for i in rows if params[i].has_penalties]
    if pen:
        if history is None or any(history[i] is None for i in pen):
            raise ValueError("presence/frequency/repetition penalties need the sequence's tokens "
                             "(this engine path does not pass them)")
        with_prompt = any(params[i].repetition_penalty != 1.0 for i in pen)
        counts, prompt_mask = _penalty_counts(pen, history, vocab, dev, pending_token_ids, with_prompt)
        pen_t = torch.tensor(pen, dtype=torch.long).to(dev, non_blocking=True)
        sub = out[pen_t]                                                              # [P, V]
        if with_prompt:
            rep = torch.tensor([params[i].repetition_penalty for i in pen],
                               dtype=torch.float32).to(dev, non_blocking=True)[:, None]  # [P, 1]
            seen = prompt_mask | (counts > 0)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = torch.tensor([params[i].frequency_penalty for i in pen],
                            dtype=torch.float32).to(dev, non_blocking=True)[:, None]       # [P, 1]
        pres = torch.tensor([params[i].presence_penalty for i in pen],
                            dtype=torch.float32).to(dev, non_blocking=True)[:, None]       # [P, 1]
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        out[pen_t] = sub
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) sets with ``-inf``.

    Args:
        logits: ``[B, V]`` float32 (already temperature-scaled).
        top_k: ``[B]`` int64, ``<= 0`` or ``>= V`` means disabled.
        top_p: ``[B]`` float32 in (0, 1]; 1 means disabled.

    Returns:
        ``[B, V]`` float32 with excluded entries at ``-inf``.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)              # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]                    # [1, V]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    remove = ranks >= k[:, None]                                                  # beyond top-k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                                     # mass of better tokens
    remove |= mass_before >= top_p[:, None]                                        # nucleus cut
    remove[:, 0] = False                                                           # always keep the best
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


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

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

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
            logits = apply_logits_processing(logits, params, history, pending_token_ids)   # [B, V]
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
            sub = logits[rows]                                                    # [S, V]
            temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
            sub = sub / temps[:, None]
            if any(params[i].top_k > 0 for i in rows) or any(params[i].top_p < 1 for i in rows):
                top_k = torch.tensor([params[i].top_k for i in rows], device=logits.device, dtype=torch.long)
                top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device,
                                     dtype=torch.float32)
                sub = apply_top_k_top_p(sub, top_k, top_p)
            probs = torch.softmax(sub, dim=-1)                                    # [S, V]
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
    stream's work) when one is given, else on the current stream; :meth:`result` waits for
    them.

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

    def result(self) -> SampleResult:
        """Wait for this step's sampling (only its own work, not later launches) and return
        the ids and logprob records."""
        if self._event is not None:
            self._event.synchronize()
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
