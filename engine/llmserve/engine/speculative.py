"""Speculative decoding: a proposer drafts tokens, the target verifies them in the normal step.

Algorithm (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv:2211.17192; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", arXiv:2302.01318). For a decoding sequence whose newest token ``x`` is not
yet in the target's KV cache:

1. a proposer ``q`` proposes ``k`` tokens ``d_1..d_k`` (:class:`DraftModelProposer`: ``k`` cheap
   autoregressive passes of a small model over its own paged KV cache, batched over sequences);
2. the target ``p`` computes ``[x, d_1, .., d_k]`` in **one** pass (query length ``k + 1`` over
   its paged cache: ``num_computed_tokens`` catches up with ``num_tokens`` after the drafts are
   appended tentatively), giving ``p_1..p_{k+1}``;
3. the rejection sampler (:class:`Verification`): greedy requests accept the longest prefix
   with ``d_i == argmax p_i`` and append ``argmax p_{n+1}`` (the correction, or a bonus token
   when all ``k`` were accepted), so the output is token-identical to target-only greedy
   decoding; sampled requests accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``,
   on the first rejection resample from ``normalize(max(0, p_i - q_i))``, and draw the bonus
   from ``p_{k+1}`` when all are accepted, so every emitted token follows the target
   distribution exactly (Leviathan et al., Theorem 1; Chen et al., Theorem 1). Temperature,
   top-k and top-p shape ``p`` and ``q`` through the sampler's own function
   (:func:`llmserve.worker.shaping.sampling_probs`), so "the target distribution" is the one a
   target-only :class:`~llmserve.worker.sampler.Sampler` would draw from. A proposer without a
   distribution (an n-gram or prompt-lookup proposer) leaves ``q`` empty: a point mass on its
   draft, accepted with probability ``p_i(d_i)``.
4. rejected tokens are rolled back: the scheduler's update appends the verified run up to its
   first stop, then sets ``num_computed_tokens`` to the accepted length and releases the blocks
   past it (:meth:`BlockManager.trim`); the proposer rolls its own state back. Slots of
   rejected tokens inside a kept block are overwritten later; attention never reads past
   ``context_lens``.

Engine integration: there is one step, :meth:`LLMEngine.step
<llmserve.engine.llm_engine.LLMEngine.step>`. With a :class:`Speculator` attached (what
:class:`SpeculativeEngine` builds), the scheduler plans the step as usual (prefill chunks and
1-token decodes); the speculator then gives decode-phase sequences up to ``k`` extra query
tokens (limited by the step's leftover token budget, free blocks, ``max_tokens``,
``max_model_len`` and the proposer's own limits; when nothing is left they decode normally),
while the proposer mirrors prefill chunks into its own state. One target pass serves the whole
mixed batch; plain rows go through the sampler, verified rows through the rejection sampler,
and both through the scheduler's one update (:meth:`Scheduler.update
<llmserve.core.scheduler.Scheduler.update>`). The draft model keeps its own :class:`KVCache` and
:class:`BlockManager` (same block size, by default as many blocks as the target) and a
per-request ``_DraftState`` that may lag the target; it catches up in its next pass (after a
fully accepted run it is two tokens behind: ``d_k`` and the bonus token). Speculative steps
read their tokens in the same step (no asynchronous scheduling).

Per request: ``SamplingParams.num_speculative_tokens`` overrides the engine's ``k`` (0 turns
speculation off for it). Sampled requests draw every random number (draft samples, acceptance
uniforms, the final token) from their own seeded generator, in a fixed order, so a seeded request
is reproducible. ``max_tokens``, EOS and stop tokens reached inside an accepted run stop the
request exactly there: the rest of the run is dropped.

Structured output (grammar-constrained requests) goes through the grammar on both sides:
draft ``j`` is drawn from the draft's logits masked by the request's matcher after drafts
``1..j-1`` (the matcher accepts each draft tentatively; ``q`` is that masked distribution), the
mask after all ``k`` drafts is kept too, and the matcher is rolled back. The same ``k + 1``
masks are applied to the target's verified rows before verification, so every emitted token is
allowed and the output follows constrained target-only decoding exactly (greedy: the same
tokens); the emitted tokens then advance the matcher for real. A grammar that ends inside an
accepted run (its stop token) stops the request there.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import EngineConfig, ModelConfig
from ..core.block_manager import BlockManager
from ..core.outputs import DraftVerdict, SampledTokens
from ..core.scheduler import ScheduledSequence, SchedulerOutput
from ..core.sequence import Sequence
from ..worker.input_builder import StepItem
from ..worker.kv_cache import DEFAULT_CPU_CACHE_BYTES, KVCache
from ..worker.model_runner import ModelRunner
from ..worker.shaping import SamplingRows, TokenBitmask, apply_token_bitmask, sampling_probs
from .llm_engine import LLMEngine
from .builder import build_draft_parts

__all__ = [
    "DRAFT_IS_TARGET",
    "MAX_SPECULATIVE_TOKENS",
    "DraftModelProposer",
    "Proposer",
    "SpeculativeEngine",
    "SpeculativeStats",
    "Speculator",
    "Verification",
    "greedy_verify",
    "rejection_sample",
]

MAX_SPECULATIVE_TOKENS = 32
DRAFT_IS_TARGET = "target"   # draft_model value: reuse the target's weights (own KV cache)


# ---------------------------------------------------------------------------------------------
# The verification rules (pure tensor functions, tested directly)
# ---------------------------------------------------------------------------------------------
def greedy_verify(target_argmax: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest prefix of drafts equal to the target's argmax.

    Args:
        target_argmax: ``[S, K+1]`` int64, ``argmax p_i`` at the ``K + 1`` verified positions.
        draft_tokens: ``[S, K]`` int64 proposals (entries past ``num_drafts`` are ignored).
        num_drafts: ``[S]`` int64, drafts actually proposed per row (``0..K``).

    Returns:
        ``(num_accepted [S], next_token [S])``: accepted drafts and the target's token after
        them (the correction at the first mismatch, or the bonus token when all matched).
    """
    s, k = draft_tokens.shape
    rows = torch.arange(s, device=draft_tokens.device)
    valid = torch.arange(k, device=draft_tokens.device)[None, :] < num_drafts[:, None]   # [S, K]
    match = (target_argmax[:, :k] == draft_tokens) & valid                               # [S, K]
    n = match.long().cumprod(dim=1).sum(dim=1)                                           # [S]
    return n, target_argmax[rows, n]


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     uniforms: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's accept/resample rule (Leviathan et al. 2023, Algorithm 1;
    Chen et al. 2023, Algorithm 2), vectorised over rows.

    Draft ``i`` (1-based) is accepted iff ``u_i * q_i(d_i) < p_i(d_i)``, i.e. with probability
    ``min(1, p_i(d_i) / q_i(d_i))``; acceptance stops at the first rejection ``n + 1``. The next
    token is drawn from ``max(0, p_{n+1} - q_{n+1})`` (normalisation is implicit) after a
    rejection, or from ``p_{n+1}`` when every proposed draft was accepted (the bonus token); if
    the residual is all zero (``p == q``, where rejection has probability 0 but rounding may
    still reject) ``p_{n+1}`` is used. Draws use the exponential race ``argmax(w / E)`` with
    ``E ~ Exp(1)``, which picks ``i`` with probability ``w_i / sum(w)``.

    Args:
        target_probs: ``[S, K+1, V]`` float32, ``p_1..p_{K+1}`` (rows past ``num_drafts + 1``
            are ignored).
        draft_probs: ``[S, K, V]`` float32, ``q_1..q_K`` the drafts were sampled from.
        draft_tokens: ``[S, K]`` int64 proposals.
        num_drafts: ``[S]`` int64 in ``0..K``.
        uniforms: ``[S, K]`` float32 in ``[0, 1)``.
        noise: ``[S, V]`` float32 ``Exp(1)`` draws for the final token.

    Returns:
        ``(num_accepted [S] int64, next_token [S] int64)``.
    """
    s, k = draft_tokens.shape
    dev = target_probs.device
    rows = torch.arange(s, device=dev)
    if k == 0:
        return torch.zeros(s, dtype=torch.long, device=dev), (target_probs[:, 0] / noise).argmax(-1)
    valid = torch.arange(k, device=dev)[None, :] < num_drafts[:, None]                   # [S, K]
    p_d = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)            # [S, K]
    q_d = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)                    # [S, K]
    accept = (uniforms * q_d < p_d) & valid                                              # [S, K]
    n = accept.long().cumprod(dim=1).sum(dim=1)                                          # [S]
    p_next = target_probs[rows, n]                                                       # [S, V]
    q_next = draft_probs[rows, n.clamp(max=k - 1)]                                       # [S, V]
    residual = (p_next - q_next).clamp_min(0.0)                                          # [S, V]
    use_residual = (n < num_drafts) & (residual.sum(-1) > 0)                             # [S]
    dist = torch.where(use_residual[:, None], residual, p_next)                          # [S, V]
    return n, (dist / noise).argmax(-1)


# ---------------------------------------------------------------------------------------------
# Bookkeeping
# ---------------------------------------------------------------------------------------------
class _DraftState:
    """The draft model's view of one request: its own block table and progress (duck-typed
    for :class:`BlockManager`, which reads ``request_id``, ``num_computed_tokens``, ``block_ids``)."""

    __slots__ = ("block_ids", "num_computed_tokens", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []


class _SeqView:
    """What the input builder reads from a sequence (``request_id``, ``block_ids``,
    ``num_pending``, ``token_ids_slice``), over a token list with tentative draft tokens
    appended and a block table of either model's cache."""

    __slots__ = ("all_token_ids", "block_ids", "request_id")

    def __init__(self, request_id: str, all_token_ids: list[int], block_ids: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = all_token_ids
        self.block_ids = block_ids

    @property
    def num_pending(self) -> int:   # every token id is on the host (no asynchronous scheduling)
        return 0

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


def _view_item(request_id: str, start: int, tokens: list[int], block_ids: list[int],
               num_new_tokens: int) -> StepItem:
    """A pass over ``tokens`` computing ``num_new_tokens`` of them from position ``start``."""
    return StepItem(_SeqView(request_id, tokens, block_ids), start, num_new_tokens, len(tokens))


@dataclass(slots=True)
class _Spec:
    """A sequence speculated this step: ``T`` tokens before it, ``k`` drafts."""

    index: int                      # position in SchedulerOutput.scheduled
    seq: Sequence
    ds: Any                         # the proposer's state of the request (a draft model's: _DraftState)
    k: int
    T: int
    greedy: bool
    gen: torch.Generator | None
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)   # sampled only: [V] per draft (empty: point masses)
    n_acc: int = 0                                          # drafts accepted by the target
    masks: torch.Tensor | None = None   # constrained only: [k + 1, W] int32 bitmasks, row i after i drafts
    grammar_steps: int = 0              # drafts the matcher accepted tentatively
    grammar_done: bool = False          # the matcher terminated (or refused a draft)


