"""Speculative decoding (engine/llmserve/speculative.py) on CPU.

* Greedy: token-identical to target-only ``LLMEngine`` on the tiny model for many prompts and
  k in {1, 2, 4, 7} (per-request ``num_speculative_tokens``), with ``max_tokens``, stop tokens and
  EOS reached inside accepted runs, for a draft that always agrees (tiny itself) and one that
  mostly disagrees (tiny cut to 2 layers, saved with ``save_checkpoint``) under forced preemption;
  both KV caches return to their free-block baseline.
* Sampling: the accept/resample rule on explicit Markov-chain distributions (40k draws, joint of
  the first three tokens, chi-square and TV against the exact target joint) with two broken
  rules as negative controls; end to end on 8-token-vocabulary random Qwen2 target/draft
  checkpoints (6k sequences, temperature/top-k/top-p), again with a broken rule that must fail.
* Mixed greedy/sampled batches, seeded reproducibility, aborts, validation, and the
  ``llmserve benchmark --speculative-model`` report section.

Torch runs single-threaded here: the CI machine has 2 shared cores and intra-op threads only
add contention for these small matmuls.
"""

from __future__ import annotations

import dataclasses
import random

import llmserve.engine.speculative as spec_mod
import numpy as np
import pytest
import torch
from llmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.models.loader import save_checkpoint
from llmserve.models.qwen2 import Qwen2ForCausalLM
from llmserve.core.sampling_params import SamplingParams
from llmserve.engine.speculative import SpeculativeEngine, greedy_verify, rejection_sample

BLOCK = 4
KS = (1, 2, 4, 7)


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _counts_free(engine) -> tuple[int, int]:
    return engine.block_manager.num_free_blocks, engine.draft_block_manager.num_free_blocks


def _run(engine, reqs):
    seqs = [engine.add_request(p, sp) for p, sp in reqs]
    while engine.has_unfinished_requests():
        engine.step()
    return [s.output_token_ids for s in seqs]


# ---------------------------------------------------------------------------------------------
# Greedy parity on the tiny model
# ---------------------------------------------------------------------------------------------
def _tiny_config(num_blocks=512, max_seqs=12, budget=2048):
    return EngineConfig(model="tiny", device="cpu", dtype="float32",
                        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget))


