"""Weight-only INT8/INT4 quantization: formats, error bounds, layers, module swap, sizes,
checkpoints, and closeness of a quantized model to its 16-bit original."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# Triton picks interpreter vs compiler when its jit functions are defined (at import), so the
# interpreter must be chosen before anything imports triton (as tests/test_triton_kernels.py does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmserve.quant import (
    DEFAULT_INCLUDE,
    Int4Linear,
    Int8Linear,
    TritonInt8Linear,
    apply_linear_backend,
    dequantize_int4,
    dequantize_int8,
    load_quantized,
    model_nbytes,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantize_state_dict,
    quantized_copy,
    read_quantization_config,
    save_quantized,
    unpack_int4,
)

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9, 37, generator=g)
    w[2] = 0.0                                   # an all-zero row
    w[3] *= 1e-4                                 # a tiny row
    w[4, 5] = 50.0                               # an outlier
    w[5] = torch.linspace(-1, 1, 37)             # exact grid-ish values, ties
    return [w, torch.randn(1, 1, generator=g), torch.randn(16, 128, generator=g).half(),
            torch.randn(7, 13, generator=g).bfloat16()]


# ----------------------------------------------------------------------------------------------
# Formats and error bounds
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("idx", range(4))
def test_int8_round_trip_error_at_most_half_a_step(idx):
    w = _weights()[idx]
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    w32 = w.float()
    torch.testing.assert_close(scale, w32.abs().amax(1) / 127, rtol=0, atol=0)
    err = (dequantize_int8(q, scale) - w32).abs()
    bound = scale[:, None] / 2 * (1 + 1e-5) + 1e-12
    assert bool((err <= bound).all()), float((err - bound).max())
    # the largest magnitude of every non-zero row maps to +-127 exactly
    nz = scale > 0
    assert bool((q[nz].abs().amax(1) == 127).all())


@pytest.mark.parametrize("idx", range(4))
@pytest.mark.parametrize("group_size", [None, 4, 10, 128])
def test_int4_round_trip_error_at_most_half_a_step(idx, group_size):
    w = _weights()[idx]
    n, k = w.shape
    packed, scale = quantize_int4(w, group_size)
    g = k if group_size is None else group_size
    groups = -(-k // g)
    assert packed.dtype == torch.uint8 and packed.shape == (n, (k + 1) // 2)
    assert scale.dtype == torch.float32 and scale.shape == (n, groups)
    q = unpack_int4(packed, k)
    assert int(q.min()) >= -7 and int(q.max()) <= 7          # symmetric grid, -8 unused
    deq = dequantize_int4(packed, scale, k, group_size)
    s_full = scale.repeat_interleave(g, dim=1)[:, :k]        # each element's own group scale
    err = (deq - w.float()).abs()
    assert bool((err <= s_full / 2 * (1 + 1e-5) + 1e-12).all())
    # scale = max |w| / 7 over each (possibly shorter last) group
    wp = F.pad(w.float(), (0, groups * g - k)).view(n, groups, g)
    torch.testing.assert_close(scale, wp.abs().amax(2) / 7, rtol=0, atol=0)


def test_int4_pack_unpack_exact_all_16_values_and_odd_shapes():
    vals = torch.arange(-8, 8, dtype=torch.int8)
    for shape in [(16,), (1, 16), (3, 5), (1, 1), (2, 3, 7), (4, 33)]:
        numel = 1
        for s in shape:
            numel *= s
        q = vals.repeat(numel // 16 + 1)[:numel].reshape(shape)
        q = q[..., torch.randperm(shape[-1], generator=torch.Generator().manual_seed(1))]
        p = pack_int4(q)
        assert p.dtype == torch.uint8 and p.shape == (*shape[:-1], (shape[-1] + 1) // 2)
        assert torch.equal(unpack_int4(p, shape[-1]), q)
    # the nibble layout is the documented one: low = element 2j, high = element 2j+1
    p = pack_int4(torch.tensor([[1, -1, -8, 7, 3]], dtype=torch.int8))
    assert p.tolist() == [[0xF1, 0x78, 0x03]]
    # every byte value unpacks and re-packs to itself
    allbytes = torch.arange(256, dtype=torch.int16).to(torch.uint8).reshape(1, 256)
    assert torch.equal(pack_int4(unpack_int4(allbytes, 512)), allbytes)


def test_int4_pack_errors():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([8]))
    with pytest.raises(ValueError, match="integer"):
        pack_int4(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="inconsistent"):
        unpack_int4(torch.zeros(2, 3, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.randn(2, 8), group_size=3)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]))


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_reference_layers_equal_dequantize_then_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(21, 10, bias=bias)
    x = torch.randn(2, 3, 21)
    m8 = Int8Linear.from_linear(lin)
    w8 = dequantize_int8(m8.weight, m8.weight_scale)
    torch.testing.assert_close(m8(x), F.linear(x, w8, lin.bias))
    m4 = Int4Linear.from_linear(lin, group_size=8)
    w4 = dequantize_int4(m4.weight_packed, m4.weight_scale, 21, 8)
    torch.testing.assert_close(m4(x), F.linear(x, w4, lin.bias))
    # and both are close to the float layer
    assert (m8(x) - lin(x)).abs().max() < 0.05
    assert (m4(x) - lin(x)).abs().max() < 0.5
    assert sorted(dict(m8.named_buffers())) == sorted(["weight", "weight_scale"] + (["bias"] if bias else []))
    assert sorted(dict(m4.named_buffers())) == sorted(["weight_packed", "weight_scale"] + (["bias"] if bias else []))


def test_triton_int8_layer_without_cuda_raises_clearly(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = TritonInt8Linear.from_linear(nn.Linear(16, 8))
    with pytest.raises(RuntimeError, match="CUDA device.*TRITON_INTERPRET=1.*'int8'"):
        layer(torch.randn(2, 16))


def test_triton_int8_layer_in_interpreter_matches_reference(monkeypatch):
    """On CPU the fused kernel runs in Triton's interpreter when TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU variant below covers CUDA")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    ref = Int8Linear.from_linear(lin)
    tri = TritonInt8Linear.from_linear(lin)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(tri(x), ref(x), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_triton_int8_layer_on_gpu_bf16():
    torch.manual_seed(0)
    lin = nn.Linear(256, 384).cuda().bfloat16()
    ref = Int8Linear.from_linear(lin)
    tri = TritonInt8Linear.from_linear(lin)
    for m in (1, 7, 200):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(tri(x).float(), ref(x).float(), rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------------------------
# State-dict transform and module swap
# ----------------------------------------------------------------------------------------------

def make_small_model(seed: int = 0, tie: bool = True):
    """A small random llmserve Qwen2 (vocab 256, hidden 64, 2 layers, GQA 4/2, in_features 64
    and 128) with peaked logits: N(0, 1/fan_in) projections, unit-variance embeddings."""
    from llmserve.config import ModelConfig
    from llmserve.models.qwen2 import Qwen2ForCausalLM

    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=tie, torch_dtype="float32")
    g = torch.Generator().manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2 and "embed" not in name and name != "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g))
    for p in model.parameters():
        p.requires_grad_(False)
    return model, cfg


@pytest.fixture()
def small_model():
    model, cfg = make_small_model()
    return model, cfg, None


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", None), ("int4", 16),
                                               ("triton-int8", None)])
