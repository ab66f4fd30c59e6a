"""The fused serving forward pass: same weights and the same function as
``Qwen2ForCausalLM.forward``, in ~10 kernels a layer instead of ~35.

What changes against the readable path (``models/qwen2.py``):

* q/k/v projections run as one GEMM over a packed ``[Hq*D + 2*Hkv*D, H]`` weight, and
  gate/up as one GEMM over ``[2*I, H]``. The packed tensors are built once; the original
  ``q_proj.weight`` etc. become *views* into them, so HF parameter names and
  ``state_dict()`` are unchanged and no memory is duplicated.
* RMSNorm and the residual add are one kernel; RoPE, the QKV split and the K/V cache write are
  one kernel; SiLU-and-mul is one kernel (``triton_kernels/fused.py``).

Layers whose projections were swapped for quantized modules keep calling those modules (the
packing applies to plain ``nn.Linear`` only). Parity with the readable path is tested in
``tests/test_fast_forward.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata
from ..triton_kernels.fused import add_rmsnorm, rope_qkv_write_kv, silu_and_mul


def _pack(linears: list[nn.Linear], with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate weights (and biases) along the output dim and re-point each module's
    parameters at views of the packed tensor."""
    w = torch.cat([m.weight.data for m in linears], dim=0)                  # [sum(out), in]
    b = torch.cat([m.bias.data for m in linears], dim=0) if with_bias else None
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = w[start:start + rows]
        if with_bias:
            m.bias.data = b[start:start + rows]
        start += rows
    return w, b


class FastQwen2Forward:
    """Fused forward for a loaded :class:`~llmserve.models.qwen2.Qwen2ForCausalLM`.

    Args:
        model: the model (weights already on their device and dtype).

    Call it like ``model.forward``: ``(input_ids [N], positions [N], kv_caches, meta) ->
    hidden [N, H]``. Needs Triton (a GPU, or ``TRITON_INTERPRET=1`` with CPU tensors).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            entry = {"layer": layer}
            if all(type(m) is nn.Linear for m in (attn.q_proj, attn.k_proj, attn.v_proj)):
                entry["qkv"] = _pack([attn.q_proj, attn.k_proj, attn.v_proj], with_bias=True)
            if all(type(m) is nn.Linear for m in (mlp.gate_proj, mlp.up_proj)):
                entry["gate_up"] = _pack([mlp.gate_proj, mlp.up_proj], with_bias=False)
            self.layers.append(entry)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        model = self.model
        backend = model.attention_backend
        cos, sin = model.rope_cos_sin(input_ids.device)                     # [L, D/2] fp32
        x = model.model.embed_tokens(input_ids)                             # [N, H]
        n = x.shape[0]
        residual = None
        for entry, (k_cache, v_cache) in zip(self.layers, kv_caches):
            layer = entry["layer"]
            attn, mlp = layer.self_attn, layer.mlp
            h, residual = add_rmsnorm(x, layer.input_layernorm.weight, self.eps, residual)  # [N, H]
            if "qkv" in entry:
                qkv = F.linear(h, *entry["qkv"])                            # [N, (Hq+2Hkv)*D]
            else:
                qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
            q = rope_qkv_write_kv(qkv, positions, meta.slot_mapping, cos, sin, k_cache, v_cache,
                                  self.num_heads, self.num_kv_heads)        # [N, Hq, D]
            o = backend.forward(q, k_cache, v_cache, meta, self.scale)     # [N, Hq, D]
            x = attn.o_proj(o.reshape(n, self.num_heads * self.head_dim))  # [N, H]
            h, residual = add_rmsnorm(x, layer.post_attention_layernorm.weight, self.eps, residual)
            if "gate_up" in entry:
                gu = F.linear(h, entry["gate_up"][0])                       # [N, 2I]
            else:
                gu = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)
            x = mlp.down_proj(silu_and_mul(gu))                             # [N, H]
        h, _ = add_rmsnorm(x, model.model.norm.weight, self.eps, residual)  # [N, H]
        return h
