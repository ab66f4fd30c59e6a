"""Speculative decoding: a small draft model proposes tokens, the target verifies them in one pass.

Algorithm (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv:2211.17192; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", arXiv:2302.01318). For a decoding sequence whose newest token ``x`` is not
yet in the target's KV cache:

1. the draft model ``q`` proposes ``k`` tokens ``d_1..d_k`` autoregressively (``k`` cheap passes
   over its own paged KV cache, batched over sequences);
2. the target ``p`` computes ``[x, d_1, .., d_k]`` in **one** pass (query length ``k + 1`` over
   its paged cache: ``num_computed_tokens`` catches up with ``num_tokens`` after the drafts are
   appended tentatively), giving ``p_1..p_{k+1}``;
3. greedy requests accept the longest prefix with ``d_i == argmax p_i`` and append
   ``argmax p_{n+1}`` (the correction, or a bonus token when all ``k`` were accepted), so the
   output is token-identical to target-only greedy decoding; sampled requests accept ``d_i``
   with probability ``min(1, p_i(d_i) / q_i(d_i))``, on the first rejection resample from
   ``normalize(max(0, p_i - q_i))``, and draw the bonus from ``p_{k+1}`` when all are accepted,
   so every emitted token follows the target distribution exactly (Leviathan et al., Theorem 1;
   Chen et al., Theorem 1). Temperature, top-k and top-p are applied identically to ``p`` and
   ``q`` (:func:`processed_probs`), so "the target distribution" is the one a target-only
   :class:`~llmserve.worker.sampler.Sampler` would draw from.
4. rejected tokens are rolled back in both caches: ``num_computed_tokens`` drops to the accepted
   length and blocks past it are released (:meth:`BlockManager.trim`); their slots inside a kept
   block are overwritten later, and attention never reads past ``context_lens``.

Engine integration (:class:`SpeculativeEngine`): the scheduler plans the step exactly as for
:class:`~llmserve.engine.llm_engine.LLMEngine` (prefill chunks and 1-token decodes). Decode-phase sequences
then get up to ``k`` extra query tokens (limited by the step's leftover token budget, free
blocks, ``max_tokens`` and ``max_model_len``; when nothing is left they decode normally), while
prefill chunks run unchanged and are mirrored into the draft's cache in the draft's first pass.
One target pass serves the whole mixed batch. The draft keeps its own :class:`KVCache` and
:class:`BlockManager` (same block size, by default as many blocks as the target) and a
per-request ``_DraftState`` that may lag the target; it catches up in its next pass (after a
fully accepted run it is two tokens behind: ``d_k`` and the bonus token).

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import EngineConfig, ModelConfig
from .llm_engine import LLMEngine, RequestOutput
from ..worker.kv_cache import DEFAULT_CPU_CACHE_BYTES, KVCache
from ..core.block_manager import BlockManager
from ..worker.input_builder import StepItem
from ..worker.model_runner import ModelRunner
from ..worker.sampler import TokenBitmask, TokenHistory, apply_token_bitmask, apply_top_k_top_p
from ..core.sampling_params import SamplingParams
from ..core.sequence import Sequence

__all__ = [
    "DRAFT_IS_TARGET",
    "MAX_SPECULATIVE_TOKENS",
    "SpeculativeEngine",
    "SpeculativeStats",
    "greedy_verify",
    "processed_probs",
    "rejection_sample",
]

MAX_SPECULATIVE_TOKENS = 32
DRAFT_IS_TARGET = "target"   # draft_model value: reuse the target's weights (own KV cache)


# ---------------------------------------------------------------------------------------------
# The verification rules (pure tensor functions, tested directly)
# ---------------------------------------------------------------------------------------------
def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled request draws from: ``softmax(top_k_top_p(logits / T))``.

    Identical to :meth:`llmserve.worker.sampler.Sampler.sample`'s processing, and applied to both the
    target's and the draft's logits, so the speculative output matches the target-only sampler.

    Args:
        logits: ``[R, V]`` float32.
        params: one :class:`SamplingParams` per row, each with ``temperature > 0``.

    Returns:
        ``[R, V]`` float32 probabilities (rows sum to 1; excluded tokens are exactly 0).
    """
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
    sub = logits.float() / temps[:, None]                                       # [R, V]
    top_k = torch.tensor([p.top_k for p in params], device=dev, dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sub = apply_top_k_top_p(sub, top_k, top_p)
    return torch.softmax(sub, dim=-1)                                           # [R, V]


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
    ds: _DraftState
    k: int
    T: int
    greedy: bool
    gen: torch.Generator | None
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)   # sampled only: [V] per draft
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
    """:class:`~llmserve.engine.llm_engine.LLMEngine` with draft-model speculative decoding (module docstring).

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
        ValueError: ``num_speculative_tokens`` out of range; loader errors for either model.
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
        super().__init__(cfg, **kw)
        self.async_scheduling = False  # this engine's step() reads its tokens in the same step
        self.draft_model_name = str(draft_model)
        self.num_speculative_tokens = k
        if share:
            self.draft_model, self.draft_config = self.model, self.model_config
        else:
            self.draft_model, self.draft_config = draft
        self.draft_kv_cache = KVCache(
            num_layers=self.draft_config.num_hidden_layers, num_blocks=self.kv_cache.num_blocks,
            block_size=self.block_size, num_kv_heads=self.draft_config.num_key_value_heads,
            head_dim=self.draft_config.head_dim, dtype=self.draft_model.dtype, device=self.device)
        self.draft_block_manager = BlockManager(self.kv_cache.num_blocks, self.block_size)
        forward, graphs = self._build_draft_fast_path(self.config, share)
        self.draft_runner = ModelRunner(self.draft_model, self.draft_kv_cache.kv_caches,
                                        self.block_size, self.device, forward=forward,
                                        cuda_graphs=graphs)
        self._draft_states: dict[str, _DraftState] = {}
        self._draft_max_pos = self.draft_config.max_position_embeddings
        self._vocab = self.model_config.vocab_size
        self.spec_stats = SpeculativeStats()

    def _build_draft_fast_path(self, config: EngineConfig, share: bool):
        """On CUDA the draft runs the fused forward too (the target's own one when shared) and,
        with the Triton backend and ``use_cuda_graph``, replays captured graphs for its 1-token
        passes (passes 2..k are always decode-only). On CPU: the readable path."""
        if self.device.type != "cuda" or not self.fast_path.fused_forward:
            return None, None
        if share:
            fast = self.runner.forward
        else:
            from .shard import apply_decode_options
            from ..models.fused_forward import FastQwen2Forward
            draft_path = config.fast_path.resolve(self.draft_config, self.device)   # its own size rules
            apply_decode_options(self.draft_model, draft_path)
            fast = FastQwen2Forward(self.draft_model, draft_path)
        graphs = None
        if config.attention_backend == "triton" and config.use_cuda_graph:
            from ..worker.cuda_graph import CUDAGraphDecodeRunner
            graphs = CUDAGraphDecodeRunner(fast, fast.compute_logits,
                                           self.draft_kv_cache.kv_caches, self.block_size,
                                           config.scheduler.max_num_seqs, self.max_model_len, self.device,
                                           short_context=fast.options.graph_short_context)
            graphs.capture()
        return fast, graphs

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _k_for(self, seq: Sequence) -> int:
        k = seq.sampling_params.num_speculative_tokens
        if seq.sampling_params.needs_logits_processing:
            return 0   # penalties / logit_bias: the plain sampler path (drafts would verify unprocessed)
        return self.num_speculative_tokens if k is None else min(k, MAX_SPECULATIVE_TOKENS)

    def _drop_draft(self, request_id: str) -> None:
        ds = self._draft_states.pop(request_id, None)
        if ds is not None:
            self.draft_block_manager.free(ds)

    def _finish(self, seq: Sequence) -> None:
        super()._finish(seq)
        self._drop_draft(seq.request_id)

    def reset_speculative_stats(self) -> None:
        """Zero the counters (the benchmark calls this after warm-up)."""
        self.spec_stats = SpeculativeStats()

    def reset_stats(self) -> None:
        """:meth:`LLMEngine.reset_stats` plus the draft runner's and the speculative counters."""
        super().reset_stats()
        self.draft_runner.reset_stats()
        self.draft_block_manager.reset_peak()
        self.reset_speculative_stats()

    def speculative_stats(self) -> dict[str, Any]:
        """Counters and ratios of :class:`SpeculativeStats` plus the configuration."""
        d = self.spec_stats.as_dict()
        d.update(draft_model=self.draft_model_name, num_speculative_tokens=self.num_speculative_tokens,
                 draft_num_free_blocks=self.draft_block_manager.num_free_blocks,
                 draft_num_total_blocks=self.draft_block_manager.num_total_blocks)
        return d

    def stats(self) -> dict:
        s = super().stats()
        s["speculative"] = self.speculative_stats()
        return s

    def _align_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[R, Vd]`` -> ``[R, V]`` (target vocab): cut, or pad with ``-inf``."""
        vd = logits.shape[-1]
        if vd == self._vocab:
            return logits
        if vd > self._vocab:
            return logits[:, :self._vocab]
        pad = logits.new_full((logits.shape[0], self._vocab - vd), float("-inf"))
        return torch.cat([logits, pad], dim=-1)                                     # [R, V]

    # ---- planning --------------------------------------------------------------------------------
    def _plan(self, scheduled: list) -> tuple[list[_Spec], list[tuple[_DraftState, Sequence, int]]]:
        """Pick the decode sequences to speculate (and their ``k``), allocate the extra target
        slots and the draft slots; list the prefill chunks the draft mirrors."""
        bm, dbm = self.block_manager, self.draft_block_manager
        budget = self.scheduler.config.max_num_batched_tokens - sum(i.num_new_tokens for i in scheduled)
        specs: list[_Spec] = []
        mirrors: list[tuple[_DraftState, Sequence, int]] = []
        for idx, item in enumerate(scheduled):
            seq = item.seq
            kreq = self._k_for(seq)
            if kreq <= 0 or seq.sampling_params.max_tokens < 3:
                continue   # (the first token comes from prefill; k <= max_tokens - 2 after it)
            ds = self._draft_states.get(seq.request_id)
            if ds is None:
                ds = self._draft_states[seq.request_id] = _DraftState(seq.request_id)
            T = seq.num_tokens
            decode = (item.num_new_tokens == 1 and seq.num_computed_tokens == T - 1
                      and seq.num_output_tokens >= 1)
            if decode:
                sp = seq.sampling_params
                k = min(kreq, sp.max_tokens - seq.num_output_tokens - 1, self.max_model_len - T - 1,
                        self._draft_max_pos - T + 1, max(budget, 0))
                while k > 0 and not (bm.num_new_blocks(seq, 1 + k) <= bm.num_free_blocks and
                                     dbm.blocks_needed(T + k - 1) - len(ds.block_ids) <= dbm.num_free_blocks):
                    k -= 1
                if k <= 0:
                    continue
                bm.append_slots(seq, 1 + k)
                dbm.append_slots(ds, T + k - 1 - ds.num_computed_tokens)
                budget -= k
                gen = None if sp.greedy else self.sampler._generator(seq.request_id, sp.seed)
                spec = _Spec(idx, seq, ds, k, T, sp.greedy, gen)
                if seq.request_id in self.structured:
                    spec.masks = self.structured.new_bitmask(k + 1)            # [k + 1, W]
                specs.append(spec)
            else:
                end = seq.num_computed_tokens + item.num_new_tokens
                n = end - ds.num_computed_tokens
                if n > 0 and end <= self._draft_max_pos and dbm.can_append(ds, n):
                    dbm.append_slots(ds, n)
                    mirrors.append((ds, seq, n))
        return specs, mirrors

    # ---- draft passes ----------------------------------------------------------------------------
    def _propose(self, specs: list[_Spec], mirrors: list[tuple[_DraftState, Sequence, int]]) -> None:
        """Run the draft's passes: pass 1 mirrors prefill chunks and catches every speculated
        sequence up to its newest token (usually 1-2 tokens); pass ``j`` proposes draft ``j``
        (1 token a sequence: a CUDA-graph replay when available)."""
        if not specs and not mirrors:
            return
        kmax = max((s.k for s in specs), default=0)
        st = self.spec_stats
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
            res = self.draft_runner.execute(items)
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

    def _mask_drafts(self, logits: torch.Tensor, active: list[_Spec], j: int) -> None:
        """Mask the draft logits ``[A, V]`` of constrained specs by their grammar after drafts
        ``1..j-1`` (kept as row ``j - 1`` of their verification masks)."""
        rows = [r for r, s in enumerate(active) if s.masks is not None and not s.grammar_done]
        if not rows:
            return
        for r in rows:
            self.structured.fill_bitmask([active[r].seq.request_id], out=active[r].masks, start=j - 1)
        bitmask = torch.stack([active[r].masks[j - 1] for r in rows])                   # [C, W]
        apply_token_bitmask(logits, TokenBitmask(rows, bitmask))

    def _advance_grammar(self, active: list[_Spec]) -> None:
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

    def _finish_draft_masks(self, specs: list[_Spec]) -> None:
        """Fill the mask after the last draft, then roll every matcher back to its request's
        real output."""
        for s in specs:
            if s.masks is None:
                continue
            rid = s.seq.request_id
            if not s.grammar_done and s.grammar_steps == s.k:
                self.structured.fill_bitmask([rid], out=s.masks, start=s.k)
            self.structured.rollback(rid, s.grammar_steps)

    def _sample_drafts(self, logits: torch.Tensor, active: list[_Spec]) -> None:
        chosen = logits.argmax(dim=-1)                                                 # [R]
        sampled = [i for i, s in enumerate(active) if not s.greedy]
        if sampled:
            probs = processed_probs(logits[sampled], [active[i].seq.sampling_params for i in sampled])
            noise = torch.empty_like(probs)                                            # [S, V]
            for r, i in enumerate(sampled):
                noise[r].exponential_(generator=active[i].gen)
            chosen[sampled] = (probs / noise).argmax(dim=-1)
            for r, i in enumerate(sampled):
                active[i].q.append(probs[r])
        for s, t in zip(active, chosen.tolist()):
            s.drafts.append(int(t))

    # ---- verification ----------------------------------------------------------------------------
    def _verify(self, logits: torch.Tensor, offsets: list[int], specs: list[_Spec]
                ) -> list[tuple[int, list[int]]]:
        """Accepted count and emitted tokens (accepted drafts + next token) per spec."""
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
            params = [s.seq.sampling_params for s in sub for _ in range(kmax + 1)]
            p = processed_probs(logits[idx.view(-1)], params).view(len(sub), kmax + 1, -1)  # [S, K+1, V]
            q = torch.zeros(len(sub), kmax, p.shape[-1], device=dev)                   # [S, K, V]
            toks = torch.zeros(len(sub), kmax, dtype=torch.long)                       # [S, K]
            unif = torch.ones(len(sub), kmax, device=dev)                              # [S, K]
            noise = torch.empty(len(sub), p.shape[-1], device=dev)                     # [S, V]
            for r, s in enumerate(sub):
                q[r, :s.k] = torch.stack(s.q)
                toks[r, :s.k] = torch.tensor(s.drafts, dtype=torch.long)
                unif[r, :s.k] = torch.rand(s.k, generator=s.gen, device=dev)
                noise[r].exponential_(generator=s.gen)
            nd = torch.tensor([s.k for s in sub], dtype=torch.long, device=dev)
            n, nxt = rejection_sample(p, q, toks.to(dev), nd, unif, noise)
            for r, (nn, t) in enumerate(zip(n.tolist(), nxt.tolist())):
                s = sub[r]
                results[sampled[r]] = (nn, s.drafts[:nn] + [t])
        return results  # type: ignore[return-value]

    def _mask_constrained(self, logits: torch.Tensor, scheduled: list, normal: list[int], nrows: list[int],
                          specs: list[_Spec], spec_offsets: list[int]) -> None:
        """Mask the target's logits ``[R, V]`` of constrained requests in place: the sampled
        row of a plain one, every verified row of a speculated one (module docstring)."""
        sc = self.structured
        if not len(sc):
            return
        plain = [(r, scheduled[i].seq.request_id) for r, i in zip(nrows, normal)
                 if scheduled[i].seq.request_id in sc]
        spec = [(o, s) for o, s in zip(spec_offsets, specs) if s.masks is not None]
        if not plain and not spec:
            return
        rows = [r for r, _ in plain]
        parts = [sc.fill_bitmask([rid for _, rid in plain])] if plain else []
        for o, s in spec:                  # the masks built while drafting (_propose)
            rows.extend(range(o, o + s.k + 1))
            parts.append(s.masks)
        apply_token_bitmask(logits, TokenBitmask(rows, torch.cat(parts) if len(parts) > 1 else parts[0]))

    # ---- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduling iteration: draft passes, then one target pass over the whole batch
        (prefill chunks, plain decodes and ``k + 1``-token verifications).

        Returns:
            an output for each sequence that received tokens this step (``new_token_ids`` may
            hold several tokens).
        """
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self._drop_draft(seq.request_id)
        if not out.scheduled:
            return []
        self.num_steps += 1
        st = self.spec_stats
        st.num_target_steps += 1
        specs, mirrors = self._plan(out.scheduled)
        in_use = self.block_manager.num_total_blocks - self.block_manager.num_free_blocks
        self.max_blocks_in_use = max(self.max_blocks_in_use, in_use)
        self._propose(specs, mirrors)

        # One target pass: every scheduled item, speculated ones with their drafts appended.
        spec_of = {s.index: s for s in specs}
        normal: list[int] = []           # indices into out.scheduled that sample normally
        nrows: list[int] = []            # their logits rows
        spec_offsets: list[int] = []     # first logits row of each spec (order of `specs`)
        if not specs:                    # the LLMEngine path (CUDA-graph replay when decode-only)
            res = self.runner.execute(out.scheduled)
            logits, normal = res.logits, res.sample_indices                          # [S, V]
            nrows = list(range(len(normal)))
        else:
            # The same builder and runner; a verified sequence asks for the logits of all its
            # 1 + k rows, the others for their last row when they sample.
            items: list[Any] = []
            num_logits: list[int] = []
            nlog = 0                     # logits rows so far
            for idx, item in enumerate(out.scheduled):
                s = spec_of.get(idx)
                if s is not None:
                    seq = s.seq
                    items.append(_view_item(seq.request_id, s.T - 1, seq.all_token_ids + s.drafts,
                                            seq.block_ids, 1 + s.k))
                    num_logits.append(1 + s.k)
                    spec_offsets.append(nlog)
                    nlog += 1 + s.k
                else:
                    items.append(item)
                    num_logits.append(1 if item.will_sample else 0)
                    if item.will_sample:
                        nrows.append(nlog)
                        normal.append(idx)
                        nlog += 1
            logits = self.runner.execute(items, num_logits=num_logits).logits        # [R, V]
        for idx, item in enumerate(out.scheduled):
            if idx not in spec_of:
                item.seq.num_computed_tokens += item.num_new_tokens
        if not normal and not specs:
            return []
        self._mask_constrained(logits, out.scheduled, normal, nrows, specs, spec_offsets)

        emitted: dict[int, tuple[list[int], list[dict | None]]] = {}
        if normal:
            seqs = [out.scheduled[i].seq for i in normal]
            res = self.sampler.sample(logits[nrows], [q.sampling_params for q in seqs],
                                      [q.request_id for q in seqs],
                                      history=[TokenHistory(q.prompt_token_ids, q.output_token_ids)
                                               for q in seqs])
            for i, tok, lp in zip(normal, res.token_ids, res.logprobs):
                emitted[i] = ([tok], [lp])
        if specs:
            verdicts = self._verify(logits, spec_offsets, specs)
            for s, off, (n_acc, toks) in zip(specs, spec_offsets, verdicts):
                st.num_verifications += 1
                st.num_proposed_tokens += s.k
                st.num_accepted_tokens += n_acc
                lps: list[dict | None] = [None] * len(toks)
                if s.seq.sampling_params.logprobs is not None:
                    lps = _logprob_records(logits[off:off + len(toks)], toks, s.seq.sampling_params.logprobs)
                emitted[s.index] = (toks, lps)
                s.n_acc = n_acc

        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        for idx in sorted(emitted):
            seq = out.scheduled[idx].seq
            toks, lps = emitted[idx]
            s = spec_of.get(idx)
            new: list[int] = []
            status = None
            constrained = seq.request_id in self.structured
            for tok, lp in zip(toks, lps):
                seq.append_token(tok, now)
                new.append(tok)
                if seq.sampling_params.logprobs is not None:
                    seq.output_logprobs.append(lp)
                status = (self.structured.accept(seq, tok) if constrained else None) \
                    or seq.check_stop(self.max_model_len)
                if status is not None:
                    break
            st.num_output_tokens += len(new)
            st.num_target_seq_passes += 1
            if s is not None:
                st.num_emitted_tokens += len(new)
                st.num_truncated_tokens += len(toks) - len(new)
                if status is None:   # roll back the rejected drafts in both caches
                    seq.num_computed_tokens = s.T + s.n_acc
                    self.block_manager.trim(seq, seq.num_computed_tokens)
                    s.ds.num_computed_tokens = min(s.ds.num_computed_tokens, seq.num_computed_tokens)
                    self.draft_block_manager.trim(s.ds, s.ds.num_computed_tokens)
            self._emit(seq, new, status, outputs)
        return outputs


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
