# run39: engine A/B of the fragment kernel's weight loads with ld.global.cg (not allocated in L1,
# EXP_VARIANT=1) against the shipped L1/L2 evict_first hint (EXP_VARIANT=0): every launch of the
# kernel gets CACHE from the environment the A/B script sets before building each engine.
import os, runpy, sys
import llmserve.triton_kernels.int8_frag as F
kernel = F._int8_frag_kernel
class _Kernel:
    def __getitem__(self, grid):
        launch = kernel[grid]
        def run(*a, **kw):
            kw["CACHE"] = int(os.environ.get("EXP_VARIANT", "0"))
            return launch(*a, **kw)
        return run
F._int8_frag_kernel = _Kernel()
out = sys.argv[1]
f = "LLMSERVE_INT8_FRAGMENTS=1"
sets = [f"{f},EXP_VARIANT={v}" for v in "10"] * 3
sys.argv = ["int8_frag_decode_ab.py", "--preset", "qwen2.5-1.5b", "--batches", "2", "8", "16", "--settings", *sets, "--out", out]
runpy.run_path("scripts/int8_frag_decode_ab.py", run_name="__main__")
