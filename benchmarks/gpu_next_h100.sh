#!/usr/bin/env bash
# The next H100 session in one call: W1/W2 re-measured with the exact (float64) reductions of session 3, the
# Qwen3-30B-A3B shape with the gather combine (W6 bf16, W6F FP8 kept), and the CUDA eager-numerics tests alone.
set -u
OUT=${OUT:-benchmarks/h100}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 300 python -m poc.bench --workload W1 W2 --compile --warm 2 --timed 6 \
    --out "$OUT/w1_w2_exact.json" 2>&1 | grep -E '^\{|Error|Traceback' | cut -c1-400
timeout 200 python -m poc.bench --workload W6 W6F --batch 32 --compile --warm 2 --timed 6 \
    --out "$OUT/w6_combine_gather.json" 2>&1 | grep -E '^\{|Error|Traceback' | cut -c1-400
POC_TEST_DEVICE=cuda timeout 120 python -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=$PWD \
    tests/test_eager_numerics.py -rA 2>&1 | grep -E "PASSED|FAILED|SKIPPED|passed|failed" | tail -12
