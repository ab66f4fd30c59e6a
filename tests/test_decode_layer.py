"""The one-launch decoder layer (``triton_kernels/decode_layer.py``) against the five-kernel
matrix-vector path and the readable model, in Triton's interpreter on CPU (fp32; one program,
so the stages run in order in it) and on a GPU when present."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from llmserve.attention.base import get_attention_backend  # noqa: E402
from llmserve.models.fast_forward import FastQwen2Forward  # noqa: E402
from llmserve.triton_kernels.decode_layer import (DecodeLayerConfig, DecodeLayerWeights,  # noqa: E402
                                                  decode_layer)
from llmserve.triton_kernels.gemv import gemv, gemv_qkv_rope  # noqa: E402
from llmserve.triton_kernels.paged_attention import paged_attention_decode  # noqa: E402

from test_fast_forward import DEVICE, batch, small_model  # noqa: E402


def _five_kernels(model, fast, r, pos, caches, meta):
    """The matrix-vector path's five kernels for layer 0 (the reference of one launch)."""
    layer, entry = model.model.layers[0], fast.layers[0]
    k_cache, v_cache = caches[0]
    cos, sin = model.rope_cos_sin(r.device)
    q = gemv_qkv_rope(r, entry["qkv"][0], bias=entry["qkv"][1], norm_weight=layer.input_layernorm.weight,
                      eps=fast.eps, positions=pos, slot_mapping=meta.slot_mapping, cos=cos, sin=sin,
                      k_cache=k_cache, v_cache=v_cache, num_heads=fast.num_heads, num_kv_heads=fast.num_kv_heads)
    o = paged_attention_decode(q, k_cache, v_cache, meta, fast.scale)
    n = r.shape[0]
    gemv(o.reshape(n, -1), layer.self_attn.o_proj.weight, bias=layer.self_attn.o_proj.bias, residual=r, out=r)
    act = gemv(r, entry["gate_up"][0], prologue="rmsnorm", glu=True,
               norm_weight=layer.post_attention_layernorm.weight, eps=fast.eps)
    gemv(act, layer.mlp.down_proj.weight, residual=r, out=r)
    return r


@pytest.mark.parametrize("seqs,splits", [
    ([(1, 1)], None),                            # batch 1, first position
    ([(17, 1)], 3),                              # 17 = 16 + 1: a 1-position last tile, 2 splits used
    ([(40, 1)], 2),                              # 3 tiles over 2 splits (2 + 1), merged
    ([(9, 1), (4, 1), (33, 1)], 4),              # batch 3: split counts differ per sequence
    ([(8, 1), (5, 1), (1, 1), (16, 1)], None),   # batch 4, a block-boundary context
])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (7, 1)])
def test_decode_layer_matches_five_kernels(seqs, splits, hq, hkv):
    model = small_model(hq, hkv, d=32)
    fast = FastQwen2Forward(model, use_gemv=True, gemv_max_tokens=4)
    ids, pos, caches, meta = batch(model, seqs)
    caches2 = [(k.clone(), v.clone()) for k, v in caches]
    r0 = model.model.embed_tokens(ids)
    ref = _five_kernels(model, fast, r0.clone(), pos, caches, meta)
    layer, entry = model.model.layers[0], fast.layers[0]
    w = DecodeLayerWeights(entry["qkv"][0], entry["qkv"][1], layer.input_layernorm.weight,
                           layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias,
                           layer.post_attention_layernorm.weight, entry["gate_up"][0],
                           layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)
    cos, sin = model.rope_cos_sin(r0.device)
    barrier = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    r = r0.clone()
    out = decode_layer(r, w, positions=pos, slot_mapping=meta.slot_mapping, cos=cos, sin=sin,
                       k_cache=caches2[0][0], v_cache=caches2[0][1], block_tables=meta.block_tables,
                       context_lens=meta.context_lens, max_context_len=meta.max_context_len,
                       num_heads=hq, num_kv_heads=hkv, eps=fast.eps, scale=fast.scale, barrier=barrier,
                       num_splits=splits)
    assert out is r
    torch.testing.assert_close(r, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches2[0][0], caches[0][0])
    torch.testing.assert_close(caches2[0][1], caches[0][1])
    assert barrier.tolist() == [0, 0]                       # re-armed for the next launch


def test_layer_kernel_path_matches_readable_path(monkeypatch):
    """``LLMSERVE_DECODE_LAYER=1``: decode-only steps of <= 4 sequences take one launch a layer;
    a prefill chunk still takes the five-kernel path."""
    import llmserve.models.fast_forward as ff

    calls = []
    monkeypatch.setattr(ff, "decode_layer", lambda *a, **k: calls.append(1) or decode_layer(*a, **k))
    monkeypatch.setenv("LLMSERVE_DECODE_LAYER", "1")
    model = small_model(6, 2, d=32)
    model.attention_backend = get_attention_backend("triton")
    for seqs, launches in (([(9, 1), (4, 1), (17, 1)], 2), ([(7, 3)], 0)):
        calls.clear()
        ids, pos, caches, meta = batch(model, seqs)
        caches2 = [(k.clone(), v.clone()) for k, v in caches]
        ref = model(ids, pos, caches, meta)
        fast = FastQwen2Forward(model, use_gemv=True, gemv_max_tokens=4)
        assert fast.use_layer_kernel
        out = fast(ids, pos, caches2, meta)
        torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
        for (k1, v1), (k2, v2) in zip(caches, caches2):
            torch.testing.assert_close(k2[:-1], k1[:-1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v2[:-1], v1[:-1], atol=1e-5, rtol=1e-5)
        assert len(calls) == launches                       # one launch a layer, decode only


def test_decode_layer_rejects_bad_input():
    model = small_model(6, 2, d=32)
    fast = FastQwen2Forward(model, use_gemv=True, gemv_max_tokens=4)
    ids, pos, caches, meta = batch(model, [(5, 1)])
    layer, entry = model.model.layers[0], fast.layers[0]
    w = DecodeLayerWeights(entry["qkv"][0], entry["qkv"][1], layer.input_layernorm.weight,
                           layer.self_attn.o_proj.weight, None, layer.post_attention_layernorm.weight,
                           entry["gate_up"][0], layer.mlp.down_proj.weight, None)
    cos, sin = model.rope_cos_sin(pos.device)
    kw = dict(positions=pos, slot_mapping=meta.slot_mapping, cos=cos, sin=sin, k_cache=caches[0][0],
              v_cache=caches[0][1], block_tables=meta.block_tables, context_lens=meta.context_lens,
              max_context_len=meta.max_context_len, num_heads=6, num_kv_heads=2, eps=1e-6, scale=0.25,
              barrier=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    r = model.model.embed_tokens(ids)
    with pytest.raises(ValueError, match="1 <= M <= 4"):
        decode_layer(r.repeat(5, 1), w, **kw)
    with pytest.raises(ValueError, match="heads"):
        decode_layer(r, w, **{**kw, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="w_o"):
        decode_layer(r, DecodeLayerWeights(*[getattr(w, f) for f in w.__slots__][:3], w.w_o[:, :-1],
                                           *[getattr(w, f) for f in w.__slots__][4:]), **kw)
    with pytest.raises(ValueError, match="barrier"):
        decode_layer(r, w, **{**kw, "barrier": torch.zeros(1, dtype=torch.int32, device=DEVICE)})
    with pytest.raises(ValueError, match="powers of two"):
        DecodeLayerConfig((3, 16), (4, 16), (4, 16), (4, 16))
