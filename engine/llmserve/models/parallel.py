"""Tensor parallelism inside one model: the shard plan, the collectives, the vocabulary-parallel
embedding and the name-based slicing rules the loader applies.

Megatron-style (Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053, section 3): in every
decoder layer the q/k/v and gate/up projections are *column parallel* (each rank holds a slice
of their output rows, biases included) and o_proj / down_proj are *row parallel* (each rank
holds the matching slice of their input columns and produces a partial sum; one all-reduce per
projection adds the partial sums). Attention heads are split with the query heads, so attention
itself needs no communication: rank ``r`` keeps the K/V heads its query heads read. When the
ranks outnumber the K/V heads, a K/V head is replicated on every rank whose query heads use it.
The embedding and the LM head are split along the vocabulary, padded to a multiple of the rank
count (``ceil(V / N)`` rows a rank, the padding rows zero): the embedding looks up the ids its
rank owns, zeroes the others and all-reduces; the LM head's logits are gathered on rank 0 and
cut back to ``V`` columns. Norms are replicated. Parameter names stay the Hugging Face ones;
only the shapes are local.

With one rank nothing here changes the model: :class:`TensorParallelGroup` of size 1 is the
identity and the model builds plain modules.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig

__all__ = ["ShardPlan", "TensorParallelGroup", "VocabParallelEmbedding", "plan_tensor_parallel",
           "shard_spec"]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` holds of one model.

    Attributes:
        rank, size: this rank and the number of ranks.
        q_start, q_count: the query heads ``[q_start, q_start + q_count)`` (column slice of
            q_proj, row slice of o_proj's input).
        kv_start, kv_count: the K/V heads ``[kv_start, kv_start + kv_count)`` those query heads
            use (k_proj / v_proj rows, the local KV cache's heads); replicated on several ranks
            when ``size > num_key_value_heads``.
        inter_start, inter_count: the MLP's intermediate columns
            ``[inter_start, inter_start + inter_count)`` (gate/up rows, down_proj input).
        vocab_start: first vocabulary row of this rank (``rank * vocab_per_rank``).
        vocab_count: real vocabulary rows this rank holds (the last ranks may hold fewer, or 0).
        vocab_per_rank: rows of the local embedding / LM head (``ceil(V / size)``); rows past
            ``vocab_count`` are zero padding.
        vocab_size: the model's full vocabulary (logits are cut back to it).
    """

    rank: int
    size: int
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int
    inter_start: int
    inter_count: int
    vocab_start: int
    vocab_count: int
    vocab_per_rank: int
    vocab_size: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _kv_span(q_start: int, q_count: int, group: int) -> tuple[int, int, bool]:
    """K/V heads ``(first, count, uniform)`` used by query heads ``[q_start, q_start + q_count)``
    when each K/V head serves ``group`` consecutive query heads; ``uniform``: every K/V head of
    the span serves the same number of those query heads (the local GQA ratio is one integer)."""
    first = q_start // group
    last = (q_start + q_count - 1) // group
    count = last - first + 1
    if q_count % count:
        return first, count, False
    per = q_count // count
    uniform = all((q_start + j) // group - first == j // per for j in range(q_count))
    return first, count, uniform


def plan_tensor_parallel(config: ModelConfig, size: int) -> list[ShardPlan]:
    """One :class:`ShardPlan` per rank for ``size`` ranks.

    Rules: ``size`` divides ``num_attention_heads`` (each rank gets ``Hq / size`` consecutive
    query heads) and ``intermediate_size``; each rank's query heads must use their K/V heads
    evenly (true whenever ``size`` divides ``num_key_value_heads`` or is a multiple of it; a
    K/V head is then replicated ``size / Hkv`` times). The vocabulary needs no rule: it is
    padded to ``size * ceil(V / size)`` rows.

    Raises:
        ValueError: ``size`` not a positive integer, or one of the rules broken; the message
            names the model's sizes and the valid ``tensor_parallel_size`` values.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    hq, hkv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size

    def bad(why: str) -> ValueError:
        valid = [d for d in _divisors(hq) if d <= 64 and inter % d == 0
                 and all(_kv_span(r * (hq // d), hq // d, hq // hkv)[2] for r in range(d))]
        return ValueError(f"tensor_parallel_size={size} does not fit this model: {why}; "
                          f"valid sizes: {valid}")

    if hq % size:
        raise bad(f"it must divide num_attention_heads={hq}")
    if inter % size:
        raise bad(f"it must divide intermediate_size={inter}")
    group = hq // hkv
    m = hq // size
    ic = inter // size
    per = math.ceil(config.vocab_size / size)
    plans = []
    for r in range(size):
        first, count, uniform = _kv_span(r * m, m, group)
        if not uniform:
            raise bad(f"rank {r}'s query heads [{r * m}, {(r + 1) * m}) would use K/V heads "
                      f"{first}..{first + count - 1} unevenly (num_key_value_heads={hkv}); pick a size "
                      f"that divides num_key_value_heads or is a multiple of it")
        vstart = r * per
        plans.append(ShardPlan(rank=r, size=size, q_start=r * m, q_count=m, kv_start=first,
                               kv_count=count, inter_start=r * ic, inter_count=ic, vocab_start=vstart,
                               vocab_count=max(0, min(per, config.vocab_size - vstart)),
                               vocab_per_rank=per, vocab_size=config.vocab_size))
    return plans


class TensorParallelGroup:
    """This rank's view of the tensor-parallel group: its :class:`ShardPlan` and the
    collectives the sharded model calls. Size 1 (``group=None``): every collective is the
    identity.

    Args:
        plan: this rank's shard plan.
        group: the ``torch.distributed`` process group of the model's collectives (NCCL on
            GPUs, gloo on CPU), or None for one rank.

    Attributes:
        num_collectives, collective_seconds: collectives called and the host wall seconds spent
            in them (on CPU with gloo the transfer itself; with NCCL only the launch).
    """

    def __init__(self, plan: ShardPlan, group=None) -> None:
        if plan.size > 1 and group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")
        self.plan = plan
        self.group = group
        self.rank = plan.rank
        self.size = plan.size
        self.num_collectives = 0
        self.collective_seconds = 0.0

    @classmethod
    def single(cls, config: ModelConfig) -> "TensorParallelGroup":
        """The one-rank group of ``config`` (the identity)."""
        return cls(plan_tensor_parallel(config, 1)[0])

    def reset_stats(self) -> None:
        self.num_collectives = 0
        self.collective_seconds = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (any shape, contiguous); returns ``x``."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.collective_seconds += time.perf_counter() - t0
        self.num_collectives += 1
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``x`` over the ranks, in place; returns ``x``."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_reduce_min_int(self, value: int, device: torch.device | str) -> int:
        """The smallest of every rank's ``value`` (one int64 all-reduce on ``device``)."""
        if self.size == 1:
            return int(value)
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def row_parallel_absmax(self, name: str, absmax: torch.Tensor) -> torch.Tensor:
        """Quantization hook (``quantize_model``'s ``row_absmax``): the maximum over the ranks
        of a row-parallel projection's per-row statistic (o_proj, down_proj: each rank holds a
        slice of every row), ``absmax`` as it is for the others (whole rows)."""
        if self.size > 1 and ROW_PARALLEL.fullmatch(name):
            return self.all_reduce_max(absmax.contiguous())
        return absmax

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """Gather vocabulary shards on rank 0.

        Args:
            local: ``[M, vocab_per_rank]`` this rank's logits columns (contiguous).

        Returns:
            On rank 0 ``[M, vocab_size]`` (the shards side by side, padding columns cut); on the
            other ranks None.
        """
        if self.size == 1:
            return local[:, :self.plan.vocab_size]
        import torch.distributed as dist

        t0 = time.perf_counter()
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        self.collective_seconds += time.perf_counter() - t0
        self.num_collectives += 1
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=-1)[:, :self.plan.vocab_size]                # [M, V]


