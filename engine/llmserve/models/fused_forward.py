"""The fused serving forward pass: same weights and the same function as
``Qwen2ForCausalLM.forward``, in ~10 kernels a layer instead of ~35.

What changes against the readable path (``models/qwen2.py``):

* q/k/v projections run as one GEMM over a packed ``[Hq*D + 2*Hkv*D, H]`` weight, and
  gate/up as one GEMM over ``[2*I, H]``. The packed tensors are built once; the original
  ``q_proj.weight`` etc. become *views* into them, so HF parameter names and
  ``state_dict()`` are unchanged and no memory is duplicated.
* RMSNorm and the residual add are one kernel; RoPE, the QKV split and the K/V cache write are
  one kernel; SiLU-and-mul is one kernel (``kernels/fused.py``).
* Steps of at most ``gemv_max_tokens`` tokens (batch-1 decode by default; up to
  ``GEMV_MAX_M`` = 4 on request) take a matrix-vector path (``kernels/gemv.py``) with the
  norms and SiLU-and-mul folded into the projections, RoPE and the K/V cache write into the
  QKV projection's epilogue and the residual adds into the O and down projections'
  epilogues: four projection kernels and the attention kernel a layer. The residual stream is
  updated in place; the first layer's QKV and O kernels read the token embeddings straight
  from the table (no lookup kernel); the LM head is a matrix-vector kernel that writes fp32
  logits (:meth:`FastQwen2Forward.compute_logits`).
* On Hopper these kernels are launched with programmatic dependent launch (PDL,
  ``kernels/_launch.py``): each starts while the previous one drains and reads its first
  weight tile before waiting for it (``FastPathConfig.pdl``).

Projections quantized with the Triton INT8 scheme (``--linear-backend triton-int8``,
:class:`~llmserve.quant.TritonInt8Linear`) are packed and fused the same way: the int8
rows and their per-row scales go to the same kernels (the matrix-vector kernel reads int8
rows and applies the scale in its epilogue; larger steps call
:func:`~llmserve.kernels.int8_linear.int8_linear` on the packed weight). With
``FastPathConfig.int8_layout="planes"`` their int8 rows are repacked once as *byte planes*
(four a 32-bit word, :func:`~llmserve.kernels.int8_layout.pack_int8_planes`), which the
matrix-vector kernel streams faster (faster batch-1 decode for 1.5B/7B shapes, slower steps
of 2..64 tokens); ``state_dict`` still gives row-major int8. With
``FastPathConfig.int8_fragments`` (a bf16 model on CUDA, row-major int8; otherwise ignored
with a warning) each projection also keeps a copy in the MMA-fragment layout
(:func:`~llmserve.kernels.int8_layout.pack_int8_fragments`, twice the int8 weight memory; an
in-place ``load_state_dict`` repacks it) and steps of at most 16 tokens that do not take the
matrix-vector path call :func:`~llmserve.kernels.int8_frag.int8_frag_linear` instead of
``int8_linear``, with PDL by the size rule of ``FastPathConfig.int8_frag_pdl``. Other
quantized modules (the reference ``int8`` scheme, ``int4``) keep being called as modules and
turn the matrix-vector path off.

Tensor parallel (a model built with a :class:`~llmserve.models.parallel.TensorParallelGroup` of
more than one rank): the packed projections are this rank's shards, the embedding is the
vocabulary-parallel one, and the outputs of o_proj and down_proj are all-reduced before the
residual add (fused into the next RMSNorm kernel). The matrix-vector path is off, since its O
and down kernels add the residual in their epilogue, before a reduction could run. Parity with the readable path is tested in
``tests/test_fast_forward.py``; the numbers behind each default are in docs/performance.md.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata
from ..attention.triton_backend import TritonPagedAttention
from ..config import FastPathConfig, ResolvedFastPath
from ..quant import TritonInt8Linear
from ..kernels.int8_layout import pack_int8_fragments, pack_int8_planes
from ..kernels._launch import pdl_available
from ..kernels.argmax import argmax_rows
from ..kernels.fused import add_rmsnorm, rope_qkv_write_kv, silu_and_mul
from ..kernels.gemv import GEMV_MAX_M, gemv, gemv_qkv_rope
from ..kernels.int8_frag import FRAG_MAX_M, int8_frag_linear
from ..kernels.int8_linear import int8_linear
from ..kernels.invariant import invariant_linear
from ..kernels.paged_attention import paged_attention_decode
from .batch_invariant import RowBlockedLinear

_log = logging.getLogger(__name__)


def _pack(linears: list[nn.Module], with_bias: bool
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Concatenate weights (and biases, and the per-row scales of INT8 layers) along the output
    dim and re-point each module's tensors at views of the packed ones; returns ``(weight
    [sum(out), in], bias or None, scale [sum(out)] or None)``. All modules are plain
    ``nn.Linear`` or all :class:`~llmserve.quant.TritonInt8Linear` (see :func:`_kind`)."""
    names = ["weight"] + (["bias"] if with_bias else []) + \
        (["weight_scale"] if _kind(linears[0]) == "int8" else [])
    packed = {n: torch.cat([getattr(m, n).data for m in linears], dim=0) for n in names}
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        for n in names:
            view = packed[n][start:start + rows]
            if n in m._parameters:       # keep the Parameter object, swap its storage
                m._parameters[n].data = view
            else:                        # a buffer (Triton INT8 layers): re-point it
                setattr(m, n, view)
        start += rows
    return packed["weight"], packed.get("bias"), packed.get("weight_scale")


