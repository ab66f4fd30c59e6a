#!/usr/bin/env bash
# The GPU evidence runs, in two stages that each fit one device-tool call (<= 10 min).
# Run on the GPU machine from the repo root: bash scripts/gpu_evidence.sh a|b
# Outputs go to $OUT (the device tool brings them back) or ./artifacts/gpu.
source scripts/gpu_env.sh
OUT=${OUT:-artifacts/gpu}; mkdir -p "$OUT"
case "$1" in
a)
  timeout 400 python3 -m llmserve.cli bench-compare --hf-requests 16 --hf-decode-steps 32 \
    --rates 4 16 64 --openloop-requests 120 --out "$OUT/h200" 2>&1 | grep -v "^{" | tail -40
  timeout 90 python3 -m llmserve.cli quantize-eval --model random:qwen2.5-1.5b --device cuda \
    --modes fp16,int8,int4,triton-int8 --eval-tokens 2048 --text-source file \
    --text-file .gpu/sharegpt-subset.json --attention-backend triton \
    --output "$OUT/quantization.json" 2>&1 | tail -8
  timeout 100 python3 scripts/bench_speculative.py --device cuda --ks 1,2,4 --batch-sizes 1 \
    --repeats 1 --output "$OUT/speculative.json" 2>&1 | tail -8
  ;;
tests)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_service_api.py \
    --ignore=tests/test_service_fake.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  ;;
b)
  timeout 300 snakemake results/checkpoint3 --cores 4 --resources gpu=1 \
    --config profile=h200-quick llmserve="python3 -m llmserve.cli" > "$OUT/snakemake.log" 2>&1
  tail -5 "$OUT/snakemake.log"
  tar czf "$OUT/checkpoint3-h200-quick.tgz" results/checkpoint3/h200-quick checksums/checkpoint3-h200-quick.sha256 2>/dev/null
  ;;
esac
