#!/usr/bin/env bash
# 4 H200: Qwen3-235B-A22B, FP8 experts kept, two replicas of tp=2 (bf16 all-reduces).
set -u
OUT=${OUT:-benchmarks/h200x4}
mkdir -p "$OUT"
export PYTHONPATH=src
POC_TP_REDUCE=model timeout 330 python -m poc.bench --workload W7R --batch 32 48 --compile --warm 2 --timed 6 --out "$OUT/w7r_tp2_x2_replicas.json" 2>&1 | grep -E '^\{|Error|Traceback|File' | tail -6
nvidia-smi --query-gpu=memory.used --format=csv,noheader