@pytest.fixture(scope="module")
def greedy_case():
    """24 requests (6 prompts x k in KS) with length / stop-token / EOS endings, the EOS ids
    to install, and the target-only LLMEngine outputs for exactly these requests."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 151643) for _ in range(n)] for n in (1, 3, BLOCK, BLOCK + 1, 15, 33)]
    pre_engine = LLMEngine(_tiny_config())
    pre = _run(pre_engine, [(p, SamplingParams(max_tokens=14, ignore_eos=True)) for p in prompts])
    eos = tuple(sorted({pre[i][3 + i % 6] for i in range(len(prompts))}))
    reqs = []
    for i, p in enumerate(prompts):
        for k in KS:
            kind = (i + k) % 3
            if kind == 0:
                sp = SamplingParams(max_tokens=rng.randint(3, 14), ignore_eos=True, num_speculative_tokens=k)
            elif kind == 1:
                sp = SamplingParams(max_tokens=14, ignore_eos=True, stop_token_ids=[pre[i][rng.randint(1, 9)]],
                                    num_speculative_tokens=k)
            else:
                sp = SamplingParams(max_tokens=14, num_speculative_tokens=k)
            reqs.append((p, sp))
    ref = LLMEngine(_tiny_config())
    ref.eos_token_ids = eos
    return reqs, eos, _run(ref, reqs)


def _check_endings(reqs, outs, eos):
    stopped_early = 0
    for (p, sp), o in zip(reqs, outs):
        assert 1 <= len(o) <= sp.max_tokens
        if len(o) < sp.max_tokens:
            assert o[-1] in sp.stop_token_ids or (not sp.ignore_eos and o[-1] in eos)
            stopped_early += 1
    return stopped_early


def test_greedy_self_draft_matches_target(greedy_case):
    """Draft = target (100% acceptance): runs of k+1 tokens; stops inside them truncate."""
    reqs, eos, ref = greedy_case
    eng = SpeculativeEngine(_tiny_config(), draft_model="tiny", num_speculative_tokens=4)
    eng.eos_token_ids = eos
    free0 = _counts_free(eng)
    out = _run(eng, reqs)
    assert out == ref
    assert _check_endings(reqs, out, eos) >= 6        # stop/EOS endings actually happened
    assert _counts_free(eng) == free0
    st = eng.speculative_stats()
    assert st["acceptance_rate"] >= 0.99
    assert st["num_truncated_tokens"] > 0             # a stop landed inside an accepted run
    assert st["num_output_tokens"] == sum(map(len, out))
    assert st["target_passes_per_output_token"] < 0.5
    assert st["mean_tokens_per_verification"] > 2


def test_greedy_different_draft_matches_target(greedy_case, tiny_model, tmp_path):
    """A 2-layer draft (tiny's first two layers, saved as a checkpoint) mostly disagrees: many
    rejections and rollbacks, under forced preemption; both caches end at their baseline."""
    model, config = tiny_model
    cfg2 = dataclasses.replace(config, num_hidden_layers=2)
    draft = Qwen2ForCausalLM(cfg2)
    sd = {k: v for k, v in model.state_dict().items()
          if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    draft.load_state_dict(sd)
    save_checkpoint(draft, cfg2, tmp_path / "draft2")
    reqs, eos, ref = greedy_case
    eng = SpeculativeEngine(_tiny_config(num_blocks=20), draft_model=str(tmp_path / "draft2"),
                            num_speculative_tokens=4)
    eng.eos_token_ids = eos
    free0 = _counts_free(eng)
    out = _run(eng, reqs)
    assert out == ref
    assert _counts_free(eng) == free0
    st = eng.speculative_stats()
    assert eng.stats()["num_preemptions"] > 0
    assert 0.0 < st["acceptance_rate"] < 0.6
    assert st["num_proposed_tokens"] - st["num_accepted_tokens"] > 100    # many rollbacks
    assert st["num_verifications"] > 0 and st["num_draft_passes"] > st["num_target_steps"]


# ---------------------------------------------------------------------------------------------
# The rejection rule on explicit distributions
# ---------------------------------------------------------------------------------------------
def _markov_tables(v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P and draft Q: row ``v`` is the start distribution, row ``i`` is ``p(. | i)``.
    Q has zeros where P does not (and vice versa) so both residual branches matter."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v + 1, v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(v + 1, v, generator=g) * 1.5, -1)
    p[:, 0] = 0.0                      # the target never emits 0; the draft often proposes it
    q[:, 1] = 0.0                      # the draft never proposes 1; only the residual yields it
    q[:, 0] += 0.1
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _always_accept(tp, dp, toks, nd, u, noise):
    s = toks.shape[0]
    return nd.clone(), (tp[torch.arange(s), nd] / noise).argmax(-1)


def _resample_from_target(tp, dp, toks, nd, u, noise):
    n, _ = rejection_sample(tp, dp, toks, nd, u, noise)
    return n, (tp[torch.arange(toks.shape[0]), n] / noise).argmax(-1)


def _simulate(rule, p, q, n: int, k: int, length: int, seed: int) -> torch.Tensor:
    """Generate ``length`` tokens for ``n`` rows with speculative rounds of ``k`` drafts."""
    v = p.shape[1]
    g = torch.Generator().manual_seed(seed)
    out = torch.full((n, length), -1, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), v, dtype=torch.long)          # START state
    while bool((count < length).any()):
        act = (count < length).nonzero().squeeze(1)
        s = act.numel()
        prev = last[act]
        toks, qs, ps = [], [], []
        for _ in range(k):
            qj = q[prev]                                                           # [S, V]
            d = torch.multinomial(qj, 1, generator=g).squeeze(1)
            ps.append(p[prev])
            qs.append(qj)
            toks.append(d)
            prev = d
        ps.append(p[prev])
        tp, dp = torch.stack(ps, 1), torch.stack(qs, 1)                            # [S, K+1|K, V]
        dt = torch.stack(toks, 1)                                                  # [S, K]
        u = torch.rand(s, k, generator=g)
        noise = torch.empty(s, v).exponential_(generator=g)
        nacc, nxt = rule(tp, dp, dt, torch.full((s,), k, dtype=torch.long), u, noise)
        for j in range(k + 1):
            take = j <= nacc          # j < n: accepted draft j; j == n: the correction/bonus
            tok = torch.where(j < nacc, dt[:, min(j, k - 1)], nxt)
            sel = take & (count[act] < length)
            rows = act[sel]
            out[rows, count[rows]] = tok[sel]
            last[rows] = tok[sel]
            count[rows] += 1
    return out


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float, float]:
    """(chi-square p-value with cells of expected count < 5 pooled, TV distance, statistic)."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs_c = np.append(counts[~small], counts[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    keep = exp_c > 0
    assert obs_c[~keep].sum() == 0, "a zero-probability outcome was produced"
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    df = int(keep.sum()) - 1   # chi-square survival function = regularized upper gamma Q(df/2, x/2)
    pval = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
    return pval, 0.5 * float(np.abs(counts / n - probs).sum()), stat


def test_rejection_rule_matches_target_joint():
    """40k draws of the first 3 tokens (V=6, 216 cells) under rounds of K=3 drafts."""
    v, n, k = 6, 40_000, 3
    p, q = _markov_tables(v, seed=3)
    exact = (p[v][:, None, None] * p[:v][:, :, None] * p[:v][None, :, :]).reshape(-1).numpy()  # [V^3]
    exact = exact / exact.sum()

    def joint(rule, seed):
        out = _simulate(rule, p, q, n, k, 3, seed)
        idx = (out[:, 0] * v + out[:, 1]) * v + out[:, 2]
        return np.bincount(idx.numpy(), minlength=v ** 3)

    pval, tv, _ = _chi2(joint(rejection_sample, 1), exact)
    assert pval > 1e-4 and tv < 0.03, (pval, tv)
    # Exact-distribution noise floor for comparison: sampling the target directly.
    for bad in (_always_accept, _resample_from_target):
        bad_counts = joint(bad, 1)
        with pytest.raises(AssertionError):   # a produced zero-probability token also fails
            bpval, btv, _ = _chi2(bad_counts, exact)
            assert bpval > 1e-4 and btv < 0.03
        assert 0.5 * np.abs(bad_counts / n - exact).sum() > 0.06, bad.__name__


def test_rejection_rule_single_step_cases():
    """Hand-checkable cases: q == p accepts everything; disjoint supports reject at once and
    resample from p; K = 0 samples p; greedy_verify takes the longest matching prefix."""
    v = 4
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).repeat(1, 3, 1)                      # [1, 3, V]
    q_same = p[:, :2].clone()
    toks = torch.tensor([[1, 2]])
    noise = torch.ones(1, v)
    n, _ = rejection_sample(p, q_same, toks, torch.tensor([2]), torch.tensor([[0.999, 0.999]]), noise)
    assert n.item() == 2
    q_disjoint = torch.tensor([[0.0, 0.0, 0.0, 1.0]]).repeat(1, 2, 1)
    n, nxt = rejection_sample(p, q_disjoint, torch.tensor([[3, 3]]), torch.tensor([2]),
                              torch.zeros(1, 2), torch.tensor([[1.0, 0.5, 1.0, 1.0]]))
    assert n.item() == 0 and nxt.item() == 1
    n, nxt = rejection_sample(p[:, :1], torch.zeros(1, 0, v), torch.zeros(1, 0, dtype=torch.long),
                              torch.tensor([0]), torch.zeros(1, 0), torch.tensor([[1.0, 2.0, 1.0, 1.0]]))
    assert n.item() == 0 and nxt.item() == 2
    am = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])
    d = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    n, nxt = greedy_verify(am, d, torch.tensor([3, 3, 1]))
    assert n.tolist() == [3, 1, 1] and nxt.tolist() == [8, 9, 2]


