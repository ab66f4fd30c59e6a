"""The paged, batched engine: ``LLMEngine.step()`` is one iteration of continuous (or static)
batching.

schedule (:meth:`Scheduler.schedule <llmserve.core.scheduler.Scheduler.schedule>`) -> execute
(the runner builds the tensors and runs the forward pass; ``num_computed_tokens`` advances; the
sampler queues the draws of the sequences that caught up) -> update (:meth:`Scheduler.update
<llmserve.core.scheduler.Scheduler.update>`: append, stop checks, finish and free) -> outputs.
The engine's parts are built by :mod:`llmserve.engine.builder`. Every request keeps a timing
record (:class:`~llmserve.core.sequence.RequestMetrics`) from which the benchmark derives TTFT,
TPOT, ITL.
"""

from __future__ import annotations

import gc
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..envs import triton_interpret
from ..worker.input_builder import PendingTokens
from ..worker.sampler import PendingSample, Sampler, TokenBitmask, TokenHistory
from ..core.admission import RequestLimits, validate_request
from ..core.outputs import RequestOutput, SampledTokens, StepUpdate
from ..core.sampling_params import SamplingParams
from ..core.scheduler import SchedulerOutput
from ..core.sequence import Sequence, SequenceStatus
from ..core.trace import RequestTracer
from .builder import (DeviceParts, build_paged_parts, build_structured_output, check_reuse_key, load_target,
                      pin_invariant_threads)
from .triton_cache import triton_cache_entries


TokenCallback = Callable[["RequestOutput"], None]


def _check_interpreter(config: EngineConfig, device: torch.device) -> None:
    """``ValueError`` when Triton kernels would run on a CPU without Triton's interpreter: the
    Triton attention backend, or an explicitly requested fused forward."""
    if device.type != "cpu" or triton_interpret():
        return
    if config.attention_backend == "triton":
        raise ValueError("the Triton backend on a CPU needs TRITON_INTERPRET=1 set before start-up "
                         "(slow; meant for tests), or use --paged-attention-backend torch")
    if config.fast_path.fused_forward:
        raise ValueError("fast_path.fused_forward=True on a CPU needs TRITON_INTERPRET=1 set before "
                         "start-up (the fused forward's kernels run in Triton's interpreter), or "
                         "leave fused_forward unset (the readable forward on CPU)")


