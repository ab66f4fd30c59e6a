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
