#!/usr/bin/env bash
# 4 H200: W7D (235B-A22B, experts in bf16 as dequantised at load, tp=4) with half-precision tp all-reduces.
set -u
OUT=${OUT:-benchmarks/h200x4}
mkdir -p "$OUT"
export PYTHONPATH=src
POC_TP_REDUCE=model timeout 300 python -m poc.bench --workload W7D --batch 32 64 --compile --warm 1 --timed 3 --out "$OUT/w7d_bf16_experts_bf16_reduce.json" 2>&1 | grep -E '^\{|Error|Traceback|File' | tail -6
