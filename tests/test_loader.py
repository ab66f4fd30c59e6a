"""Checkpoint resolution, validation and saving: every problem is named in the error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.config import ModelConfig
from llmserve.models.loader import load_model, resolve_model_path, save_checkpoint
from llmserve.models.qwen2 import Qwen2ForCausalLM

SMALL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False,
                    eos_token_id=0, torch_dtype="float32")


@pytest.fixture
def small_ckpt(tmp_path):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(SMALL)
    path = save_checkpoint(model, SMALL, tmp_path / "ckpt")
    return path, model


def _edit_weights(path, fn):
    f = path / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)


def test_save_and_load_roundtrip(small_ckpt):
    path, model = small_ckpt
    loaded, config, resolved = load_model(str(path))
    assert resolved == path.resolve() and config == SMALL
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    assert not any(p.requires_grad for p in loaded.parameters())
    ids = torch.randint(0, 64, (2, 5))
    torch.testing.assert_close(loaded.forward_reference(ids), model.forward_reference(ids))


def test_tied_checkpoint_has_no_lm_head_and_loads_tied(tmp_path):
    cfg = ModelConfig(**{**{f: getattr(SMALL, f) for f in SMALL.__dataclass_fields__},
                         "tie_word_embeddings": True})
    path = save_checkpoint(Qwen2ForCausalLM(cfg), cfg, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model, _, _ = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_casts_dtype(small_ckpt):
    path, _ = small_ckpt
    model, _, _ = load_model(str(path), dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_tensor_is_named(small_ckpt):
    path, _ = small_ckpt
    _edit_weights(path, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(path))


def test_missing_lm_head_when_untied_is_named(small_ckpt):
    path, _ = small_ckpt
    _edit_weights(path, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*lm_head\.weight"):
        load_model(str(path))


def test_wrong_shape_is_named_with_both_shapes(small_ckpt):
    path, _ = small_ckpt
    _edit_weights(path, lambda sd: sd.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(8, 32)))
    with pytest.raises(ValueError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert "wrong shape" in msg and "model.layers.0.self_attn.k_proj.weight" in msg
    assert "[8, 32]" in msg and "[16, 32]" in msg


def test_unexpected_tensor_is_named_but_inv_freq_ignored(small_ckpt):
    path, _ = small_ckpt

    def add(sd):
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
        sd["model.layers.0.extra.weight"] = torch.zeros(3)

    _edit_weights(path, add)
    with pytest.raises(ValueError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert "unexpected tensors (1): model.layers.0.extra.weight" in msg
    assert "inv_freq" not in msg


def test_all_problems_reported_together(small_ckpt):
    path, _ = small_ckpt

    def break_all(sd):
        sd.pop("model.norm.weight")
        sd["bogus"] = torch.zeros(1)
        sd["model.embed_tokens.weight"] = torch.zeros(65, 32)

    _edit_weights(path, break_all)
    with pytest.raises(ValueError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert "model.norm.weight" in msg and "bogus" in msg and "model.embed_tokens.weight" in msg
    assert str(path) in msg


def test_unsupported_architecture_lists_supported(small_ckpt):
    path, _ = small_ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*supported architectures.*Qwen2ForCausalLM"):
        load_model(str(path))


def test_nonexistent_path_is_named(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(FileNotFoundError, match="no/such-model"):
        load_model(str(missing))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("./relative/missing-dir")


def test_dir_without_weights_or_config(tmp_path, small_ckpt):
    path, _ = small_ckpt
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_model(str(path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(empty))


def test_sharded_index_with_missing_shard(hf_qwen2, tmp_path):
    src, _ = hf_qwen2("gqa4_untied_sharded")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(str(dst))


def test_hub_id_offline_error_names_id_cache_and_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("no-such-org/no-such-model-xyz")
    msg = str(e.value)
    assert "no-such-org/no-such-model-xyz" in msg and "HF_HUB_OFFLINE" in msg
    from huggingface_hub import constants
    assert str(constants.HF_HUB_CACHE) in msg


def test_tiny_resolves_to_cached_checkpoint(tiny_path):
    assert resolve_model_path("tiny") == tiny_path
    assert (tiny_path / "config.json").is_file() and (tiny_path / "model.safetensors").is_file()
