import os, runpy, sys
import llmserve.triton_kernels.int8_frag as F
from llmserve.triton_kernels.int8_frag import FragConfig
base = dict(F._TUNED_PDL)
V = {
 "0": {},
 "1": {(1536, 8960, 1): FragConfig(2, 8, 6, prefetch=True, l2_prefetch=True, fold=True)},
 "2": {(8960, 1536, 1): FragConfig(2, 8, 1, prefetch=True, l2_prefetch=True, fold=True)},
 "3": {(8960, 1536, 2): FragConfig(2, 8, 1, l2_prefetch=True), (1536, 8960, 2): FragConfig(2, 8, 6, l2_prefetch=True)},
 "4": {(2048, 1536, 1): FragConfig(4, 4, 1, stages=4, l2_prefetch=True, fold=True), (2048, 1536, 2): FragConfig(2, 4, 1, stages=4, l2_prefetch=True)},
}
orig = F.choose_frag_config
def choose(m, n, k, device=None, gpu_name=None, pdl=False):
    F._TUNED_PDL.clear(); F._TUNED_PDL.update(base); F._TUNED_PDL.update(V[os.environ.get("EXP_VARIANT", "0")])
    return orig(m, n, k, device, gpu_name, pdl)
F.choose_frag_config = choose
out = sys.argv[1]
f = "LLMSERVE_INT8_FRAGMENTS=1"
sets = [f"{f},EXP_VARIANT={v}" for v in "01234"] * 2
sys.argv = ["int8_frag_decode_ab.py", "--preset", "qwen2.5-1.5b", "--batches", "2", "8", "16", "--settings", *sets, "--out", out]
runpy.run_path("scripts/int8_frag_decode_ab.py", run_name="__main__")