class VocabParallelEmbedding(nn.Module):
    """Token embedding split along the vocabulary (HF name ``embed_tokens.weight``, local shape
    ``[vocab_per_rank, H]``).

    ``forward(ids [...] int64) -> [..., H]``: rows of ids this rank owns are looked up, the
    others are zero, and the group all-reduces, so every rank ends with the full embedding
    (exactly the one-rank lookup: one addend is the row, the others zero).
    """

    def __init__(self, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = tp.plan.vocab_per_rank
        self.embedding_dim = hidden_size
        self.vocab_start = tp.plan.vocab_start
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings, hidden_size))  # [Vp, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mask = (local >= 0) & (local < self.num_embeddings)                        # [...]
        x = F.embedding(torch.where(mask, local, torch.zeros_like(local)), self.weight)  # [..., H]
        x = x.masked_fill(~mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(x.contiguous())

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} rows from {self.vocab_start} of {self.tp.plan.vocab_size}, "
                f"dim {self.embedding_dim}, rank {self.tp.rank}/{self.tp.size}")


_LAYER = r"model\.layers\.\d+\."
_RULES = (
    (re.compile(_LAYER + r"self_attn\.q_proj\.(weight|bias)"), 0, "q"),
    (re.compile(_LAYER + r"self_attn\.(k|v)_proj\.(weight|bias)"), 0, "kv"),
    (re.compile(_LAYER + r"self_attn\.o_proj\.weight"), 1, "q"),
    (re.compile(_LAYER + r"mlp\.(gate|up)_proj\.weight"), 0, "inter"),
    (re.compile(_LAYER + r"mlp\.down_proj\.weight"), 1, "inter"),
    (re.compile(r"model\.embed_tokens\.weight|lm_head\.weight"), 0, "vocab"),
)
#: Row-parallel projections (module names): their input columns are split.
ROW_PARALLEL = re.compile(_LAYER + r"(self_attn\.o_proj|mlp\.down_proj)")
#: Row-parallel parameters whose bias would have to be added after the reduce (Qwen2 has none).
ROW_PARALLEL_BIASES = re.compile(_LAYER + r"(self_attn\.o_proj|mlp\.down_proj)\.bias")