# ---------------------------------------------------------------------------------------------
# End to end on small-vocabulary random checkpoints
# ---------------------------------------------------------------------------------------------
V_SMALL = 8
PROMPT = [1, 2, 3]
SP_KW = dict(temperature=0.9, top_k=6, top_p=0.95)


def _small_model(layers: int, seed: int) -> tuple[Qwen2ForCausalLM, ModelConfig]:
    cfg = ModelConfig(vocab_size=V_SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")
    g = torch.Generator().manual_seed(seed)
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, prm in m.named_parameters():
            if name.endswith("norm.weight"):
                prm.fill_(1.0)
            elif name == "lm_head.weight":
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.4)
            elif name.endswith("embed_tokens.weight"):
                prm.copy_(torch.randn(prm.shape, generator=g))
            elif name.endswith(".bias"):
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.1)
            else:
                prm.copy_(torch.randn(prm.shape, generator=g) / prm.shape[1] ** 0.5)
    return m, cfg


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """(target_dir, draft_dir, target model): a 2-layer target; the draft is its first layer
    with perturbed weights (per-position TV to the target ~0.1-0.7, so acceptance is partial)."""
    root = tmp_path_factory.mktemp("spec-small")
    target, tcfg = _small_model(2, seed=1)
    dcfg = dataclasses.replace(tcfg, num_hidden_layers=1)
    draft = Qwen2ForCausalLM(dcfg).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        draft.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=g)
                               for k, v in target.state_dict().items() if ".layers.1." not in k})
    save_checkpoint(target, tcfg, root / "target")
    save_checkpoint(draft, dcfg, root / "draft")
    return root / "target", root / "draft", target


