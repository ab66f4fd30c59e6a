# run39: engine A/B of the fragment kernel's weight loads with ld.global.cg (not allocated in L1,
# EXP_VARIANT=1) against the shipped L1/L2 evict_first hint (EXP_VARIANT=0).
import os, runpy, sys
import llmserve.triton_kernels.int8_frag as F
orig = F.choose_frag_config
def choose(m, n, k, device=None, gpu_name=None, pdl=False):
    F.int8_frag_linear.__kwdefaults__["_cache"] = int(os.environ.get("EXP_VARIANT", "0"))
    return orig(m, n, k, device, gpu_name, pdl)
F.choose_frag_config = choose
out = sys.argv[1]
f = "LLMSERVE_INT8_FRAGMENTS=1"
sets = [f"{f},EXP_VARIANT={v}" for v in "10"] * 3
sys.argv = ["int8_frag_decode_ab.py", "--preset", "qwen2.5-1.5b", "--batches", "2", "8", "16", "--settings", *sets, "--out", out]
runpy.run_path("scripts/int8_frag_decode_ab.py", run_name="__main__")