def shard_spec(name: str, plan: ShardPlan, head_dim: int) -> tuple[int, int, int, int] | None:
    """How rank ``plan.rank`` slices checkpoint tensor ``name`` (HF names).

    Returns:
        ``(dim, start, count, length)``: take ``count`` entries from ``start`` along ``dim`` and
        zero-pad them to ``length`` (only the vocabulary rows are padded: ``length`` is
        ``vocab_per_rank`` there, ``count`` elsewhere); None for a replicated tensor (norms).

    Raises:
        ValueError: a bias on a row-parallel projection (o_proj / down_proj), which Qwen2 does
            not have: it would need adding once after the all-reduce.
    """
    if plan.size > 1 and ROW_PARALLEL_BIASES.fullmatch(name):
        raise ValueError(f"{name}: a bias on a row-parallel projection is not supported with "
                         "tensor_parallel_size > 1 (Qwen2 has none)")
    for pattern, dim, what in _RULES:
        if pattern.fullmatch(name):
            if what == "q":
                return dim, plan.q_start * head_dim, plan.q_count * head_dim, plan.q_count * head_dim
            if what == "kv":
                return dim, plan.kv_start * head_dim, plan.kv_count * head_dim, plan.kv_count * head_dim
            if what == "inter":
                return dim, plan.inter_start, plan.inter_count, plan.inter_count
            return dim, plan.vocab_start, plan.vocab_count, plan.vocab_per_rank
    return None
