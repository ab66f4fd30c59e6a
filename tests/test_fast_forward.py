"""The fused forward path (Triton norm/rope/silu kernels, packed GEMMs) against the readable
paged path, run in Triton's interpreter on CPU (fp32) and in bf16 on a GPU when present."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from llmserve.attention.metadata import AttentionMetadata  # noqa: E402
from llmserve.config import FastPathConfig, ModelConfig  # noqa: E402
from llmserve.models.fused_forward import FastQwen2Forward  # noqa: E402
from llmserve.models.qwen2 import Qwen2ForCausalLM  # noqa: E402
from llmserve.kernels.fused import add_rmsnorm, silu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def opts(model, **fields):
    """``FastPathConfig(**fields)`` resolved for ``model`` (its size rules included)."""
    return FastPathConfig(**fields).resolve(model.config, DEVICE)


def small_model(hq=4, hkv=2, d=16, dtype=torch.float32, hidden=48, intermediate=80):
    cfg = ModelConfig(vocab_size=97, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                      max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.to(DEVICE, dtype).eval()


def clone_caches(caches):
    """A copy of per-layer ``(k, v)`` caches (each path of a comparison writes its own)."""
    return [(k.clone(), v.clone()) for k, v in caches]


def batch(model, seqs, block_size=4):
    """seqs: list of (context_len, q_len). Fresh caches with the prefix already computed by the
    readable path; returns inputs for one more step."""
    cfg = model.config
    nblk = [(c + block_size - 1) // block_size for c, _ in seqs]
    total = sum(nblk)
    shape = (total + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
    perm = torch.randperm(total).tolist()
    ids, pos, slots, tables, qlens = [], [], [], [], []
    for (c, ql), nb in zip(seqs, nblk):
        t = [perm.pop() for _ in range(nb)]
        tables.append(t)
        for p in range(c - ql, c):
            ids.append(int(torch.randint(0, cfg.vocab_size, ())))
            pos.append(p)
            slots.append(t[p // block_size] * block_size + p % block_size)
        qlens.append(ql)
    bt = torch.zeros(len(seqs), max(nblk), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots).to(DEVICE), qsl.to(DEVICE),
                             torch.tensor([c for c, _ in seqs], dtype=torch.int32).to(DEVICE),
                             bt.to(DEVICE), max(qlens), max(c for c, _ in seqs), block_size,
                             max(qlens) == 1)
    caches = [(torch.randn(shape, dtype=model.dtype, device=DEVICE),
               torch.randn(shape, dtype=model.dtype, device=DEVICE)) for _ in range(cfg.num_hidden_layers)]
    return torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE), caches, meta


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 1), (4, 4)])
def test_fast_forward_matches_readable_path(hq, hkv):
    model = small_model(hq, hkv)
    ids, pos, caches, meta = batch(model, [(9, 9), (5, 1), (8, 3), (1, 1)])
    caches2 = clone_caches(caches)
    ref = model(ids, pos, caches, meta)
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = FastQwen2Forward(model)
    out = fast(ids, pos, caches2, meta)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for (k1, v1), (k2, v2) in zip(caches, caches2):        # same K/V written to the same slots
        torch.testing.assert_close(k2[:-1], k1[:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2[:-1], v1[:-1])
    sd_after = model.state_dict()                            # packing keeps names and values
    assert sd_after.keys() == sd_before.keys()
    for k in sd_before:
        torch.testing.assert_close(sd_after[k], sd_before[k])


@pytest.mark.parametrize("seqs", [
    [(1, 1)],                                  # batch 1, first position
    [(9, 1), (4, 1), (17, 1)],                 # batch 3 decode, block boundaries (4, 16+1)
    [(8, 1), (5, 1), (1, 1), (12, 1)],         # batch 4 = GEMV_MAX_M
    [(7, 3)],                                  # a 3-token chunk also takes the gemv path
])
def test_gemv_path_matches_readable_path(seqs):
    """Steps of <= 4 tokens run the matrix-vector path (norms and SiLU-mul folded into the
    projections, residual adds into their epilogues); same hidden states and cache writes."""
    model = small_model(6, 2)
    ids, pos, caches, meta = batch(model, seqs)
    caches2 = clone_caches(caches)
    caches3 = clone_caches(caches)
    ref = model(ids, pos, caches, meta)
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
    assert fast.use_gemv
    out = fast(ids, pos, caches2, meta)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
    for (k1, v1), (k2, v2) in zip(caches, caches2):
        torch.testing.assert_close(k2[:-1], k1[:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2[:-1], v1[:-1], atol=1e-5, rtol=1e-5)
    logits = fast.compute_logits(out)                       # the LM head as a gemv, fp32 out
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, model.compute_logits(ref), atol=2e-4, rtol=2e-4)
    off = FastQwen2Forward(model, opts(model, gemv_max_tokens=0))(ids, pos, caches3, meta)
    torch.testing.assert_close(off, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("seqs", [[(1, 1)], [(9, 1), (4, 1), (17, 1)], [(7, 3)]])
def test_gemv_path_embedding_gather(monkeypatch, seqs):
    """The first layer's kernels read the embedding rows straight from the table
    (``embed_gather``, on by default): the same hidden states and cache writes as the lookup
    kernel (fp32 in the interpreter: bit for bit) and as the readable path, with a token id
    repeated in one step (``embed_gather`` off: the lookup kernel, as for non-contiguous ids)."""
    model = small_model(6, 2)
    ids, pos, caches, meta = batch(model, seqs)
    if ids.numel() > 1:
        ids[1] = ids[0]                                        # the same row gathered twice
    caches2 = clone_caches(caches)
    caches3 = clone_caches(caches)
    ref = model(ids, pos, caches, meta)
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
    assert fast.embed_gather
    out = fast(ids, pos, caches2, meta)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
    off = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
    off.embed_gather = False
    tol = dict(atol=0, rtol=0) if DEVICE == "cpu" else dict(atol=1e-5, rtol=1e-5)  # GPU: FMA contraction
    torch.testing.assert_close(off(ids, pos, caches3, meta), out, **tol)
    for (k1, v1), (k2, v2), (k3, v3) in zip(caches, caches2, caches3):
        torch.testing.assert_close(k2[:-1], k1[:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2[:-1], v1[:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k3, k2, **tol)
        torch.testing.assert_close(v3, v2, **tol)


def test_add_rmsnorm_and_silu_match_reference():
    torch.manual_seed(1)
    x = torch.randn(7, 33, device=DEVICE)
    r = torch.randn(7, 33, device=DEVICE)
    w = torch.randn(33, device=DEVICE)
    out, res = add_rmsnorm(x, w, 1e-6, r)
    s = x + r
    ref = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(res, s)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    gu = torch.randn(5, 2 * 1030, device=DEVICE)
    torch.testing.assert_close(silu_and_mul(gu), torch.nn.functional.silu(gu[:, :1030]) * gu[:, 1030:],
                               atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError):
        add_rmsnorm(x, torch.ones(5, device=DEVICE), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("short_context,prompt_step,max_tokens", [(0, 5, 20), (32, 5, 20), (128, 19, 40)])
def test_cuda_graph_decode_matches_eager(monkeypatch, short_context, prompt_step, max_tokens):
    """Graph replays give the eager tokens. With a short-context graph the first decode steps
    replay it (longest context <= short_context), later ones the full-length graph: 32 tokens
    is one decode split of this model (head_dim 32: 64-token tiles); 128 tokens is two, merged
    in the decode kernel (prompts 3..98 tokens + 40 generated)."""
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.core.sampling_params import SamplingParams

    def run(graph: bool):
        cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", attention_backend="triton",
                           use_cuda_graph=graph, cache=CacheConfig(num_blocks=512),
                           fast_path=FastPathConfig(graph_short_context=short_context),
                           scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512))
        eng = LLMEngine(cfg)
        prompts = [[10 + i] * (3 + prompt_step * i) for i in range(6)]
        outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        g = eng.runner.cuda_graphs
        return [o.output_token_ids for o in outs], eng.runner.num_graph_steps, g.num_short_replays if g else 0

    eager, n0, _ = run(False)
    graphed, n1, n_short = run(True)
    assert n0 == 0 and n1 > 0
    assert (0 < n_short < n1) if short_context else n_short == 0
    assert graphed == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,chunk,async_", [("float32", None, True), ("float32", 48, False),
                                                ("bfloat16", 48, True)])
def test_mixed_graphs_match_eager(dtype, chunk, async_):
    """Steps with prefill chunks replayed from the token-count graphs
    (``worker/mixed_graph.py``) give the eager steps' tokens: prompts of 1..300 tokens at block
    and tile boundaries (15, 16, 17, 127, 128, 129), chunked or whole, with decodes riding
    along, asynchronous scheduling or not, then the same prompts again as prefix-cache hits;
    steps past the largest bucket (200 tokens here) run eagerly."""
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.core.sampling_params import SamplingParams

    lengths = [1, 2, 15, 16, 17, 33, 127, 128, 129, 200, 255, 300, 5, 64, 7]

    def run(max_tokens: int):
        cfg = EngineConfig(model="tiny", device="cuda", dtype=dtype, attention_backend="triton",
                           use_cuda_graph=True, async_scheduling=async_,
                           cache=CacheConfig(num_blocks=1024, enable_prefix_caching=True),
                           fast_path=FastPathConfig(mixed_graph_max_tokens=max_tokens),
                           scheduler=SchedulerConfig(max_num_seqs=7, max_model_len=512,
                                                     max_num_batched_tokens=400,
                                                     prefill_chunk_size=chunk))
        eng = LLMEngine(cfg)
        prompts = [[(7 * i + 3 * j) % 90 + 5 for j in range(n)] for i, n in enumerate(lengths)]
        sp = SamplingParams(max_tokens=24, ignore_eos=True)
        first = [o.output_token_ids for o in eng.generate(prompts, sp)]
        again = [o.output_token_ids for o in eng.generate(prompts, sp)]     # prefix-cache hits
        r = eng.runner
        return first, again, r.num_mixed_graph_steps, r.num_eager_steps

    eager_first, eager_again, m0, e0 = run(0)
    first, again, m1, e1 = run(200)
    assert m0 == 0 and e0 > 0 and m1 > 0
    assert first == eager_first and again == eager_again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pdl_choices_same_tokens():
    """The QKV kernel triggering its successor first (the default for this size), not
    triggering, and no PDL at all change only when kernels start, not what they compute: the
    same greedy tokens through graph replays of the matrix-vector path, for contexts of one
    and several decode splits."""
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.core.sampling_params import SamplingParams

    def run(**fields):
        cfg = EngineConfig(model="tiny", device="cuda", dtype="bfloat16", attention_backend="triton",
                           use_cuda_graph=True, cache=CacheConfig(num_blocks=512),
                           scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512),
                           fast_path=FastPathConfig(**fields))
        eng = LLMEngine(cfg)
        fast = eng.runner.forward
        assert fast.trigger_roles["qkv"] == (fields.get("pdl_trigger_qkv", True) and fast.pdl)
        if fields.get("pdl") is False:
            assert not fast.pdl and not any(fast.trigger_roles.values())
        return [eng.generate([[10 + i] * (3 + 60 * i)], SamplingParams(max_tokens=60, ignore_eos=True))[0]
                .output_token_ids for i in range(4)]

    assert run() == run(pdl_trigger_qkv=False) == run(pdl=False)


def test_trigger_roles():
    """Which decode kernels trigger their successor before their PDL wait: none without PDL;
    else the QKV kernel only, when ``pdl_trigger_qkv`` (its size rule: hidden <= 2048)."""
    from llmserve.models.fused_forward import TRIGGER_ROLES, trigger_roles
    only = lambda *r: {k: k in r for k in TRIGGER_ROLES}                        # noqa: E731
    assert trigger_roles(False, True) == trigger_roles(False, False) == only()
    assert trigger_roles(True, True) == only("qkv")
    assert trigger_roles(True, False) == only()
    model = small_model(6, 2)                                                 # hidden size 48
    assert opts(model).pdl_trigger_qkv and not opts(model, pdl_trigger_qkv=False).pdl_trigger_qkv
    fast = FastQwen2Forward(model)
    assert fast.trigger_roles == (only("qkv") if fast.pdl else only())       # no PDL on CPU
    assert FastQwen2Forward(model, opts(model, pdl=False)).pdl is False


def record_decode_launches(monkeypatch) -> tuple[list, list]:
    """Wrap the matrix-vector path's kernel launchers in ``fast_forward``: each call appends
    ``(launcher name, pdl_trigger_first)`` to the first list (the final norm its ``pdl`` to
    the second) and runs the real launch without PDL (the interpreter has none)."""
    import llmserve.models.fused_forward as ff
    seen, norm_pdl = [], []

    def recorder(name, fn):
        def call(*args, **kw):
            seen.append((name, kw.get("pdl_trigger_first")))
            return fn(*args, **{**kw, "pdl": False, "pdl_trigger_first": False})
        return call

    def norm(*args, pdl=False, **kw):          # the final norm: launched with PDL on the GPU
        norm_pdl.append(pdl)
        return add_rmsnorm(*args, **kw)

    for name in ("gemv", "gemv_qkv_rope", "paged_attention_decode", "argmax_rows"):
        monkeypatch.setattr(ff, name, recorder(name, getattr(ff, name)))
    monkeypatch.setattr(ff, "add_rmsnorm", norm)
    return seen, norm_pdl


def test_gemv_path_passes_trigger_roles(monkeypatch):
    """Each kernel of the matrix-vector path is launched with its own role's
    ``pdl_trigger_first`` (recorded around the real launches, which run without PDL here):
    the QKV kernel of every layer, and no other, with the default roles."""
    from llmserve.models.fused_forward import trigger_roles
    seen, norm_pdl = record_decode_launches(monkeypatch)
    model = small_model(6, 2)
    ids, pos, caches, meta = batch(model, [(5, 1)])
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
    fast.pdl, fast.trigger_roles = True, trigger_roles(True, opts(model).pdl_trigger_qkv)
    ref = model(ids, pos, clone_caches(caches), meta)
    out = fast(ids, pos, caches, meta)
    fast.compute_logits(out)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
    layers = model.config.num_hidden_layers
    assert [f for n, f in seen if n == "gemv_qkv_rope"] == [True] * layers
    assert [f for n, f in seen if n != "gemv_qkv_rope"] == [False] * (len(seen) - layers)
    assert len(seen) - layers >= 3 * layers + 1                    # O, gate-up, down a layer; LM head
    assert norm_pdl == [True]


@pytest.mark.parametrize("role", [None, "qkv", "attn", "o", "gate_up", "down", "head", "argmax"])
def test_each_decode_kernel_gets_its_own_trigger_role(monkeypatch, role):
    """With exactly one role set, exactly that kernel (every layer's, for per-layer kernels) is
    launched with ``pdl_trigger_first``: QKV, the Triton decode attention, O, gate-up, down,
    the LM head and the greedy argmax each read their own role (recorded around the real
    launches, which run without PDL here)."""
    from llmserve.attention import get_attention_backend
    from llmserve.models.fused_forward import TRIGGER_ROLES
    seen, norm_pdl = record_decode_launches(monkeypatch)
    model = small_model(4, 2, d=32)
    model.attention_backend = get_attention_backend("triton")       # the direct decode kernel
    ids, pos, caches, meta = batch(model, [(5, 1)])
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
    fast.pdl, fast.trigger_roles = True, {k: k == role for k in TRIGGER_ROLES}
    ref = model(ids, pos, clone_caches(caches), meta)
    out = fast(ids, pos, caches, meta)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
    fast.greedy(fast.compute_logits(out))
    layers = model.config.num_hidden_layers
    gemvs = [f for n, f in seen if n == "gemv"]
    assert len(gemvs) == 3 * layers + 1                            # O, gate-up, down a layer; LM head
    got = {"qkv": [f for n, f in seen if n == "gemv_qkv_rope"],
           "attn": [f for n, f in seen if n == "paged_attention_decode"],
           "o": gemvs[0:3 * layers:3], "gate_up": gemvs[1:3 * layers:3], "down": gemvs[2:3 * layers:3],
           "head": gemvs[-1:], "argmax": [f for n, f in seen if n == "argmax_rows"]}
    for k, flags in got.items():
        assert flags == [k == role] * (1 if k in ("head", "argmax") else layers), (k, flags)
    assert norm_pdl == [True]


def test_add_rmsnorm_pdl_launch(monkeypatch):
    """``add_rmsnorm(pdl=True)`` launches its kernel with PDL where PDL is available
    (``launch_pdl`` and the kernel's ``USE_PDL``; never trigger-first); without it, or where
    PDL is unavailable, no PDL options at all."""
    from llmserve.kernels import fused
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw)

    monkeypatch.setattr(fused, "_add_rmsnorm_kernel", Recorder())
    monkeypatch.setattr(fused, "pdl_available", lambda device: True)   # as on an H200
    x, w = torch.randn(2, 40, device=DEVICE), torch.ones(40, device=DEVICE)
    for pdl in (True, False):
        fused.add_rmsnorm(x, w, 1e-6, pdl=pdl)
        fused.add_rmsnorm(x, w, 1e-6, x.clone(), pdl=pdl)
    assert [(k["USE_PDL"], k["PDL_TRIGGER_FIRST"], k.get("launch_pdl", False)) for k in seen] == \
        [(True, False, True)] * 2 + [(False, False, False)] * 2
    seen.clear()
    monkeypatch.setattr(fused, "pdl_available", lambda device: False)
    fused.add_rmsnorm(x, w, 1e-6, pdl=True)
    fused.silu_and_mul(torch.randn(2, 8, device=DEVICE), pdl=True)      # runs (interpreter on CPU)
    assert [(k["USE_PDL"], k.get("launch_pdl", False)) for k in seen] == [(False, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_d2h_side_stream_same_outputs():
    """Sampled ids copied to the host on a side stream (the CUDA sampler's ``copy_stream``; set
    to ``None`` here: copies on the compute stream) with the decode graphs alternating their
    greedy output row:
    the same greedy tokens through many graph replays (both rows used), the same sampled tokens
    and logprobs for seeded requests."""
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.core.sampling_params import SamplingParams

    def run(side: bool):
        cfg = EngineConfig(model="tiny", device="cuda", dtype="bfloat16", attention_backend="triton",
                           use_cuda_graph=True, cache=CacheConfig(num_blocks=512),
                           scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512))
        eng = LLMEngine(cfg)
        assert eng.async_scheduling and eng.sampler.copy_stream is not None
        if not side:
            eng.sampler.copy_stream = None
        greedy = [eng.generate([[10 + i] * (3 + 60 * i)], SamplingParams(max_tokens=40, ignore_eos=True))[0]
                  .output_token_ids for i in range(3)]
        outs = eng.generate([[5] * 7, [9] * 30, [11] * 3],
                            SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=3, logprobs=2))
        return greedy, [(list(o.output_token_ids), o.logprobs) for o in outs], eng.runner.cuda_graphs._replays

    g1, s1, n1 = run(True)
    g0, s0, n0 = run(False)
    assert n1 > 2 and n0 > 2
    assert g1 == g0
    assert [t for t, _ in s1] == [t for t, _ in s0]
    for (_, a), (_, b) in zip(s1, s0):
        assert len(a) == 30 and [r["top"] for r in a] == [r["top"] for r in b]


def test_fast_path_config_rejects_bad_values():
    """Every FastPathConfig field is validated once, at construction: a ValueError naming the
    field and its allowed values; EngineConfig takes only a FastPathConfig."""
    from llmserve.config import EngineConfig

    bad = {"fused_forward": "yes", "gemv_max_tokens": 5, "pdl": None, "gemv_early_epilogue": 1,
           "gemv_pre_wait": "0", "pdl_trigger_qkv": 2, "graph_short_context": -1, "graph_argmax": "on",
           "mixed_graph_max_tokens": 16385,
           "decode_splits": "fast", "decode_stages": 0, "decode_min_tiles": 0,
           "decode_fused_max_splits": 129, "decode_wide_tile": 1, "decode_early_pages": "1",
           "decode_prefetch_kv": None, "int8_layout": "col", "int8_fragments": "1", "int8_frag_pdl": 0.5,
           "invariant_block_rows": 1025}
    assert set(bad) == set(FastPathConfig.__dataclass_fields__)               # every field covered
    for name, value in bad.items():
        with pytest.raises(ValueError, match=rf"^{name} must be"):
            FastPathConfig(**{name: value})
    for name in ("gemv_max_tokens", "decode_stages"):
        with pytest.raises(ValueError, match=r"integer in \["):
            FastPathConfig(**{name: True})                                     # a bool is no count
    with pytest.raises(ValueError, match="int8_fragments needs int8_layout='row'"):
        FastPathConfig(int8_layout="planes", int8_fragments=True)
    with pytest.raises(ValueError, match="fast_path must be a FastPathConfig"):
        EngineConfig(fast_path={"pdl": False})
    with pytest.raises(AttributeError):
        FastPathConfig().pdl = False                                            # frozen
    FastPathConfig(gemv_max_tokens=0, graph_short_context=0, decode_splits="waves", int8_layout="planes")


def test_size_rules_resolve_per_model():
    """``None`` fields resolve by hidden size once per model, at the Qwen2.5 presets' shapes: on
    for 0.5B (hidden 896), 1.5B (1536) and 3B (2048), off for 7B (3584), as the environment-free
    defaults were; explicit values win; ``fused_forward`` follows the device."""
    from llmserve.models.presets import preset_config

    rules = ("gemv_early_epilogue", "gemv_pre_wait", "pdl_trigger_qkv", "int8_frag_pdl")
    for name, on in (("qwen2.5-0.5b", True), ("qwen2.5-1.5b", True), ("qwen2.5-3b", True),
                     ("qwen2.5-7b", False)):
        mc = preset_config(name)
        r = FastPathConfig().resolve(mc, "cuda")
        assert all(getattr(r, f) is on for f in rules), name
        assert (r.fused_forward, r.gemv_max_tokens, r.pdl, r.graph_short_context, r.graph_argmax) == \
            (True, 1, True, 512, True)
        assert r.decode_options() == dict(split_policy="legacy", stages=3, min_tiles=1, fused_max_splits=8,
                                          wide_tile=True, early_pages=None, prefetch_kv=True)
        assert (r.int8_layout, r.int8_fragments) == ("row", False)
        forced = FastPathConfig(**dict.fromkeys(rules, not on)).resolve(mc, "cuda")
        assert all(getattr(forced, f) is (not on) for f in rules)
    mc = preset_config("qwen2.5-1.5b")
    assert FastPathConfig().resolve(mc, "cpu").fused_forward is False
    assert FastPathConfig(fused_forward=True).resolve(mc, "cpu").fused_forward is True
    assert FastPathConfig(fused_forward=False).resolve(mc, "cuda:0").fused_forward is False


def test_readable_forward_when_fused_forward_is_false(tiny_path):
    """``fused_forward=False`` keeps the readable forward (no FastQwen2Forward, no graphs) even
    where the fused one would be the default; the default on CPU is the readable one too, and
    ``fused_forward=True`` on CPU (Triton interpreter; without the matrix-vector path, whose
    LM head over the tiny model's 151,936-token vocabulary is slow there) gives the same greedy
    tokens."""
    from llmserve.config import EngineConfig, SchedulerConfig
    from llmserve.core.sampling_params import SamplingParams
    from llmserve.engine.llm_engine import LLMEngine

    def engine(**fields):
        return LLMEngine(EngineConfig(model=str(tiny_path), device=DEVICE, attention_backend="triton",
                                      scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=64),
                                      fast_path=FastPathConfig(**fields)))

    readable = engine(fused_forward=False)
    assert not isinstance(readable.runner.forward, FastQwen2Forward) and readable.runner.cuda_graphs is None
    assert readable.fast_path.fused_forward is False
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    want = [o.output_token_ids for o in readable.generate([[5, 6, 7], [9] * 5], sp)]
    fused = engine(fused_forward=True, gemv_max_tokens=0 if DEVICE == "cpu" else 1)
    assert isinstance(fused.runner.forward, FastQwen2Forward)
    assert fused.model.attention_backend.decode_options == fused.fast_path.decode_options()
    assert [o.output_token_ids for o in fused.generate([[5, 6, 7], [9] * 5], sp)] == want
    if DEVICE == "cpu":
        assert not isinstance(engine().runner.forward, FastQwen2Forward)


@pytest.mark.parametrize("value,expected", [(None, True), (False, False), (True, True)])
def test_gemv_path_early_epilogue_choice(value, expected):
    """``gemv_early_epilogue`` (``None``: on for hidden sizes <= 2048) changes where the
    epilogue's operands are loaded, not the result."""
    model = small_model(6, 2)
    ids, pos, caches, meta = batch(model, [(9, 1), (4, 1)])
    caches2 = clone_caches(caches)
    ref = model(ids, pos, caches, meta)
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4, gemv_early_epilogue=value))
    assert fast.early_epilogue is expected
    torch.testing.assert_close(fast(ids, pos, caches2, meta), ref, atol=5e-5, rtol=5e-5)


def test_gemv_early_epilogue_size_rule(monkeypatch):
    """Unset, the choice follows the hidden size (on up to 2048, where it measured faster on
    the H200; off above, where 7B measured slower), and it reaches the kernel launches of the
    QKV, O and down projections."""
    import llmserve.models.fused_forward as ff

    model = small_model(6, 2)
    assert FastQwen2Forward(model).early_epilogue is True
    import dataclasses

    cfg = model.config
    model.config = dataclasses.replace(cfg, hidden_size=3584)   # only the rule reads it here
    fast = FastQwen2Forward(model)
    model.config = cfg
    assert fast.early_epilogue is False
    seen = []
    for name in ("gemv", "gemv_qkv_rope"):
        real = getattr(ff, name)
        monkeypatch.setattr(ff, name, lambda *a, _r=real, **k: seen.append(k.get("early_epilogue")) or _r(*a, **k))
    ids, pos, caches, meta = batch(model, [(5, 1)])
    fast(ids, pos, caches, meta)
    assert seen.count(False) == 3 * model.config.num_hidden_layers    # QKV, O, down a layer
    assert True not in seen


@pytest.mark.parametrize("seqs", [[(1, 1)], [(9, 1), (4, 1), (17, 1)], [(9, 9), (5, 1), (8, 3)]])
@pytest.mark.parametrize("planes", [True, False])
def test_int8_projections_are_fused(seqs, planes, monkeypatch):
    """Triton INT8 projections are packed like float ones (int8 rows + per-row scales) and take
    the fused kernels: the matrix-vector path for steps of <= 4 tokens (int8 rows, scale in the
    epilogue), the packed INT8 GEMM otherwise. Same hidden states, cache writes and logits as
    the readable path calling the quantized modules one by one; state_dict unchanged (also
    with the weights repacked as byte planes, int8_layout="planes": state_dict unpacks them, and an
    in-place load_state_dict of the row-major checkpoint packs them again)."""
    from llmserve.quant import TritonInt8Linear, quantize_model

    layout = "planes" if planes else "row"
    model = quantize_model(small_model(6, 2), "triton-int8")
    ids, pos, caches, meta = batch(model, seqs)
    caches2 = clone_caches(caches)
    ref = model(ids, pos, caches, meta)
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4, int8_layout=layout))
    assert fast.use_gemv
    assert all(e["qkv"][2] is not None and e["gate_up"][2] is not None for e in fast.layers)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is TritonInt8Linear
    assert q_proj.weight.data_ptr() == fast.layers[0]["qkv"][0].data_ptr()  # a view, no copy
    assert fast.int8_planes == planes
    layer0 = model.model.layers[0]
    for m in (q_proj, layer0.self_attn.o_proj, layer0.mlp.gate_proj, layer0.mlp.down_proj):
        assert m.planes == planes and m.weight.dtype == (torch.int32 if planes else torch.int8)
    out = fast(ids, pos, caches2, meta)
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
    for (k1, v1), (k2, v2) in zip(caches, caches2):
        torch.testing.assert_close(k2[:-1], k1[:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2[:-1], v1[:-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.compute_logits(out), model.compute_logits(ref), atol=2e-4, rtol=2e-4)
    sd_after = model.state_dict()
    assert sd_after.keys() == sd_before.keys()
    for k in sd_before:
        torch.testing.assert_close(sd_after[k], sd_before[k])
    # an in-place load of changed row-major weights reaches the packed tensors the fused path
    # reads, in the right layout: layer 0's down projection with negated, column-reversed rows
    # gives what a model that never packed anything gives with the same checkpoint
    key = "model.layers.0.mlp.down_proj.weight"
    sd_new = dict(sd_before)
    sd_new[key] = (-sd_before[key]).flip(1).contiguous()
    model.load_state_dict(sd_new)
    assert layer0.mlp.down_proj.weight.dtype == (torch.int32 if planes else torch.int8)
    assert torch.equal(model.state_dict()[key], sd_new[key])
    plain = quantize_model(small_model(6, 2), "triton-int8")
    plain.load_state_dict(sd_new)
    caches3 = [(k.clone(), v.clone()) for k, v in caches2]
    torch.testing.assert_close(fast(ids, pos, caches3, meta), plain(ids, pos, caches2, meta),
                               atol=5e-5, rtol=5e-5)
    if planes:   # a checkpoint of the wrong shape or dtype is refused with the module's shape
        bad = dict(sd_before)
        bad[key] = sd_before[key][:, :8].contiguous()
        with pytest.raises(RuntimeError, match=r"expected int8 \[\d+, \d+\] \(held as int32 byte planes"):
            model.load_state_dict(bad)
        bad[key] = torch.zeros(layer0.mlp.down_proj.weight.shape, dtype=torch.int8)  # [out, in/4] int8
        with pytest.raises(RuntimeError, match="size/dtype mismatch"):
            model.load_state_dict(bad)
        # a second fused forward on the same model keeps (and reports) the planes
        assert FastQwen2Forward(model, opts(model, gemv_max_tokens=4)).int8_planes   # row asked


def test_reference_int8_layers_turn_the_gemv_path_off():
    """The reference ``int8`` scheme (dequantize + F.linear) is not fused: those modules keep
    being called, and the result still matches the readable path."""
    from llmserve.quant import quantize_model

    model = quantize_model(small_model(6, 2), "int8")
    ids, pos, caches, meta = batch(model, [(9, 1)])
    caches2 = clone_caches(caches)
    ref = model(ids, pos, caches, meta)
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
    assert not fast.use_gemv and "qkv" not in fast.layers[0]
    torch.testing.assert_close(fast(ids, pos, caches2, meta), ref, atol=2e-5, rtol=2e-5)


def test_quantizing_after_building_the_fused_forward_raises():
    """The fused forward packs q/k/v and gate/up once; quantizing the model afterwards would
    leave those packed copies stale, so the next call refuses instead of mixing old and new
    weights."""
    from llmserve.quant import quantize_model

    model = small_model(6, 2)
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
    quantize_model(model, "triton-int8")
    ids, pos, caches, meta = batch(model, [(9, 1)])
    with pytest.raises(RuntimeError, match="quantized after"):
        fast(ids, pos, caches, meta)


@pytest.mark.parametrize("include", [r"model\.layers\.0\.self_attn\.q_proj",
                                     r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)",
                                     r"model\.layers\.0\..*_proj"])
def test_partly_quantized_models_match_the_readable_path(include):
    """Some projections Triton INT8, the rest float: groups of mixed kinds (q int8, k/v float)
    are not packed and keep calling their modules, uniform groups are fused; the one-token
    (matrix-vector) path is taken only when every group could be packed."""
    from llmserve.quant import quantize_model

    model = quantize_model(small_model(6, 2), "triton-int8", include=include)
    for seqs in ([(9, 1)], [(9, 9), (5, 1)]):
        ids, pos, caches, meta = batch(model, seqs)
        caches2 = clone_caches(caches)
        ref = model(ids, pos, caches, meta)
        fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
        torch.testing.assert_close(fast(ids, pos, caches2, meta), ref, atol=5e-5, rtol=5e-5)
    assert fast.use_gemv == ("q_proj" not in include)


def _fragment_sized_model(dtype):
    """A 2-layer model whose projections the fragment layout takes (N % 16, K % 32): hidden 64,
    4 q heads x 16, 2 KV heads, intermediate 96."""
    return small_model(4, 2, 16, dtype, hidden=64, intermediate=96)


def test_int8_fragments_need_cuda_and_bf16(monkeypatch, caplog):
    """``int8_fragments=True`` is ignored, with a warning, where the kernel cannot run (CPU,
    or a model that is not bf16): same results as without it."""
    from llmserve.quant import quantize_model

    model = quantize_model(_fragment_sized_model(torch.float32), "triton-int8")
    ids, pos, caches, meta = batch(model, [(9, 1), (4, 1), (17, 1)])
    caches2 = clone_caches(caches)
    ref = model(ids, pos, caches, meta)
    with caplog.at_level("WARNING"):
        fast = FastQwen2Forward(model, opts(model, int8_fragments=True))
    assert not fast.int8_fragments and "int8_fragments=True ignored" in caplog.text
    torch.testing.assert_close(fast(ids, pos, caches2, meta), ref, atol=5e-5, rtol=5e-5)


def test_int8_fragment_views_follow_load_state_dict():
    """A Triton INT8 layer holding a view of a fragment copy (what the fused forward gives it
    with int8_fragments=True) has that view repacked in place by load_state_dict."""
    from llmserve.quant import TritonInt8Linear, quantize_model
    from llmserve.kernels.int8_layout import pack_int8_fragments

    model = quantize_model(_fragment_sized_model(torch.float32), "triton-int8")
    layer = model.model.layers[0]
    mods = [layer.self_attn.q_proj, layer.self_attn.k_proj]
    assert all(type(m) is TritonInt8Linear for m in mods)
    copy = pack_int8_fragments(torch.cat([m.weight for m in mods]))
    mods[0].fragments, mods[1].fragments = copy[:4], copy[4:]       # 64 and 32 rows
    ptr = copy.data_ptr()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert not any("fragments" in k for k in sd)
    key = "model.layers.0.self_attn.k_proj.weight"
    sd[key] = (-sd[key]).flip(1).contiguous()
    model.load_state_dict(sd)
    assert copy.data_ptr() == ptr
    assert torch.equal(copy, pack_int8_fragments(torch.cat([mods[0].weight, sd[key]])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seqs", [[(9, 1), (4, 1), (17, 1)], [(5, 1)] * 9, [(9, 1)] * 16,
                                  [(7, 7), (12, 1), (5, 3)], [(9, 9), (8, 8)]])
def test_int8_fragments_serve_small_steps(seqs, monkeypatch):
    """With int8_fragments=True (bf16, CUDA) steps of 2..16 tokens (decode, prefill and
    mixed) run every projection through int8_frag_linear (four calls a layer, each with its
    own weight), a 17-token step runs none, and the result is what the row-major INT8 path
    gives, also after an in-place load_state_dict of changed weights."""
    import llmserve.models.fused_forward as ff
    from llmserve.quant import quantize_model

    model = quantize_model(_fragment_sized_model(torch.bfloat16), "triton-int8")
    ids, pos, caches, meta = batch(model, seqs)
    caches2, caches3, caches4 = clone_caches(caches), clone_caches(caches), clone_caches(caches)
    plain = FastQwen2Forward(model, opts(model))
    ref = plain(ids, pos, caches, meta)
    assert not FastQwen2Forward(model, opts(model, int8_fragments=True, int8_frag_pdl=False)).frag_pdl
    fast = FastQwen2Forward(model, opts(model, int8_fragments=True))
    assert fast.int8_fragments and set(fast.layers[0]["frag"]) == {"qkv", "gate_up", "o", "down"}
    # hidden 64 <= config.SMALL_HIDDEN_MAX: PDL on by default where the GPU and Triton have it
    assert fast.frag_pdl == ff.pdl_available(torch.device("cuda"))
    calls = []
    real = ff.int8_frag_linear
    monkeypatch.setattr(ff, "int8_frag_linear", lambda *a, **k: calls.append((a[1], k.get("pdl")))
                        or real(*a, **k))
    out = fast(ids, pos, caches2, meta)
    n_tok = sum(q for _, q in seqs)
    if n_tok > 16:
        assert calls == []
    else:
        fr = fast.layers
        assert [c.data_ptr() for c, _ in calls] == [fr[i]["frag"][k][0].data_ptr() for i in range(len(fr))
                                                   for k in ("qkv", "o", "gate_up", "down")]
        assert all(p == fast.frag_pdl for _, p in calls)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-2, err
    # an in-place load of changed weights reaches the fragment copies (and the packed row-major
    # weights the plain forward reads)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for key in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        sd[key] = (-sd[key]).flip(1).contiguous()
    model.load_state_dict(sd)
    # the reference: a model that never packed anything, loaded with the same checkpoint (the
    # first forward's packed q/k/v and gate/up are stale: the second one re-pointed the modules)
    fresh = quantize_model(_fragment_sized_model(model.dtype), "triton-int8")
    fresh.load_state_dict(sd)
    ref2 = FastQwen2Forward(fresh, opts(fresh))(ids, pos, caches3, meta)
    out2 = fast(ids, pos, caches4, meta)
    assert ((ref2.float() - ref.float()).norm() / ref.float().norm()).item() > 0.1   # the load mattered
    err2 = ((out2.float() - ref2.float()).norm() / ref2.float().norm()).item()
    assert err2 < 2e-2, err2


def test_batch_invariant_fused_forward():
    """The batch-invariant mode's fused forward (packed projections through the invariant
    linear kernel, the invariant attention backend, no matrix-vector path): the readable path's
    function, and a decode row's hidden state the same bits alone as in a mixed step."""
    from llmserve.attention.invariant import InvariantTritonAttention
    from llmserve.models.batch_invariant import make_batch_invariant

    model = small_model(6, 2, d=32)
    make_batch_invariant(model, 16, 4)
    ids, pos, caches, meta = batch(model, [(9, 9), (5, 1), (8, 3), (1, 1)])
    caches2 = clone_caches(caches)
    ref = model(ids, pos, caches, meta)            # readable path, torch invariant attention
    model.attention_backend = InvariantTritonAttention(block_n=16)
    fast = FastQwen2Forward(model, opts(model, gemv_max_tokens=4))
    assert fast.invariant and not fast.use_gemv
    out = fast(ids, pos, caches2, meta)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # the decode row (sequence 1, row 9) alone: same cache contents, a batch of one
    meta1 = AttentionMetadata(meta.slot_mapping[9:10], torch.tensor([0, 1], dtype=torch.int32),
                              meta.context_lens[1:2], meta.block_tables[1:2], 1, 5, 4, True)
    alone = fast(ids[9:10], pos[9:10], clone_caches(caches2), meta1)
    assert torch.equal(alone[0], out[9])
