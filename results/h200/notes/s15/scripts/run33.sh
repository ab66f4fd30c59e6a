#!/bin/bash
source scripts/gpu_env.sh
D=$OUT/s15run7; mkdir -p $D
for b in 2 4; do for g in 1 $b; do for rep in 1 2; do
LLMSERVE_DECODE_GEMV_MAX=$g python3 scripts/profile_decode.py --preset qwen2.5-1.5b --batch $b --context 128 --replays 50 --out $D/p_b${b}_g${g}_$rep.json > /tmp/p_b${b}_g${g}_$rep.log 2>&1
head -1 /tmp/p_b${b}_g${g}_$rep.log
done; done; done
LLMSERVE_DECODE_GEMV_MAX=4 python3 -m pytest -q -m gpu tests/test_fast_forward.py -k "cuda_graph or trigger" 2>&1 | tail -2
python3 - <<'PY'
import json,os,glob
for f in sorted(glob.glob(os.environ["OUT"]+"/s15run7/*.json")):
    d=json.load(open(f)); print(os.path.basename(f), round(d["total_us"],1), [(round(k["us"],1), k["count"], k["name"][:40]) for k in d["kernels"][:6]])
PY
