"""``llmserve bench-compare``: llmserve against the hardware floor and HF transformers, in one run.

Measures, with random weights of published Qwen2.5 shapes (speed does not depend on values):

a. batch-1 decode ms/step for each model against the floor (unique weight bytes / measured
   copy bandwidth), for llmserve (CUDA graphs + fused kernels; bf16 weights, and with
   ``--decode-linear-backends`` also the Triton INT8 weight-only projections, whose floor
   counts their int8 bytes) and HF ``generate``;
b. the offline workload (N requests, input and output lengths uniform in [lo, hi], EOS
   ignored): output tok/s of llmserve continuous batching (with the hand-tuned scheduler
   flags, with every flag at its default, or both: ``--offline-flags``), HF ``generate_batch``
   (its continuous batching) and HF static ``generate``; the HF runs may use a subset of the
   requests (``--hf-requests``) to keep the run short, which the report states;
c. open-loop ShareGPT-profile runs at several arrival rates: p50/p95 TTFT and TPOT
   (through ``llmserve benchmark``'s runner; tuned flags, defaults or both, alternated:
   ``--openloop-flags``);
d. the decode sweep (``--parts decode-sweep``): ms per decode step at batch 1..256 and contexts
   128 and 1024 against the floor (weight bytes plus the step's KV bytes over the copy
   bandwidth), with a plot.

Each part that fails is kept as a row with its error. Output: JSON + a Markdown table.
The copy bandwidth and matmul rate are measured at the start of the run (METHOD.md: measure
the ceilings on the machine you report).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from ..engine_args import int_at_least


# ---------------------------------------------------------------------------------------------
# ceilings
def measure_ceilings(device: torch.device) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    n = 1 << 30                                                        # 1 GiB buffers
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    bw = 2 * n / float(np.median(times))
    del a, b
    m = 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        x @ y
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    flops = 2 * m ** 3 / float(np.median(times))
    del x, y
    torch.cuda.empty_cache()
    return {"copy_bandwidth_Bps": bw, "bf16_matmul_flops": flops}


def unique_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: parameters and persistent buffers (the int8
    weights and scales of quantized layers), each storage counted once (tied embeddings)."""
    from ..quant import model_nbytes

    return model_nbytes(model)


# ---------------------------------------------------------------------------------------------
# a. batch-1 decode
def llmserve_engine(preset: str, max_num_seqs: int, max_model_len: int, num_blocks: int | None = None,
                    chunk: int | None = None, budget: int = 8192, graphs: bool = True,
                    linear_backend: str = "torch"):
    """An ``LLMEngine`` on ``cuda`` over random weights of ``preset``'s shapes with the tuned
    flags of this comparison (Triton attention, ``max_num_seqs``, chunk, budget; 60% of free
    memory for the KV pool so two engines of a run never compete for it)."""
    from ..engine import build_engine
    from ..engine_args import EngineArgs

    args = EngineArgs(model=f"random:{preset}", device="cuda", attention_backend="triton", cuda_graph=graphs,
                      linear_backend=linear_backend, block_size=16, num_blocks=num_blocks,
                      gpu_memory_utilization=0.6, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      max_num_batched_tokens=budget, prefill_chunk_size=chunk or 0)
    return build_engine(args.create_engine_config("offline"))


def default_engine(preset: str, max_model_len: int = 4096):
    """The engine ``llmserve benchmark --device cuda`` builds with no tuning flag: every field at
    its CUDA default (:func:`llmserve.engine_args.device_defaults`)."""
    from ..engine import build_engine
    from ..engine_args import EngineArgs

    return build_engine(EngineArgs(model=f"random:{preset}", device="cuda",
                                   max_model_len=max(4096, max_model_len)).create_engine_config("offline"))


