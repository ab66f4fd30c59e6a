"""Shaping a row's next-token distribution: every transform between the model's logits and
the draw lives here, for the sampler and for speculative verification and drafting alike.

In the order they apply (vLLM's order):

1. :func:`apply_logits_processing`: ``logit_bias`` (OpenAI: added to the raw logits), the
   repetition penalty (Keskar et al. 2019, "CTRL", as in HF ``RepetitionPenaltyLogitsProcessor``
   and vLLM: over prompt and output tokens, positive logits divided, negative multiplied), then
   OpenAI's frequency and presence penalties over output tokens
   (``logit -= frequency * count + presence * (count > 0)``). Token counts are rebuilt every
   step from the sequence's tokens (:class:`TokenHistory`), so they are right after preemption
   and recompute; a token still on the device (asynchronous scheduling) is added from the
   previous step's id tensor, with no host synchronisation.
2. :func:`apply_token_bitmask`: grammar-constrained rows (structured output) come with a token
   bitmask (:class:`TokenBitmask`, filled on the host by the engine's grammar matchers); every
   token the grammar does not allow gets logit ``-inf`` in those rows only, so temperature,
   top-k/top-p, the draw and the logprobs all see the constrained distribution (vLLM and SGLang
   apply xgrammar's bitmasks at the same point). A batch without constrained rows pays nothing.
3. :func:`sampling_probs`: temperature, then top-k and top-p (:func:`apply_top_k_top_p`;
   top-p follows Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration": keep the
   smallest set of most-likely tokens whose mass reaches ``top_p``, the token that crosses the
   threshold kept), then softmax: the distribution a sampled row draws from. The sampler draws
   from it, and speculative decoding applies the very same function to the target's and the
   draft's logits, so verified tokens follow what a target-only sampler would draw.

The per-row numbers (temperature, top-k, top-p, the three penalties) come from persistent
per-request arrays (:class:`SamplingRows`): a request's values are written into its slot once,
and a batch's device tensors (:class:`RowParams`) are gathered only when the batch's rows
change (a decode batch that stays the same reuses them), as vLLM's input batch does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..core.sampling_params import SamplingParams

__all__ = [
    "RowParams",
    "SamplingRows",
    "TokenBitmask",
    "TokenHistory",
    "apply_logits_processing",
    "apply_token_bitmask",
    "apply_top_k_top_p",
    "sampling_probs",
]


@dataclass(slots=True, frozen=True)
class RowParams:
    """One batch's per-row sampling numbers on the logits' device (read-only, may be reused by
    later steps with the same rows).

    Attributes:
        temperature: ``[B]`` float32 (> 0 for sampled rows; greedy rows hold 0 and are never
            divided by it).
        top_k: ``[B]`` int64, ``<= 0`` disabled.
        top_p: ``[B]`` float32 in (0, 1], 1 disabled.
        repetition: ``[B]`` float32 repetition penalty (1: none).
        frequency: ``[B]`` float32 frequency penalty (0: none).
        presence: ``[B]`` float32 presence penalty (0: none).
        top_k_top_p: some row restricts top-k or top-p (decided on the host).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    top_k_top_p: bool

    def repeat_interleave(self, n: int) -> "RowParams":
        """Each row repeated ``n`` times in place (``[B] -> [B * n]``): the ``k + 1`` verified
        positions of a speculated sequence share its parameters."""
        return RowParams(*(t.repeat_interleave(n) for t in (self.temperature, self.top_k, self.top_p,
                                                            self.repetition, self.frequency, self.presence)),
                         self.top_k_top_p)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str) -> "RowParams":
        """Build a batch's tensors directly from its parameters (one-off callers; a step loop
        uses :meth:`SamplingRows.view`, which reuses them across steps)."""
        return _gather(np.asarray([_row(p) for p in params], dtype=np.float32).reshape(-1, _NUM_F),
                       np.asarray([p.top_k for p in params], dtype=np.int64), torch.device(device))


# float32 columns of a row: temperature, top_p, repetition, frequency, presence
_NUM_F = 5


def _row(p: SamplingParams) -> tuple[float, float, float, float, float]:
    return (p.temperature, p.top_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)


def _gather(f: np.ndarray, k: np.ndarray, device: torch.device) -> RowParams:
    """``f`` ``[B, 5]`` float32 and ``k`` ``[B]`` int64 host rows -> :class:`RowParams`."""
    ft = torch.from_numpy(np.ascontiguousarray(f.T)).to(device)                      # [5, B]
    kt = torch.from_numpy(np.ascontiguousarray(k)).to(device)                         # [B]
    restrict = bool((k > 0).any()) or bool((f[:, 1] < 1).any())
    return RowParams(ft[0], kt, ft[1], ft[2], ft[3], ft[4], restrict)