def _ref_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (smallest prefix reaching top_p, crossing token kept),
    written independently of the engine's code. ``logits`` [R, V] -> probs [R, V] float64."""
    out = []
    for row in logits.double():
        pr = torch.softmax(row / temperature, -1)
        order = pr.argsort(descending=True)
        keep = torch.zeros_like(pr, dtype=torch.bool)
        keep[order[:top_k]] = True
        pr = torch.where(keep, pr, 0.0)
        pr = pr / pr.sum()
        mass = 0.0
        keep2 = torch.zeros_like(keep)
        for i in order.tolist():
            if not keep[i] or mass >= top_p:
                continue
            keep2[i] = True
            mass += pr[i].item()
        pr = torch.where(keep2, pr, 0.0)
        out.append(pr / pr.sum())
    return torch.stack(out)


def _exact_joint(model, length: int) -> np.ndarray:
    """Exact target distribution of the first ``length`` generated tokens, ``[V] * length``."""
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.tensor([PROMPT])
    for _ in range(length):
        logits = model.forward_reference(prefixes)[:, -1]                          # [B, V]
        probs = _ref_probs(logits, **{k: SP_KW[k] for k in ("temperature", "top_k", "top_p")})
        joint = (joint[:, None] * probs).reshape(-1)                               # [B*V]
        b = prefixes.shape[0]
        prefixes = torch.cat([prefixes.repeat_interleave(V_SMALL, 0),
                              torch.arange(V_SMALL).repeat(b)[:, None]], 1)
    return joint.reshape([V_SMALL] * length).numpy()


def _small_engine(target_dir, draft_dir, k=2, max_seqs=1024):
    cfg = EngineConfig(model=str(target_dir), device="cpu", dtype="float32", seed=0,
                       cache=CacheConfig(block_size=BLOCK, num_blocks=4096),
                       scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16384,
                                                 max_model_len=64))
    return SpeculativeEngine(cfg, draft_model=str(draft_dir), num_speculative_tokens=k)


