#!/usr/bin/env bash
# 4 H200: compiled ranks against one GPU (v1 fp16, tp=2), then W7 (235B-A22B, FP8 experts, tp=4) with the
# expert-parallel rows gathered per rank, tp all-reduces in fp32 (default) and in bf16 (POC_TP_REDUCE=model).
set -u
OUT=${OUT:-benchmarks/h200x4}
mkdir -p "$OUT"
export PYTHONPATH=src
timeout 150 python benchmarks/rank_compile_check.py --out "$OUT/rank_compile_check.json" 2>&1 | grep -E '^\{|Error|Traceback|File' | tail -8
timeout 200 python -m poc.bench --workload W7 --batch 32 --compile --warm 1 --timed 3 --out "$OUT/w7_ep_rows_fp32_reduce.json" 2>&1 | grep -E '^\{|Error|Traceback|File' | tail -6
POC_TP_REDUCE=model timeout 200 python -m poc.bench --workload W7 --batch 32 64 --compile --warm 1 --timed 3 --out "$OUT/w7_ep_rows_bf16_reduce.json" 2>&1 | grep -E '^\{|Error|Traceback|File' | tail -6