@dataclass(slots=True)
class SpeculativeStats:
    """Counters since construction (or :meth:`SpeculativeEngine.reset_speculative_stats`).

    Attributes:
        num_verifications: (sequence, target pass) pairs that verified >= 1 draft.
        num_proposed_tokens: draft tokens proposed (and verified).
        num_accepted_tokens: draft tokens accepted (before stop truncation).
        num_emitted_tokens: tokens appended by verifications (after stop truncation).
        num_truncated_tokens: accepted/bonus tokens dropped because a stop condition came first.
        num_output_tokens: every output token appended (speculative or not).
        num_target_seq_passes: (sequence, target pass) pairs that appended >= 1 token.
        num_target_steps: target forward passes (engine steps with work).
        num_draft_passes: draft forward passes.
        num_draft_tokens: tokens the draft computed (prefill mirrors, catch-up, drafts).
    """

    num_verifications: int = 0
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_truncated_tokens: int = 0
    num_output_tokens: int = 0
    num_target_seq_passes: int = 0
    num_target_steps: int = 0
    num_draft_passes: int = 0
    num_draft_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The counters plus derived ratios (``acceptance_rate``, ``mean_accepted_length``, ...;
        None when their denominator is 0) and a ``definitions`` string."""
        d: dict[str, Any] = dataclasses.asdict(self)
        prop, acc, ver = self.num_proposed_tokens, self.num_accepted_tokens, self.num_verifications
        out = self.num_output_tokens
        d["acceptance_rate"] = acc / prop if prop else None
        d["mean_accepted_length"] = acc / ver if ver else None
        d["mean_tokens_per_verification"] = (acc + ver) / ver if ver else None
        d["target_passes_per_output_token"] = self.num_target_seq_passes / out if out else None
        d["target_steps_per_output_token"] = self.num_target_steps / out if out else None
        d["definitions"] = (
            "acceptance_rate = accepted / proposed draft tokens; mean_accepted_length = accepted "
            "drafts per verification (0..k); mean_tokens_per_verification = that + 1 (correction "
            "or bonus token); target_passes_per_output_token = (sequence, target pass) pairs that "
            "produced tokens / output tokens (1.0 without speculation); "
            "target_steps_per_output_token = engine steps / output tokens (batch-dependent)")
        return d


# ---------------------------------------------------------------------------------------------
# Proposers
# ---------------------------------------------------------------------------------------------
class Proposer:
    """What the :class:`Speculator` asks of a proposer of draft tokens.

    Per request the proposer keeps a state object (:meth:`state`; its ``num_computed_tokens``
    is how far it has seen the sequence). Each step the speculator asks how many drafts it can
    offer a decoding sequence (:meth:`max_drafts`, :meth:`can_reserve`), reserves them
    (:meth:`reserve`), tells it about the other scheduled sequences (:meth:`mirror`), then calls
    :meth:`propose` once for the whole batch. After the update it rolls back what was rejected
    (:meth:`rollback`) and forgets finished or preempted requests (:meth:`release`).

    A draft model implements all of them (:class:`DraftModelProposer`); an n-gram or
    prompt-lookup proposer would keep no cache: ``mirror`` returns None, ``can_reserve`` is
    always True, and ``propose`` fills ``spec.drafts`` from the sequence's own tokens, leaving
    ``spec.q`` empty (a point mass, which the rejection sampler accepts with probability
    ``p(d)``).
    """

    def state(self, request_id: str) -> Any:
        """The request's state (created on first use)."""
        raise NotImplementedError

    def max_drafts(self, num_tokens: int) -> int:
        """The most drafts it can propose for a sequence of ``num_tokens`` tokens."""
        raise NotImplementedError

    def can_reserve(self, state: Any, num_tokens: int, k: int) -> bool:
        """Whether ``k`` drafts fit its own resources."""
        return True

    def reserve(self, state: Any, num_tokens: int, k: int) -> None:
        """Reserve what ``k`` drafts need (called once the target's slots are reserved)."""

    def mirror(self, state: Any, seq: Sequence, item: ScheduledSequence) -> Any | None:
        """A scheduled sequence that does not speculate this step (a prefill chunk, a first
        token): what :meth:`propose` must do for it (``mirrors`` entry), or None."""
        return None

    def propose(self, specs: list["_Spec"], mirrors: list) -> None:
        """Fill every spec's ``drafts`` (``spec.k`` ids) and, for sampled rows with a draft
        distribution, ``q`` (one ``[V]`` float32 probability row per draft)."""
        raise NotImplementedError

    def rollback(self, spec: "_Spec") -> None:
        """After the update: forget what it computed past the verified tokens."""

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted request."""

    def reset_stats(self) -> None:
        """Zero its own counters."""


class DraftModelProposer(Proposer):
    """Drafts from a small model with its own paged KV cache (module docstring).

    Args:
        model: the draft model (``Qwen2ForCausalLM``).
        config: its :class:`ModelConfig`.
        runner: a :class:`ModelRunner` over the draft's own KV cache.
        block_manager: the draft cache's blocks.
        target_vocab: the target's vocabulary size (draft logits are cut or padded with
            ``-inf`` to it).
        structured: the engine's grammar matchers (structured output), or None.
        stats: the speculative counters (draft passes and tokens are counted here).
    """

    def __init__(self, model: torch.nn.Module, config: ModelConfig, runner: ModelRunner,
                 block_manager: BlockManager, target_vocab: int, structured, stats: "SpeculativeStats") -> None:
        self.model = model
        self.config = config
        self.runner = runner
        self.block_manager = block_manager
        self.structured = structured
        self.stats = stats
        self._vocab = target_vocab
        self._max_pos = config.max_position_embeddings
        self._states: dict[str, _DraftState] = {}
        self._rows = SamplingRows(runner.device)

    # ---- per-request state -------------------------------------------------------------------
    def state(self, request_id: str) -> _DraftState:
        """The request's :class:`_DraftState` (its draft block table and progress)."""
        ds = self._states.get(request_id)
        if ds is None:
            ds = self._states[request_id] = _DraftState(request_id)
        return ds

    def max_drafts(self, num_tokens: int) -> int:
        """Drafts that stay inside the draft model's positions (``max_position_embeddings``)."""
        return self._max_pos - num_tokens + 1

    def can_reserve(self, state: _DraftState, num_tokens: int, k: int) -> bool:
        """Whether the draft cache has the blocks for the first ``num_tokens + k - 1`` tokens
        (through draft ``k - 1``; the draft never computes its last draft)."""
        dbm = self.block_manager
        return dbm.blocks_needed(num_tokens + k - 1) - len(state.block_ids) <= dbm.num_free_blocks

    def reserve(self, state: _DraftState, num_tokens: int, k: int) -> None:
        """Append the draft cache's slots up to the first ``num_tokens + k - 1`` tokens (its
        catch-up and drafts ``1..k-1``)."""
        self.block_manager.append_slots(state, num_tokens + k - 1 - state.num_computed_tokens)

    def mirror(self, state: _DraftState, seq: Sequence, item: ScheduledSequence):
        """Prefill chunks are computed by the draft too (in its first pass), so its cache
        holds the prompt when the sequence starts decoding."""
        end = seq.num_computed_tokens + item.num_new_tokens
        n = end - state.num_computed_tokens
        if n > 0 and end <= self._max_pos and self.block_manager.can_append(state, n):
            self.block_manager.append_slots(state, n)
            return (state, seq, n)
        return None

    def rollback(self, spec: "_Spec") -> None:
        """The draft's computed length drops to the target's verified one (at most), and its
        blocks past it are released."""
        ds = spec.ds
        ds.num_computed_tokens = min(ds.num_computed_tokens, spec.seq.num_computed_tokens)
        self.block_manager.trim(ds, ds.num_computed_tokens)

    def release(self, request_id: str) -> None:
        """Free the request's draft blocks and sampling slot."""
        ds = self._states.pop(request_id, None)
        if ds is not None:
            self.block_manager.free(ds)
        self._rows.release(request_id)

    def reset_stats(self) -> None:
        """Zero the draft runner's step counts and the draft cache's high-water mark."""
        self.runner.reset_stats()
        self.block_manager.reset_peak()

    def _align_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[R, Vd]`` -> ``[R, V]`` (target vocab): cut, or pad with ``-inf``."""
        vd = logits.shape[-1]
        if vd == self._vocab:
            return logits
        if vd > self._vocab:
            return logits[:, :self._vocab]
        pad = logits.new_full((logits.shape[0], self._vocab - vd), float("-inf"))
        return torch.cat([logits, pad], dim=-1)                                     # [R, V]

    # ---- draft passes ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, specs: list["_Spec"], mirrors: list) -> None:
        """Run the draft's passes: pass 1 mirrors prefill chunks and catches every speculated
        sequence up to its newest token (usually 1-2 tokens); pass ``j`` proposes draft ``j``
        (1 token a sequence: a CUDA-graph replay when available)."""
        if not specs and not mirrors:
            return
        kmax = max((s.k for s in specs), default=0)
        st = self.stats
        for j in range(1, max(kmax, 1) + 1):
            items: list[StepItem] = []
            owners: list[_Spec | None] = []
            if j == 1:
                for ds, seq, n in mirrors:
                    items.append(_view_item(seq.request_id, ds.num_computed_tokens, seq.all_token_ids,
                                            ds.block_ids, n))
                    owners.append(None)
            for s in specs:
                if s.k < j:
                    continue
                c = s.ds.num_computed_tokens
                tokens = s.seq.all_token_ids + s.drafts
                items.append(_view_item(s.seq.request_id, c, tokens, s.ds.block_ids,
                                        len(tokens) - c))            # 1 token after the first pass
                owners.append(s)
            if not items:
                break
            # Logits come back for every item that catches up: all spec items (their view ends
            # at the newest token) and mirrors that finish a prompt (ignored).
            res = self.runner.execute(items)
            logits, idx = res.logits, res.sample_indices                                # [R, Vd]
            st.num_draft_passes += 1
            st.num_draft_tokens += sum(it.num_new_tokens for it in items)
            if j == 1:
                for ds, _seq, n in mirrors:
                    ds.num_computed_tokens += n
            for it, s in zip(items, owners):
                if s is not None:
                    s.ds.num_computed_tokens += it.num_new_tokens
            rows = [r for r, i in enumerate(idx) if owners[i] is not None]
            active = [owners[idx[r]] for r in rows]
            if active:
                dl = self._align_vocab(logits[rows])                                     # [A, V]
                self._mask_drafts(dl, active, j)
                self._sample_drafts(dl, active)
                self._advance_grammar(active)
        self._finish_draft_masks(specs)

    def _mask_drafts(self, logits: torch.Tensor, active: list["_Spec"], j: int) -> None:
        """Mask the draft logits ``[A, V]`` of constrained specs by their grammar after drafts
        ``1..j-1`` (kept as row ``j - 1`` of their verification masks)."""
        rows = [r for r, s in enumerate(active) if s.masks is not None and not s.grammar_done]
        if not rows:
            return
        for r in rows:
            self.structured.fill_bitmask([active[r].seq.request_id], out=active[r].masks, start=j - 1)
        bitmask = torch.stack([active[r].masks[j - 1] for r in rows])                   # [C, W]
        apply_token_bitmask(logits, TokenBitmask(rows, bitmask))

    def _advance_grammar(self, active: list["_Spec"]) -> None:
        """The matcher of each constrained spec accepts its newest draft (tentatively)."""
        for s in active:
            if s.masks is None or s.grammar_done:
                continue
            rid = s.seq.request_id
            if self.structured.accept_draft(rid, s.drafts[-1]):
                s.grammar_steps += 1
                s.grammar_done = self.structured.is_terminated(rid)
            else:
                s.grammar_done = True

    def _finish_draft_masks(self, specs: list["_Spec"]) -> None:
        """Fill the mask after the last draft, then roll every matcher back to its request's
        real output."""
        for s in specs:
            if s.masks is None:
                continue
            rid = s.seq.request_id
            if not s.grammar_done and s.grammar_steps == s.k:
                self.structured.fill_bitmask([rid], out=s.masks, start=s.k)
            self.structured.rollback(rid, s.grammar_steps)

    def _sample_drafts(self, logits: torch.Tensor, active: list["_Spec"]) -> None:
        """Draw each active spec's next draft from ``logits`` ``[A, V]``: greedy rows take the
        argmax, sampled rows draw from :func:`sampling_probs` with their own generator (the
        distribution is kept as ``q``)."""
        chosen = logits.argmax(dim=-1)                                                 # [A]
        sampled = [i for i, s in enumerate(active) if not s.greedy]
        if sampled:
            sps = [active[i].seq.sampling_params for i in sampled]
            rows = self._rows.view([active[i].seq.request_id for i in sampled], sps, key="draft")
            probs = sampling_probs(logits[sampled], rows)                              # [S, V]
            noise = torch.empty_like(probs)                                            # [S, V]
            for r, i in enumerate(sampled):
                noise[r].exponential_(generator=active[i].gen)
            chosen[sampled] = (probs / noise).argmax(dim=-1)
            for r, i in enumerate(sampled):
                active[i].q.append(probs[r])
        for s, t in zip(active, chosen.tolist()):
            s.drafts.append(int(t))


# ---------------------------------------------------------------------------------------------
# The rejection sampler inside the step
# ---------------------------------------------------------------------------------------------
class Verification:
    """One step's verification: which logits rows the target computes, the rejection sampler
    over the speculated rows, and their verdicts merged with the plainly sampled rows.

    Args:
        scheduled: the step's scheduled items.
        specs: the sequences that speculate this step (their drafts proposed).
        structured: the engine's grammar matchers, or None.
        rows: the speculator's persistent sampling rows (temperature, top-k, top-p).
        stats: the speculative counters.

    Attributes:
        items: the target pass's items (a speculated sequence computes ``[x, d_1..d_k]``).
        num_logits: logits rows per item (``1 + k`` for a speculated one).
        specs: as given.
    """

    def __init__(self, scheduled: list[ScheduledSequence], specs: list["_Spec"], structured,
                 rows: SamplingRows, stats: "SpeculativeStats") -> None:
        self.specs = specs
        self.structured = structured
        self._rows = rows
        self._stats = stats
        spec_of = {s.index: s for s in specs}
        self.items: list[Any] = []
        self.num_logits: list[int] = []
        self.offsets: list[int] = []     # first logits row of each spec (order of `specs`)
        self.normal: list[int] = []      # indices into `scheduled` that sample a single token
        self.normal_rows: list[int] = [] # their logits rows
        self.verdicts: list[DraftVerdict] = []
        nlog = 0
        for idx, item in enumerate(scheduled):
            s = spec_of.get(idx)
            if s is not None:
                seq = s.seq
                self.items.append(_view_item(seq.request_id, s.T - 1, seq.all_token_ids + s.drafts,
                                             seq.block_ids, 1 + s.k))
                self.num_logits.append(1 + s.k)
                self.offsets.append(nlog)
                nlog += 1 + s.k
            else:
                self.items.append(item)
                self.num_logits.append(1 if item.will_sample else 0)
                if item.will_sample:
                    self.normal_rows.append(nlog)
                    self.normal.append(idx)
                    nlog += 1

    def plain_rows(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The logits ``[N, V]`` of the rows that sample a single token and their indices into
        the scheduled list."""
        return logits[self.normal_rows], self.normal

    @torch.inference_mode()
    def run(self, logits: torch.Tensor) -> None:
        """Mask the verified rows of constrained requests, verify every spec (greedy: longest
        matching prefix; sampled: :func:`rejection_sample`) and build its verdict: the
        accepted drafts plus the next token, their logprob records (from the masked target
        logits) and the computed length to keep. ``logits``: ``[R, V]`` of the target pass."""
        self._mask(logits)
        st = self._stats
        for s, off, (n_acc, toks) in zip(self.specs, self.offsets, self._verify(logits)):
            st.num_verifications += 1
            st.num_proposed_tokens += s.k
            st.num_accepted_tokens += n_acc
            lps: list[dict | None] = [None] * len(toks)
            if s.seq.sampling_params.logprobs is not None:
                lps = _logprob_records(logits[off:off + len(toks)], toks, s.seq.sampling_params.logprobs)
            s.n_acc = n_acc
            self.verdicts.append(DraftVerdict(toks, lps, s.T + n_acc))
            s.seq.num_pending += 1

    def merge(self, plain: SampledTokens) -> SampledTokens:
        """The plain rows' tokens and the verdicts as one :class:`SampledTokens` in scheduled
        order (what :meth:`Scheduler.update` reads)."""
        seqs: list[Sequence] = []
        tokens: list[int] = []
        logprobs: list[dict | None] = []
        drafts: dict[int, DraftVerdict] = {}
        rows = sorted([(i, j, None) for j, i in enumerate(self.normal)]
                      + [(s.index, j, s) for j, s in enumerate(self.specs)], key=lambda r: r[0])
        for _, j, s in rows:
            if s is None:
                seqs.append(plain.seqs[j])
                tokens.append(plain.token_ids[j])
                logprobs.append(plain.logprobs[j])
            else:
                drafts[len(seqs)] = self.verdicts[j]
                seqs.append(s.seq)
                tokens.append(self.verdicts[j].token_ids[0])
                logprobs.append(None)
        return SampledTokens(seqs, tokens, logprobs, drafts)

    def _mask(self, logits: torch.Tensor) -> None:
        """Apply the masks built while drafting to every verified row of a constrained spec."""
        spec = [(o, s) for o, s in zip(self.offsets, self.specs) if s.masks is not None]
        if not spec:
            return
        rows: list[int] = []
        for o, s in spec:
            rows.extend(range(o, o + s.k + 1))
        masks = [s.masks for _, s in spec]
        apply_token_bitmask(logits, TokenBitmask(rows, torch.cat(masks) if len(masks) > 1 else masks[0]))

    def _verify(self, logits: torch.Tensor) -> list[tuple[int, list[int]]]:
        """Accepted count and emitted tokens (accepted drafts + next token) per spec."""
        specs, offsets = self.specs, self.offsets
        results: list[tuple[int, list[int]] | None] = [None] * len(specs)
        dev = logits.device
        greedy = [i for i, s in enumerate(specs) if s.greedy]
        sampled = [i for i, s in enumerate(specs) if not s.greedy]
        if greedy:
            am = logits.argmax(dim=-1).tolist()                                        # [R]
            for i in greedy:
                s, o = specs[i], offsets[i]
                n = 0
                while n < s.k and am[o + n] == s.drafts[n]:
                    n += 1
                results[i] = (n, s.drafts[:n] + [am[o + n]])
        if sampled:
            kmax = max(specs[i].k for i in sampled)
            sub = [specs[i] for i in sampled]
            # Row index of p_j for each sampled spec (padding repeats its last row).
            idx = torch.tensor([[offsets[i] + min(j, specs[i].k) for j in range(kmax + 1)] for i in sampled],
                               dtype=torch.long, device=dev)                           # [S, K+1]
            rows = self._rows.view([s.seq.request_id for s in sub], [s.seq.sampling_params for s in sub],
                                   key="verify").repeat_interleave(kmax + 1)
            p = sampling_probs(logits[idx.view(-1)], rows).view(len(sub), kmax + 1, -1)  # [S, K+1, V]
            q = torch.zeros(len(sub), kmax, p.shape[-1], device=dev)                   # [S, K, V]
            toks = torch.zeros(len(sub), kmax, dtype=torch.long)                       # [S, K]
            unif = torch.ones(len(sub), kmax, device=dev)                              # [S, K]
            noise = torch.empty(len(sub), p.shape[-1], device=dev)                     # [S, V]
            for r, s in enumerate(sub):
                d = torch.tensor(s.drafts, dtype=torch.long)
                if s.q:
                    q[r, :s.k] = torch.stack(s.q)
                else:                          # a proposer without a distribution: point masses
                    q[r, torch.arange(s.k), d.to(dev)] = 1.0
                toks[r, :s.k] = d
                unif[r, :s.k] = torch.rand(s.k, generator=s.gen, device=dev)
                noise[r].exponential_(generator=s.gen)
            nd = torch.tensor([s.k for s in sub], dtype=torch.long, device=dev)
            n, nxt = rejection_sample(p, q, toks.to(dev), nd, unif, noise)
            for r, (nn, t) in enumerate(zip(n.tolist(), nxt.tolist())):
                s = sub[r]
                results[sampled[r]] = (nn, s.drafts[:nn] + [t])
        return results  # type: ignore[return-value]