class _EngineBase:
    """Model/tokenizer loading and request validation shared by both engines."""

    #: whether ``SamplingParams.prompt_logprobs`` is computed (else such requests are refused)
    supports_prompt_logprobs = False
    #: whether ``SamplingParams.structured_output`` is enforced (else such requests are refused)
    supports_structured_output = False
    #: whether ``EngineConfig.tensor_parallel_size > 1`` is served (else refused)
    supports_tensor_parallel = False

    def __init__(self, config: EngineConfig, *, load_model_fn=None, reuse: DeviceParts | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        _check_interpreter(config, self.device)
        t_load = time.perf_counter()
        #: start-up wall seconds by phase (``load``, ``kv_cache``, ``graph_capture``, ``warmup``)
        #: and the KV pool's size; the server logs them and reports them on ``/health``
        self.startup: dict = {}
        torch.manual_seed(config.seed)
        #: rank 0's tensor-parallel runtime (:mod:`llmserve.engine.tensor_parallel`), or None
        self.tp_runtime = None
        #: whether another engine may take this one's device parts (not with a custom loader:
        #: its weights are not named by the configuration)
        self._shareable = load_model_fn is None
        pin_invariant_threads(config)
        if reuse is None:
            load_target(self, config, load_model_fn)
        else:   # another engine's model and tokenizer (llmserve.engine.builder.EnginePartsCache)
            self.model, self.model_config = reuse.shard.model, reuse.shard.model_config
            self.model_path, self.fast_path = reuse.shard.model_path, reuse.shard.fast_path
            self.tokenizer = reuse.tokenizer
        self.startup["load_s"] = time.perf_counter() - t_load
        self.max_model_len = min(config.scheduler.max_model_len, self.model_config.max_position_embeddings)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.sampler = Sampler(self.device, seed=config.seed)
        self._ids = itertools.count()
        #: per-request lifecycle records (:class:`~llmserve.core.trace.RequestTracer`), or None
        #: (off: the default; ``llmserve benchmark --trace`` and ``serve --trace`` attach one)
        self.tracer: RequestTracer | None = None
        self.structured = build_structured_output(self, config) if self.supports_structured_output else None

    def _tp_abort(self, cause: BaseException) -> None:
        """Tensor parallel: a failure during construction stops the other ranks; a rank that
        died is named in the error raised instead of ``cause``."""
        if self.tp_runtime is None:
            return
        err = self.tp_runtime.fail(cause)
        if self.tp_runtime.dead_ranks() and not isinstance(cause, (ValueError, FileNotFoundError)):
            raise err from cause

    def shutdown(self) -> None:
        """Release what the engine holds outside this process: with tensor parallelism, stop
        the other ranks and destroy the process groups (also done at interpreter exit).
        Idempotent; a no-op with one rank. The engine takes no further steps afterwards."""
        if self.tp_runtime is not None:
            self.tp_runtime.shutdown()

    # ---- request intake ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (text is tokenized; ids are validated against the vocab).

        Raises:
            ValueError: empty prompt, or an id outside ``[0, vocab_size)``.
        """
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return ids

    def request_limits(self) -> RequestLimits:
        """What every request is checked against (:mod:`llmserve.core.admission`): here the
        context length only; engines with a KV cache add its size and the step budget."""
        return RequestLimits(self.max_model_len)

    def check_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                      request_id: str | None = None) -> list[int]:
        """Validate a request without queueing it; return its prompt ids.

        Raises:
            ValueError: empty prompt, bad token ids, a structured output this engine does not
                support or whose schema cannot be compiled (compiled grammars are cached, so
                the request's own submission reuses it); a
                :class:`~llmserve.core.admission.RequestRejectedError` when it can never be
                served (context exceeded, more KV blocks than the whole cache holds, or without
                chunked prefill a prompt above the step budget).
        """
        ids = self.encode_prompt(prompt)
        sp = sampling_params or SamplingParams()
        if sp.prompt_logprobs is not None and not self.supports_prompt_logprobs:
            raise ValueError(f"prompt_logprobs is not supported by {type(self).__name__}; "
                             "use the paged LLMEngine without speculative decoding")
        validate_request(len(ids), sp.max_tokens, self.request_limits(), request_id)
        if sp.structured_output is not None:
            self.check_structured_output(sp.structured_output)
        return ids

    def prepare_structured_output(self) -> None:
        """Build the grammar compiler now (it reads the tokenizer's vocabulary; the server calls
        this on its tokenizer thread before compiling schemas on other threads). No-op without
        structured output support.

        Raises:
            ValueError: xgrammar is not installed.
        """
        if self.structured is not None:
            self.structured.cache.prepare()

    def check_structured_output(self, spec) -> None:
        """Compile a :class:`~llmserve.core.sampling_params.StructuredOutput` (cached), so a bad
        schema is refused before anything is queued. Safe to call from any thread.

        Raises:
            ValueError: this engine does not enforce structured output, the schema cannot be
                compiled (the message says why), or xgrammar is not installed.
        """
        if self.structured is None:
            raise ValueError(f"structured output is not supported by {type(self).__name__}; "
                             "use the paged LLMEngine")
        self.structured.check(spec)

    def _new_seq(self, prompt, sampling_params, request_id, arrival_time, priority) -> Sequence:
        ids = self.check_request(prompt, sampling_params, request_id)
        sp = sampling_params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        return Sequence(rid, ids, sp, arrival_time=arrival_time, priority=priority,
                        eos_token_ids=self.eos_token_ids)

    def generate(self, prompts: list[str | list[int]] | str | list[int],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (offline batch); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        while self.has_unfinished_requests():
            self.step()
        return [RequestOutput.from_seq(s, []) for s in seqs]


@dataclass(slots=True)
class _InFlightStep:
    """A launched step whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]
    sample: "PendingSample"
    #: speculative decoding: the step's verification (its verified rows), else None
    verify: object | None = None

    def device_source(self) -> PendingTokens:
        """Where the next step finds the input ids of these sequences (``[S]`` int64 on the
        device, one row per sequence)."""
        return PendingTokens(self.sample.token_ids_device, {s.request_id: i for i, s in enumerate(self.seqs)})


class LLMEngine(_EngineBase):
    """Paged KV cache + iteration-level scheduling (continuous or static batching).

    Continuous batching follows Orca (Yu et al., OSDI 2022); the paged KV cache follows
    vLLM/PagedAttention (Kwon et al., SOSP 2023); chunked prefill follows Sarathi-Serve
    (Agrawal et al., OSDI 2024).

    A step (:meth:`step`) is schedule -> execute -> update: :meth:`Scheduler.schedule
    <llmserve.core.scheduler.Scheduler.schedule>` plans it, the runner computes the forward pass
    and the sampler queues the draws on the device, and :meth:`Scheduler.update
    <llmserve.core.scheduler.Scheduler.update>` appends the tokens, applies the stop rules and
    finishes and frees the sequences that ended; the engine then calls the callbacks.

    With asynchronous scheduling (:attr:`async_scheduling`, the default on CUDA) a step's
    sampled tokens are read on the *next* call: that call plans and launches its forward pass
    (sequences whose newest token is still on the device take it as input there), then reads
    the previous step's tokens while the device runs, and returns their outputs. A request that
    stops on EOS therefore costs one extra token of device work, which is discarded; stops by
    length are known ahead and cost nothing. Grammar-constrained rows (structured output) need
    every earlier token accepted by their matcher before their bitmask can be filled, so a step
    that samples for one reads the previous step's tokens *before* it samples (after its forward
    pass was launched, so the overlap is kept); a constrained request never runs ahead of its
    grammar, and steps without constrained rows are unchanged.

    Speculative decoding (:attr:`speculator`, set by
    :class:`~llmserve.engine.speculative.SpeculativeEngine`) happens inside the same step: a
    proposer drafts tokens for decoding sequences, the forward pass computes their ``1 + k``
    rows with the rest of the batch, and the rejection sampler's verdicts go through the same
    update (which stops a run at its first stop token and rolls rejected drafts back).

    Tensor parallelism (``config.tensor_parallel_size > 1``, :mod:`llmserve.engine.tensor_parallel`):
    this object is rank 0; it starts the other ranks, broadcasts each step to them and samples.
    Call :meth:`shutdown` when done (it also runs at interpreter exit). Under ``torchrun``
    the constructor on ranks other than 0 serves as that rank and raises ``SystemExit`` once
    rank 0 shuts down. A failed rank makes :meth:`step` raise
    :class:`~llmserve.engine.tensor_parallel.TensorParallelError`.

    Args:
        config: engine configuration (model, device, dtype, cache, scheduler, backends).
        load_model_fn: a ``load_model``-like loader (keyword); with tensor parallelism it takes
            ``tp=`` too and must be picklable (a module-level function): every rank calls it.

    Raises:
        ValueError/FileNotFoundError: from model loading or config validation (a
            ``tensor_parallel_size`` that does not fit the model included).
        TensorParallelError: a tensor-parallel rank failed while starting.
    """

    supports_prompt_logprobs = True
    supports_structured_output = True
    supports_tensor_parallel = True

    def __init__(self, config: EngineConfig, *, reuse: DeviceParts | None = None, **kw) -> None:
        if reuse is not None:   # refused before anything of the engine is set up
            if config.tensor_parallel_size > 1:
                raise ValueError("reused device parts serve one rank; tensor_parallel_size must be 1")
            check_reuse_key(reuse, config)
        super().__init__(config, reuse=reuse, **kw)
        try:
            self._init_engine(config, reuse)
        except BaseException as e:
            self._tp_abort(e)
            raise

    def _init_engine(self, config: EngineConfig, reuse: DeviceParts | None = None) -> None:
        parts = build_paged_parts(self, config, reuse)
        # what another engine of the same settings may take over (detach_device_parts)
        self._device_parts: DeviceParts | None = parts.device if self._shareable else None
        self._detached = False
        self.block_size = config.cache.block_size
        self.kv_cache, self.block_manager = parts.kv_cache, parts.block_manager
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self._seqs: dict[str, Sequence] = {}
        self._callbacks: dict[str, TokenCallback] = {}
        self.num_steps = 0
        self.max_blocks_in_use = 0
        # Wall seconds of each phase of step(), summed over steps. On a GPU, "execute" is host
        # work (input preparation, kernel or graph launches; the device runs asynchronously),
        # "sample" is the host's part of sampling (launching it, grammar bitmasks, reading the
        # ids), "device_wait" the host blocked until a launched step's token ids were on the
        # host, and "schedule" + "postprocess" are host work. On a GPU with asynchronous
        # scheduling the device waits for the host where "device_wait" is near zero. Not
        # counted as device_wait: speculative verification and drafts and prompt logprobs
        # read device results inside "execute" / "sample", tensor-parallel sends wait for the
        # other ranks inside "execute"; on a CPU the forward pass itself is "execute".
        self.step_seconds = {"schedule": 0.0, "execute": 0.0, "sample": 0.0, "device_wait": 0.0,
                             "postprocess": 0.0}
        # Prompt logprobs: logits rows computed for them (beyond the sampled rows) and the wall
        # seconds of their log-softmax, top-k and host read (part of "execute"), summed over steps.
        self.num_prompt_logprob_rows = 0
        self.prompt_logprob_seconds = 0.0
        # Asynchronous scheduling: launch step n+1 before reading step n's tokens (default on
        # CUDA, where the device runs while the host plans; EngineConfig.async_scheduling).
        auto = self.device.type == "cuda"
        self.async_scheduling = auto if config.async_scheduling is None else bool(config.async_scheduling)
        self._inflight: _InFlightStep | None = None
        #: speculative decoding (:class:`~llmserve.engine.speculative.Speculator`), or None
        self.speculator = None

    def warmup(self, force: bool = False) -> dict:
        """Compile and load the GPU kernels of every kind of step before serving.

        Triton compiles a kernel variant the first time it meets it (argument values that are 1
        or multiples of 16, pointer alignments, a mixed decode + prefill batch): a fraction of a
        second to a few seconds each, which a cold process would otherwise pay inside its first
        requests' TTFT (H200, 1.5B open-loop at 16 req/s: p95 TTFT 717-822 ms on a cold Triton
        cache). This runs synthetic requests through the
        scheduler: a batch of prompts of 1-2 tokens, odd lengths, multiples of 16 and a prompt
        longer than the prefill chunk (without chunking: as long as one step's token budget),
        decoding together; then short prompts arriving one step apart next to a decoding request
        of 24, 300 and 600 tokens of context, so decode rows mix with prefill chunks at growing
        batch sizes and at the contexts that switch the decode attention's tile and split merge;
        then a seeded sampled request with top-k/top-p and logprobs (no engine random stream is
        consumed). With CUDA graphs of steps with prefill chunks (``runner.mixed_graphs``) the
        requests run twice, first with those graphs set aside, so the kernel variants of the
        eager steps past their largest bucket compile too. Requests the engine cannot take (context, step budget, KV blocks) are
        skipped. The step, KV and graph counters are reset afterwards. CUDA only (a no-op
        elsewhere unless ``force``: the CPU tests run the same requests through the readable
        path).

        Returns:
            ``{"seconds", "triton_compiles", "requests"}`` (``triton_compiles``: new entries in
            Triton's on-disk cache, ``None`` when it cannot be read; ``skipped`` with the reason
            when nothing ran).

        Raises:
            RuntimeError: requests are queued or running (warm up an idle engine). Anything a
                step raises propagates after the warm-up's requests are aborted.
        """
        if self.device.type != "cuda" and not force:
            self.freeze_gc()
            return {"skipped": f"device {self.device.type} (no kernels to compile)", "seconds": 0.0,
                    "triton_compiles": 0, "requests": 0}
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() needs an idle engine (requests are queued or running)")
        t0, c0 = time.perf_counter(), triton_cache_entries()
        vocab = int(self.model_config.vocab_size)
        sched = self.config.scheduler
        # longest prompt: one past the prefill chunk (two chunks), or without chunking the
        # most one step takes; requests this engine cannot take (context, step budget, KV
        # blocks) are skipped below
        longest = sched.prefill_chunk_size + 9 if sched.prefill_chunk_size else sched.max_num_batched_tokens
        lengths = sorted({1, 2, 7, 16, 17, 31, 64, 100, longest})
        added: list[str] = []

        def prompt(n: int, salt: int) -> list[int]:
            return [(97 * i + 13 * salt + 11) % vocab for i in range(n)]

        def add(n: int, salt: int, sp: SamplingParams, rid: str) -> Sequence | None:
            try:
                seq = self.add_request(prompt(n, salt), sp, request_id=rid)
            except ValueError:            # rejected at once (nothing queued): skip it
                return None
            added.append(rid)
            return seq

        def drain() -> None:
            while self.has_unfinished_requests():
                self.step()

        greedy = SamplingParams(max_tokens=3, ignore_eos=True)
        # Steps with prefill chunks replay a CUDA graph up to the mixed runner's token count and
        # run eagerly past it, with other kernel variants (the prefill kernel without a tile
        # schedule, the decode kernel's split count for the real context): the requests run once
        # with the mixed graphs set aside, so the eager variants compile too, then with them.
        mixed = getattr(self.runner, "mixed_graphs", None)
        try:
            for p, graphs in enumerate([None, mixed] if mixed is not None else [None]):
                self.runner.mixed_graphs = graphs
                tag = "warmup" if p == 0 else f"warmup{p}"
                for i, n in enumerate(lengths):      # batched prefills (chunked), then batch decode
                    add(n, i, greedy, f"{tag}-a{i}")
                drain()
                # Staggered arrivals next to a decoding request of a short, a medium and a long
                # context: decode rows mixed with prefill chunks at batch 2, 3, ... (the
                # attention kernels pick their tile, split count and merge by batch size and
                # context, each a kernel variant).
                small = [n for n in lengths if n <= 100]
                for j, base in enumerate((24, 300, 600)):
                    bg = add(base, 200 + j, SamplingParams(max_tokens=len(small) + 4, ignore_eos=True),
                             f"{tag}-bg{j}")
                    if bg is None:
                        continue
                    while bg.num_computed_tokens < base and self.has_unfinished_requests():
                        self.step()
                    for i, n in enumerate(small):
                        add(n, 50 + 10 * j + i, greedy, f"{tag}-b{j}-{i}")
                        self.step()
                    drain()
                add(5, 99, SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=20, seed=0,
                                          logprobs=2, ignore_eos=True), f"{tag}-c0")
                drain()
        except BaseException:
            for rid in added:                        # leave nothing queued behind
                self.abort_request(rid)
            raise
        finally:
            self.runner.mixed_graphs = mixed
        count = len(added)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reset_stats()
        self.freeze_gc()
        c1 = triton_cache_entries()
        self.startup["warmup_s"] = time.perf_counter() - t0
        return {"seconds": time.perf_counter() - t0, "requests": count,
                "triton_compiles": None if c0 is None or c1 is None else len(c1 - c0)}

    def detach_device_parts(self) -> DeviceParts | None:
        """Give up this engine's device parts (model, KV cache, fused forward, CUDA graphs) for
        another engine of the same settings to take over
        (:class:`~llmserve.engine.builder.EnginePartsCache`); this engine takes no request
        afterwards (:meth:`add_request` raises RuntimeError). None when it has none to give
        (tensor parallelism, a custom ``load_model_fn``, speculative decoding) or gave them
        already.

        Raises:
            RuntimeError: requests are queued or running, or a step is still in flight.
        """
        if self.has_unfinished_requests() or self._inflight is not None:
            raise RuntimeError("detach_device_parts() needs an idle engine (requests are queued or running)")
        parts, self._device_parts = self._device_parts, None
        self._detached = True
        return parts

    def freeze_gc(self) -> None:
        """Collect once and freeze every live object (``gc.freeze()``), when
        ``config.freeze_gc``: the collector's later passes skip the long-lived model, tokenizer
        and buffers, so no step waits on a full pass over them (Python's ``gc`` documentation
        recommends freezing after start-up for the same reason)."""
        if self.config.freeze_gc:
            gc.collect()
            gc.freeze()

    def reset_stats(self) -> None:
        """Zero every counter :meth:`stats` reports (steps, phase seconds, KV high-water marks,
        preemptions) and the runner's step and graph counts, so later stats cover only what
        runs after the call (:meth:`warmup` calls it; benchmarks call it after their warm-up
        requests). Requests and the KV cache are left as they are."""
        self.num_steps = 0
        self.max_blocks_in_use = 0
        self.step_seconds = dict.fromkeys(self.step_seconds, 0.0)
        self.num_prompt_logprob_rows = 0
        self.prompt_logprob_seconds = 0.0
        self.runner.reset_stats()
        if self.tp_runtime is not None:
            self.tp_runtime.channel.reset_stats()
            self.tp_runtime.group.reset_stats()
        self.block_manager.reset_peak()
        self.scheduler.num_preemptions = self.scheduler.num_recomputed_tokens = 0
        self.block_manager.reset_prefix_cache_stats()
        if self.structured is not None:
            self.structured.reset_stats()
        if self.speculator is not None:
            self.speculator.reset_stats()

    def reset_prefix_cache_stats(self) -> None:
        """Zero the prefix-cache query, hit and eviction counters (the cached blocks stay)."""
        self.block_manager.reset_prefix_cache_stats()

    def request_limits(self) -> RequestLimits:
        """The scheduler's limits: context, the whole KV cache and the step budget."""
        return self.scheduler.request_limits()

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, callback: TokenCallback | None = None) -> Sequence:
        """Queue a request; it joins the batch at the next ``step()``.

        Args:
            prompt: text or token ids.
            sampling_params: decoding rules (default greedy, 16 tokens).
            request_id: unique id (generated when ``None``).
            arrival_time: ``time.perf_counter()`` timestamp (default now).
            priority: lower runs first under the priority policy.
            callback: called with a :class:`RequestOutput` for every new token and at finish.

        Raises:
            ValueError: the request can never fit (rejected at once; nothing is queued).
            RuntimeError: the engine gave its device parts away (:meth:`detach_device_parts`).
        """
        if self._detached:
            raise RuntimeError("this engine gave its device parts to another engine; it takes no requests")
        try:
            seq = self._new_seq(prompt, sampling_params, request_id, arrival_time, priority)
            if seq.request_id in self._seqs:
                raise ValueError(f"request_id {seq.request_id!r} is already in use")
        except ValueError as e:
            if self.tracer is not None:
                self.tracer.on_rejected(request_id, str(e))
            raise
        if seq.sampling_params.structured_output is not None:
            self.structured.add(seq)                  # compiled in check_request: a cache hit
        try:
            self.scheduler.add_request(seq)
        except BaseException as e:
            if self.structured is not None:
                self.structured.remove(seq.request_id)
            if self.tracer is not None and seq.status is SequenceStatus.REJECTED:
                self.tracer.on_rejected(seq.request_id, str(e))
            raise
        if self.tracer is not None:
            self.tracer.on_queued(seq)
        self._seqs[seq.request_id] = seq
        if callback is not None:
            self._callbacks[seq.request_id] = callback
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed at once. Returns False if unknown/finished."""
        seq = self.scheduler.abort_request(request_id)
        if seq is None:
            return False
        self._finish(seq)
        return True

    def _finish(self, seq: Sequence) -> None:
        """Release a finished request's engine state (sampler generator, grammar matcher,
        proposer state); an aborted request's callback is told here."""
        self._seqs.pop(seq.request_id, None)
        if self.tracer is not None:
            self.tracer.on_finished(seq)
        self.sampler.release(seq.request_id)
        if self.speculator is not None:
            self.speculator.release(seq.request_id)
        if self.structured is not None:
            self.structured.remove(seq.request_id)
        cb = self._callbacks.pop(seq.request_id, None)
        if cb is not None and seq.status is SequenceStatus.FINISHED_ABORTED:
            cb(RequestOutput.from_seq(seq, []))

    def has_unfinished_requests(self) -> bool:
        """Whether a request is waiting or running, or a launched step's tokens are unread."""
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute (and queue the sampling) -> update -> outputs.

        With asynchronous scheduling (:attr:`async_scheduling`, the default on CUDA) the
        update reads the *previous* step's tokens, after this step's forward pass was launched
        (see the class docstring). Returns an output per sequence that received tokens.

        Raises:
            TensorParallelError: a tensor-parallel rank died, raised or did not answer within
                ``distributed_timeout_s`` (then every later call raises it too).
        """
        if self.tp_runtime is not None:
            self.tp_runtime.check()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.tracer is not None and (plan.scheduled or plan.preempted):
            self.tracer.on_step(t0, self.num_steps + bool(plan.scheduled), plan.scheduled, plan.preempted)
        launched, outputs, early_error = None, [], None
        if plan.scheduled:
            launched, outputs, early_error = self._launch(plan, t0)
        # Swap first: whatever happens while reading, the launched step stays the one in
        # flight and the previous one is never read twice.
        previous, self._inflight = self._inflight, (launched if self.async_scheduling else None)
        if previous is not None:
            outputs += self._update(previous)
        if launched is not None and not self.async_scheduling:
            outputs += self._update(launched)
        if early_error is not None:
            raise early_error
        return outputs

    def _launch(self, plan: SchedulerOutput, t0: float
                ) -> tuple[_InFlightStep | None, list[RequestOutput], Exception | None]:
        """Run the planned step's forward pass and queue its sampling without waiting.

        Returns ``(launched, outputs, error)``: the step in flight (None when nothing samples),
        the outputs of a previous step read early (constrained rows need their grammar up to
        date before their bitmask is filled) and a callback error of that early read, raised
        by :meth:`step` once this step is launched.
        """
        self.num_steps += 1
        t1 = time.perf_counter()
        pending = self._inflight.device_source() if self._inflight is not None else None
        verify = self._speculate(plan) if self.speculator is not None else None
        in_use = self.block_manager.num_total_blocks - self.block_manager.num_free_blocks
        self.max_blocks_in_use = max(self.max_blocks_in_use, in_use)
        plp = self._plan_prompt_logprobs(plan.scheduled)
        items, num_logits = plan.scheduled, (plp[0] if plp is not None else None)
        if verify is not None:             # verified rows: all 1 + k logits rows of each
            items, num_logits = verify.items, verify.num_logits
        res = self._execute(items, pending, num_logits)
        for item in plan.scheduled:
            item.seq.num_computed_tokens = item.end_position
        logits, sample_idx = res.logits, res.sample_indices
        if plp is not None:
            logits, sample_idx = self._record_prompt_logprobs(plan.scheduled, res, *plp)
        if verify is not None:             # the rows that sample a single token
            logits, sample_idx = verify.plain_rows(res.logits)
        t2 = time.perf_counter()
        self.step_seconds["schedule"] += t1 - t0
        self.step_seconds["execute"] += t2 - t1
        outputs: list[RequestOutput] = []
        early_error: Exception | None = None
        launched = None
        early_read = 0.0   # seconds of the early read below: _update books them itself
        if sample_idx or verify is not None:
            seqs = [plan.scheduled[i].seq for i in sample_idx]
            argmax, mask = res.device_argmax, None
            if self.structured is not None and len(self.structured) and any(
                    s.request_id in self.structured for s in seqs):
                if self._inflight is not None:   # the constrained rows' previous tokens first
                    previous, self._inflight = self._inflight, None
                    t_read = time.perf_counter()
                    try:
                        outputs += self._update(previous)
                    except Exception as e:  # noqa: BLE001 - a callback's; raised once this step is launched
                        early_error = e
                    early_read = time.perf_counter() - t_read
                seqs, logits, argmax, mask = self._constrain(seqs, logits, argmax)
            history, pending_ids = self._token_history(seqs, pending)
            sample = self.sampler.sample_async(logits, [s.sampling_params for s in seqs],
                                               [s.request_id for s in seqs],
                                               argmax=argmax, history=history,
                                               pending_token_ids=pending_ids, token_bitmask=mask)
            for seq in seqs:
                seq.num_pending += 1
            if verify is not None:          # after the plain rows' draws (the random streams' order)
                verify.run(res.logits)
            launched = _InFlightStep(seqs, sample, verify)
        self.step_seconds["sample"] += time.perf_counter() - t2 - early_read
        return launched, outputs, early_error

    def _speculate(self, plan: SchedulerOutput):
        """Speculative decoding: the speculator picks the decodes that speculate (and reserves
        their slots), the proposer drafts their tokens (:meth:`_propose`), and the returned
        verification (None when no sequence speculates this step) tells the forward pass
        which rows to compute and verifies them."""
        specs, mirrors = self.speculator.plan(plan)
        self._propose(specs, mirrors)
        return self.speculator.verification(plan.scheduled, specs)

    def _propose(self, specs: list, mirrors: list) -> None:
        """Ask the speculator's proposer for this step's drafts (fills each spec's tokens)."""
        self.speculator.proposer.propose(specs, mirrors)

    def _constrain(self, seqs: list[Sequence], logits: torch.Tensor, argmax: torch.Tensor | None
                   ) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None, TokenBitmask | None]:
        """The bitmask of this step's constrained rows, once their matchers hold every earlier
        token. Rows whose sequence finished meanwhile (a stop read just now) are dropped from
        the sampled rows (``logits`` ``[S, V]`` -> ``[S', V]``, ``argmax`` likewise)."""
        keep = [j for j, s in enumerate(seqs) if not s.is_finished]
        if len(keep) < len(seqs):
            idx = torch.tensor(keep, dtype=torch.long, device=logits.device)
            seqs = [seqs[j] for j in keep]
            logits = logits.index_select(0, idx)                                      # [S', V]
            argmax = argmax.index_select(0, idx) if argmax is not None else None
        rows = [j for j, s in enumerate(seqs) if s.request_id in self.structured]
        if not rows:
            return seqs, logits, argmax, None
        bitmask = self.structured.fill_bitmask([seqs[j].request_id for j in rows])
        return seqs, logits, argmax, TokenBitmask(rows, bitmask)
    def _execute(self, scheduled, pending, num_logits):
        """``runner.execute``; with tensor parallelism any failure in it (the ranks may be out
        of step) fails the group and raises :class:`TensorParallelError`."""
        if self.tp_runtime is None:
            return self.runner.execute(scheduled, pending, num_logits)
        try:
            return self.runner.execute(scheduled, pending, num_logits)
        except Exception as e:
            raise self.tp_runtime.fail(e) from e

    @staticmethod
    def _plan_prompt_logprobs(scheduled) -> tuple[list[int], list[tuple[int, int]]] | None:
        """Logits rows per item when some item scores prompt tokens this step: ``(num_logits,
        spans)`` with ``spans[i] = (lo, hi)`` the prompt-scoring positions of item ``i``
        (:meth:`Sequence.prompt_logprob_rows`); ``None`` (the default rows) otherwise."""
        spans = None
        for i, item in enumerate(scheduled):
            seq = item.seq
            if seq.sampling_params.prompt_logprobs is None or not seq.needs_prompt_logprobs:
                continue
            lo, hi = seq.prompt_logprob_rows(item.start_position, item.end_position)
            if lo < hi:
                if spans is None:
                    spans = [(0, 0)] * len(scheduled)
                spans[i] = (lo, hi)
        if spans is None:
            return None
        num_logits = []
        for item, (lo, hi) in zip(scheduled, spans):
            if lo < hi:   # rows lo .. end-1: prompt rows lo .. hi-1, then (hi == end - 1) the sampled row
                num_logits.append(item.end_position - lo)
            else:
                num_logits.append(1 if item.will_sample else 0)
        return num_logits, spans

    def _record_prompt_logprobs(self, scheduled, res, num_logits: list[int],
                                spans: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Append the prompt logprob records of this step's prompt rows to their sequences
        (log-softmax of the fp32 logits, the prompt token's logprob and the top
        ``prompt_logprobs`` alternatives) and return the sampled rows' logits ``[S, V]`` and
        their item indices. The prompt rows are read on the host at once (synchronous; only
        steps holding such rows pay it)."""
        t0 = time.perf_counter()
        logits = res.logits                                                     # [R, V]
        prompt_rows: list[int] = []
        targets: list[int] = []
        sample_rows: list[int] = []
        sample_idx: list[int] = []
        row = 0
        for i, (item, m, (lo, hi)) in enumerate(zip(scheduled, num_logits, spans)):
            if lo < hi:
                prompt_rows.extend(range(row, row + hi - lo))
                targets.extend(item.seq.prompt_token_ids[lo + 1:hi + 1])
            if item.will_sample and m:
                sample_rows.append(row + m - 1)
                sample_idx.append(i)
            row += m
        dev = logits.device
        rows_t = torch.tensor(prompt_rows, dtype=torch.long, device=dev)
        lp = torch.log_softmax(logits.index_select(0, rows_t).float(), dim=-1)  # [P, V]
        tok_lp = lp.gather(1, torch.tensor(targets, dtype=torch.long, device=dev)[:, None])[:, 0]
        k = max(item.seq.sampling_params.prompt_logprobs for item, (lo, hi) in zip(scheduled, spans) if lo < hi)
        top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
        tok_lp, top_v, top_i = tok_lp.tolist(), top_v.tolist(), top_i.tolist()
        j = 0
        for item, (lo, hi) in zip(scheduled, spans):
            if lo >= hi:
                continue
            seq = item.seq
            kk = seq.sampling_params.prompt_logprobs
            for _ in range(hi - lo):
                seq.prompt_logprobs.append({"token_logprob": tok_lp[j],
                                            "top": list(zip(top_i[j][:kk], top_v[j][:kk]))})
                j += 1
        self.num_prompt_logprob_rows += len(prompt_rows)
        if sample_rows != list(range(len(sample_rows))) or len(sample_rows) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(sample_rows, dtype=torch.long, device=dev))
        self.prompt_logprob_seconds += time.perf_counter() - t0
        return logits, sample_idx

    @staticmethod
    def _token_history(seqs: list[Sequence], pending) -> tuple[list | None, torch.Tensor | None]:
        """Per-row :class:`~llmserve.worker.sampler.TokenHistory` for the penalties (``None``
        when no row has any); a token still on the device is found in the previous step's
        sampled ids (``pending``, from :meth:`_InFlightStep.device_source`)."""
        if not any(s.sampling_params.has_penalties for s in seqs):
            return None, None
        rows = pending.index if pending is not None else {}
        history = [TokenHistory(s.prompt_token_ids, s.output_token_ids,
                                rows.get(s.request_id) if s.num_pending > 0 else None)
                   if s.sampling_params.has_penalties else None for s in seqs]
        return history, (pending.token_ids if pending is not None else None)

    def _update(self, step: _InFlightStep) -> list[RequestOutput]:
        """Wait for ``step``'s sampled tokens and hand them to the scheduler's update (append,
        grammar, stop rules, finish and free: :meth:`Scheduler.update`); then call the
        requests' callbacks and release the finished requests' engine state. Sequences that
        finished (EOS, abort) while the step was in flight drop their token.

        Raises:
            Exception: the first exception a callback raised, once every token is recorded.
        """
        t0 = time.perf_counter()
        step.sample.wait()
        t1 = time.perf_counter()
        result = step.sample.result()
        now = time.perf_counter()
        sampled = SampledTokens(step.seqs, result.token_ids, result.logprobs)
        if step.verify is not None:
            sampled = step.verify.merge(sampled)
        accept = self.structured.accept if self.structured is not None and len(self.structured) else None
        update = self.scheduler.update(sampled, accept)
        if self.speculator is not None:
            self.speculator.after_update(step.verify, update.outputs)
        errors = self._deliver(update)
        self.step_seconds["device_wait"] += t1 - t0
        self.step_seconds["sample"] += now - t1
        self.step_seconds["postprocess"] += time.perf_counter() - now
        if errors:  # every token is recorded first; then the first callback error propagates
            raise errors[0]
        return update.outputs

    def _deliver(self, update: StepUpdate) -> list[Exception]:
        """Call the callbacks of the requests in ``update`` (their exceptions are returned, not
        raised), then release the engine state of the requests that finished."""
        errors: list[Exception] = []
        if self._callbacks:
            for ro in update.outputs:
                cb = self._callbacks.get(ro.request_id)
                if cb is not None:
                    try:
                        cb(ro)
                    except Exception as e:  # noqa: BLE001 - re-raised by the caller once the step is consistent
                        errors.append(e)
        for seq in update.finished:
            self._callbacks.pop(seq.request_id, None)   # told above: _finish must not repeat it
            self._finish(seq)
        return errors

    def stats(self) -> dict:
        """Scheduler and KV cache counters (for metrics endpoints and benchmark reports)."""
        bm = self.block_manager
        total = bm.num_total_blocks
        used = total - bm.num_free_blocks
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": total,
            "kv_cache_usage": used / total if total else 0.0,
            "max_blocks_in_use": self.max_blocks_in_use,
            "kv_cache_usage_high_water": self.max_blocks_in_use / total if total else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_recomputed_tokens": self.scheduler.num_recomputed_tokens,
            "num_steps": self.num_steps,
            # how the model runner executed its steps: replayed decode graphs, replayed graphs
            # of steps with prefill chunks, eager forwards (every step on a CPU)
            "steps_by_path": {"decode_graph": self.runner.num_graph_steps,
                              "mixed_graph": self.runner.num_mixed_graph_steps,
                              "eager": self.runner.num_eager_steps},
            "block_size": self.block_size,
            "step_seconds": dict(self.step_seconds),
            "prompt_logprobs": {"rows": self.num_prompt_logprob_rows,
                                "seconds": self.prompt_logprob_seconds},
            # prefix cache: queries/hits in tokens at admission, hit_rate = hits / queries
            "prefix_cache": bm.prefix_cache_stats(),
            # grammar-constrained requests: bitmask rows and their host seconds, grammar compilations
            "structured_output": self.structured.stats() if self.structured is not None else None,
            "tensor_parallel": self._tp_stats(),
        }

    def _tp_stats(self) -> dict:
        """Tensor parallelism: the size, rank 0's step broadcasts (count, host wall seconds,
        bytes) and its model collectives (all-reduces and logits gathers: count, host wall
        seconds; on CPU with gloo the transfers themselves, with NCCL only their launches)."""
        rt = self.tp_runtime
        if rt is None:
            return {"size": 1}
        ch, g = rt.channel, rt.group
        return {"size": rt.size, "broadcast_steps": ch.num_sends, "broadcast_seconds": ch.send_seconds,
                "broadcast_bytes": ch.send_bytes, "collectives": g.num_collectives,
                "collective_seconds": g.collective_seconds}
