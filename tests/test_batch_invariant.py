"""The batch-invariant mode (``EngineConfig.batch_invariant``): a request's logits are bitwise the
same whatever it is batched with.

Three modes, as SGLang's deterministic-inference tests name them: *single* (one prompt at
varying batch sizes), *mixed* (one prompt among varying co-requests), *prefix* (prompts sharing
prefixes of varying lengths, prefix-cache hits against misses); each under chunked prefill
(chunk 16 and 256 with a step token budget) and forced preemption with recompute. The
reference is the same prompt run alone (batch 1, no chunking, a fresh cache). Logits are
compared with ``torch.equal`` on every sampled position, and token ids as well.

The fp32 cases are the discriminating ones: with the mode off they fail on x86 CPUs (a single
row goes down the BLAS library's matrix-vector path, several rows a GEMM). The bf16 GEMMs of
these small shapes happen to be row-invariant on some CPUs even without the mode, so there the
bf16 cases only guard the mode's own ops in bf16.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.config import CacheConfig, EngineConfig, FastPathConfig, SchedulerConfig
from llmserve.core.sampling_params import SamplingParams
from llmserve.engine import LLMEngine
from llmserve.engine.naive import NaiveEngine

MAX_TOKENS = 10


def _engine(model: str, dtype: str, *, inv: bool = True, chunk: int | None = None, budget: int = 4096,
            num_blocks: int | None = None, max_seqs: int = 32, prefix: bool = True,
            block_rows: int = 16, naive: bool = False):
    cfg = EngineConfig(model=model, dtype=dtype, batch_invariant=inv,
                       fast_path=FastPathConfig(invariant_block_rows=block_rows),
                       cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix),
                       scheduler=SchedulerConfig(max_num_seqs=max_seqs, prefill_chunk_size=chunk,
                                                 max_num_batched_tokens=budget))
    return NaiveEngine(cfg) if naive else LLMEngine(cfg)


def _run(engine, prompts: list[list[int]], sps: list[SamplingParams] | None = None, first: int = 0):
    """Run ``prompts`` to completion; return ``{request_id: (logits rows, token ids)}`` (ids
    ``r<first>``, ``r<first+1>``, ...)."""
    rec: dict[str, list[torch.Tensor]] = {}
    if isinstance(engine, NaiveEngine):
        model = engine.model
        orig_fwd = model.forward_reference
        current: list[str] = []

        def fwd(ids, last_only=False):
            out = orig_fwd(ids, last_only=last_only)
            rec.setdefault(current[0], []).append(out[0, -1].detach().clone())
            return out

        model.forward_reference = fwd
        outs = {}
        for i, p in enumerate(prompts):
            current[:] = [f"r{i}"]
            sp = sps[i] if sps else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            outs[f"r{i}"] = engine.generate([p], sp)[0].output_token_ids
        model.forward_reference = orig_fwd
        return {r: (rec[r], list(outs[r])) for r in outs}
    orig = engine.sampler.sample_async

    def spy(logits, params, request_ids, *a, **k):
        for i, r in enumerate(request_ids):
            rec.setdefault(r, []).append(logits[i].detach().clone())
        return orig(logits, params, request_ids, *a, **k)

    engine.sampler.sample_async = spy
    seqs = []
    for i, p in enumerate(prompts):
        sp = sps[i] if sps else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        seqs.append(engine.add_request(p, sp, request_id=f"r{first + i}"))
    while engine.has_unfinished_requests():
        engine.step()
    return {s.request_id: (rec[s.request_id], list(s.output_token_ids)) for s in seqs}


def _prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lens]


def _same(got, ref, what: str) -> int:
    """Assert ``got`` equals ``ref`` bitwise; return the number of logits rows compared."""
    (lg, tg), (lr, tr) = got, ref
    assert tg == tr, f"{what}: tokens {tg} != {tr}"
    assert len(lg) == len(lr)
    for step, (a, b) in enumerate(zip(lg, lr)):
        assert torch.equal(a, b), (f"{what}: logits differ at output position {step} "
                                   f"(max |diff| {float((a - b).abs().max()):.3g})")
    return len(lg)


@pytest.fixture(scope="module")
def models(hf_qwen2, tiny_path):
    return {"gqa4": str(hf_qwen2("gqa4_untied_sharded")[0]), "gqa2": str(hf_qwen2("gqa_tied")[0]),
            "tiny": str(tiny_path)}


VOCAB = {"gqa4": 1000, "gqa2": 1000, "tiny": 151936}


# ---- the modes --------------------------------------------------------------------------------

@pytest.mark.parametrize("model,dtype", [("gqa4", "float32"), ("gqa2", "bfloat16"), ("tiny", "float32")])
def test_single_and_mixed(models, model, dtype):
    """One prompt alone, then at batch sizes 2..24 among different co-requests, in different
    arrival positions, with chunked prefill and a step token budget."""
    path, vocab = models[model], VOCAB[model]
    target = _prompts(1, 1, 33, 34, vocab)[0]
    ref = _run(_engine(path, dtype), [target])["r0"]
    compared = 0
    cases = [(2, 5, {}), (3, 6, {"chunk": 16, "budget": 48}), (8, 7, {}),
             (17, 8, {"chunk": 256, "budget": 300})]
    if model != "tiny":
        cases.append((24, 9, {"chunk": 16, "budget": 64}))
    for batch, seed, kw in cases:
        others = _prompts(seed, batch - 1, 3, 70, vocab)
        pos = seed % batch
        prompts = others[:pos] + [target] + others[pos:]
        out = _run(_engine(path, dtype, **kw), prompts)
        compared += _same(out[f"r{pos}"], ref, f"{model} {dtype} batch {batch} at {pos} {kw}")
    assert compared >= MAX_TOKENS * len(cases)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_request_matches_its_batch1_run(models, dtype):
    """All requests of one batch (not only a probe) against their own batch-1 runs: 12 prompts,
    chunk 16, forced preemption (a cache too small for all of them at once)."""
    path = models["gqa4"]
    prompts = _prompts(3, 12, 5, 60, 1000)
    eng = _engine(path, dtype, chunk=16, budget=64, num_blocks=14)
    out = _run(eng, prompts)
    assert eng.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    compared = 0
    for i, p in enumerate(prompts):
        ref = _run(_engine(path, dtype), [p])["r0"]
        compared += _same(out[f"r{i}"], ref, f"{dtype} request {i}")
    assert compared == 12 * MAX_TOKENS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_cache_hits_and_misses(models, dtype):
    """Prompts sharing prefixes of 0..40 tokens (block size 16: full-block hits of 0, 1 or 2
    blocks): with prefix caching the later ones hit the cache; every one matches its batch-1
    run on a cold cache."""
    path = models["gqa4"]
    g = torch.Generator().manual_seed(11)
    base = torch.randint(0, 1000, (40,), generator=g).tolist()
    prompts = [base[:k] + torch.randint(0, 1000, (9,), generator=g).tolist() for k in (40, 0, 16, 33, 17, 40, 31)]
    eng = _engine(path, dtype, prefix=True)
    out = _run(eng, [prompts[0]])                      # warm the cache with the longest prefix
    out.update(_run(eng, prompts[1:], first=1))
    hits = eng.block_manager.prefix_cache_hits
    for i, p in enumerate(prompts):
        ref = _run(_engine(path, dtype, prefix=False), [p])["r0"]
        _same(out[f"r{i}"], ref, f"{dtype} prefix prompt {i}")
    assert hits >= 5 * 16, f"expected full-block prefix hits, got {hits} tokens"


def test_seeded_sampling_is_reproducible(models):
    """temperature > 0 with a per-request seed: the same tokens alone and in a batch."""
    path = models["gqa4"]
    target = _prompts(21, 1, 20, 21, 1000)[0]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    ref = _run(_engine(path, "float32"), [target], [sp])["r0"]
    others = _prompts(22, 6, 3, 40, 1000)
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=7, ignore_eos=True)
    out = _run(_engine(path, "float32", chunk=16, budget=40), [*others[:3], target, *others[3:]],
               [plain] * 3 + [sp] + [plain] * 3)
    _same(out["r3"], ref, "seeded sampling")


def test_naive_control_matches(models):
    """The naive control (full-prefix recompute through the reference forward) gives the paged
    engine's logits bitwise in this mode: the two paths share the tiles and row blocks."""
    path = models["gqa4"]
    prompts = _prompts(31, 3, 10, 50, 1000)
    paged = _run(_engine(path, "float32", chunk=16, budget=40), prompts)
    naive = _run(_engine(path, "float32", naive=True), prompts)
    for r in paged:
        _same(naive[r], paged[r], f"naive vs paged {r}")