class SamplingRows:
    """Per-request sampling numbers in persistent per-slot host arrays, and per-batch device
    views rebuilt only when a batch's rows change.

    A request gets a slot the first time a batch holds it (its parameters are written once);
    :meth:`release` frees the slot when it finishes. :meth:`view` returns the device tensors
    of a batch: when the same request ids with the same parameters come again under the same
    ``key`` (a decode batch that did not change), the previous tensors are returned without any
    host or device work beyond comparing the two lists.

    Args:
        device: where the views live (the logits' device).
    """

    def __init__(self, device: torch.device | str, capacity: int = 64) -> None:
        self.device = torch.device(device)
        self._slots: dict[str, int] = {}
        self._owner: list[SamplingParams | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._f = np.zeros((capacity, _NUM_F), dtype=np.float32)
        self._k = np.zeros(capacity, dtype=np.int64)
        self._views: dict[str, tuple[list[str], list[SamplingParams], RowParams]] = {}
        #: batches whose device tensors were (re)built, for tests and profiles
        self.num_rebuilds = 0

    def __len__(self) -> int:
        """Requests holding a slot."""
        return len(self._slots)

    def release(self, request_id: str) -> None:
        """Free a finished request's slot (unknown ids are ignored)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._owner[slot] = None
            self._free.append(slot)

    def _slot(self, request_id: str, params: SamplingParams) -> int:
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._slots[request_id] = self._free.pop()
        if self._owner[slot] is not params:
            self._owner[slot] = params
            self._f[slot] = _row(params)
            self._k[slot] = params.top_k
        return slot

    def _grow(self) -> None:
        n = len(self._owner)
        self._owner.extend([None] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))
        self._f = np.concatenate([self._f, np.zeros_like(self._f)])
        self._k = np.concatenate([self._k, np.zeros_like(self._k)])

    def view(self, request_ids: list[str], params: list[SamplingParams], key: str = "rows") -> RowParams:
        """The device tensors of the batch ``request_ids`` (row ``i`` has ``params[i]``).

        Args:
            request_ids: one id per row.
            params: one :class:`SamplingParams` per row.
            key: which of the caller's batches this is (the sampler keeps its sampled rows and
                its penalised rows apart); each key remembers its last batch.

        Returns:
            :class:`RowParams` with ``B = len(request_ids)`` rows.
        """
        hit = self._views.get(key)
        if hit is not None and hit[0] == request_ids and hit[1] == params:
            return hit[2]
        idx = np.fromiter((self._slot(r, p) for r, p in zip(request_ids, params)), dtype=np.int64,
                          count=len(request_ids))
        rows = _gather(self._f[idx], self._k[idx], self.device)
        self._views[key] = (list(request_ids), list(params), rows)
        self.num_rebuilds += 1
        return rows


def sampling_probs(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """The distribution each row draws from: ``softmax(top_k_top_p(logits / temperature))``.

    The sampler's sampled rows and both sides of speculative verification (the target's
    verified rows and the draft's proposals) go through this one function.

    Args:
        logits: ``[R, V]`` float (already processed: :func:`apply_logits_processing`, grammar
            masks); rows are never greedy (temperature > 0).
        rows: the rows' :class:`RowParams` (``R`` rows).

    Returns:
        ``[R, V]`` float32 probabilities (rows sum to 1; excluded tokens are exactly 0).
    """
    sub = logits.float() / rows.temperature[:, None]                                  # [R, V]
    if rows.top_k_top_p:
        sub = apply_top_k_top_p(sub, rows.top_k, rows.top_p)
    return torch.softmax(sub, dim=-1)                                                 # [R, V]


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
                            pending_token_ids: torch.Tensor | None = None,
                            sampling_rows: SamplingRows | None = None,
                            request_ids: list[str] | None = None) -> torch.Tensor:
    """Logit bias, repetition, frequency and presence penalties (module docstring), batched.

    Args:
        logits: ``[B, V]`` float32 raw model logits (not modified).
        params: per row; rows with neither penalties nor bias are left as they are.
        history: per row the sequence's tokens (needed by rows with penalties).
        pending_token_ids: ``[S]`` int64, the previous step's sampled ids on the device, read
            at ``history[i].pending_row``.
        sampling_rows, request_ids: the caller's persistent :class:`SamplingRows` and the rows' request
            ids, where the penalties are read from (default: built from ``params`` now).

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
        pen_params = [params[i] for i in pen]
        if sampling_rows is not None and request_ids is not None:
            pr = sampling_rows.view([request_ids[i] for i in pen], pen_params, key="penalties")
        else:
            pr = RowParams.from_params(pen_params, dev)
        pen_t = torch.tensor(pen, dtype=torch.long).to(dev, non_blocking=True)
        sub = out[pen_t]                                                              # [P, V]
        if with_prompt:
            rep = pr.repetition[:, None]                                               # [P, 1]
            seen = prompt_mask | (counts > 0)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq, pres = pr.frequency[:, None], pr.presence[:, None]                      # [P, 1]
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


