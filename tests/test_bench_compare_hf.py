"""``bench_compare.hf_generate_batch``: HF ``generate_batch`` through the helper that
``offline_hf_continuous`` uses, on a tiny random Qwen2 (fp32, CPU).

Regression: under a caller's ``torch.inference_mode()`` transformers 5.17's ``generate_batch``
failed every request with zero tokens (its background thread may not update the inference
tensors made during warm-up). The helper must turn inference mode off itself.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llmserve.bench.compare import hf_generate_batch


@pytest.fixture(scope="module")
def tiny_hf():
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    if not hasattr(model, "generate_batch"):
        pytest.skip(f"transformers {transformers.__version__} has no generate_batch")
    return model


PROMPTS = [list(range(10, 10 + n)) for n in (5, 9, 13, 17)]


@pytest.mark.timeout(120)
def test_generate_batch_under_inference_mode_produces_all_tokens(tiny_hf):
    seen = []
    orig = tiny_hf.generate_batch

    def spy(*a, **kw):
        seen.append(torch.is_inference_mode_enabled())
        return orig(*a, **kw)

    tiny_hf.generate_batch = spy
    try:
        with torch.inference_mode():                 # as a caller decorated with it would be
            out = hf_generate_batch(tiny_hf, PROMPTS, max_new=8,  # small cache: default sizing takes ~25 s on CPU
                                    cb_config=transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64))
    finally:
        del tiny_hf.generate_batch
    assert seen == [False]
    assert out["failed"] == {}
    assert out["per_request"] == [8] * len(PROMPTS)  # EOS ignored: exactly max_new each
    assert out["produced"] == 8 * len(PROMPTS)
    assert len(out["results"]) == len(PROMPTS)


def test_decode_sweep_mechanics(hf_qwen2, tmp_path):
    """The decode sweep's cells on a CPU engine: every (context, batch) a row with a step time
    and the KV bytes it read; the table and the plot render; a sweep with nothing to draw raises."""
    from llmserve.bench.compare import decode_sweep, kv_bytes_per_token, plot_decode_sweep, to_markdown
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.llm_engine import LLMEngine

    path = str(hf_qwen2("gqa_tied")[0])
    eng = LLMEngine(EngineConfig(model=path, cache=CacheConfig(num_blocks=64),
                                 scheduler=SchedulerConfig(max_num_seqs=3)))
    rows = decode_sweep(eng, [1, 3], [16, 40], steps=4, warm=2)
    assert [(r["context"], r["batch"]) for r in rows] == [(16, 1), (16, 3), (40, 1), (40, 3)]
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 for r in rows), rows
    for r in rows:                             # the bracketed comparison, recomputed
        assert r["traced_ms_per_step"] > 0 and -0.9 < r["trace_overhead"] < 10, r
    assert eng.tracer is None                  # detached after its window
    # tracing measured at the listed contexts only: the others time one window
    some = decode_sweep(eng, [1], [16, 40], steps=4, warm=2, trace=[16])
    assert "trace_overhead" in some[0] and "trace_overhead" not in some[1], some
    assert all(r["status"] == "ok" for r in some), some
    with pytest.raises(ValueError, match=r"contexts \[99\]"):
        decode_sweep(eng, [1], [16], steps=2, warm=1, trace=[99])
    assert all("replay_ms" not in r for r in rows)   # no decode graphs on the CPU: no replay row
    per_token = kv_bytes_per_token(eng.model_config, 4)
    assert rows[1]["kv_bytes"] == 3 * (16 + 2 + 2) * per_token
    assert not eng.has_unfinished_requests()
    # a tight step budget staggers the batch's admission: the timed steps still see it whole
    eng2 = LLMEngine(EngineConfig(model=path, cache=CacheConfig(num_blocks=192),
                                  scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=96)))
    r16 = decode_sweep(eng2, [16], [48], steps=10, warm=2)[0]
    assert r16["status"] == "ok", r16          # every timed step ran all 16 (else "failed")
    # too small a cache: the row says so instead of timing a partial batch
    eng3 = LLMEngine(EngineConfig(model=path, cache=CacheConfig(num_blocks=12),
                                  scheduler=SchedulerConfig(max_num_seqs=8)))
    bad = decode_sweep(eng3, [8], [40], steps=4, warm=1)[0]
    assert bad["status"] == "failed" and bad["error"], bad
    assert not eng3.has_unfinished_requests()
    for r in rows:
        r["floor_ms"], r["ratio_to_floor"] = 0.01, r["ms_per_step"] / 0.01
    rep = {"ceilings": {"copy_bandwidth_Bps": 1e12, "bf16_matmul_flops": 1e15}, "gpu": "cpu",
           "date": "d", "torch": "t", "transformers": "x", "triton": "y", "command": "c",
           "parts": {"decode-sweep": {"model": "m", "weight_bytes": 1, "rows": rows}}}
    rep["part_seconds"] = {"ceilings": 1.04, "decode-sweep": 20.0}
    md = to_markdown(rep)
    assert "Wall seconds of each part (model builds and warm-ups included): ceilings 1, decode-sweep 20; 21 in all." in md
    assert "| 40: ms/step |" in md and "| 16: x floor |" in md and "| 16: tracing on |" in md
    assert "graph replay alone" not in md
    rows[0].update(replay_ms=0.5, host_gap_ms=rows[0]["ms_per_step"] - 0.5)
    assert "| 16: graph replay alone | 0.50 |" in to_markdown(rep) and "| 16: host gap" in to_markdown(rep)
    plot_decode_sweep(rows, tmp_path / "s.png", "t")
    assert (tmp_path / "s.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no successful cell"):
        plot_decode_sweep([dict(rows[0], status="failed")], tmp_path / "e.png", "t")


def test_replay_ms_times_the_last_decode_graph():
    """``_replay_ms`` replays the graph the last step replayed, ``steps`` times between two
    waits for the device, and gives None where no decode graph ran."""
    from types import SimpleNamespace

    from llmserve.bench.compare import _replay_ms

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    waits = []
    eng = SimpleNamespace(runner=SimpleNamespace(cuda_graphs=SimpleNamespace(last_graph=Graph())))
    ms = _replay_ms(eng, 7, lambda: waits.append(1))
    assert Graph.replays == 7 and len(waits) == 2 and ms >= 0
    assert _replay_ms(SimpleNamespace(runner=SimpleNamespace(cuda_graphs=None)), 3, lambda: None) is None
    none_yet = SimpleNamespace(runner=SimpleNamespace(cuda_graphs=SimpleNamespace(last_graph=None)))
    assert _replay_ms(none_yet, 3, lambda: None) is None


@pytest.mark.parametrize("flags,rows", [
    ([], ["llmserve continuous", "llmserve continuous, defaults"]),
    (["--offline-flags", "tuned"], ["llmserve continuous"]),
    (["--offline-flags", "defaults"], ["llmserve continuous, defaults"]),
    (["--offline-flags", "defaults", "tuned"], ["llmserve continuous", "llmserve continuous, defaults"]),
])
def test_offline_flags_choose_the_llmserve_rows(monkeypatch, flags, rows):
    """``bench-compare --offline-flags``: the tuned row, the defaults row or both (the engine
    run itself stubbed: no GPU here); the report's markdown takes either alone."""
    import argparse

    import llmserve.bench.compare as c

    monkeypatch.setattr(c, "measure_ceilings", lambda device: {"copy_bandwidth_Bps": 1e12, "bf16_matmul_flops": 1e14})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "test GPU")
    monkeypatch.setattr(c, "offline_llmserve", lambda *a, **kw: {"requests": 4, "output_tokens": 8,
                                                                 "output_tok_per_s": 1.0})
    p = argparse.ArgumentParser()
    c.add_bench_compare_subparser(p.add_subparsers())
    args = p.parse_args(["bench-compare", "--parts", "offline", "--skip-hf", "--offline-requests", "4"] + flags)
    args.command_line = "llmserve bench-compare"
    report = c.run(args)
    assert [r["name"] for r in report["parts"]["offline"]["rows"]] == rows
    assert all(name in c.to_markdown(report) for name in rows)


def test_offline_flags_refuse_other_values(capsys):
    import argparse

    import llmserve.bench.compare as c

    p = argparse.ArgumentParser()
    c.add_bench_compare_subparser(p.add_subparsers())
    with pytest.raises(SystemExit):
        p.parse_args(["bench-compare", "--offline-flags", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
