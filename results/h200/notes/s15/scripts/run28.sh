#!/bin/bash
# session 15 run 2: trigger placement A/B (1.5B 4 rounds; 0.5B/7B 3 rounds), parity, timeline
source scripts/gpu_env.sh
D=$OUT/s15run2; mkdir -p $D
python3 scripts/ab_decode_env.py $D/ab15.json --presets qwen2.5-1.5b --rounds 4 --settings "" \
  "LLMSERVE_PDL_TRIGGER_ROLES=qkv" "LLMSERVE_DECODE_TRIGGER_AT=1" "LLMSERVE_DECODE_TRIGGER_AT=2" \
  "LLMSERVE_PDL_TRIGGER_ROLES=qkv LLMSERVE_DECODE_TRIGGER_AT=1" "LLMSERVE_PDL_TRIGGER_ROLES=qkv,head" \
  "LLMSERVE_PDL_TRIGGER_ROLES=qkv,down" > $D/ab15.log 2>&1
python3 scripts/ab_decode_env.py $D/ab05_7.json --presets qwen2.5-0.5b qwen2.5-7b --rounds 3 --settings "" \
  "LLMSERVE_PDL_TRIGGER_ROLES=qkv" "LLMSERVE_PDL_TRIGGER_ROLES=qkv LLMSERVE_DECODE_TRIGGER_AT=1" > $D/ab05_7.log 2>&1
python3 scripts/token_parity_env.py $D/parity.json --presets qwen2.5-1.5b qwen2.5-0.5b --settings "" \
  "LLMSERVE_PDL_TRIGGER_ROLES=qkv" "LLMSERVE_PDL_TRIGGER_ROLES=qkv LLMSERVE_DECODE_TRIGGER_AT=1" > $D/parity.log 2>&1
LLMSERVE_PDL_TRIGGER_ROLES=qkv python3 scripts/profile_decode.py --preset qwen2.5-1.5b --timeline --context 128 --out $D/tl_qkv.json > $D/tl_qkv.log 2>&1
python3 scripts/profile_decode.py --preset qwen2.5-1.5b --timeline --context 128 --out $D/tl_base.json > $D/tl_base.log 2>&1
python3 - <<'PY'
import json,os,statistics as st
for f in ["ab15.json","ab05_7.json"]:
    d=json.load(open(os.environ["OUT"]+"/s15run2/"+f))
    by={}
    for r in d["rows"]:
        by.setdefault((r["preset"],r["setting"]),[]).append(r["step_ms"] if r["error"] is None else r["error"][:80])
    for k,v in by.items(): print(f"{k[0]:14s} {k[1]:60s}", [round(x,4) if isinstance(x,float) else x for x in v], round(st.median([x for x in v if isinstance(x,float)] or [0]),4))
d=json.load(open(os.environ["OUT"]+"/s15run2/parity.json"))
print(json.dumps(d)[:1500])
for f in ["tl_qkv.json","tl_base.json"]:
    t=json.load(open(os.environ["OUT"]+"/s15run2/"+f))["timeline"]
    print(f, round(t["step_us"],1), {k:(round(v["marginal_us"],2),round(v["own_us"],2)) for k,v in t["layer_positions"].items()})
PY