def _sampled_outputs(engine, n, max_tokens=4, seed0=0):
    reqs = [(PROMPT, SamplingParams(max_tokens=max_tokens, seed=seed0 + i, ignore_eos=True, **SP_KW))
            for i in range(n)]
    return np.array(_run(engine, reqs))


def test_end_to_end_sampling_follows_target(small_models, monkeypatch):
    """6k sequences: token 1 comes from the prefill sampler, tokens 2-4 from verifications
    (rounds of k=2 then 1 drafts). Joint (t2, t3) and marginals of t1 and t4 vs the exact
    target distribution; the always-accept rule must fail the same check."""
    target_dir, draft_dir, target = small_models
    exact = _exact_joint(target, 4)                                                 # [V]*4
    checks = [("t1", lambda o: o[:, 0], exact.sum(axis=(1, 2, 3))),
              ("t2t3", lambda o: o[:, 1] * V_SMALL + o[:, 2], exact.sum(axis=(0, 3)).reshape(-1)),
              ("t4", lambda o: o[:, 3], exact.sum(axis=(0, 1, 2)))]
    eng = _small_engine(target_dir, draft_dir)
    free0 = _counts_free(eng)
    out = _sampled_outputs(eng, 6000)
    assert _counts_free(eng) == free0
    st = eng.speculative_stats()
    assert 0.1 < st["acceptance_rate"] < 0.9 and st["num_truncated_tokens"] == 0
    for name, f, probs in checks:
        counts = np.bincount(f(out), minlength=probs.size)
        pval, tv, _ = _chi2(counts, probs)
        assert pval > 1e-4, (name, pval, tv)

    monkeypatch.setattr(spec_mod, "rejection_sample", _always_accept)
    bad = _sampled_outputs(_small_engine(target_dir, draft_dir), 2000)
    counts = np.bincount(bad[:, 1] * V_SMALL + bad[:, 2], minlength=V_SMALL ** 2)
    probs = checks[1][2]
    try:
        pval, tv, _ = _chi2(counts, probs)
    except AssertionError:   # produced a token the target can never produce: failed already
        pval, tv = 0.0, 1.0
    assert pval < 1e-12 and tv > 0.1, (pval, tv)


def test_mixed_batch_seeds_and_abort(small_models):
    """Greedy and sampled requests in one batch (k = 0..3 per request): greedy ones equal the
    target-only LLMEngine, seeded sampled ones are reproducible whatever the batch, no invalid
    ids; aborting mid-run frees both caches."""
    target_dir, draft_dir, _ = small_models
    greedy = [([1 + i % 5, 2, 3 + i % 4], SamplingParams(max_tokens=12, ignore_eos=True,
                                                         num_speculative_tokens=i % 4)) for i in range(6)]
    sampled = [([2, 1 + i % 3], SamplingParams(max_tokens=12, seed=100 + i, ignore_eos=True,
                                               num_speculative_tokens=1 + i % 3, **SP_KW)) for i in range(6)]
    cfg = EngineConfig(model=str(target_dir), cache=CacheConfig(block_size=BLOCK, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=64))
    ref_greedy = _run(LLMEngine(cfg), greedy)
    eng = SpeculativeEngine(cfg, draft_model=str(draft_dir), num_speculative_tokens=3)
    free0 = _counts_free(eng)
    mixed = _run(eng, [r for pair in zip(greedy, sampled) for r in pair])
    assert mixed[0::2] == ref_greedy
    for o in mixed:
        assert len(o) == 12 and all(0 <= t < V_SMALL for t in o)
    alone = _run(SpeculativeEngine(cfg, draft_model=str(draft_dir), num_speculative_tokens=3), sampled)
    assert alone == mixed[1::2]
    assert _counts_free(eng) == free0

    seqs = [eng.add_request(p, sp) for p, sp in sampled + greedy]
    for _ in range(3):
        eng.step()
    assert _counts_free(eng) != free0
    for s in seqs:
        assert eng.abort_request(s.request_id)
    assert _counts_free(eng) == free0 and not eng.has_unfinished_requests()
    st = eng.stats()
    assert st["speculative"]["num_verifications"] > 0 and st["num_free_blocks"] == free0[0]