def test_state_dict_transform_matches_module_swap(small_model, scheme, group_size):
    model, config, _ = small_model
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    qsd, meta = quantize_state_dict(sd, scheme, group_size=group_size)
    qmodel = quantized_copy(model, scheme, group_size=group_size)
    msd = qmodel.state_dict()
    assert sorted(qsd) == sorted(msd)
    for k in qsd:
        assert qsd[k].dtype == msd[k].dtype and torch.equal(qsd[k], msd[k]), k
    expected = sorted(f"model.layers.{i}.{p}" for i in range(config.num_hidden_layers) for p in PROJ)
    assert meta["modules"] == expected == qmodel.quantization_config["modules"]
    assert meta == qmodel.quantization_config
    assert meta["scheme"] == scheme and meta["group_size"] == group_size
    json.dumps(meta)                                          # serialisable
    # embeddings, lm_head and norms stay 16-bit: untouched and shared with the original
    assert type(qmodel.lm_head) is nn.Linear
    assert qmodel.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert qmodel.model.norm.weight is model.model.norm.weight
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear   # original untouched
    for name in expected:
        assert isinstance(qmodel.get_submodule(name), Int4Linear if scheme == "int4" else Int8Linear)


def test_selection_is_explicit_and_errors_are_clear(small_model):
    model, _, _ = small_model
    q = quantized_copy(model, "int8", include=["model.layers.0.mlp.down_proj"])
    assert q.quantization_config["modules"] == ["model.layers.0.mlp.down_proj"]
    assert type(q.model.layers[0].mlp.up_proj) is nn.Linear
    q = quantized_copy(model, "int8", include=r"model\.layers\.1\.self_attn\.[qk]_proj")
    assert q.quantization_config["modules"] == ["model.layers.1.self_attn.k_proj",
                                                "model.layers.1.self_attn.q_proj"]
    with pytest.raises(ValueError, match=r"supported: \['int8', 'int4', 'triton-int8'\]"):
        quantized_copy(model, "int3")
    with pytest.raises(ValueError, match="only to the int4"):
        quantized_copy(model, "int8", group_size=64)
    with pytest.raises(ValueError, match="do not exist"):
        quantized_copy(model, "int8", include=["model.layers.9.mlp.up_proj"])
    with pytest.raises(ValueError, match="only nn.Linear"):
        quantized_copy(model, "int8", include=["model.embed_tokens"])
    with pytest.raises(ValueError, match="no module matched"):
        quantized_copy(model, "int8", include=r"nothing\.here")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(q, "int4")
    assert apply_linear_backend(model, "torch") is model
    with pytest.raises(ValueError, match="unknown linear backend"):
        apply_linear_backend(model, "fp8")