@pytest.mark.parametrize("block_rows", [1, 5])
def test_other_block_rows(models, block_rows):
    path = models["gqa2"]
    target = _prompts(41, 1, 19, 20, 1000)[0]
    ref = _run(_engine(path, "float32", block_rows=block_rows), [target])["r0"]
    prompts = _prompts(42, 6, 3, 50, 1000)
    out = _run(_engine(path, "float32", block_rows=block_rows, chunk=16, budget=32), prompts + [target])
    _same(out["r6"], ref, f"block_rows {block_rows}")


# ---- the pieces -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_blocked_linear(dtype):
    from llmserve.models.batch_invariant import row_blocked_linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 200, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(70, 200, generator=g).to(dtype)
    full = row_blocked_linear(x, w, b, 16)
    torch.testing.assert_close(full.float(), torch.nn.functional.linear(x, w, b).float(),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    for start, m in [(0, 1), (5, 1), (3, 2), (17, 16), (1, 17), (40, 30)]:
        part = row_blocked_linear(x[start:start + m], w, b, 16)
        assert torch.equal(part, full[start:start + m]), (start, m)
    assert row_blocked_linear(x[:0], w, b, 16).shape == (0, 96)


def test_invariant_attention_is_attention():
    """Numerically the same attention as the reference backend (block boundaries, GQA 4, a
    decode row and prefill chunks), and each row's bits independent of the others."""
    from llmserve.attention.invariant import invariant_paged_attention
    from llmserve.attention.torch_backend import paged_attention_torch
    from conftest import build_attn_metadata

    g = torch.Generator().manual_seed(0)
    bs, hkv, hq, d = 16, 2, 8, 16
    k_cache = torch.randn(20, bs, hkv, d, generator=g)
    v_cache = torch.randn(20, bs, hkv, d, generator=g)
    seqs = [(31, 1), (0, 17), (16, 16), (5, 3)]
    tables = [[0, 1], [2, 3], [4, 5], [6]]
    meta, _ = build_attn_metadata(seqs, tables, bs)
    n = sum(q for _, q in seqs)
    q = torch.randn(n, hq, d, generator=g)
    out = invariant_paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(out, paged_attention_torch(q, k_cache, v_cache, meta, d ** -0.5),
                               rtol=1e-5, atol=1e-5)
    # the decode row alone gives the same bits
    meta1, _ = build_attn_metadata(seqs[:1], tables[:1], bs)
    assert torch.equal(invariant_paged_attention(q[:1], k_cache, v_cache, meta1, d ** -0.5), out[:1])
    # the 16-token chunk of the third sequence computed as two chunks of 8
    meta_a, _ = build_attn_metadata([(16, 8)], [[4, 5]], bs)
    meta_b, _ = build_attn_metadata([(24, 8)], [[4, 5]], bs)
    rows = slice(18, 34)
    a = invariant_paged_attention(q[rows][:8], k_cache, v_cache, meta_a, d ** -0.5)
    b = invariant_paged_attention(q[rows][8:], k_cache, v_cache, meta_b, d ** -0.5)
    assert torch.equal(torch.cat([a, b]), out[rows])


def test_uninitialised_cache_values_do_not_leak():
    """Keys past a row's position are masked and their values zeroed, so NaN or inf in unused
    cache slots (memory never written) cannot reach the output."""
    from llmserve.attention.invariant import invariant_paged_attention
    from conftest import build_attn_metadata

    bs, h, d = 16, 2, 8
    k_cache = torch.randn(4, bs, h, d)
    v_cache = torch.randn(4, bs, h, d)
    k_cache[0, 5:] = float("nan")
    v_cache[0, 5:] = float("inf")
    meta, _ = build_attn_metadata([(4, 1)], [[0]], bs)
    out = invariant_paged_attention(torch.randn(1, h, d), k_cache, v_cache, meta, d ** -0.5)
    assert torch.isfinite(out).all()


# ---- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw,needle", [
    ({"device": "cuda"}, "attention_backend='torch'"),
    ({"attention_backend": "triton"}, "attention_backend='triton'"),
    ({"linear_backend": "int8"}, "linear_backend='int8'"),
    ({"fast_path": FastPathConfig(fused_forward=True)}, "fused_forward=True"),
    ({"device": "cuda", "attention_backend": "triton", "fast_path": FastPathConfig(fused_forward=False)},
     "fused_forward=False"),
    ({"device": "cuda", "attention_backend": "triton", "linear_backend": "triton-int8"},
     "linear_backend='triton-int8'"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
])
def test_refused_combinations(kw, needle):
    with pytest.raises(ValueError, match="batch_invariant") as e:
        EngineConfig(batch_invariant=True, **kw)
    assert needle in str(e.value)