def _to_planes(linears: list[nn.Module], packed: torch.Tensor | None = None) -> torch.Tensor:
    """Repack the int8 rows of Triton INT8 modules (``packed``: their concatenation from
    :func:`_pack`, else the one module's weight) as byte planes and re-point each module's
    ``weight`` at its rows of them; returns the planes ``[sum(out), in / 4]`` int32 (weights
    that already are planes are returned as they are)."""
    src = packed if packed is not None else linears[0].weight
    if src.dtype == torch.int32:         # already planes (a second FastQwen2Forward on the model)
        return src
    planes = pack_int8_planes(src)
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = planes[start:start + rows]
        start += rows
    return planes


def _fragments(entry: dict, groups: dict[str, list[nn.Module]]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``{name: (fragments, scale, bias)}`` for :func:`int8_frag_linear`, one a row-major Triton
    INT8 projection group of the layer (``qkv`` / ``gate_up`` packed in ``entry``, ``o`` and
    ``down`` alone) whose sizes the layout takes: every module's rows a multiple of 16, the
    input a multiple of 32. Each module's :attr:`~llmserve.quant.TritonInt8Linear.fragments`
    is pointed at its rows of the copy, so an in-place ``load_state_dict`` repacks them; the
    row-major weights stay for the other steps."""
    out = {}
    for name, mods in groups.items():
        if not (mods and all(_kind(m) == "int8" and not m.planes for m in mods)):
            continue
        w, b, s = entry[name] if name in entry else _proj(mods[0])
        if w.shape[1] % 32 or any(m.out_features % 16 for m in mods):
            continue
        frags = pack_int8_fragments(w)
        start = 0
        for m in mods:
            m.fragments = frags[start // 16:(start + m.out_features) // 16]
            start += m.out_features
        out[name] = (frags, s, b)
    return out


def _kind(m: nn.Module) -> str | None:
    """``"float"`` for a plain ``nn.Linear``, ``"int8"`` for a Triton INT8 layer (same function
    through :func:`~llmserve.kernels.int8_linear.int8_linear` or the matrix-vector
    kernel: int8 rows, per-row scale applied in the epilogue), ``"invariant"`` for the
    batch-invariant mode's :class:`~llmserve.models.batch_invariant.RowBlockedLinear`
    (:func:`~llmserve.kernels.invariant.invariant_linear` on the packed weight), ``None`` for
    anything else (the reference quantized layers, INT4), which the fused path calls as
    modules."""
    if type(m) is nn.Linear:
        return "float"
    if type(m) is TritonInt8Linear:
        return "int8"
    if type(m) is RowBlockedLinear:
        return "invariant"
    return None


def _same_kind(mods: list[nn.Module]) -> bool:
    """Whether ``mods`` can be packed together: all plain or all Triton INT8 (:func:`_kind`)."""
    kind = _kind(mods[0])
    return kind is not None and all(_kind(m) == kind for m in mods)


def _proj(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(weight, bias, scale)`` of a plain or Triton INT8 projection (scale ``None`` if float)."""
    return m.weight, m.bias, (m.weight_scale if _kind(m) == "int8" else None)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, s: torch.Tensor | None,
            invariant: bool = False) -> torch.Tensor:
    """``F.linear`` of a float weight (the batch-invariant kernel with ``invariant``), or the
    Triton INT8 linear when ``s`` (scales) is given."""
    if s is not None:
        return int8_linear(x, w, s, b)
    if invariant:
        return invariant_linear(x, w, b)
    return F.linear(x, w, b)


