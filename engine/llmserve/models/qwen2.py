"""The Qwen2 / Qwen2.5 decoder in plain PyTorch, with Hugging Face parameter names.

Architecture (matches ``transformers.models.qwen2.modeling_qwen2``, which is the reference the
tests compare logits against):

* token embedding -> ``num_hidden_layers`` pre-norm decoder layers -> final RMSNorm -> lm_head
  (``lm_head`` shares the embedding matrix when ``tie_word_embeddings``);
* each layer: ``x + o_proj(attn(RoPE(q_proj(n1(x))), RoPE(k_proj(n1(x))), v_proj(n1(x))))``,
  then ``x + down_proj(silu(gate_proj(n2(x))) * up_proj(n2(x)))`` (SwiGLU, Shazeer 2020,
  "GLU Variants Improve Transformer");
* q/k/v projections carry a bias, o_proj does not; grouped-query attention (Ainslie et al.
  2023, "GQA") with ``num_attention_heads / num_key_value_heads`` query heads per K/V head;
* RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization") computed in fp32
  and cast back before the weight multiply, exactly as HF ``Qwen2RMSNorm``;
* rotary position embedding (Su et al. 2021, "RoFormer", arXiv:2104.09864) in the
  "rotate-half" (GPT-NeoX) layout HF uses: dimension ``i`` is paired with ``i + D/2``,
  ``inv_freq[i] = rope_theta ** (-2i / D)``.

Two forward paths share every weight:

* :meth:`Qwen2ForCausalLM.forward` — the serving path: a flat varlen batch of ``N`` tokens from
  any number of sequences; each layer writes its new K/V into the paged cache through the
  attention backend and then attends against the cache (see :mod:`llmserve.attention`).
* :meth:`Qwen2ForCausalLM.forward_reference` — uncached causal attention over ``[B, T]`` with
  ``torch.nn.functional.scaled_dot_product_attention``; the reference the paged path is
  checked against.

All projections are plain ``nn.Linear`` modules so quantization can swap them by name.

Tensor parallelism (``tp``, a :class:`~llmserve.models.parallel.TensorParallelGroup` of more than
one rank; :mod:`llmserve.models.parallel`): the same modules with local shapes (this rank's
query and K/V heads, intermediate columns and vocabulary rows), one all-reduce after o_proj and
one after down_proj, a vocabulary-parallel embedding, and logits gathered on rank 0. Every rank
must run the same forward calls (the collectives pair up across ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, get_attention_backend
from ..attention.invariant import invariant_dense_attention
from ..config import ModelConfig
from .parallel import TensorParallelGroup, VocabParallelEmbedding


class RMSNorm(nn.Module):
    """``y = w * (x / sqrt(mean(x^2) + eps))`` with the statistics in fp32 (HF ``Qwen2RMSNorm``).

    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization" (arXiv:1910.07467).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., H]`` any float dtype -> ``[..., H]`` in ``x.dtype``."""
        dtype = x.dtype
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)                       # [..., 1] fp32
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies ``theta ** (-2i/D)`` for ``i < D/2``: ``[D/2]`` fp32 on CPU.

    Computed exactly as HF ``Qwen2RotaryEmbedding`` (default rope type) so cos/sin are
    bit-identical. Source: RoFormer (Su et al. 2021), eq. 15.
    """
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by the angles whose cos/sin are given (rotate-half layout).

    Args:
        x: ``[..., T, H, D]`` or broadcast-compatible with ``cos``/``sin`` of shape
            ``[..., T, 1, D/2]``; any float dtype.
        cos, sin: fp32 ``[..., T, 1, D/2]``; cast to ``x.dtype`` before use, as HF does.

    Returns:
        Same shape and dtype as ``x``: ``[x1*cos - x2*sin, x2*cos + x1*sin]`` where ``x1, x2``
        are the two halves of the last dimension. This is bit-identical to HF's
        ``x*cat(cos,cos) + rotate_half(x)*cat(sin,sin)``.
    """
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _tp_or_single(config: ModelConfig, tp: TensorParallelGroup | None) -> TensorParallelGroup:
    return tp if tp is not None else TensorParallelGroup.single(config)


