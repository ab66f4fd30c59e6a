# The command run24 ran (inline, `python3 -c`), at 40f76a6: the PDL table without its L2 prefetch.
import dataclasses, runpy, sys
import llmserve.triton_kernels.int8_frag as F
F._TUNED_PDL.update({k: dataclasses.replace(v, l2_prefetch=False) for k, v in F._TUNED_PDL.items()})
print(F._TUNED_PDL)
f = "LLMSERVE_INT8_FRAGMENTS=1"
sys.argv = ['int8_frag_decode_ab.py', '--preset', 'qwen2.5-1.5b', '--batches', '2', '8', '16', '--settings',
            f"{f},LLMSERVE_INT8_FRAG_PDL_TABLE=0", f"{f},LLMSERVE_INT8_FRAG_PDL_TABLE=1",
            f"{f},LLMSERVE_INT8_FRAG_PDL_TABLE=0", f"{f},LLMSERVE_INT8_FRAG_PDL_TABLE=1", '--out', sys.argv[1]]
runpy.run_path('scripts/int8_frag_decode_ab.py', run_name='__main__')