def decode_llmserve(preset: str, steps: int, prompt_len: int = 32, linear_backend: str = "torch") -> dict:
    """Batch-1 greedy decode of ``steps`` tokens after a ``prompt_len``-token prompt: median and
    p90 ms between tokens, one replay of the last decode graph (CUDA events), the weight bytes
    of the model as built (``linear_backend`` as ``--linear-backend``)."""
    from ..core.sampling_params import SamplingParams

    eng = llmserve_engine(preset, max_num_seqs=8, max_model_len=2048, num_blocks=2048,
                          linear_backend=linear_backend)
    weight_bytes = unique_param_bytes(eng.model)
    sp = SamplingParams(max_tokens=steps, ignore_eos=True)
    eng.generate([list(range(100, 100 + prompt_len))], SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
    seq = eng.add_request(list(range(200, 200 + prompt_len)), sp)
    torch.cuda.synchronize()
    before, steps0 = dict(eng.step_seconds), eng.num_steps
    while eng.has_unfinished_requests():
        eng.step()
    gaps = np.diff(np.array(seq.metrics.token_times)) * 1e3
    # where a step's wall time went, us per step ("device_wait": the host waiting for the device)
    n_steps = max(1, eng.num_steps - steps0)
    split_us = {k: (eng.step_seconds[k] - before[k]) / n_steps * 1e6 for k in before}
    # the graph replay alone (GPU time of one decode step: the graph the last step replayed), CUDA events
    g = eng.runner.cuda_graphs
    graph_ms = None
    if g is not None and g.last_graph is not None:
        graph = g.last_graph
        times = []
        for _ in range(50):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        graph_ms = float(np.median(times))
    out = {"step_ms_median": float(np.median(gaps)), "step_ms_p90": float(np.percentile(gaps, 90)),
           "graph_replay_ms": graph_ms, "weight_bytes": weight_bytes, "step_split_us": split_us,
           "graph_steps": eng.runner.num_graph_steps, "eager_steps": eng.runner.num_eager_steps,
           "mixed_graph_steps": eng.runner.num_mixed_graph_steps,
           "short_context_replays": g.num_short_replays if g is not None else 0}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def hf_model(preset: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ..models.presets import preset_config

    cfg = preset_config(preset).to_hf_dict()
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    cfg.pop("torch_dtype", None)
    hf_cfg = Qwen2Config(**cfg)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(hf_cfg).to(torch.bfloat16)
    model.eval()
    return model


@torch.inference_mode()
def decode_hf(preset: str, steps: int, prompt_len: int = 32) -> dict:
    model = hf_model(preset)
    ids = torch.arange(100, 100 + prompt_len, device="cuda")[None]
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    torch.cuda.synchronize()
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    out = {"step_ms": (total - t_prefill) / (steps - 1) * 1e3}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# b. offline workload
def offline_workload(n: int, lo: int, hi: int, seed: int, vocab: int = 151643):
    rng = np.random.default_rng(seed)
    ins = rng.integers(lo, hi + 1, size=n)
    outs = rng.integers(lo, hi + 1, size=n)
    prompts = [rng.integers(10, vocab, size=int(k)).tolist() for k in ins]
    return prompts, [int(o) for o in outs]


def _timed_runs(run_once, repetitions: int, tokens) -> dict:
    """Call ``run_once()`` ``repetitions`` times and time each call on the wall clock.

    Args:
        run_once: runs the whole timed workload once (it synchronises the device itself) and
            returns the output tokens it produced, or None to count ``tokens``.
        repetitions: timed runs (>= 1).
        tokens: output tokens of one run when ``run_once`` returns None.

    Returns: ``seconds`` and ``output_tok_per_s`` of the median run (by tok/s), their lists
    per run (``runs_seconds``, ``runs_output_tok_per_s``), ``output_tok_per_s_min``/``_max``,
    ``output_tok_per_s_cv`` (standard deviation / mean; None under 2 runs) and ``repetitions``.

    Raises:
        ValueError: ``repetitions`` < 1.
    """
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions}")
    secs, rates = [], []
    for _ in range(repetitions):
        t0 = time.perf_counter()
        made = run_once()
        dt = time.perf_counter() - t0
        secs.append(dt)
        rates.append((tokens if made is None else made) / dt)
    mid = sorted(range(repetitions), key=lambda i: rates[i])[(repetitions - 1) // 2]
    return {"seconds": secs[mid], "output_tok_per_s": rates[mid], "runs_seconds": secs,
            "runs_output_tok_per_s": rates, "output_tok_per_s_min": min(rates),
            "output_tok_per_s_max": max(rates), "output_tok_per_s_cv": _cv(rates),
            "repetitions": repetitions}


def offline_llmserve(preset: str, prompts, outs, max_num_seqs: int | None, chunk: int | None,
                     budget: int | None, defaults: bool = False, repetitions: int = 1) -> dict:
    """The offline workload through ``LLMEngine`` (all requests at t = 0): output tok/s after a
    warm-up, ``repetitions`` timed runs on the same engine (see :func:`_timed_runs`; the
    median run is the row's value). ``defaults``: the engine with no tuning flag
    (:func:`default_engine`) instead of the given ``max_num_seqs``/``chunk``/``budget``."""
    from ..core.sampling_params import SamplingParams

    max_len = max(len(p) + o for p, o in zip(prompts, outs)) + 16
    if defaults:
        eng = default_engine(preset, max_len)
        sc = eng.config.scheduler
        max_num_seqs, chunk, budget = sc.max_num_seqs, sc.prefill_chunk_size, sc.max_num_batched_tokens
    else:
        eng = llmserve_engine(preset, max_num_seqs=max_num_seqs, max_model_len=max_len, chunk=chunk,
                              budget=budget)
    # Warm-up: the first 64 requests of the workload with short outputs, so Triton's
    # per-specialisation compiles (prefill chunks, mixed prefill+decode steps, decode buckets)
    # happen before timing. A first run on a fresh machine otherwise pays ~5 s of compiles.
    eng.generate(prompts[:64], SamplingParams(max_tokens=32, ignore_eos=True))
    torch.cuda.synchronize()
    steps0, graph0, eager0 = eng.stats()["num_steps"], eng.runner.num_graph_steps, eng.runner.num_eager_steps
    mixed0 = eng.runner.num_mixed_graph_steps

    def run_once():
        for p, o in zip(prompts, outs):
            eng.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()

    total_out = sum(outs)
    out = {"requests": len(prompts), "output_tokens": total_out}
    out.update(_timed_runs(run_once, repetitions, total_out))
    st = eng.stats()
    out.update({"num_steps": (st["num_steps"] - steps0) // repetitions,
                "num_preemptions": st["num_preemptions"],
                "graph_steps": (eng.runner.num_graph_steps - graph0) // repetitions,
                "eager_steps": (eng.runner.num_eager_steps - eager0) // repetitions,
                "mixed_graph_steps": (eng.runner.num_mixed_graph_steps - mixed0) // repetitions,
                "num_blocks": st["num_total_blocks"], "max_num_seqs": max_num_seqs, "prefill_chunk": chunk,
                "max_num_batched_tokens": budget,
                # where the wall time went (LLMEngine.step_seconds, all runs and the warm-up):
                # "device_wait": the host waiting for the device
                "step_seconds": st["step_seconds"]})
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def hf_generate_batch(model, prompts, max_new: int, cb_config=None) -> dict:
    """HF continuous batching (``model.generate_batch``), greedy, EOS ignored, ``max_new`` tokens each.

    Args:
        model: an HF causal LM (any device; ``generate_batch`` picks its paged attention).
        prompts: list of token-id lists (one per request).
        max_new: new tokens asked of every request.
        cb_config: optional ``transformers.ContinuousBatchingConfig`` (cache blocks, batch
            tokens); None keeps transformers' own sizing, which the benchmark uses.

    Returns: ``{"results", "produced", "per_request", "failed", "missing"}``: the
    ``generate_batch`` dict, the total generated tokens, the generated-token count of each
    returned request, ``{request_id: error}`` for the requests transformers marked failed, and
    how many requests are absent from the results (unfinished ones are dropped there).

    Runs with inference mode off. ``generate_batch`` builds its cache and static input tensors
    in the calling thread (warm-up) and decodes in a background thread; in transformers 5.17
    that thread only enters ``torch.no_grad`` (``_run_generation_loop``), so tensors made under
    a caller's ``torch.inference_mode()`` are inference tensors it may not update in place
    ("Inplace update to inference tensor outside InferenceMode"), and every request fails with
    zero tokens. ``eos_token_id=-1`` is transformers' own "no EOS" value for this API.
    """
    from transformers.generation import GenerationConfig

    gc_ = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    kw = {} if cb_config is None else {"continuous_batching_config": cb_config}
    with torch.inference_mode(False), torch.no_grad():
        res = model.generate_batch(prompts, generation_config=gc_, progress_bar=False, **kw)
    per_request = [len(r.generated_tokens) for r in res.values()]
    failed = {k: r.error for k, r in res.items() if getattr(r, "error", None) is not None}
    # transformers leaves requests that never finished out of the result dict: count them too
    missing = max(0, len(prompts) - len(res))
    return {"results": res, "produced": sum(per_request), "per_request": per_request, "failed": failed,
            "missing": missing}


def offline_hf_continuous(preset: str, prompts, outs, repetitions: int = 1) -> dict:
    """Offline workload through HF ``generate_batch`` (its continuous batching), bf16 on CUDA,
    ``repetitions`` timed runs on one loaded model (see :func:`_timed_runs`).

    Every request asks for ``round(mean(outs))`` new tokens (``generate_batch`` takes one
    ``max_new_tokens``), so the total matches the workload's output tokens on average.
    ``output_tokens`` counts the tokens actually generated (median run); ``output_tok_per_s``
    is that over the wall time of the call. Raises RuntimeError if a run generated no token.
    """
    model = hf_model(preset)                 # generate_batch switches sdpa to "paged|sdpa"
    max_new = int(round(np.mean(outs)))
    failures = {"failed": 0, "produced": []}

    def run_once():
        torch.cuda.synchronize()
        out = hf_generate_batch(model, prompts, max_new)
        torch.cuda.synchronize()
        if out["produced"] == 0:
            first = next(iter(out["failed"].values()), None)
            raise RuntimeError(f"generate_batch produced no tokens for {len(prompts)} requests "
                               f"({len(out['failed'])} marked failed; first error: {first})")
        failures["failed"] = max(failures["failed"], len(out["failed"]) + out["missing"])
        failures["produced"].append(out["produced"])
        return out["produced"]

    try:
        res = _timed_runs(run_once, repetitions, None)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
    res.update({"requests": len(prompts), "max_new_tokens_each": max_new,
                "output_tokens": int(np.median(failures["produced"])),
                "requested_output_tokens": max_new * len(prompts), "failed_requests": failures["failed"]})
    return res


@torch.inference_mode()
def offline_hf_static(preset: str, prompts, outs, batch: int, repetitions: int = 1) -> dict:
    """The first ``batch`` requests through HF static ``generate`` (left padding, greedy, bf16 on
    CUDA): the batch runs until its longest request, and only each request's own target tokens
    count as output. One untimed run, then ``repetitions`` timed runs on one loaded model (see
    :func:`_timed_runs`)."""
    model = hf_model(preset)
    prompts, outs = prompts[:batch], outs[:batch]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                                     # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    max_new = max(outs)
    useful = sum(outs)

    def run_once():
        model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()

    try:
        # warm-up, untimed and whole: the first run's extra time grows with the output length
        # (a 2-token warm-up left the first timed run at a fifth of the others' throughput)
        run_once()
        res = _timed_runs(run_once, repetitions, useful)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
    res.update({"requests": len(prompts), "batch": batch, "max_new_tokens": max_new,
                "useful_output_tokens": useful,
                "note": "static batch runs until its longest request; only each request's own target "
                        "tokens count"})
    return res


# ---------------------------------------------------------------------------------------------
def _row(name, fn, *a, **kw) -> dict:
    t0 = time.perf_counter()
    try:
        res = fn(*a, **kw)
        res.update(status="ok", error=None)
    except Exception as e:  # noqa: BLE001 - a failed part is a row, never dropped
        res = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        torch.cuda.empty_cache()
    res["name"] = name
    res["wall_s"] = time.perf_counter() - t0
    print(json.dumps({k: v for k, v in res.items() if k != "traceback"}), flush=True)
    return res


def kv_bytes_per_token(model_config, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one cached token occupies over all layers."""
    mc = model_config
    return mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * dtype_bytes


#: Traced / untraced window pairs a decode-sweep cell times to measure the cost of tracing.
TRACE_PAIRS = 3


def _replay_ms(engine, steps: int, sync) -> float | None:
    """Mean ms of ``steps`` back-to-back replays of the decode graph the engine's last step
    replayed: the step's device time in the graph, without the host's part (scheduling, input
    staging, sampling, output handling) or the few small copies and kernels outside the graph.
    ``None`` where the engine has no decode graphs. The caller must know that the last step
    replayed a decode graph (``last_graph`` is not cleared by eager steps).

    Replaying is idempotent: the graph reads the inputs its last replay left in its static
    buffers and writes the same KV rows and outputs again, so the engine's next step is not
    disturbed."""
    graphs = getattr(getattr(engine, "runner", None), "cuda_graphs", None)
    g = getattr(graphs, "last_graph", None)
    if g is None:
        return None
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        g.replay()
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def decode_sweep(engine, batches: list[int], contexts: list[int], steps: int, warm: int = 8,
                 seed: int = 0, sync=None, trace=True) -> list[dict]:
    """Steady-state decode step time of ``engine`` at each batch size and context length.

    For each ``(context, batch)``: ``batch`` requests with distinct random prompts of
    ``context`` tokens (no shared prefix, so every sequence reads its own KV) and more output
    tokens than the cell needs; once every request has ``warm`` tokens the next ``steps``
    engine steps are timed on the wall clock (``sync`` waits for the device before reading it),
    each checked to decode the whole batch with no preemption; then the requests are aborted.
    The engine must admit ``max(batches)`` sequences and hold their KV.

    With ``trace`` (``True``: at every context; ``False`` or ``None``: at none; a collection
    of values of ``contexts``: at those only; tracing is host work per request and token, so
    one context shows it) the cost of request lifecycle tracing (:mod:`llmserve.core.trace`)
    is measured on the same requests: after the timed window, :data:`TRACE_PAIRS` pairs of
    windows of ``steps`` steps, one with a tracer attached and one without; each traced window
    is compared with the mean of the untraced windows around it (the context grows by
    ``steps`` tokens a window, so bracketing cancels that drift), and the median of the pairs
    is kept, so one host pause (a page fault, a garbage collection of the benchmark's own
    objects) does not decide the row.

    Returns:
        One row per cell: ``batch``, ``context``, ``ms_per_step``, ``kv_bytes`` (KV read per
        step at the timed steps' mean context), where decode graphs replay ``replay_ms`` (the
        graph alone, :func:`_replay_ms`, where every timed step replayed one) and
        ``host_gap_ms`` (``ms_per_step - replay_ms``: what a step costs beyond its graph, mostly
        host work the device waited for), with ``trace`` also ``traced_ms_per_step`` (the
        median traced window) and ``trace_overhead`` (median of traced / untraced - 1),
        ``status`` and ``error`` (a failed cell, a batch that was not full or was preempted
        included, stays a row).

    Raises:
        ValueError: ``trace`` names a context that ``contexts`` does not hold.
    """
    from ..core.sampling_params import SamplingParams
    from ..core.trace import RequestTracer

    sync = sync or (lambda: None)
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    per_token = kv_bytes_per_token(engine.model_config, torch.finfo(engine.model.dtype).bits // 8)
    traced_contexts = set(contexts) if trace is True else set(trace or ())
    if not traced_contexts <= set(contexts):
        raise ValueError(f"trace names contexts {sorted(traced_contexts - set(contexts))} "
                         f"that the sweep does not run (its contexts: {contexts})")
    rows = []
    for ctx in contexts:
        trace_here = ctx in traced_contexts
        for b in batches:
            row = {"batch": b, "context": ctx, "steps": steps, "status": "ok", "error": None}
            seqs = []
            try:
                # enough tokens that no request finishes while the others still prefill or in
                # the timed window (requests admitted first decode during the later prefills)
                budget = engine.scheduler.config.max_num_batched_tokens
                extra = -(-b * ctx // budget) + b + 16           # steps spent admitting the batch
                windows = 1 + 2 * TRACE_PAIRS if trace_here else 1
                sp = SamplingParams(max_tokens=warm + windows * steps + extra, ignore_eos=True)
                seqs = [engine.add_request(rng.integers(0, vocab, ctx).tolist(), sp) for _ in range(b)]
                while min(len(q.output_token_ids) for q in seqs) < warm:
                    engine.step()
                preempt0 = engine.scheduler.num_preemptions
                short = 0

                def window() -> float:
                    nonlocal short
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        engine.step()
                        short += engine.scheduler.num_running != b
                    sync()
                    return (time.perf_counter() - t0) / steps * 1e3

                graph0 = getattr(getattr(engine, "runner", None), "num_graph_steps", 0)
                row["ms_per_step"] = window()
                row["kv_bytes"] = b * (ctx + warm + steps // 2) * per_token
                # only where every timed step replayed a decode graph (else the last graph is stale)
                graphed = getattr(getattr(engine, "runner", None), "num_graph_steps", 0) - graph0 == steps
                replay = _replay_ms(engine, steps, sync) if graphed else None
                if replay is not None:
                    row["replay_ms"] = replay
                    row["host_gap_ms"] = row["ms_per_step"] - replay
                if trace_here:
                    before, traced, overheads = row["ms_per_step"], [], []
                    for _ in range(TRACE_PAIRS):
                        engine.tracer = RequestTracer()
                        try:
                            traced.append(window())
                        finally:
                            engine.tracer = None
                        after = window()
                        overheads.append(traced[-1] / ((before + after) / 2) - 1)
                        before = after
                    row["traced_ms_per_step"] = float(np.median(traced))
                    row["trace_overhead"] = float(np.median(overheads))
                if short or engine.scheduler.num_preemptions != preempt0:
                    row.update(status="failed", error=f"batch not full in {short} of {windows * steps} timed steps, "
                               f"{engine.scheduler.num_preemptions - preempt0} preemptions (KV cache too small?)")
            except Exception as e:  # noqa: BLE001 - the cell stays a row with its error
                row.update(status="failed", error=f"{type(e).__name__}: {e}")
            for q in seqs:
                engine.abort_request(q.request_id)
            while engine.has_unfinished_requests():
                engine.step()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def plot_decode_sweep(rows: list[dict], out: Path, title: str) -> None:
    """ms/step against batch size, one line per context, with each context's floor dashed.

    Raises:
        ValueError: no successful row (nothing to draw).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise ValueError("decode sweep: no successful cell to plot")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for ctx in sorted({r["context"] for r in ok}):
        rs = sorted((r for r in ok if r["context"] == ctx), key=lambda r: r["batch"])
        line, = ax.plot([r["batch"] for r in rs], [r["ms_per_step"] for r in rs], marker="o",
                        label=f"context {ctx}")
        if all(r.get("floor_ms") is not None for r in rs):
            ax.plot([r["batch"] for r in rs], [r["floor_ms"] for r in rs], linestyle="--",
                    color=line.get_color(), label=f"floor, context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per decode step")
    ax.set_ylabel("ms per step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    import transformers
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(device),
              "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_v,
              "python": platform.python_version(), "command": args.command_line,
              "code_hash": getattr(args, "code_hash", None), "parts": {}}
    t_part = time.perf_counter()
    seconds = report["part_seconds"] = {}

    def part_done(name: str) -> None:
        nonlocal t_part
        now = time.perf_counter()
        seconds[name] = round(now - t_part, 1)
        t_part = now

    report["ceilings"] = measure_ceilings(device)
    part_done("ceilings")
    bw = report["ceilings"]["copy_bandwidth_Bps"]
    print(json.dumps(report["ceilings"]), flush=True)
    if "decode" in args.parts:
        rows = []
        for preset in args.presets:
            for lb in args.decode_linear_backends:
                suffix = "" if lb == "torch" else f" {lb}"
                r = _row(f"llmserve decode {preset}{suffix}", decode_llmserve, preset, args.decode_steps,
                         linear_backend=lb)
                if r["status"] == "ok":
                    r["floor_ms"] = r["weight_bytes"] / bw * 1e3
                    r["ratio_to_floor"] = r["step_ms_median"] / r["floor_ms"]
                r["preset"] = preset
                r["linear_backend"] = lb
                rows.append(r)
            if not args.skip_hf and (args.hf_decode_presets is None or preset in args.hf_decode_presets):
                h = _row(f"hf generate decode {preset}", decode_hf, preset, args.hf_decode_steps)
                h["preset"] = preset
                rows.append(h)
        report["parts"]["decode"] = rows
        part_done("decode")
    if "decode-sweep" in args.parts:
        preset = args.offline_model
        batches, contexts = args.sweep_batches, args.sweep_contexts
        part = {"model": preset, "weight_bytes": None, "rows": [], "error": None}
        try:
            eng = llmserve_engine(preset, max_num_seqs=max(batches),
                                  max_model_len=max(contexts) + args.sweep_steps + 2 * max(batches) + 1024)
            part["weight_bytes"] = unique_param_bytes(eng.model)
            part["rows"] = decode_sweep(eng, batches, contexts, args.sweep_steps, seed=args.seed,
                                        sync=torch.cuda.synchronize, trace=contexts[:1])
            for r in part["rows"]:
                if r["status"] == "ok":
                    r["floor_ms"] = (part["weight_bytes"] + r["kv_bytes"]) / bw * 1e3
                    r["ratio_to_floor"] = r["ms_per_step"] / r["floor_ms"]
            del eng
        except Exception as e:  # noqa: BLE001 - the part stays in the report with its error
            part["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        report["parts"]["decode-sweep"] = part
        gc.collect()
        torch.cuda.empty_cache()
        part_done("decode-sweep")
    if "offline" in args.parts:
        prompts, outs = offline_workload(args.offline_requests, args.offline_lo, args.offline_hi, args.seed)
        reps = args.offline_repetitions
        rows = []
        if "tuned" in args.offline_flags:
            rows.append(_row("llmserve continuous", offline_llmserve, args.offline_model, prompts, outs,
                             args.max_num_seqs, args.prefill_chunk, args.max_num_batched_tokens, repetitions=reps))
        if "defaults" in args.offline_flags:
            rows.append(_row("llmserve continuous, defaults", offline_llmserve, args.offline_model, prompts, outs,
                             None, None, None, defaults=True, repetitions=reps))
        if not args.skip_hf:
            # HF's step costs the same at any output length: clipping its outputs shortens the
            # run without flattering llmserve (a shorter static batch wastes fewer padded steps)
            cap = args.hf_max_new_tokens
            hf_outs = [min(o, cap) for o in outs] if cap is not None else outs
            clipped = f", outputs clipped to {cap}" if cap is not None else ""
            k = args.hf_requests
            rows.append(_row(f"hf generate_batch (continuous){clipped}", offline_hf_continuous,
                             args.offline_model, prompts[:k], hf_outs[:k], repetitions=reps))
            n = args.hf_static_requests
            rows.append(_row(f"hf generate (static){clipped}", offline_hf_static, args.offline_model,
                             prompts[:n], hf_outs[:n], args.hf_static_batch, repetitions=reps))
        report["parts"]["offline"] = {"model": args.offline_model, "requests": len(prompts),
                                      "output_tokens": sum(outs), "lo": args.offline_lo,
                                      "hi": args.offline_hi, "seed": args.seed, "repetitions": reps,
                                      "hf_max_new_tokens": args.hf_max_new_tokens, "rows": rows}
        part_done("offline")
    if "openloop" in args.parts:
        from ..engine.builder import EnginePartsCache

        rows = []
        # With one flag set every row takes over the previous row's engine (built once); with
        # both, the rows alternate settings (so drift spreads over both) and each builds its own.
        parts = EnginePartsCache() if len(set(args.openloop_flags)) == 1 else None
        for rep in range(args.openloop_repetitions):
            for rate in args.rates:
                for defaults in [f == "defaults" for f in args.openloop_flags]:
                    name = f"llmserve open-loop {rate} req/s" + (", defaults" if defaults else "")
                    r = _row(name, openloop, args.offline_model, rate, args.openloop_requests, args.seed,
                             defaults=defaults, parts_cache=parts)
                    r.update(repetition=rep, defaults=defaults)
                    rows.append(r)
        if parts is not None:
            parts.clear()
        report["parts"]["openloop"] = rows
        part_done("openloop")
    if "serve" in args.parts:
        rows = []
        for defaults in (False, True):
            name = "llmserve serve" + (", defaults" if defaults else ", tuned flags")
            r = _row(name, serve_completion, args.offline_model, args.serve_tokens, args.serve_repetitions,
                     defaults=defaults)
            r["defaults"] = defaults
            rows.append(r)
        report["parts"]["serve"] = rows
        part_done("serve")
    return report


#: The open-loop rows' hand-tuned engine flags (the ``defaults`` rows leave them out).
OPENLOOP_TUNED_FLAGS = ("--attention-backend", "triton", "--max-num-seqs", "128", "--prefill-chunk-size",
                        "512", "--max-num-batched-tokens", "2048")


def openloop(preset: str, rate: float, requests: int, seed: int, defaults: bool = False,
             parts_cache=None) -> dict:
    """One open-loop ``llmserve benchmark`` run of the ShareGPT GPU profile at ``rate`` req/s;
    ``defaults``: without :data:`OPENLOOP_TUNED_FLAGS` (every engine flag at its CUDA default).
    ``parts_cache`` (an :class:`~llmserve.engine.builder.EnginePartsCache`): a row takes over
    the previous row's weights, KV cache and CUDA graphs when that row had the same flags,
    instead of building them again (its scheduler, caches and counters are fresh); the result's
    ``reused_parts`` says whether it did."""
    import tempfile

    from .runner import add_benchmark_args, options_from_args, run_benchmark

    out = Path(tempfile.mkdtemp()) / f"openloop-{rate}.json"
    argv = ["--config", "continuous", "--model", f"random:{preset}", "--device", "cuda",
            "--profile", "sharegpt-gpu", "--requests", str(requests),
            "--arrival-rate", str(rate), "--seed", str(seed), "--warmup-requests", "4",
            "--output", str(out), "--no-progress"]
    if not defaults:
        argv += list(OPENLOOP_TUNED_FLAGS)
    from ..envs import sharegpt_path
    if sharegpt_path():
        argv += ["--dataset-path", sharegpt_path()]
    parser = argparse.ArgumentParser(prog="llmserve benchmark")
    add_benchmark_args(parser)
    rep, _, _ = run_benchmark(options_from_args(parser.parse_args(argv)), parts_cache=parts_cache)
    agg = rep.get("aggregates", {})
    keys = ["ttft_ms_p50", "ttft_ms_p95", "tpot_ms_p50", "tpot_ms_p95", "output_throughput",
            "request_throughput", "num_requests", "num_preemptions"]
    res = {k: agg.get(k) for k in keys}
    startup = (rep.get("warmup") or {}).get("engine_startup") or {}
    res.update(rate=rate, run_status=rep.get("status"), run_error=rep.get("error"),
               reused_parts=bool(startup.get("reused_parts")))
    gc.collect()
    torch.cuda.empty_cache()
    return res


#: ``serve``'s hand-tuned engine flags of the ``serve`` rows (the ``defaults`` row leaves them out).
SERVE_TUNED_FLAGS = ("--attention-backend", "triton", "--cuda-graph", "--fused-forward", "--async-scheduling",
                     "--max-num-seqs", "256", "--prefill-chunk-size", "512", "--max-num-batched-tokens", "2048")


def serve_completion(preset: str, tokens: int, repetitions: int, defaults: bool = False) -> dict:
    """Wall seconds of a ``tokens``-token greedy ``/v1/completions`` answer from ``llmserve serve``
    (in this process, on loopback, after its start-up and kernel warm-up): median and spread
    over ``repetitions`` requests. ``defaults``: ``serve --model random:PRESET --device cuda``
    with no other flag; else with :data:`SERVE_TUNED_FLAGS`."""
    import httpx

    from ..serve.server import BackgroundServer, add_serve_subparser, build_app

    parser = argparse.ArgumentParser(prog="llmserve")
    add_serve_subparser(parser.add_subparsers(dest="command"))
    argv = ["serve", "--model", f"random:{preset}", "--device", "cuda", "--log-level", "warning"]
    if not defaults:
        argv += list(SERVE_TUNED_FLAGS)
    t0 = time.perf_counter()
    app = build_app(parser.parse_args(argv))
    startup_s = time.perf_counter() - t0
    times = []
    with BackgroundServer(app) as srv:
        body = {"model": f"random:{preset}", "prompt": "Tell me a long story about a lighthouse.",
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            health = client.get("/health").json()
            for _ in range(repetitions + 1):          # the first answer is not timed
                t = time.perf_counter()
                r = client.post("/v1/completions", json=body)
                r.raise_for_status()
                times.append(time.perf_counter() - t)
                n = r.json()["usage"]["completion_tokens"]
    times = times[1:]
    del app
    gc.collect()
    torch.cuda.empty_cache()
    med = float(np.median(times))
    return {"seconds_median": med, "seconds_min": float(min(times)), "seconds_max": float(max(times)),
            "ms_per_token": med / max(1, n) * 1e3, "completion_tokens": n, "startup_s": startup_s,
            "startup": health.get("startup"), "flags": " ".join(argv[1:])}


def to_markdown(rep: dict) -> str:
    c = rep["ceilings"]
    lines = [f"# llmserve vs the floor and HF transformers ({rep['gpu']})", "",
             f"Date {rep['date']}; torch {rep['torch']}, transformers {rep['transformers']}, "
             f"triton {rep['triton']}. Measured ceilings: copy {c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
             f"bf16 matmul {c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s. Random weights, bf16.", "",
             f"Command: `{rep['command']}`" + (f"; engine code hash `{rep['code_hash']}`"
                                               if rep.get("code_hash") else ""), ""]
    if "decode" in rep["parts"]:
        lines += ["## Batch-1 decode (ms/step)", "",
                  "| model | engine | ms/step (median) | graph replay ms | floor ms | x floor | status |",
                  "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for r in rep["parts"]["decode"]:
            lb = r.get("linear_backend", "torch")
            eng = ("HF generate" if r["name"].startswith("hf")
                   else "llmserve" if lb == "torch" else f"llmserve, {lb} projections")
            ms = r.get("step_ms_median", r.get("step_ms"))
            lines.append(f"| {r.get('preset')} | {eng} | {_f(ms)} | {_f(r.get('graph_replay_ms'))} | "
                         f"{_f(r.get('floor_ms'))} | {_f(r.get('ratio_to_floor'))} | "
                         f"{r['status']} {r.get('error') or ''} |")
        lines.append("")
    if "offline" in rep["parts"]:
        o = rep["parts"]["offline"]
        lines += [f"## Offline workload ({o['requests']} requests, lengths uniform in [{o['lo']}, {o['hi']}], "
                  f"{o['output_tokens']} output tokens, {o['model']})", "",
                  "Output tok/s: median [min-max] over the timed runs (one loaded engine or model, "
                  "after a warm-up); CV = standard deviation / mean; seconds: the median run.", "",
                  "| engine | requests | output tokens | runs | seconds | output tok/s | CV | status |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in o["rows"]:
            toks = r.get("output_tokens", r.get("useful_output_tokens"))
            rates = r.get("runs_output_tok_per_s") or [r.get("output_tok_per_s")]
            cv = r.get("output_tok_per_s_cv")
            lines.append(f"| {r['name']} | {r.get('requests', '')} | {toks or ''} | {r.get('repetitions', 1)} | "
                         f"{_f(r.get('seconds'))} | {_spread(rates)} | "
                         f"{'' if cv is None else f'{cv:.0%}' + (' noisy' if cv > 0.10 else '')} | "
                         f"{r['status']} {r.get('error') or ''} |")
        lines.append("")
    if "decode-sweep" in rep["parts"] and rep["parts"]["decode-sweep"].get("error"):
        lines += ["## Decode sweep", "", f"failed: {rep['parts']['decode-sweep']['error']}", ""]
    elif "decode-sweep" in rep["parts"]:
        d = rep["parts"]["decode-sweep"]
        rows = d["rows"]
        batches = sorted({r["batch"] for r in rows})
        lines += [f"## Decode step at batch 1..{max(batches)} ({d['model']}, ms/step; x floor = over "
                  "(weight + KV bytes) / copy bandwidth)", "",
                  "Tracing on: the step time with request lifecycle tracing (`--trace`) against "
                  "the untraced steps around it, on the same requests (median of "
                  f"{TRACE_PAIRS} traced windows, each bracketed by untraced ones; at the contexts with "
                  "a row of it: tracing is host work per token, so one context shows it).", "",
                  "| context | " + " | ".join(str(b) for b in batches) + " |",
                  "| --- |" + " ---: |" * len(batches)]
        for ctx in sorted({r["context"] for r in rows}):
            cells = {r["batch"]: r for r in rows if r["context"] == ctx}
            ms = [(_f(cells[b].get("ms_per_step")) if cells[b]["status"] == "ok" else "failed")
                  if b in cells else "" for b in batches]
            xf = [_f(cells[b].get("ratio_to_floor")) if b in cells else "" for b in batches]
            lines.append(f"| {ctx}: ms/step | " + " | ".join(ms) + " |")
            lines.append(f"| {ctx}: x floor | " + " | ".join(xf) + " |")
            if any(c.get("replay_ms") is not None for c in cells.values()):
                okc = {b: c for b, c in cells.items() if c["status"] == "ok"}
                rp = [_f(okc[b].get("replay_ms")) if b in okc else "" for b in batches]
                gap = [_f(okc[b].get("host_gap_ms")) if b in okc else "" for b in batches]
                lines.append(f"| {ctx}: graph replay alone | " + " | ".join(rp) + " |")
                lines.append(f"| {ctx}: host gap (step - replay) | " + " | ".join(gap) + " |")
            if any(c.get("trace_overhead") is not None for c in cells.values()):
                tr = [f"{cells[b]['trace_overhead']:+.1%}" if cells.get(b, {}).get("trace_overhead") is not None
                      else "" for b in batches]
                lines.append(f"| {ctx}: tracing on | " + " | ".join(tr) + " |")
        errors = [r for r in rows if r["status"] != "ok"]
        lines += [f"- batch {r['batch']} context {r['context']}: {r['error']}" for r in errors]
        lines.append("")
    if "openloop" in rep["parts"]:
        lines += ["## Open-loop ShareGPT profile (llmserve continuous, Qwen2.5-1.5B shapes)", "",
                  "Tuned flags: `" + " ".join(OPENLOOP_TUNED_FLAGS) + "`; defaults: none of them. "
                  "Median [min-max] over the repetitions (tuned and defaults alternated when both "
                  "run); CV = "
                  "standard deviation / mean of p50 TTFT.", "",
                  "| rate req/s | flags | runs | p50 TTFT ms | CV | p95 TTFT ms | p50 TPOT ms | output tok/s | status |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        groups: dict = {}
        for r in rep["parts"]["openloop"]:
            groups.setdefault((r.get("rate"), bool(r.get("defaults"))), []).append(r)
        for (rate, defaults), rs in groups.items():
            ok = [r for r in rs if r["status"] == "ok" and r.get("run_status") == "ok"]
            errs = "; ".join(sorted({str(r.get("error") or r.get("run_error")) for r in rs if r not in ok}))
            ttft = [r["ttft_ms_p50"] for r in ok if r.get("ttft_ms_p50") is not None]
            cv = _cv(ttft)
            lines.append(f"| {rate} | {'defaults' if defaults else 'tuned'} | {len(ok)}/{len(rs)} | "
                         f"{_spread([r.get('ttft_ms_p50') for r in ok])} | "
                         f"{'' if cv is None else f'{cv:.0%}' + (' noisy' if cv > 0.10 else '')} | "
                         f"{_spread([r.get('ttft_ms_p95') for r in ok])} | "
                         f"{_spread([r.get('tpot_ms_p50') for r in ok])} | "
                         f"{_spread([r.get('output_throughput') for r in ok])} | "
                         f"{'ok' if not errs else 'failed: ' + errs} |")
        lines.append("")
    if "serve" in rep["parts"]:
        lines += ["## `llmserve serve`: one greedy completion, defaults against tuned flags", "",
                  "| server | flags | completion tokens | seconds (median [min-max]) | ms/token | start-up s | status |",
                  "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for r in rep["parts"]["serve"]:
            sec = (f"{r['seconds_median']:.3f} [{r['seconds_min']:.3f}-{r['seconds_max']:.3f}]"
                   if r["status"] == "ok" else "")
            lines.append(f"| {r['name']} | `{r.get('flags', '')}` | {r.get('completion_tokens', '')} | {sec} | "
                         f"{_f(r.get('ms_per_token'))} | {_f(r.get('startup_s'))} | "
                         f"{r['status']} {r.get('error') or ''} |")
        lines.append("")
    if rep.get("part_seconds"):
        sec = rep["part_seconds"]
        lines += ["Wall seconds of each part (model builds and warm-ups included): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sec.items())
                  + f"; {sum(sec.values()):.0f} in all.", ""]
    return "\n".join(lines) + "\n"


def _spread(vals) -> str:
    """``median [min-max]`` of the numbers in ``vals`` (``None`` skipped), or empty."""
    v = [float(x) for x in vals if x is not None]
    if not v:
        return ""
    return f"{np.median(v):,.2f} [{min(v):,.2f}-{max(v):,.2f}]" if len(v) > 1 else f"{v[0]:,.2f}"


def _cv(vals) -> float | None:
    """Coefficient of variation (population standard deviation / mean), ``None`` under 2 values."""
    v = [float(x) for x in vals if x is not None]
    if len(v) < 2 or np.mean(v) == 0:
        return None
    return float(np.std(v) / np.mean(v))


def _f(v) -> str:
    return "" if v is None else (f"{v:,.2f}" if isinstance(v, float) else str(v))


def add_bench_compare_subparser(sub) -> None:
    p = sub.add_parser("bench-compare", help="llmserve vs floor vs HF transformers on a CUDA GPU",
                       description="Compare llmserve with a floor and with HF transformers on one CUDA GPU: "
                                   "batch-1 decode, offline throughput and open-loop latency; writes JSON "
                                   "and Markdown under --output.")
    p.add_argument("--parts", nargs="+", default=["decode", "offline", "openloop", "decode-sweep", "serve"],
                   choices=["decode", "offline", "openloop", "decode-sweep", "serve"],
                   help="which comparisons to run (default: all)")
    p.add_argument("--sweep-batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="decode sweep: sequences per step (model: --offline-model)")
    p.add_argument("--sweep-contexts", nargs="+", type=int, default=[128, 1024],
                   help="decode sweep: prompt length of every sequence (tokens)")
    p.add_argument("--sweep-steps", type=int, default=100, help="decode sweep: steps timed per cell")
    p.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"],
                   help="model presets of the decode comparison (random weights of the real shapes)")
    p.add_argument("--decode-steps", type=int, default=256, help="decode steps timed per preset")
    p.add_argument("--decode-linear-backends", nargs="+", default=["torch", "triton-int8"],
                   choices=["torch", "triton-int8"],
                   help="batch-1 decode rows per linear backend (triton-int8: int8 weight-only "
                        "projections, embeddings and LM head bf16)")
    p.add_argument("--hf-decode-steps", type=int, default=64, help="decode steps timed for HF transformers")
    p.add_argument("--hf-decode-presets", nargs="+", default=None,
                   help="presets whose batch-1 decode HF transformers also runs (default: every --presets)")
    p.add_argument("--offline-model", default="qwen2.5-1.5b",
                   help="model preset of the offline and open-loop comparisons")
    p.add_argument("--offline-requests", type=int, default=256, help="requests of the offline run")
    p.add_argument("--offline-lo", type=int, default=100, help="shortest prompt/output length (tokens)")
    p.add_argument("--offline-hi", type=int, default=1024, help="longest prompt/output length (tokens)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="llmserve: most sequences per step")
    p.add_argument("--prefill-chunk-size", "--prefill-chunk", dest="prefill_chunk", type=int, default=2048,
                   help="llmserve: chunked-prefill size (tokens)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="llmserve: token budget of one step")
    p.add_argument("--hf-requests", type=int, default=32, help="requests given to HF generate_batch")
    p.add_argument("--hf-static-batch", type=int, default=64, help="batch size of HF's static-batch baseline")
    p.add_argument("--hf-static-requests", type=int, default=256,
                   help="offline requests given to HF's static-batch baseline (the first N)")
    p.add_argument("--hf-max-new-tokens", type=int_at_least(1), default=None,
                   help="clip the output length of every HF offline request to this many tokens "
                        "(default: the workload's own lengths)")
    p.add_argument("--offline-repetitions", type=int_at_least(1), default=3,
                   help="timed runs of every offline row on one loaded engine or model")
    p.add_argument("--code-hash", default=None,
                   help="the engine's code hash, recorded in the report (the pipeline passes it)")
    p.add_argument("--skip-hf", action="store_true", help="do not run HF transformers")
    p.add_argument("--rates", nargs="+", type=float, default=[4.0, 16.0, 64.0],
                   help="open-loop arrival rates (requests/s)")
    p.add_argument("--openloop-requests", type=int, default=200, help="requests per open-loop rate")
    p.add_argument("--openloop-repetitions", type=int_at_least(1), default=3,
                   help="runs of every open-loop row (tuned flags and defaults alternated)")
    p.add_argument("--openloop-flags", nargs="+", default=["tuned", "defaults"], choices=["tuned", "defaults"],
                   help="open-loop rows: with the hand-tuned engine flags, with every flag at its "
                        "default, or both (alternated)")
    p.add_argument("--offline-flags", nargs="+", default=["tuned", "defaults"], choices=["tuned", "defaults"],
                   help="offline llmserve rows: with --max-num-seqs/--prefill-chunk-size/"
                        "--max-num-batched-tokens, with every engine flag at its default, or both")
    p.add_argument("--serve-tokens", type=int, default=256, help="serve rows: tokens of the timed completion")
    p.add_argument("--serve-repetitions", type=int, default=5, help="serve rows: timed completions per row")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--output", "--out", dest="out", default="results/h200", help="output directory")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import sys
    if not torch.cuda.is_available():
        print("bench-compare needs a CUDA GPU", file=sys.stderr)
        return 2
    args.command_line = "llmserve " + " ".join(sys.argv[1:])
    rep = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(rep, indent=2))
    (out / "compare.md").write_text(to_markdown(rep))
    d = rep["parts"].get("decode-sweep")
    if d and any(r["status"] == "ok" for r in d["rows"]):
        plot_decode_sweep(d["rows"], out / "decode_sweep.png",
                          f"decode step vs batch, {d['model']} shapes, {rep['gpu']}")
    elif d:
        print("decode sweep: no successful cell, no plot", file=sys.stderr)
    print(to_markdown(rep))
    return 0