class Qwen2Attention(nn.Module):
    """Multi-head attention with GQA, q/k/v bias and RoPE (HF ``Qwen2Attention``). With a
    tensor-parallel ``tp``: this rank's query heads and the K/V heads they use, and o_proj's
    partial sums all-reduced.

    ``invariant_tile``: ``None``, or the key-tile size of the batch-invariant mode (set by
    :func:`llmserve.models.batch_invariant.make_batch_invariant`), with which the reference
    forward attends through :func:`llmserve.attention.invariant.invariant_dense_attention`.
    """

    invariant_tile: int | None = None

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = _tp_or_single(config, tp)
        self.num_heads = self.tp.plan.q_count                  # local query heads
        self.num_kv_heads = self.tp.plan.kv_count              # local K/V heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """Paged path. ``x``: ``[N, H]``; ``cos``/``sin``: ``[N, 1, D/2]`` fp32;
        ``kv_cache``: two ``[num_blocks+1, block_size, Hkv, D]`` tensors. Returns ``[N, H]``."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)         # [N, Hq, D]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)      # [N, Hkv, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)      # [N, Hkv, D]
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale)        # [N, Hq, D]
        return self.tp.all_reduce(self.o_proj(o.reshape(n, self.num_heads * self.head_dim)))  # [N, H]

    def forward_reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Uncached causal path. ``x``: ``[B, T, H]``; ``cos``/``sin``: ``[T, 1, D/2]``.
        Returns ``[B, T, H]``."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)      # [B, T, Hq, D]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)   # [B, T, Hkv, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)   # [B, T, Hkv, D]
        q = apply_rope(q, cos, sin).transpose(1, 2)                       # [B, Hq, T, D]
        k = apply_rope(k, cos, sin).transpose(1, 2)                       # [B, Hkv, T, D]
        if self.invariant_tile is not None:
            o = invariant_dense_attention(q.transpose(1, 2), k.transpose(1, 2), v, self.scale,
                                          self.invariant_tile).to(x.dtype)  # [B, T, Hq, D]
            return self.tp.all_reduce(self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim)))
        v = v.transpose(1, 2)                                             # [B, Hkv, T, D]
        g = self.num_heads // self.num_kv_heads
        if g > 1:  # GQA: each K/V head serves g consecutive query heads (HF repeat_kv)
            k = k.repeat_interleave(g, dim=1)                             # [B, Hq, T, D]
            v = v.repeat_interleave(g, dim=1)                             # [B, Hq, T, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [B, Hq, T, D]
        o = o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)            # [B, T, Hq*D]
        return self.tp.all_reduce(self.o_proj(o))                         # [B, T, H]