def _logprob_records(logits: torch.Tensor, tokens: list[int], k: int) -> list[dict]:
    """Sampler-style logprob records (raw target logits) for tokens emitted at consecutive rows."""
    lp = torch.log_softmax(logits.float(), dim=-1)                                  # [n, V]
    tok_lp = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
    recs = []
    if k > 0:
        vals, ids = lp.topk(k, dim=-1)
        for j in range(len(tokens)):
            recs.append({"token_logprob": tok_lp[j], "top": list(zip(ids[j].tolist(), vals[j].tolist()))})
    else:
        recs = [{"token_logprob": v, "top": []} for v in tok_lp]
    return recs


class Speculator:
    """Speculative decoding inside :meth:`LLMEngine.step
    <llmserve.engine.llm_engine.LLMEngine.step>`: picks the decodes that speculate and their
    ``k``, reserves the target's extra slots, and builds the step's :class:`Verification`.

    Args:
        proposer: where drafts come from (:class:`Proposer`).
        num_speculative_tokens: default drafts per step ``k`` (a request's
            ``num_speculative_tokens`` overrides it).
        block_manager: the target's blocks.
        max_num_batched_tokens: the step's token budget (drafts use what the plan left).
        max_model_len: the context limit.
        sampler: the engine's sampler (per-request generators).
        structured: the engine's grammar matchers, or None.
        stats: the speculative counters.
    """

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, block_manager: BlockManager,
                 max_num_batched_tokens: int, max_model_len: int, sampler, structured,
                 stats: "SpeculativeStats") -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.sampler = sampler
        self.structured = structured
        self.stats = stats
        self._rows = SamplingRows(sampler.device)

    def _k_for(self, seq: Sequence) -> int:
        k = seq.sampling_params.num_speculative_tokens
        if seq.sampling_params.needs_logits_processing:
            return 0   # penalties / logit_bias: the plain sampler path (drafts would verify unprocessed)
        return self.num_speculative_tokens if k is None else min(k, MAX_SPECULATIVE_TOKENS)

    def plan(self, plan: SchedulerOutput) -> tuple[list["_Spec"], list]:
        """Pick the decode sequences to speculate (and their ``k``), reserve the extra target
        slots and the proposer's; collect what the proposer mirrors of the other sequences.
        Preempted sequences' proposer state is dropped first."""
        for seq in plan.preempted:
            self.proposer.release(seq.request_id)
        self.stats.num_target_steps += 1
        scheduled = plan.scheduled
        bm, prop = self.block_manager, self.proposer
        budget = self.max_num_batched_tokens - sum(i.num_new_tokens for i in scheduled)
        specs: list[_Spec] = []
        mirrors: list = []
        for idx, item in enumerate(scheduled):
            seq = item.seq
            kreq = self._k_for(seq)
            if kreq <= 0 or seq.sampling_params.max_tokens < 3:
                continue   # (the first token comes from prefill; k <= max_tokens - 2 after it)
            state = prop.state(seq.request_id)
            T = seq.num_tokens
            decode = (item.num_new_tokens == 1 and seq.num_computed_tokens == T - 1
                      and seq.num_output_tokens >= 1)
            if not decode:
                m = prop.mirror(state, seq, item)
                if m is not None:
                    mirrors.append(m)
                continue
            sp = seq.sampling_params
            k = min(kreq, sp.max_tokens - seq.num_output_tokens - 1, self.max_model_len - T - 1,
                    prop.max_drafts(T), max(budget, 0))
            while k > 0 and not (bm.num_new_blocks(seq, 1 + k) <= bm.num_free_blocks
                                 and prop.can_reserve(state, T, k)):
                k -= 1
            if k <= 0:
                continue
            bm.append_slots(seq, 1 + k)
            prop.reserve(state, T, k)
            budget -= k
            gen = None if sp.greedy else self.sampler.generator(seq.request_id, sp.seed)
            spec = _Spec(idx, seq, state, k, T, sp.greedy, gen)
            if self.structured is not None and seq.request_id in self.structured:
                spec.masks = self.structured.new_bitmask(k + 1)                # [k + 1, W]
            specs.append(spec)
        return specs, mirrors

    def verification(self, scheduled: list[ScheduledSequence], specs: list["_Spec"]) -> Verification | None:
        """The step's :class:`Verification`, or None when no sequence speculates."""
        if not specs:
            return None
        return Verification(scheduled, specs, self.structured, self._rows, self.stats)

    def after_update(self, verify: Verification | None, outputs: list) -> None:
        """After :meth:`Scheduler.update`: count the step's tokens (``outputs``: its
        :class:`~llmserve.core.outputs.RequestOutput` s) and let the proposer roll back what
        was rejected (sequences that finished are released by the engine instead)."""
        st = self.stats
        for ro in outputs:
            st.num_output_tokens += len(ro.new_token_ids)
            st.num_target_seq_passes += 1
        if verify is None:
            return
        for s in verify.specs:
            emitted = s.seq.num_output_tokens - (s.T - s.seq.num_prompt_tokens)
            st.num_emitted_tokens += emitted
            st.num_truncated_tokens += s.n_acc + 1 - emitted
            if not s.seq.is_finished:
                self.proposer.rollback(s)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self.proposer.release(request_id)
        self._rows.release(request_id)

    def reset_counters(self) -> None:
        """Zero the speculative counters (:class:`SpeculativeStats`)."""
        for f in dataclasses.fields(self.stats):
            setattr(self.stats, f.name, 0)

    def reset_stats(self) -> None:
        """Zero the speculative counters and the proposer's own (its runner's steps, its
        cache's high-water mark)."""
        self.proposer.reset_stats()
        self.reset_counters()


