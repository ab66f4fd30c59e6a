#!/bin/bash
source scripts/gpu_env.sh
D=$OUT/s15run6; mkdir -p $D
for b in 2 4; do for q in 1 0; do for rep in 1 2; do
LLMSERVE_PDL_TRIGGER_QKV=$q python3 scripts/profile_decode.py --preset qwen2.5-1.5b --batch $b --timeline --context 128 --replays 50 --out $D/tl_b${b}_q${q}_$rep.json > $D/tl_b${b}_q${q}_$rep.log 2>&1
done; done; done
python3 - <<'PY'
import json,os,glob
for f in sorted(glob.glob(os.environ["OUT"]+"/s15run6/*.json")):
    t=json.load(open(f))["timeline"]
    print(os.path.basename(f), round(t["step_us"],1), {k[:6]:round(v["marginal_us"],2) for k,v in t["layer_positions"].items()})
PY