def test_cuda_configuration_is_accepted():
    """On CUDA the mode runs the fused forward with the Triton attention backend."""
    cfg = EngineConfig(batch_invariant=True, device="cuda", attention_backend="triton", dtype="bfloat16")
    assert cfg.batch_invariant
    EngineConfig(batch_invariant=True, device="cuda:0", attention_backend="triton",
                 fast_path=FastPathConfig(fused_forward=True))


def test_bad_values():
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineConfig(batch_invariant=1)
    with pytest.raises(ValueError, match="invariant_block_rows"):
        FastPathConfig(invariant_block_rows=0)


# ---- where the mode is reported -----------------------------------------------------------------

def test_server_reports_the_mode(models):
    """``/health`` and ``/v1/models`` say whether outputs carry the guarantee; two identical
    requests sent together, and one alone, return the same tokens."""
    import httpx

    from llmserve.engine.async_engine import AsyncLLMEngine
    from llmserve.serve.app import create_app
    from llmserve.serve.server import BackgroundServer

    cfg = EngineConfig(model=models["gqa4"], batch_invariant=True,
                       scheduler=SchedulerConfig(max_num_seqs=8, prefill_chunk_size=16, max_num_batched_tokens=40))
    eng = AsyncLLMEngine(LLMEngine(cfg))
    srv = BackgroundServer(create_app(eng, served_model_name="m"), shutdown_timeout=2.0).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            health = c.get("/health").json()
            assert (health["status"], health["batch_invariant"]) == ("ok", True)
            assert c.get("/v1/models").json()["data"][0]["batch_invariant"] is True
            body = {"model": "m", "prompt": list(range(5, 40)), "max_tokens": 8, "temperature": 0,
                    "logprobs": 3}
            alone = c.post("/v1/completions", json=body).json()["choices"][0]
            from concurrent.futures import ThreadPoolExecutor
            others = [{**body, "prompt": list(range(100 + i, 130 + 3 * i))} for i in range(5)]
            with ThreadPoolExecutor(6) as ex:
                futs = [ex.submit(c.post, "/v1/completions", json=b) for b in [*others[:2], body, *others[2:]]]
                together = futs[2].result().json()["choices"][0]
                [f.result() for f in futs]
            assert together["text"] == alone["text"]
            assert together["logprobs"] == alone["logprobs"]
    finally:
        srv.stop()
        eng.shutdown()


