import os, sys
from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.engine import LLMEngine
from llmserve.sampling_params import SamplingParams
def run(env):
    for k in ("LLMSERVE_DECODE_WARM_O", "LLMSERVE_DECODE_WARM_MB"): os.environ.pop(k, None)
    os.environ.update(env)
    cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", attention_backend="triton", use_cuda_graph=True,
                       cache=CacheConfig(num_blocks=512), scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512))
    eng = LLMEngine(cfg)
    outs = eng.generate([[10 + i] * (3 + 7 * i) for i in range(1)], SamplingParams(max_tokens=60, ignore_eos=True))
    return [o.output_token_ids for o in outs]
a = run({}); b = run({"LLMSERVE_DECODE_WARM_O": "1", "LLMSERVE_DECODE_WARM_MB": "0.05"})
print("warm tokens equal:", a == b, len(a[0]))
