"""GPU parity of the decode attention under LLMSERVE_DECODE_WIDE_CFG variants (batch 1, 12/2 heads, D 128, bf16)."""
import os, sys, json, torch
sys.path.insert(0, "tests")
from test_triton_kernels import make_batch, assert_close
from llmserve.attention.torch_backend import paged_attention_torch
from llmserve.triton_kernels.paged_attention import paged_attention_decode
res = []
for cfg in sys.argv[1:]:
    os.environ["LLMSERVE_DECODE_WIDE_CFG"] = "" if cfg == "-" else cfg
    for ctx in [1, 17, 64, 65, 200, 256, 257, 300, 511, 512]:
        q, kc, vc, meta = make_batch([(ctx, 1)], 16, 12, 2, 128, torch.bfloat16, seed=ctx)
        meta.max_context_len = 512   # the short-context graph's bound
        ref = paged_attention_torch(q, kc, vc, meta, 128 ** -0.5)
        try:
            for _ in range(2):
                out = paged_attention_decode(q, kc, vc, meta, 128 ** -0.5)
            assert_close(out, ref, torch.bfloat16)
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[:300]
        res.append(dict(cfg=cfg, ctx=ctx, error=err))
        print(cfg, ctx, err, flush=True)
json.dump(res, open(os.environ.get("OUTF", "/tmp/attn_par.json"), "w"), indent=1)