def test_draft_cache_consistent_after_rollbacks(small_models):
    """After rejections roll the draft's cache back (and it catches up 1-2 tokens), its greedy
    proposals still equal the draft model's uncached greedy continuation of the sequence."""
    target_dir, draft_dir, _ = small_models
    cfg = EngineConfig(model=str(target_dir), cache=CacheConfig(block_size=BLOCK, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=64))
    eng = SpeculativeEngine(cfg, draft_model=str(draft_dir), num_speculative_tokens=3)
    propose = eng._propose
    checked = []

    def checked_propose(specs, mirrors):
        propose(specs, mirrors)
        for s in specs:
            ids = torch.tensor([s.seq.all_token_ids])
            for d in s.drafts:
                assert eng.draft_model.forward_reference(ids, last_only=True)[0, -1].argmax().item() == d
                ids = torch.cat([ids, torch.tensor([[d]])], 1)
            checked.append((s.ds.num_computed_tokens, s.T + s.k - 1))   # computed through d_{k-1}

    eng._propose = checked_propose
    reqs = [([1 + i, 2 + i % 3, 5], SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(6)]
    out = _run(eng, reqs)
    st = eng.speculative_stats()
    assert len(checked) == st["num_verifications"] > 20 and all(c == e for c, e in checked)
    assert 0 < st["acceptance_rate"] < 1 and all(len(o) == 20 for o in out)


def test_validation():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=1.5)
    assert SamplingParams(num_speculative_tokens=0).num_speculative_tokens == 0
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeEngine(EngineConfig(), draft_model="tiny", num_speculative_tokens=-2)


def test_benchmark_speculative_section(small_models, tmp_path):
    """``llmserve benchmark --speculative-model``: same greedy tokens as without it, and a
    ``speculative`` section with the counters."""
    import argparse

    from llmserve.bench.runner import BenchmarkOptions, add_benchmark_args, run_benchmark

    target_dir, draft_dir, _ = small_models
    prof = tmp_path / "p.yaml"
    prof.write_text("name: tiny-spec\nseed: 0\nnum_requests: 6\nwarmup_requests: 1\n"
                    "arrival: {rate: inf, burstiness: 1.0}\ndataset: {kind: synthetic, path: null}\n"
                    "prompt_len: {distribution: uniform, min: 2, max: 6}\n"
                    "output_len: {distribution: uniform, min: 4, max: 10}\n"
                    "ignore_eos: true\ntemperature: 0.0\npriorities: [0]\n")
    p = argparse.ArgumentParser()
    add_benchmark_args(p)
    args = p.parse_args(["--model", str(target_dir), "--speculative-model", str(draft_dir),
                         "--num-speculative-tokens", "3", "--block-size", "4", "--num-blocks", "256",
                         "--max-model-len", "64"])
    assert args.speculative_model == str(draft_dir) and args.num_speculative_tokens == 3
    common = dict(model=str(target_dir), profile=str(prof), block_size=4, num_blocks=256,
                  max_model_len=64, progress=False)
    base, _, _ = run_benchmark(BenchmarkOptions(output=str(tmp_path / "base.json"), **common))
    rep, _, _ = run_benchmark(BenchmarkOptions(output=str(tmp_path / "spec.json"), speculative_model=str(draft_dir),
                                               num_speculative_tokens=3, **common))
    assert base["status"] == "ok" and rep["status"] == "ok", rep.get("error")
    assert rep["token_digest"] == base["token_digest"]
    sp = rep["speculative"]
    assert base["speculative"] is None
    for key in ("num_proposed_tokens", "num_accepted_tokens", "acceptance_rate", "mean_accepted_length",
                "target_passes_per_output_token"):
        assert key in sp
    assert sp["num_output_tokens"] == rep["aggregates"]["total_output_tokens"]
    assert 0 < sp["target_passes_per_output_token"] < 1
