"""A/B of decode-attention kernel versions from git history on one GPU, same inputs, same timer.

Usage: python3 scripts/ab_decode_versions.py DIR  (DIR holds pa_<commit>.py copies of
``triton_kernels/paged_attention.py`` with the relative imports made absolute). Prints us per
call for batch 64 / context 2048 (3 splits) and batch 1 / context 2048 (32 splits), Qwen2.5-1.5B
head layout, bf16, block 16 (the bench_kernels.py decode points).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from cuda_timing import graph_time_us

from llmserve.attention.metadata import AttentionMetadata


def batch(b, ctx, hq=12, hkv=2, d=128, bs=16, dev="cuda"):
    nb = ctx // bs
    perm = torch.randperm(b * nb + 1, device=dev)[: b * nb].to(torch.int32)
    bt = perm.view(b, nb)
    kc = torch.randn(b * nb + 2, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.zeros(b, dtype=torch.int64, device=dev),
                             query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
                             context_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev),
                             block_tables=bt, max_query_len=1, max_context_len=ctx, block_size=bs,
                             is_decode_only=True)
    return q, kc, vc, meta


def main() -> None:
    rows = []
    cases = [(64, 2048, 3), (1, 2048, 32), (1, 128, None)]
    inputs = {c: batch(c[0], c[1]) for c in cases}
    for f in sorted(Path(sys.argv[1]).glob("pa_*.py")):
        try:
            spec = importlib.util.spec_from_file_location(f.stem, f)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - a version that does not load is a row too
            rows.append(dict(version=f.stem, error=f"{type(e).__name__}: {e}"[:300]))
            print(json.dumps(rows[-1]), flush=True)
            continue
        for (b, ctx, splits) in cases:
            q, kc, vc, meta = inputs[(b, ctx, splits)]
            if splits is None:                      # the engine's graph: grid sized for 2,048
                meta.max_context_len = 2048
            kw = {} if splits is None else {"num_splits": splits}
            fn = lambda: mod.paged_attention_decode(q, kc, vc, meta, 128 ** -0.5, **kw)  # noqa: E731
            row = dict(version=f.stem, batch=b, context=ctx, splits=splits, us=None, error=None)
            try:
                row["us"] = graph_time_us([fn], 50)
            except Exception as e:  # noqa: BLE001 - kept as a row with the error
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            meta.max_context_len = ctx


if __name__ == "__main__":
    main()