class Qwen2MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020). ``act`` is the SiLU
    (the batch-invariant mode swaps in one formula for every code path). With a
    tensor-parallel ``tp``: this rank's intermediate columns, down_proj's partial sums
    all-reduced."""

    act = staticmethod(F.silu)

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = _tp_or_single(config, tp)
        h, i = config.hidden_size, self.tp.plan.inter_count
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., H]`` (via ``[..., intermediate]``)."""
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config, tp)
        self.mlp = Qwen2MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, backend) -> torch.Tensor:
        """Paged path: ``[N, H]`` -> ``[N, H]``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_reference(self, x, cos, sin) -> torch.Tensor:
        """Reference path: ``[B, T, H]`` -> ``[B, T, H]``."""
        x = x + self.self_attn.forward_reference(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Embedding, decoder layers and final norm (HF ``Qwen2Model``; prefix ``model.``)."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:  # [V / N (padded), H]: this rank's vocabulary rows
            self.embed_tokens = VocabParallelEmbedding(config.hidden_size, tp)
        else:
            weight = torch.empty(config.vocab_size, config.hidden_size)      # [V, H]
            if weight.device.type != "meta":  # normal_ on meta tensors imports torch._dynamo (~7 s)
                nn.init.normal_(weight)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen2ForCausalLM(nn.Module):
    """Qwen2/Qwen2.5 causal LM with HF parameter names.

    Args:
        config: the model's hyper-parameters.
        attention_backend: a backend object, a registered name (``"torch"``/``"triton"``) or
            ``None`` (torch). Settable later via the ``attention_backend`` attribute.
        tp: this rank's :class:`~llmserve.models.parallel.TensorParallelGroup` (None: one rank);
            the modules then hold this rank's shards (module docstring).

    Weights are created with ``nn.Linear``/``nn.Embedding`` default init; real weights come
    from :func:`llmserve.models.loader.load_model`.
    """

    def __init__(self, config: ModelConfig, attention_backend=None,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = _tp_or_single(config, tp)
        self.model = Qwen2Model(config, self.tp if self.tp.size > 1 else None)
        self.lm_head = nn.Linear(config.hidden_size, self.tp.plan.vocab_per_rank, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention_backend = attention_backend
        self._inv_freq = rope_inv_freq(config.head_dim, config.rope_theta)  # [D/2] fp32, CPU
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- configuration -------------------------------------------------------------------
    @property
    def attention_backend(self):
        """The paged attention backend used by :meth:`forward` (has ``write_kv``/``forward``)."""
        return self._attention_backend

    @attention_backend.setter
    def attention_backend(self, backend) -> None:
        if backend is None:
            backend = "torch"
        if isinstance(backend, str):
            backend = get_attention_backend(backend)
        self._attention_backend = backend

    def tie_weights(self) -> None:
        """Re-point ``lm_head.weight`` at the embedding when ``tie_word_embeddings``."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- RoPE ----------------------------------------------------------------------------
    def rope_cos_sin(self, device: torch.device, min_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos``/``sin`` tables ``[L, D/2]`` on ``device``, ``L >= max(min_len,
        max_position_embeddings)``; built once per device (``L * D * 4`` bytes in total) and
        grown only when a longer reference sequence asks for it."""
        device = torch.device(device)
        cached = self._rope_cache.get(device)
        if cached is not None and cached[0].shape[0] >= min_len:
            return cached
        length = max(min_len, self.config.max_position_embeddings)
        t = torch.arange(length, dtype=torch.float, device="cpu")         # [L] fp32
        freqs = t[:, None] * self._inv_freq[None, :]                      # [L, D/2]
        cached = (freqs.cos().to(device), freqs.sin().to(device))
        self._rope_cache[device] = cached
        return cached

    # -- forward paths -------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Paged forward of a flat varlen batch.

        Args:
            input_ids: ``[N]`` int64 token ids of this step (all sequences concatenated).
            positions: ``[N]`` int64 position of each token in its sequence
                (``< max_position_embeddings``).
            kv_caches: one ``(k_cache, v_cache)`` per layer, each
                ``[num_blocks + 1, block_size, num_kv_heads, head_dim]`` in the model dtype;
                this step's K/V are written at ``attn_metadata.slot_mapping``.
            attn_metadata: see :class:`llmserve.attention.AttentionMetadata`.

        Returns:
            ``[N, hidden_size]`` final-normed hidden states in the model dtype; feed the rows
            you need to :meth:`compute_logits`.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"kv_caches must have one (k, v) pair per layer "
                             f"({len(self.model.layers)}), got {len(kv_caches)}")
        cos_t, sin_t = self.rope_cos_sin(input_ids.device)
        cos = cos_t[positions].unsqueeze(1)                               # [N, 1, D/2]
        sin = sin_t[positions].unsqueeze(1)                               # [N, 1, D/2]
        x = self.model.embed_tokens(input_ids)                            # [N, H]
        backend = self._attention_backend
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv, attn_metadata, backend)            # [N, H]
        return self.model.norm(x)                                         # [N, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden`` ``[M, H]`` (model dtype) -> logits ``[M, vocab_size]`` float32. Tensor
        parallel: every rank computes its vocabulary columns, rank 0 gathers them and gets the
        logits, the other ranks get None."""
        if self.tp.size == 1:
            return self.lm_head(hidden).float()
        logits = self.tp.gather_vocab(self.lm_head(hidden))                 # [M, V] on rank 0
        return None if logits is None else logits.float()

    @torch.no_grad()
    def forward_reference(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Uncached causal forward over whole sequences (no padding), the reference path.

        Args:
            input_ids: ``[B, T]`` int64; every row starts at position 0.
            last_only: project only the last position through ``lm_head`` (what a generation
                step needs; the naive engine uses it).

        Returns:
            logits ``[B, T, vocab_size]`` float32 (``[B, 1, vocab_size]`` with ``last_only``);
            tensor parallel: on rank 0, None on the other ranks (every rank must call it).
        """
        _, t = input_ids.shape
        cos_t, sin_t = self.rope_cos_sin(input_ids.device, min_len=t)
        cos = cos_t[:t].unsqueeze(1)                                      # [T, 1, D/2]
        sin = sin_t[:t].unsqueeze(1)                                      # [T, 1, D/2]
        x = self.model.embed_tokens(input_ids)                            # [B, T, H]
        for layer in self.model.layers:
            x = layer.forward_reference(x, cos, sin)                      # [B, T, H]
        if last_only:
            x = x[:, -1:]                                                 # [B, 1, H]
        x = self.model.norm(x)                                            # [B, T, H]
        if self.tp.size > 1:                                              # rank 0: [B, T, V]
            b, t2, h = x.shape
            logits = self.compute_logits(x.reshape(b * t2, h))
            return None if logits is None else logits.view(b, t2, -1)
        return self.lm_head(x).float()                                    # [B, T, V] fp32

    # -- helpers -------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device
