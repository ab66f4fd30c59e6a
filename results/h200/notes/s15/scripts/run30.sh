#!/bin/bash
source scripts/gpu_env.sh
D=$OUT/s15run4; mkdir -p $D
python3 -m pytest -q -m gpu tests/test_fast_forward.py -k "trigger or cuda_graph or side_stream" > $D/tests.txt 2>&1; tail -2 $D/tests.txt
python3 scripts/ab_decode_env.py $D/ab.json --presets qwen2.5-1.5b qwen2.5-0.5b --rounds 4 --settings "" \
  "LLMSERVE_PDL_FINAL_NORM=0" > $D/ab.log 2>&1
python3 scripts/token_parity_env.py $D/parity.json --presets qwen2.5-1.5b --settings "" "LLMSERVE_PDL_FINAL_NORM=0" "LLMSERVE_PDL_TRIGGER_QKV=0 LLMSERVE_PDL_FINAL_NORM=0" > $D/parity.log 2>&1
python3 scripts/profile_decode.py --preset qwen2.5-1.5b --timeline --context 128 --out $D/tl.json > $D/tl.log 2>&1
python3 - <<'PY'
import json,os,statistics as st
d=json.load(open(os.environ["OUT"]+"/s15run4/ab.json"))
by={}
for r in d["rows"]:
    by.setdefault((r["preset"],r["setting"]),[]).append(r["step_ms"] if r["error"] is None else r["error"][:80])
for k,v in by.items(): print(f"{k[0]:14s} {k[1]:60s}", [round(x,4) if isinstance(x,float) else x for x in v], round(st.median([x for x in v if isinstance(x,float)] or [0]),4))
d=json.load(open(os.environ["OUT"]+"/s15run4/parity.json"))
print([(r["setting"], r["same_as_first"], r["error"]) for r in d["rows"]])
t=json.load(open(os.environ["OUT"]+"/s15run4/tl.json"))["timeline"]
print(round(t["step_us"],1), {k:(round(v["marginal_us"],2),round(v["own_us"],2)) for k,v in t["layer_positions"].items()})
print([(k["name"][:30], round(k["marginal_us_per_step"],2), round(k["start_vs_prev_end_us"],2)) for k in t["kernels"]])
PY
