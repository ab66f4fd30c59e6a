# run37: engine A/B of the PDL table's down entry at 9..16 tokens, shipped (TMA weights, x a step
# ahead in registers) against the previous entry (TMA weights and x both in Triton's pipeline).
import os, runpy, sys
import llmserve.triton_kernels.int8_frag as F
from llmserve.triton_kernels.int8_frag import FragConfig
base = dict(F._TUNED_PDL)
orig = F.choose_frag_config
def choose(m, n, k, device=None, gpu_name=None, pdl=False):
    F._TUNED_PDL.clear(); F._TUNED_PDL.update(base)
    if os.environ.get("EXP_VARIANT", "0") == "1":  # the previous down entry for two token tiles
        F._TUNED_PDL[(1536, 8960, 2)] = FragConfig(4, 4, 1, stages=4, tma=True)
    return orig(m, n, k, device, gpu_name, pdl)
F.choose_frag_config = choose
out = sys.argv[1]
f = "LLMSERVE_INT8_FRAGMENTS=1"
sets = [f"{f},EXP_VARIANT={v}" for v in "10"] * 3
sys.argv = ["int8_frag_decode_ab.py", "--preset", "qwen2.5-1.5b", "--batches", "8", "12", "16", "--settings", *sets, "--out", out]
runpy.run_path("scripts/int8_frag_decode_ab.py", run_name="__main__")
