#!/bin/bash
# session 15 run 1: trigger roles + attention configs A/B, timelines at two contexts
source scripts/gpu_env.sh
D=$OUT/s15run1; mkdir -p $D
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $D/smi.txt
OUTF=$D/attn_par.json python3 .gpu/attn_par.py - 256,4,1 512,16,1 64,4,3,1 64,8,4,1 128,8,2,1 128,4,3,1 > $D/attn_par.log 2>&1
python3 scripts/profile_decode.py --preset qwen2.5-1.5b --timeline --context 40 --out $D/tl_c40.json > $D/tl_c40.log 2>&1
python3 scripts/profile_decode.py --preset qwen2.5-1.5b --timeline --context 250 --out $D/tl_c250.json > $D/tl_c250.log 2>&1
python3 scripts/ab_decode_env.py $D/ab1.json --presets qwen2.5-1.5b --rounds 3 --settings "" \
  "LLMSERVE_PDL_TRIGGER_ROLES=attn" "LLMSERVE_PDL_TRIGGER_ROLES=qkv" "LLMSERVE_PDL_TRIGGER_ROLES=qkv,attn" \
  "LLMSERVE_PDL_TRIGGER_ROLES=o" "LLMSERVE_PDL_TRIGGER_ROLES=head" "LLMSERVE_PDL_TRIGGER_ROLES=down" \
  "LLMSERVE_DECODE_WIDE_CFG=256,4,1" "LLMSERVE_DECODE_WIDE_CFG=512,16,1" "LLMSERVE_DECODE_WIDE_CFG=64,4,3,1" \
  "LLMSERVE_DECODE_WIDE_CFG=64,8,4,1" "LLMSERVE_DECODE_WIDE_CFG=128,8,2,1" "LLMSERVE_DECODE_WIDE_CFG=128,4,3,1" > $D/ab1.log 2>&1
tail -5 $D/ab1.log
python3 - <<'PY'
import json,os,statistics as st
d=json.load(open(os.environ["OUT"]+"/s15run1/ab1.json"))
by={}
for r in d["rows"]:
    by.setdefault(r["setting"],[]).append(r["step_ms"] if r["error"] is None else r["error"][:80])
for k,v in by.items(): print(f"{k:45s}", v, st.median([x for x in v if isinstance(x,float)] or [0]))
PY
grep -v "^-\|^$" $D/attn_par.log | awk '$3!="None"' | head -20
