#!/bin/bash
source scripts/gpu_env.sh
D=$OUT/s15compare; mkdir -p $D
nvidia-smi > $D/gpu.txt 2>&1
python3 -m llmserve.cli bench-compare --hf-requests 32 --hf-decode-steps 32 --hf-static-batch 32 --rates 4 16 64 --openloop-requests 100 --out $D > $D/compare.log 2>&1
echo rc=$?
tail -3 $D/compare.log
python3 - <<'PY'
import json,os
d=json.load(open(os.environ["OUT"]+"/s15compare/compare.json"))
print(json.dumps(d)[:200])
for r in d.get("decode", d.get("batch1", [])):
    print({k: r.get(k) for k in ("model","engine","ms_per_step","median_ms","status")})
PY
grep -A30 "Batch-1" $D/compare.md | head -60