# ---------------------------------------------------------------------------------------------
# Loading helpers
# ---------------------------------------------------------------------------------------------
def _peek_model_config(name: str) -> ModelConfig | None:
    """The target's ModelConfig without loading weights (None when it cannot be read)."""
    try:
        if str(name).lower().startswith("random:"):
            from ..models.presets import preset_config
            return preset_config(str(name))
        from ..models.loader import read_model_config, resolve_model_path
        return read_model_config(resolve_model_path(name))
    except Exception:  # noqa: BLE001 - only used to size the caches
        return None


def _load_draft(name: str | os.PathLike, config: EngineConfig, load_fn: Callable | None):
    """Load the draft model on the target's device and dtype (``random:<preset>`` names give
    random weights with a published model's shapes, see :mod:`llmserve.models.presets`)."""
    from ..models.loader import load_model

    model, mcfg, _path = (load_fn or load_model)(name, device=config.device, dtype=config.dtype,
                                                 attention_backend=config.attention_backend)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, mcfg


def _split_cache(config: EngineConfig, target_cfg: ModelConfig | None,
                 draft_cfg: ModelConfig) -> EngineConfig:
    """Shrink the target's KV budget so that target + draft caches (same number of blocks)
    fit in the budget the config names (``num_blocks`` given: unchanged)."""
    cache = config.cache
    if cache.num_blocks is not None or target_cfg is None:
        return config
    tb = KVCache.bytes_per_token(target_cfg, config.dtype)
    db = KVCache.bytes_per_token(draft_cfg, config.dtype)
    r = tb / (tb + db)
    if cache.memory_bytes is not None:
        cache = dataclasses.replace(cache, memory_bytes=max(1, int(cache.memory_bytes * r)))
    elif torch.device(config.device).type == "cuda":
        cache = dataclasses.replace(cache, gpu_memory_utilization=cache.gpu_memory_utilization * r)
    else:
        cache = dataclasses.replace(cache, memory_bytes=int(DEFAULT_CPU_CACHE_BYTES * r))
    return dataclasses.replace(config, cache=cache)


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------
class SpeculativeEngine(LLMEngine):
    """An :class:`~llmserve.engine.llm_engine.LLMEngine` whose step speculates with a draft
    model (module docstring): the engine's own step, with a :class:`Speculator` over a
    :class:`DraftModelProposer` attached.

    Same API as ``LLMEngine`` (``add_request``, ``step``, ``has_unfinished_requests``,
    ``abort_request``, ``generate``, ``stats``) plus :meth:`speculative_stats`.

    Args:
        config: the target's engine configuration.
        draft_model: ``"tiny"`` | checkpoint directory | hub id | ``random:<preset>`` |
            ``"target"`` (reuse the target's weights with a separate draft cache: the mechanism's
            overhead at ~100% acceptance). It must share the target's tokenizer; a different
            padded vocabulary size is allowed (the draft's distribution is cut or zero-padded to
            the target's, which keeps sampled outputs exact).
        num_speculative_tokens: default drafts per step ``k`` in ``[0, 32]`` (0 = off).
        draft_load_model_fn: custom loader ``(name, device=, dtype=, attention_backend=) ->
            (model, ModelConfig, path)`` for the draft (default :func:`load_model`).
        load_model_fn: custom loader for the target (as for ``LLMEngine``).

    Cache sizing: the draft cache has as many blocks as the target's. Unless ``num_blocks`` is
    given, the target's budget (``memory_bytes``, ``gpu_memory_utilization`` or the CPU default)
    is scaled by ``target_bytes / (target_bytes + draft_bytes)`` per token, and the draft is
    loaded first, so both caches fit where the target's alone would have.

    Raises:
        ValueError: ``num_speculative_tokens`` out of range; ``batch_invariant`` or tensor
            parallelism requested; loader errors for either model.
    """

    supports_prompt_logprobs = False   # the speculative step scores no prompt rows
    supports_tensor_parallel = False   # refused in __init__ (the draft runs on rank 0 alone)

    def __init__(self, config: EngineConfig, draft_model: str | os.PathLike = "tiny",
                 num_speculative_tokens: int = 4, *, draft_load_model_fn: Callable | None = None,
                 **kw) -> None:
        if config.batch_invariant:
            raise ValueError("speculative decoding does not support batch_invariant=True: how many "
                             "tokens a step drafts depends on the step's token budget and free blocks, "
                             "so seeded sampling would depend on the batch; drop one of the two")
        if config.tensor_parallel_size > 1:
            raise ValueError(f"speculative decoding does not support tensor_parallel_size > 1 (got "
                             f"{config.tensor_parallel_size}); drop the draft model or use one rank")
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [0, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {num_speculative_tokens!r}")
        share = str(draft_model) == DRAFT_IS_TARGET
        draft = None
        if not share:
            draft = _load_draft(draft_model, config, draft_load_model_fn)
        target_cfg = None if kw.get("load_model_fn") else _peek_model_config(config.model)
        self.requested_config = config
        cfg = _split_cache(config, target_cfg, draft[1] if draft else target_cfg) \
            if (draft or target_cfg) else config
        if kw.get("reuse") is not None:
            raise ValueError("speculative decoding builds its own parts (its KV cache is split with the draft's); "
                             "reuse= is for LLMEngine")
        super().__init__(cfg, **kw)
        self._device_parts = None     # the draft shares the KV budget: nothing to hand over
        self.async_scheduling = False  # a verification's tokens are read in the same step
        self.draft_model_name = str(draft_model)
        self.num_speculative_tokens = k
        model, mcfg = (self.model, self.model_config) if share else draft
        parts = build_draft_parts(self, self.config, model, mcfg, share)
        self.spec_stats = SpeculativeStats()
        proposer = DraftModelProposer(model, mcfg, parts.runner, parts.block_manager,
                                      self.model_config.vocab_size, self.structured, self.spec_stats)
        self.draft_kv_cache = parts.kv_cache
        self.speculator = Speculator(proposer, k, self.block_manager,
                                     self.scheduler.config.max_num_batched_tokens, self.max_model_len,
                                     self.sampler, self.structured, self.spec_stats)

    @property
    def proposer(self) -> DraftModelProposer:
        """The draft-model proposer."""
        return self.speculator.proposer

    @property
    def draft_model(self) -> torch.nn.Module:
        """The draft model."""
        return self.proposer.model

    @property
    def draft_config(self) -> ModelConfig:
        """The draft model's configuration."""
        return self.proposer.config

    @property
    def draft_block_manager(self) -> BlockManager:
        """The draft cache's blocks."""
        return self.proposer.block_manager

    @property
    def draft_runner(self) -> ModelRunner:
        """The draft model's runner."""
        return self.proposer.runner

    def reset_speculative_stats(self) -> None:
        """Zero the counters (the benchmark calls this after warm-up)."""
        self.speculator.reset_counters()

    def speculative_stats(self) -> dict[str, Any]:
        """Counters and ratios of :class:`SpeculativeStats` plus the configuration."""
        d = self.spec_stats.as_dict()
        d.update(draft_model=self.draft_model_name, num_speculative_tokens=self.num_speculative_tokens,
                 draft_num_free_blocks=self.draft_block_manager.num_free_blocks,
                 draft_num_total_blocks=self.draft_block_manager.num_total_blocks)
        return d

    def stats(self) -> dict:
        """:meth:`LLMEngine.stats` plus ``speculative`` (:meth:`speculative_stats`)."""
        s = super().stats()
        s["speculative"] = self.speculative_stats()
        return s