def qkv_early_mode(pdl: bool, pre_wait: bool, early_epilogue: bool) -> int:
    """The decode QKV kernel's ``early_epilogue`` (see :func:`~llmserve.kernels.gemv.gemv`):
    2 (its RoPE operands read before the PDL wait) with ``pdl`` and ``pre_wait``
    (``FastPathConfig.gemv_pre_wait``); otherwise the other kernels' ``early_epilogue``."""
    return 2 if (pdl and pre_wait) else int(early_epilogue)


TRIGGER_ROLES = ("qkv", "attn", "o", "gate_up", "down", "head", "argmax")


def trigger_roles(pdl: bool, qkv: bool) -> dict[str, bool]:
    """Per decode kernel of the matrix-vector path (keys :data:`TRIGGER_ROLES`: QKV+RoPE,
    decode attention, O, gate-up, down, LM head, greedy argmax), whether it is launched with
    ``pdl_trigger_first`` (its successor may launch before this kernel's own PDL wait; see
    :func:`~llmserve.kernels._launch.pdl_wait`). Only the QKV kernel, with ``pdl`` and ``qkv``
    (``FastPathConfig.pdl_trigger_qkv``): the decode attention then launches while QKV
    streams its weights, reads its block-table entries and asks L2 for its K/V rows earlier.
    Triggering first in the other kernels measured no better on the H200. (The final RMSNorm,
    also a PDL kernel, always triggers after its wait.)"""
    roles = dict.fromkeys(TRIGGER_ROLES, False)
    roles["qkv"] = bool(pdl and qkv)
    return roles