def test_default_include_pattern():
    import re
    pat = re.compile(DEFAULT_INCLUDE)
    for p in PROJ:
        assert pat.fullmatch(f"model.layers.12.{p}")
    for name in ("lm_head", "model.embed_tokens", "model.norm", "model.layers.0.input_layernorm",
                 "model.layers.0.self_attn", "model.layers.0.mlp.down_proj.extra"):
        assert not pat.fullmatch(name)


# ----------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------

def test_model_nbytes_exact_on_a_hand_computed_module():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)                           # 40 fp32 = 160 B
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight                       # tied: counted once
            self.lin = nn.Linear(3, 5)                               # (15 + 5) fp32 = 80 B
            self.register_buffer("counts", torch.zeros(7, dtype=torch.int8))          # 7 B
            self.register_buffer("table", torch.zeros(2, dtype=torch.float64), persistent=False)  # 16 B

    m = M()
    assert model_nbytes(m) == 160 + 80 + 7
    assert model_nbytes(m, include_non_persistent=True) == 160 + 80 + 7 + 16
    m.half()                                                         # float tensors halve
    assert model_nbytes(m) == 80 + 40 + 7
    # quantized layers: int8 [5, 3] + fp32 scale [5] + fp16 bias [5]
    m.lin = Int8Linear.from_linear(m.lin)
    assert model_nbytes(m) == 80 + (15 + 20 + 10) + 7
    # int4, K=9 -> 5 packed bytes per row; group 4 -> 3 scales per row; no bias
    q4 = Int4Linear.from_linear(nn.Linear(9, 4, bias=False), group_size=4)
    assert model_nbytes(q4) == 4 * 5 + 4 * 3 * 4


def test_quantized_model_is_smaller_by_the_expected_bytes(small_model):
    model, config, _ = small_model
    base = model_nbytes(model)
    h, i, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hq, hkv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = [(hq, h), (hkv, h), (hkv, h), (h, hq), (i, h), (i, h), (h, i)]
    n_w = sum(o * k for o, k in shapes)                              # per layer
    n_rows = sum(o for o, _ in shapes)
    q8 = quantized_copy(model, "int8")
    assert model_nbytes(q8) == base - L * n_w * 4 + L * (n_w + 4 * n_rows)
    q4 = quantized_copy(model, "int4", group_size=16)
    packed = sum(o * ((k + 1) // 2) for o, k in shapes)
    scales = sum(o * -(-k // 16) for o, k in shapes) * 4
    assert model_nbytes(q4) == base - L * n_w * 4 + L * (packed + scales)


# ----------------------------------------------------------------------------------------------
# Model-level closeness and checkpoints
# ----------------------------------------------------------------------------------------------

def test_quantized_tiny_model_close_to_16bit(tiny_model):
    """KL(p16 || pq) and top-1 agreement on the (peaked) tiny model."""
    from llmserve.bench.evaluation import LogitErrorStats

    model, _ = tiny_model
    ids = torch.randint(0, 151643, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = model.forward_reference(ids)[0]
    out = {}
    for name, scheme, gs in [("int8", "int8", None), ("int4", "int4", None), ("int4-g32", "int4", 32)]:
        st = LogitErrorStats()
        st.update(ref, quantized_copy(model, scheme, group_size=gs).forward_reference(ids)[0])
        out[name] = st.summary()
    assert out["int8"]["kl_mean"] < 0.05 and out["int8"]["top1_agreement"] >= 0.85
    assert out["int8"]["kl_mean"] < out["int4-g32"]["kl_mean"] < out["int4"]["kl_mean"]
    assert out["int4"]["kl_mean"] < 5.0


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_untied_int8(tmp_path, tie):
    model, _ = make_small_model(seed=1, tie=tie)
    q = quantized_copy(model, "int8")
    out = save_quantized(q, tmp_path / "q8")
    loaded = load_quantized(out, scheme="triton-int8")          # same storage, other layer
    assert loaded.quantization_config["scheme"] == "triton-int8"
    assert isinstance(loaded.model.layers[0].mlp.up_proj, TritonInt8Linear)
    for name, t in q.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie


def test_save_and_load_quantized_round_trip(small_model, tmp_path):
    model, config, _ = small_model
    q = quantized_copy(model, "int4", group_size=16)
    out = save_quantized(q, tmp_path / "q4")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == q.quantization_config
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["quantization_config"]) == q.quantization_config
    assert read_quantization_config(out)["scheme"] == "int4"
    loaded = load_quantized(out)
    assert loaded.quantization_config == q.quantization_config
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded.forward_reference(ids), q.forward_reference(ids), rtol=0, atol=0)
    assert model_nbytes(loaded) == model_nbytes(q)
    # the scheme is read from metadata, never guessed from the path
    renamed = tmp_path / "int8-model"
    os.rename(out, renamed)
    assert load_quantized(renamed).quantization_config["scheme"] == "int4"
    with pytest.raises(ValueError, match="cannot be loaded as 'int8'"):
        load_quantized(renamed, scheme="int8")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config.to_hf_dict()))
    with pytest.raises(ValueError, match="no quantization_config"):
        read_quantization_config(plain)
