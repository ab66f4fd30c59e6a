"""Qwen2 model parity: llmserve vs transformers, paged vs reference, and the tiny model.

Reference: checkpoints written by ``transformers`` itself and its ``Qwen2ForCausalLM`` logits
and greedy ``generate``; llmserve loads the safetensors without any transformers model code.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from conftest import HF_VARIANTS, build_attn_metadata, empty_kv_caches
from llmserve.models import load_model
from llmserve.models.qwen2 import Qwen2ForCausalLM, apply_rope, rope_inv_freq

VARIANTS = sorted(HF_VARIANTS)
PROMPT_LENS = (1, 7, 23)


def _prompts(vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=VARIANTS)
def loaded(request, hf_qwen2):
    path, hf = hf_qwen2(request.param)
    model, config, resolved = load_model(str(path), device="cpu", dtype="float32")
    return request.param, path, hf, model, config


def test_checkpoint_layout(loaded):
    name, path, _, model, config = loaded
    if "sharded" in name:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    assert config.tie_word_embeddings == HF_VARIANTS[name]["tie_word_embeddings"]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == config.tie_word_embeddings


@torch.no_grad()
def test_reference_logits_match_transformers(loaded):
    _, _, hf, model, config = loaded
    for ids in _prompts(config.vocab_size):
        ref = hf(input_ids=ids).logits.float()                             # [1, T, V]
        ours = model.forward_reference(ids)                               # [1, T, V]
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # a batch of equal-length prompts gives the same logits as one at a time
    batch = torch.cat([torch.randint(0, config.vocab_size, (1, 9)) for _ in range(3)])
    torch.testing.assert_close(model.forward_reference(batch), hf(input_ids=batch).logits.float(),
                               atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_paged_prefill_matches_reference(loaded):
    """All prompts in one flat varlen batch, one prefill each, over scattered blocks."""
    _, _, _, model, config = loaded
    prompts = _prompts(config.vocab_size)
    bs = 4
    tables, next_block = [], 0
    for p in prompts:
        n = -(-p.shape[1] // bs)
        tables.append(list(range(next_block + n - 1, next_block - 1, -1)))  # reversed block ids
        next_block += n
    meta, positions = build_attn_metadata([(0, p.shape[1]) for p in prompts], tables, bs)
    kv = empty_kv_caches(config, next_block, bs)
    hidden = model(torch.cat([p[0] for p in prompts]), positions, kv, meta)  # [N, H]
    logits = model.compute_logits(hidden)                                     # [N, V]
    assert logits.dtype == torch.float32
    start = 0
    for p in prompts:
        t = p.shape[1]
        torch.testing.assert_close(logits[start:start + t], model.forward_reference(p)[0],
                                   atol=1e-4, rtol=1e-4)
        start += t


@torch.no_grad()
def test_paged_chunked_prefill_and_decode_match_reference(loaded):
    """Chunked prefill then token-by-token decode across block boundaries."""
    _, _, _, model, config = loaded
    bs, n_blocks = 4, 8
    seq = torch.randint(0, config.vocab_size, (22,))
    table = [5, 2, 7, 0, 3, 6]                                       # any physical blocks
    kv = empty_kv_caches(config, n_blocks, bs)
    ref = model.forward_reference(seq[None])[0]                      # [22, V]
    steps = [(0, 5), (5, 8), (13, 1), (14, 1), (15, 1), (16, 6)]     # (done, new)
    for done, new in steps:
        meta, pos = build_attn_metadata([(done, new)], [table], bs)
        out = model.compute_logits(model(seq[done:done + new], pos, kv, meta))
        torch.testing.assert_close(out, ref[done:done + new], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_greedy_generation_matches_transformers(loaded):
    _, _, hf, model, config = loaded
    for ids in _prompts(config.vocab_size)[1:]:
        hf_out = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0, ids.shape[1]:]
        x = ids
        for _ in range(32):
            nxt = model.forward_reference(x)[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            x = torch.cat([x, nxt], dim=1)
        assert x[0, ids.shape[1]:].tolist() == hf_out.tolist()


def test_rope_matches_rotate_half_formula():
    """Our half-split RoPE equals HF's ``x*cos + rotate_half(x)*sin`` with duplicated tables."""
    d, t = 16, 11
    inv = rope_inv_freq(d, 10000.0)
    freqs = torch.arange(t, dtype=torch.float)[:, None] * inv[None]           # [T, D/2]
    x = torch.randn(t, 3, d)
    ours = apply_rope(x, freqs.cos()[:, None], freqs.sin()[:, None])
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    assert torch.equal(ours, x * cos + rot * sin)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@torch.no_grad()
def test_half_precision_paged_close_to_fp32(hf_qwen2, dtype):
    path, _ = hf_qwen2("gqa_tied")
    m32, config, _ = load_model(str(path), dtype="float32")
    m16, _, _ = load_model(str(path), dtype=dtype)
    assert m16.model.layers[0].self_attn.q_proj.weight.dtype == dtype
    ids = torch.randint(0, config.vocab_size, (1, 12))
    meta, pos = build_attn_metadata([(0, 12)], [[0, 1, 2]], 4)
    kv = empty_kv_caches(config, 3, 4, dtype=dtype)
    out = m16.compute_logits(m16(ids[0], pos, kv, meta))
    ref = m32.forward_reference(ids)[0]
    assert out.dtype == torch.float32
    ref16 = m16.forward_reference(ids)[0]
    for a in (out, ref16):
        assert (a - ref).norm() / ref.norm() < 3e-2
    assert (out - ref16).norm() / ref16.norm() < 3e-2
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_attention_backend_is_settable(hf_qwen2):
    path, _ = hf_qwen2("gqa_tied")
    model, _, _ = load_model(str(path), attention_backend="torch")
    assert model.attention_backend.name == "torch"
    with pytest.raises(ValueError, match="supported"):
        model.attention_backend = "nope"


