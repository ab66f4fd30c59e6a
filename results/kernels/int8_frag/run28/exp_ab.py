import os, runpy, sys
import llmserve.triton_kernels.int8_frag as F
from llmserve.triton_kernels.int8_frag import FragConfig
base = dict(F._TUNED_PDL)
TMA = {(1536, 8960, 1), (1536, 8960, 2)}
V = {
 "0": {},
 "1": "no-tma",
}
orig = F.choose_frag_config
def choose(m, n, k, device=None, gpu_name=None, pdl=False):
    F._TUNED_PDL.clear(); F._TUNED_PDL.update(base)
    if os.environ.get("EXP_VARIANT", "0") == "1":  # the shipped table without its TMA (down) entries
        for key in TMA:
            F._TUNED_PDL.pop(key)
    return orig(m, n, k, device, gpu_name, pdl)
F.choose_frag_config = choose
out = sys.argv[1]
f = "LLMSERVE_INT8_FRAGMENTS=1"
sets = [f"{f},EXP_VARIANT={v}" for v in "10"] * 3
sys.argv = ["int8_frag_decode_ab.py", "--preset", "qwen2.5-1.5b", "--batches", "2", "8", "16", "--settings", *sets, "--out", out]
runpy.run_path("scripts/int8_frag_decode_ab.py", run_name="__main__")