def test_cli_flags(tmp_path, models):
    """``--batch-invariant`` reaches the engine from ``generate`` and ``benchmark``, and the
    benchmark JSON records it."""
    import json

    from llmserve.cli import build_parser, main

    for cmd in (["generate", "--prompt", "hi"], ["serve", "tiny"]):
        args = build_parser().parse_args([*cmd, "--batch-invariant", "--invariant-block-rows", "8"])
        assert args.batch_invariant is True and args.invariant_block_rows == 8
    out = tmp_path / "bench.json"
    rc = main(["benchmark", "--model", "tiny", "--requests", "6", "--arrival-rate", "inf",
               "--batch-invariant", "--output", str(out), "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["batch_invariant"] is True
    assert rep["engine_config"]["batch_invariant"] is True
    assert rep["aggregates"]["num_completed"] == 6
    assert main(["generate", "--prompt", "hello", "--max-tokens", "4", "--batch-invariant",
                 "--device", "cpu"]) == 0


def test_speculative_decoding_refuses_the_mode():
    """How many tokens a speculative step drafts depends on the step's budget and free blocks, so
    seeded sampling would depend on the batch: the combination is refused, not half-kept."""
    from llmserve.engine.speculative import SpeculativeEngine

    with pytest.raises(ValueError, match="speculative decoding does not support batch_invariant"):
        SpeculativeEngine(EngineConfig(batch_invariant=True), draft_model="tiny")


def test_invariant_at_two_threads(models):
    """The mode holds whatever torch's thread count was: building the engine pins one intra-op
    thread (CPU reductions split across threads by problem size), and says so."""
    path = models["gqa2"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        target = _prompts(41, 1, 19, 20, 1000)[0]
        ref = _run(_engine(path, "float32", block_rows=5), [target])["r0"]
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        prompts = _prompts(42, 6, 3, 50, 1000)
        out = _run(_engine(path, "float32", block_rows=5, chunk=16, budget=32), prompts + [target])
        _same(out["r6"], ref, "two threads before the engine was built")
    finally:
        torch.set_num_threads(before)


# ---- on CUDA: the fused forward with the invariant kernels --------------------------------------

GPU_MODEL = "random:qwen2.5-0.5b"      # GQA 7 (14 query heads, 2 KV heads), hidden 896
GPU_TOKENS = 48


def _gpu_engine(inv: bool = True, **sched):
    chunk = sched.pop("chunk", None)
    cfg = EngineConfig(model=GPU_MODEL, device="cuda", dtype="bfloat16", attention_backend="triton",
                       batch_invariant=inv,
                       cache=CacheConfig(num_blocks=sched.pop("num_blocks", 4096),
                                         enable_prefix_caching=sched.pop("prefix", False)),
                       scheduler=SchedulerConfig(max_num_seqs=sched.pop("max_seqs", 64),
                                                 prefill_chunk_size=chunk,
                                                 max_num_batched_tokens=sched.pop("budget", 8192)))
    assert not sched, sched
    return LLMEngine(cfg)


def _gpu_run(prompts, first: int = 0, **kw):
    """One engine per call (its memory released afterwards); ``{request id: (logits, tokens)}``."""
    import gc

    eng = _gpu_engine(**kw)
    sp = SamplingParams(max_tokens=GPU_TOKENS, temperature=0.0, ignore_eos=True)
    out = _run(eng, prompts, [sp] * len(prompts), first=first)
    stats = {"preemptions": eng.scheduler.num_preemptions,
             "prefix_hits": eng.block_manager.prefix_cache_hits,
             "graph_steps": eng.runner.num_graph_steps,
             "mixed_graph_steps": eng.runner.num_mixed_graph_steps}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out, stats


def _differing(out, ref) -> list[str]:
    bad = []
    for r, (lg, tg) in out.items():
        lr, tr = ref[r]
        if tg != tr or len(lg) != len(lr) or not all(torch.equal(a, b) for a, b in zip(lg, lr)):
            bad.append(r)
    return bad


@pytest.mark.gpu
def test_gpu_every_request_matches_its_batch1_run():
    """64 prompts of 5-400 random token ids, 48 greedy tokens each, bf16 random weights (flat
    logits, the hard case), every request's logits at every output position compared bitwise
    with the same prompt run alone (batch 1, no chunking, no prefix cache): at batch 8, 17 and
    64, with 16- and 256-token chunks, under preemption and with prefix-cache hits. 64 x 48 =
    3,072 sampled outputs a setting. With the mode off the same comparison fails (so it can)."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(5, 401, (64,), generator=g).tolist()
    prompts = [torch.randint(0, 151_000, (m,), generator=g).tolist() for m in lens]
    ref, _ = _gpu_run(prompts, max_seqs=1)             # one request at a time: each alone
    settings = {
        "batch 8": dict(max_seqs=8),
        "batch 64": dict(max_seqs=64),
        "batch 17, 256-token chunks": dict(max_seqs=17, chunk=256, budget=512),
        "batch 64, 16-token chunks": dict(max_seqs=64, chunk=16, budget=128),
        "preemption": dict(max_seqs=64, num_blocks=200),
    }
    failures, mixed_steps = {}, {}
    for name, kw in settings.items():
        out, stats = _gpu_run(prompts, **kw)
        if name == "preemption":
            assert stats["preemptions"] > 0, stats
        assert stats["graph_steps"] > 0, (name, stats)
        mixed_steps[name] = stats["mixed_graph_steps"]
        bad = _differing(out, ref)
        if bad:
            failures[name] = bad
    # prefix hits: the first 32 prompts' first 160 tokens again, each with a new tail
    tails = [torch.randint(0, 151_000, (9,), generator=g).tolist() for _ in range(32)]
    shared = [p[:160] + t for p, t in zip(prompts[:32], tails)]
    ref_shared, _ = _gpu_run(shared, max_seqs=1)
    out, stats = _gpu_run(prompts[:32] + shared, max_seqs=64, prefix=True)
    shared_out = {f"r{i}": out[f"r{32 + i}"] for i in range(32)}
    assert stats["prefix_hits"] > 0, stats
    bad = _differing(shared_out, ref_shared) + _differing({k: out[k] for k in list(out)[:32]}, ref)
    if bad:
        failures["prefix hits"] = bad
    assert not failures, {k: f"{len(v)} differ: {v[:5]}" for k, v in failures.items()}
    # steps with prefill chunks replayed their graphs in the mode too (one kernel, every row in
    # its tile schedule) where a step's tokens fit them: at batch 8 (requests admitted as
    # others finish) and in the chunked settings
    for name in ("batch 8", "batch 17, 256-token chunks", "batch 64, 16-token chunks"):
        assert mixed_steps[name] > 0, mixed_steps
    off, _ = _gpu_run(prompts, max_seqs=64, inv=False)
    off_ref, _ = _gpu_run(prompts[:8], max_seqs=1, inv=False)
    assert _differing({k: off[k] for k in off_ref}, off_ref), \
        "with the mode off batch 64 gave batch 1's logits too: the comparison cannot tell"


def test_naive_engine_refuses_the_mode_on_cuda():
    """The naive control's reference forward has no fixed-order CUDA kernels: refused before
    anything is loaded (on a GPU the mode's control is the paged engine at batch 1)."""
    cfg = EngineConfig(batch_invariant=True, device="cuda", attention_backend="triton")
    with pytest.raises(ValueError, match="NaiveEngine supports batch_invariant=True on a CPU only"):
        NaiveEngine(cfg)