# --------------------------------------------------------------------------------------------
# The embedded tiny model
# --------------------------------------------------------------------------------------------

def test_tiny_config_and_load(tiny_model, tiny_path):
    model, config = tiny_model
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (151936, 128, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.tie_word_embeddings and config.eos_token_ids == (151643,)
    assert (tiny_path / "tokenizer.json").is_file()
    assert isinstance(model, Qwen2ForCausalLM)


def test_tiny_is_deterministic(tmp_path, tiny_path):
    """Two builds are byte-identical, and the cached checkpoint holds the same tensors."""
    from safetensors.torch import load_file

    from llmserve.models.tiny import write_tiny_checkpoint
    for d in ("a", "b"):
        write_tiny_checkpoint(tmp_path / d, with_tokenizer=False)

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    for f in ("model.safetensors", "config.json"):
        assert digest(tmp_path / "a" / f) == digest(tmp_path / "b" / f)
    fresh, cached = load_file(tmp_path / "a" / "model.safetensors"), load_file(tiny_path / "model.safetensors")
    assert fresh.keys() == cached.keys()
    assert all(torch.equal(fresh[k], cached[k]) for k in fresh)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == \
        json.loads((tiny_path / "config.json").read_text())


def test_tiny_cache_is_race_safe(tmp_path, monkeypatch):
    """Two concurrent first uses both return the same complete directory; no temp dirs stay."""
    from concurrent.futures import ThreadPoolExecutor

    import llmserve.models.tiny as tiny

    monkeypatch.setattr(tiny, "write_tiny_checkpoint",
                        lambda out: (Path(out).mkdir(parents=True, exist_ok=True),
                                     (Path(out) / "model.safetensors").write_bytes(b"x"),
                                     (Path(out) / "config.json").write_text("{}")))
    with ThreadPoolExecutor(4) as ex:
        paths = list(ex.map(lambda _: tiny.ensure_tiny_checkpoint(tmp_path), range(4)))
    assert len(set(paths)) == 1 and (paths[0] / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]


@torch.no_grad()
def test_tiny_logits_are_peaked_and_varied(tiny_model):
    """Greedy argmax has a margin far above fp32 summation-order noise, and is not an echo."""
    model, config = tiny_model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151643, (8, 32), generator=g)
    logits = model.forward_reference(ids)                                    # [8, 32, V]
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    median_gap = gap.median().item()
    # summation-order noise: the same prompts through the paged path as one flat batch
    bs = 16
    tables = [[2 * i + 1, 2 * i] for i in range(8)]
    meta, pos = build_attn_metadata([(0, 32)] * 8, tables, bs)
    paged = model.compute_logits(model(ids.flatten(), pos, empty_kv_caches(config, 16, bs), meta))
    noise = (paged.view_as(logits) - logits).abs().max().item()
    assert torch.equal(paged.view_as(logits).argmax(-1), logits.argmax(-1))
    print(f"tiny model: median top1-top2 gap {median_gap:.3f}, p1 {gap.quantile(0.01).item():.4f}, "
          f"paged-vs-reference noise {noise:.2e}")
    assert median_gap > 1.0
    assert noise < 1e-3
    pred = logits.argmax(-1)
    assert (pred == ids).float().mean() < 0.05                              # not an echo
    assert pred.unique().numel() > 200                                      # varied


# --------------------------------------------------------------------------------------------
# GPU: bf16 parity at Qwen2.5-0.5B shapes (random weights)
# --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_bf16_parity_qwen25_05b_shapes(tmp_path):
    from gpu_parity_helper import run_parity  # tests/, next to this file

    res = run_parity(tmp_path, device="cuda", dtype="bfloat16")
    print(json.dumps(res, indent=2))
    assert not res["failures"], res["failures"]
    assert res["reference"]["top1_agreement_vs_hf"] >= 0.99 and res["paged"]["top1_agreement_vs_hf"] >= 0.99