class FastQwen2Forward:
    """Fused forward for a loaded :class:`~llmserve.models.qwen2.Qwen2ForCausalLM`.

    Call it like ``model.forward``: ``(input_ids [N], positions [N], kv_caches, meta) ->
    hidden [N, H]``. Needs Triton (a GPU, or ``TRITON_INTERPRET=1`` with CPU tensors).

    Build it after the model's final placement and quantization: the packed tensors are
    made once, so a later ``model.to(...)``, ``.half()`` or ``load_state_dict(assign=True)``
    (which replace the modules' tensors) leaves them stale (an in-place ``load_state_dict``
    writes through the views and is fine); quantizing the model afterwards is detected and
    raises ``RuntimeError`` at the next call.

    Args:
        model: the model (weights already on their device and dtype).
        options: the resolved fast-path choices (:meth:`~llmserve.config.FastPathConfig.resolve`
            for this model); default: :class:`~llmserve.config.FastPathConfig` ``()`` resolved
            for ``model.config`` on the LM head's device. The matrix-vector path serves steps
            of ``N <= options.gemv_max_tokens`` tokens when every projection is a plain
            ``nn.Linear`` or a :class:`~llmserve.quant.TritonInt8Linear`; PDL is used where
            ``options.pdl`` and the device allow it.

    Raises:
        ValueError: ``options`` is not a :class:`~llmserve.config.ResolvedFastPath`.
    """

    def __init__(self, model: nn.Module, options: ResolvedFastPath | None = None) -> None:
        cfg = model.config
        w0 = model.lm_head.weight
        if options is None:
            options = FastPathConfig().resolve(cfg, w0.device)
        if not isinstance(options, ResolvedFastPath):
            raise ValueError("options must be a ResolvedFastPath (FastPathConfig(...).resolve(model_config, "
                             f"device)), got {type(options).__name__}")
        self.options = options
        self.model = model
        self._quantization = getattr(model, "quantization_config", None)  # see __call__
        attn0 = model.model.layers[0].self_attn
        self.num_heads = attn0.num_heads                  # this rank's heads (all with one rank)
        self.num_kv_heads = attn0.num_kv_heads
        self.tp = model.tp
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.decode_options = options.decode_options()
        # Triton INT8 weights as byte planes (int8_layout="planes"); every kernel that reads
        # them accepts both layouts, and the modules' state_dict stays row-major. Faster
        # batch-1 decode for 1.5B/7B shapes on the H200 but slower for 0.5B, and steps of
        # 2..64 tokens run the tensor-core kind 15-25% slower on planes, so not by default.
        planes = options.int8_layout == "planes"
        inter = self.tp.plan.inter_count                  # this rank's intermediate columns
        if planes and not (cfg.hidden_size % 4 == 0 and inter % 4 == 0
                           and self.num_heads * cfg.head_dim % 4 == 0):
            _log.warning("int8_layout='planes' ignored: byte planes need every projection's "
                         "input size divisible by 4 (hidden %d, intermediate %d, heads x head_dim %d)",
                         cfg.hidden_size, inter, self.num_heads * cfg.head_dim)
            planes = False
        # INT8 weights also in the MMA-fragment layout for steps of <= 16 tokens off the
        # matrix-vector path (int8_fragments): a second copy of every int8 projection.
        frags = options.int8_fragments
        if frags and (planes or w0.device.type != "cuda" or w0.dtype != torch.bfloat16):
            _log.warning("int8_fragments=True ignored: it needs a bf16 model on CUDA and "
                         "row-major int8 (int8_layout='row')")
            frags = False
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            entry = {"layer": layer}
            for name, mods, bias in (("qkv", [attn.q_proj, attn.k_proj, attn.v_proj], True),
                                     ("gate_up", [mlp.gate_proj, mlp.up_proj], False)):
                if _same_kind(mods):
                    entry[name] = _pack(mods, with_bias=bias)
                    if planes and _kind(mods[0]) == "int8":
                        entry[name] = (_to_planes(mods, entry[name][0]),) + entry[name][1:]
            for m in (attn.o_proj, mlp.down_proj):
                if planes and _kind(m) == "int8":
                    _to_planes([m])
            entry["frag"] = _fragments(entry, {
                "qkv": [attn.q_proj, attn.k_proj, attn.v_proj] if "qkv" in entry else [],
                "gate_up": [mlp.gate_proj, mlp.up_proj] if "gate_up" in entry else [],
                "o": [attn.o_proj], "down": [mlp.down_proj]}) if frags else {}
            self.layers.append(entry)
        self.int8_fragments = any(e["frag"] for e in self.layers)
        # The fragment kernel, the RMSNorms before q/k/v and gate/up and the SiLU-and-mul before
        # down launched with PDL (each fragment call's weight requests overlap the kernel before
        # it): on the H200 faster for 0.5B and 1.5B steps of 2-16 sequences, slower for 7B
        # (hidden 3584), hence int8_frag_pdl's size rule.
        self.frag_pdl = (self.int8_fragments and options.int8_frag_pdl and options.pdl
                         and pdl_available(w0.device))
        # Whether the INT8 weights are byte planes: also when an earlier FastQwen2Forward of this
        # model repacked them (planes are not undone; every kernel reads both layouts).
        self.int8_planes = any(getattr(m, "planes", False) for m in model.modules()
                               if type(m) is TritonInt8Linear)
        fusable = all("qkv" in e and "gate_up" in e and _kind(e["layer"].self_attn.o_proj) is not None
                      and _kind(e["layer"].mlp.down_proj) is not None for e in self.layers)
        assert options.gemv_max_tokens <= GEMV_MAX_M   # FastPathConfig's range matches the kernel's
        self.gemv_max_tokens = options.gemv_max_tokens
        # The batch-invariant mode's projections (packed like float ones) run the fixed-order
        # kernel at every step size: the matrix-vector path would give a decode row other bits.
        self.invariant = any(_kind(e["layer"].self_attn.o_proj) == "invariant" for e in self.layers)
        self.use_gemv = (options.gemv_max_tokens > 0 and fusable and self.tp.size == 1
                         and not self.invariant)
        self.pdl = self.use_gemv and options.pdl and pdl_available(w0.device)
        self._plain_head = type(model.lm_head) is nn.Linear and model.lm_head.bias is None
        # Epilogue operands requested before the gemv K loop (gemv's early_epilogue); by the
        # size rule of gemv_early_epilogue (faster for hidden 896 and 1536 on the H200, slower
        # for 3584). Governs the QKV kernel only when its pre-wait is off (qkv_early_mode).
        self.early_epilogue = options.gemv_early_epilogue
        # The QKV kernel's RoPE operands (positions, slots, the cos/sin rows; bias, int8
        # scales) read before its PDL wait (gemv's early_epilogue=2), so the dependent
        # position -> cos/sin load is off the critical path; gemv_pre_wait's size rule (slower
        # for 7B, like the early epilogue there).
        self.qkv_early = qkv_early_mode(self.pdl, options.gemv_pre_wait, self.early_epilogue)
        # Which decode kernels let their successor launch before their own PDL wait (by
        # default only the QKV kernel of models with hidden size <= 2048, see trigger_roles).
        self.trigger_roles = trigger_roles(self.pdl, options.pdl_trigger_qkv)
        # Matrix-vector path: the first layer's QKV and O kernels read the token embeddings
        # straight from the table (gemv's x_rows / residual_rows), so the lookup is no kernel
        # of its own.
        self.embed_gather = (type(model.model.embed_tokens) is nn.Embedding
                             and model.model.embed_tokens.weight.stride(-1) == 1)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        if getattr(self.model, "quantization_config", None) is not self._quantization:
            raise RuntimeError("the model was quantized after FastQwen2Forward was built: its packed "
                               "q/k/v and gate/up weights are the old ones; build it again")
        if self.use_gemv and input_ids.shape[0] <= self.gemv_max_tokens:
            return self._forward_gemv(input_ids, positions, kv_caches, meta)
        model = self.model
        backend = model.attention_backend
        cos, sin = model.rope_cos_sin(input_ids.device)                     # [L, D/2] fp32
        x = model.model.embed_tokens(input_ids)                             # [N, H]
        n = x.shape[0]
        residual = None
        frag_step = n <= FRAG_MAX_M                                         # steps the fragments serve
        fpdl = self.frag_pdl and frag_step
        for entry, (k_cache, v_cache) in zip(self.layers, kv_caches):
            layer = entry["layer"]
            attn, mlp = layer.self_attn, layer.mlp
            h, residual = add_rmsnorm(x, layer.input_layernorm.weight, self.eps, residual, pdl=fpdl)  # [N, H]
            small = entry["frag"] if frag_step else {}                      # fragment copies
            if "qkv" in small:
                qkv = int8_frag_linear(h, *small["qkv"], pdl=fpdl)          # [N, (Hq+2Hkv)*D]
            elif "qkv" in entry:
                qkv = _linear(h, *entry["qkv"], self.invariant)             # [N, (Hq+2Hkv)*D]
            else:
                qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
            q = rope_qkv_write_kv(qkv, positions, meta.slot_mapping, cos, sin, k_cache, v_cache,
                                  self.num_heads, self.num_kv_heads)        # [N, Hq, D]
            o = backend.forward(q, k_cache, v_cache, meta, self.scale)     # [N, Hq, D]
            o = o.reshape(n, self.num_heads * self.head_dim)
            x = int8_frag_linear(o, *small["o"], pdl=fpdl) if "o" in small else attn.o_proj(o)  # [N, H]
            x = self.tp.all_reduce(x)                                       # partial sums (TP)
            h, residual = add_rmsnorm(x, layer.post_attention_layernorm.weight, self.eps, residual, pdl=fpdl)
            if "gate_up" in small:
                gu = int8_frag_linear(h, *small["gate_up"], pdl=fpdl)       # [N, 2I]
            elif "gate_up" in entry:
                gu = _linear(h, *entry["gate_up"], self.invariant)          # [N, 2I]
            else:
                gu = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)
            a = silu_and_mul(gu, pdl=fpdl)
            x = int8_frag_linear(a, *small["down"], pdl=fpdl) if "down" in small else mlp.down_proj(a)
            x = self.tp.all_reduce(x)                                       # partial sums (TP)
        h, _ = add_rmsnorm(x, model.model.norm.weight, self.eps, residual)  # [N, H]
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [M, H] -> logits [M, V]`` float32, as ``model.compute_logits``; steps that
        took the matrix-vector path use the matrix-vector kernel for the LM head too (fp32
        written directly: no separate cast)."""
        m = hidden.shape[0]
        if not (self.use_gemv and self._plain_head and 0 < m <= self.gemv_max_tokens):
            return self.model.compute_logits(hidden)
        w = self.model.lm_head.weight                                       # [V, H]
        out = torch.empty((m, w.shape[0]), dtype=torch.float32, device=hidden.device)
        return gemv(hidden, w, out=out, pdl=self.pdl, pdl_trigger_first=self.trigger_roles["head"])

    def greedy(self, logits: torch.Tensor, out: torch.Tensor | None = None,
               out_row: torch.Tensor | None = None) -> torch.Tensor:
        """``logits [M, V]`` float32 ``-> [M]`` int64, ``torch.argmax(logits, -1)`` in one Triton
        launch (:func:`~llmserve.kernels.argmax.argmax_rows`; programmatic dependent
        launch after the LM head on the matrix-vector path). Used inside the decode graphs,
        which pass ``out`` ``[2, M]`` and ``out_row`` (int64 ``[1]``, the row to write, read on
        the device); the return value is then ``out``. Raises ``ValueError`` as ``argmax_rows``."""
        return argmax_rows(logits, out, pdl=self.pdl, pdl_trigger_first=self.trigger_roles["argmax"], out_row=out_row)

    def _forward_gemv(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: AttentionMetadata) -> torch.Tensor:
        """The same function for ``N <= GEMV_MAX_M`` tokens with fused matrix-vector kernels:
        ``r`` is the residual stream ``[N, H]``, updated in place by the O and down
        projections' epilogues; each layer's two RMSNorms run inside the QKV and gate-up
        projections, RoPE and the K/V cache write in the QKV projection's epilogue and
        SiLU-and-mul in the gate-up projection's epilogue. With :attr:`embed_gather` the first
        layer's QKV and O projections read the embedding rows of ``input_ids`` from the table
        (no lookup kernel; the O projection writes the first ``r``)."""
        model = self.model
        backend = model.attention_backend
        direct_decode = isinstance(backend, TritonPagedAttention) and meta.is_decode_only
        pdl, early = self.pdl, self.early_epilogue
        tf = self.trigger_roles
        cos, sin = model.rope_cos_sin(input_ids.device)                     # [L, D/2] fp32
        emb = model.model.embed_tokens.weight                               # [V, H]
        n = input_ids.shape[0]
        gather_ids = self.embed_gather and input_ids.is_contiguous()
        if gather_ids:          # rows of emb read by the first QKV and O kernels; O writes r
            r = torch.empty((n, emb.shape[1]), dtype=emb.dtype, device=emb.device)
        else:
            r = model.model.embed_tokens(input_ids)                         # [N, H]
        for i, (entry, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            layer = entry["layer"]
            gather = gather_ids and i == 0
            w_qkv, b_qkv, s_qkv = entry["qkv"]
            q = gemv_qkv_rope(emb if gather else r, w_qkv, bias=b_qkv, scale=s_qkv,
                              norm_weight=layer.input_layernorm.weight,
                              eps=self.eps, positions=positions, slot_mapping=meta.slot_mapping,
                              cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                              num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                              pdl=pdl, early_epilogue=self.qkv_early, pdl_trigger_first=tf["qkv"],
                              x_rows=input_ids if gather else None)         # [N, Hq, D]
            if direct_decode:
                o = paged_attention_decode(q, k_cache, v_cache, meta, self.scale, pdl=pdl,
                                           pdl_trigger_first=tf["attn"], **self.decode_options)
            else:
                o = backend.forward(q, k_cache, v_cache, meta, self.scale)  # [N, Hq, D]
            w_o, b_o, s_o = _proj(layer.self_attn.o_proj)
            gemv(o.reshape(n, self.num_heads * self.head_dim), w_o, scale=s_o, bias=b_o,
                 residual=emb if gather else r, out=r, pdl=pdl, early_epilogue=early,
                 pdl_trigger_first=tf["o"],
                 residual_rows=input_ids if gather else None)               # r += o @ Wo.T
            w_gu, _, s_gu = entry["gate_up"]
            act = gemv(r, w_gu, scale=s_gu, prologue="rmsnorm", glu=True,
                       norm_weight=layer.post_attention_layernorm.weight, eps=self.eps,
                       pdl=pdl, pdl_trigger_first=tf["gate_up"])            # [N, I]
            w_d, b_d, s_d = _proj(layer.mlp.down_proj)
            gemv(act, w_d, scale=s_d, bias=b_d, residual=r, out=r, pdl=pdl,
                 early_epilogue=early, pdl_trigger_first=tf["down"])        # r += act @ Wd.T
        h, _ = add_rmsnorm(r, model.model.norm.weight, self.eps, pdl=pdl)  # [N, H]
        return h
