#!/usr/bin/env python
"""Speculative decoding vs target-only decoding on one fixed workload.

Workload: ``B`` requests of ``--prompt-len`` random token ids (seeded), ``--output-len`` output
tokens each (``ignore_eos``), all submitted at once, greedy unless ``--temperature > 0``.
For every batch size ``B`` in ``--batch-sizes`` it measures

* target-only: a plain :class:`~llmserve.engine.LLMEngine` (CUDA graphs for decode steps when
  ``--attention-backend triton`` on CUDA);
* speculative, for every draft in ``--drafts`` and ``k`` in ``--ks``: a
  :class:`~llmserve.speculative.SpeculativeEngine` per draft (``k`` set per request through
  ``SamplingParams.num_speculative_tokens``, so one engine serves every ``k``). The draft
  ``target`` reuses the target's weights (own KV cache): ~100% greedy acceptance, i.e. the
  mechanism's overhead in its best case. With random weights (``random:<preset>`` names) a
  different draft's acceptance is meaningless (~0): that row measures the cost of k wasted
  drafts per token.

Reported per point (median over ``--repeats`` timed runs after a warm-up run): wall ms per
output token (all ``B`` sequences together: wall / total output tokens), the median per-request
TPOT in ms (decode time after the first token / (n - 1)), speedup over target-only (ratio of
wall ms per output token), acceptance rate, mean accepted drafts per verification, target
passes per output token (1.0 for target-only), draft passes, and the fraction of requests whose
greedy tokens equal target-only's (float-noise ties can flip argmax with random weights in bf16).

GPU (the lead's run): ``python scripts/bench_speculative.py --device cuda`` (defaults: target
``random:qwen2.5-7b``, drafts ``random:qwen2.5-0.5b`` and ``target``, bf16, Triton attention).
CPU smoke check: ``python scripts/bench_speculative.py --smoke`` (tiny target and drafts).
Prints one JSON document (and writes it to ``--output`` when given).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.engine import LLMEngine
from llmserve.sampling_params import SamplingParams
from llmserve.speculative import SpeculativeEngine


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="random:qwen2.5-7b")
    p.add_argument("--drafts", default="random:qwen2.5-0.5b,target",
                   help="comma-separated draft models ('target' = reuse the target's weights)")
    p.add_argument("--ks", type=_ints, default=[1, 2, 4], help="speculative tokens per step (default 1,2,4)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default=None, help="default triton on CUDA, torch on CPU")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke check: tiny target, drafts tiny and target, k 1,2,4, 2 short requests")
    a = p.parse_args(argv)
    if a.smoke:
        a.target, a.drafts, a.device = "tiny", "tiny,target", "cpu"
        a.batch_sizes, a.prompt_len, a.output_len, a.repeats = [2], 8, 10, 1
        torch.set_num_threads(1)   # small CPU matmuls: extra threads only contend
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    a.attention_backend = a.attention_backend or ("triton" if a.device.startswith("cuda") else "torch")
    return a


def engine_config(a: argparse.Namespace) -> EngineConfig:
    max_len = a.prompt_len + a.output_len + 16
    max_b = max(a.batch_sizes)
    # Blocks for the whole workload plus k-token headroom, for each of the two caches.
    num_blocks = max_b * (-(-(max_len + max(a.ks) + 1) // a.block_size)) + 8
    return EngineConfig(model=a.target, device=a.device, dtype=a.dtype, seed=a.seed,
                        cache=CacheConfig(block_size=a.block_size, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=max_b, max_model_len=max_len,
                                                  max_num_batched_tokens=max(4096, max_b * max_len)),
                        attention_backend=a.attention_backend, use_cuda_graph=not a.no_cuda_graph)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(engine, prompts, a: argparse.Namespace, k: int | None, tag: str) -> dict:
    """Run the workload once; wall time, TPOT and tokens."""
    sps = [SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=a.temperature,
                          seed=(a.seed * 7919 + i) if a.temperature > 0 else None,
                          num_speculative_tokens=k) for i in range(len(prompts))]
    _sync(a.device)
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, sp, request_id=f"{tag}-{i}") for i, (p, sp) in enumerate(zip(prompts, sps))]
    while engine.has_unfinished_requests():
        engine.step()
    _sync(a.device)
    wall = time.perf_counter() - t0
    n_out = sum(s.num_output_tokens for s in seqs)
    tpots = []
    for s in seqs:
        m = s.metrics
        if len(m.token_times) > 1:
            tpots.append((m.token_times[-1] - m.token_times[0]) / (len(m.token_times) - 1) * 1e3)
    return {"wall_s": wall, "output_tokens": n_out, "ms_per_output_token": wall * 1e3 / n_out,
            "tpot_ms_median": statistics.median(tpots) if tpots else None,
            "tokens": [list(s.output_token_ids) for s in seqs]}


def measure(engine, prompts, a, k, tag) -> dict:
    run_once(engine, prompts[:2], a, k, f"warm-{tag}")          # warm-up (autotune, allocator)
    if hasattr(engine, "reset_speculative_stats"):
        engine.reset_speculative_stats()
    runs = [run_once(engine, prompts, a, k, f"{tag}-r{r}") for r in range(a.repeats)]
    best = sorted(runs, key=lambda r: r["ms_per_output_token"])[len(runs) // 2]   # median run
    out = {"ms_per_output_token": best["ms_per_output_token"], "tpot_ms_median": best["tpot_ms_median"],
           "wall_s": best["wall_s"], "output_tokens": best["output_tokens"],
           "ms_per_output_token_all": [r["ms_per_output_token"] for r in runs], "tokens": best["tokens"]}
    if hasattr(engine, "speculative_stats"):
        st = engine.speculative_stats()
        for key in ("acceptance_rate", "mean_accepted_length", "mean_tokens_per_verification",
                    "target_passes_per_output_token", "num_proposed_tokens", "num_accepted_tokens",
                    "num_verifications", "num_draft_passes", "num_target_steps"):
            out[key] = st[key]
    else:
        out["target_passes_per_output_token"] = 1.0
    return out


def _free(engine) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = engine_config(a)
    rng = np.random.default_rng(a.seed)
    result = {"config": {k: v for k, v in vars(a).items()}, "device": a.device,
              "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "baseline": {}, "speculative": [],
              "definitions": ("ms_per_output_token = wall time / output tokens of all B requests "
                              "together (median of repeats); speedup = target-only ms_per_output_token "
                              "/ speculative ms_per_output_token; target_passes_per_output_token = "
                              "(sequence, target pass) pairs that produced tokens / output tokens")}
    t_build = time.perf_counter()
    base_engine = LLMEngine(cfg)
    result["baseline_build_s"] = time.perf_counter() - t_build
    vocab = min(base_engine.model_config.vocab_size, 151643)
    workloads = {b: [rng.integers(10, vocab, a.prompt_len).tolist() for _ in range(b)] for b in a.batch_sizes}
    base_tokens = {}
    for b in a.batch_sizes:
        m = measure(base_engine, workloads[b], a, None, f"base-b{b}")
        base_tokens[b] = m.pop("tokens")
        result["baseline"][str(b)] = m
        print(f"[target-only] B={b}: {m['ms_per_output_token']:.2f} ms/token", file=sys.stderr)
    _free(base_engine)

    for draft in [d for d in a.drafts.split(",") if d]:
        t_build = time.perf_counter()
        eng = SpeculativeEngine(cfg, draft_model=draft, num_speculative_tokens=max(a.ks))
        build_s = time.perf_counter() - t_build
        for b in a.batch_sizes:
            base = result["baseline"][str(b)]
            for k in a.ks:
                m = measure(eng, workloads[b], a, k, f"{draft}-b{b}-k{k}")
                toks = m.pop("tokens")
                same = sum(x == y for x, y in zip(toks, base_tokens[b])) / len(toks)
                m.update(draft=draft, k=k, batch_size=b, build_s=build_s,
                         speedup_vs_target=base["ms_per_output_token"] / m["ms_per_output_token"],
                         fraction_identical_to_target=same if a.temperature == 0 else None)
                result["speculative"].append(m)
                print(f"[{draft}] B={b} k={k}: {m['ms_per_output_token']:.2f} ms/token, speedup "
                      f"{m['speedup_vs_target']:.2f}x, acceptance {m['acceptance_rate']}", file=sys.stderr)
        _free(eng)

    text = json.dumps(result, indent=2, default=str)
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
