#!/usr/bin/env bash
# Qwen3-235B-A22B shape, FP8 experts kept in memory, tp=4 (attention by heads, experts by expert), on nvidia-h200-x4;
# first, the compiled ranks against one GPU (v1, fp16).
set -u
OUT=${OUT:-benchmarks/h200x4}
mkdir -p "$OUT"
export PYTHONPATH=src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python benchmarks/rank_compile_check.py --out "$OUT/rank_compile_check.json" 2>&1 | grep -E '^\{|Error|Traceback|File' | tail -8
timeout 400 python -m poc.bench --workload W7 --batch 32 64 --compile --warm 1 --timed 3 --out "$OUT/w7_235b_fp8_tp4_compile.json" 2>&1 | grep -E '^\{|ceiling|Error|Traceback|File' | tail -12
