#!/bin/bash
source scripts/gpu_env.sh
D=$OUT/s15run3; mkdir -p $D
python3 -m pytest -q -m gpu tests/test_fast_forward.py -k "trigger or cuda_graph" > $D/tests.txt 2>&1; tail -2 $D/tests.txt
python3 -m pytest -q tests/test_triton_kernels.py -k "decode" >> $D/tests.txt 2>&1; tail -2 $D/tests.txt
python3 scripts/ab_decode_env.py $D/ab.json --presets qwen2.5-1.5b --rounds 3 --settings "" \
  "LLMSERVE_DECODE_WIDE_CFG=256,16,1" "LLMSERVE_PDL_TRIGGER_QKV=0" "AB_LINEAR=triton-int8" \
  "AB_LINEAR=triton-int8 LLMSERVE_PDL_TRIGGER_QKV=0" > $D/ab.log 2>&1
python3 - <<'PY'
import json,os,statistics as st
d=json.load(open(os.environ["OUT"]+"/s15run3/ab.json"))
by={}
for r in d["rows"]:
    by.setdefault((r["preset"],r["setting"]),[]).append(r["step_ms"] if r["error"] is None else r["error"][:80])
for k,v in by.items(): print(f"{k[0]:14s} {k[1]:60s}", [round(x,4) if isinstance(x,float) else x for x in v], round(st.median([x for x in v if isinstance(x,float)] or [0]),4))
PY
