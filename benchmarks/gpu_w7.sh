#!/usr/bin/env bash
# Qwen3-235B-A22B shape, FP8 experts kept in memory, tp=4 (attention by heads, experts by expert), on nvidia-h200-x4.
set -u
OUT=${OUT:-benchmarks/h200x4}
mkdir -p "$OUT"
export PYTHONPATH=src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 520 python -m poc.bench --workload W7 --batch 32 64 --warm 1 --timed 3 --out "$OUT/w7_235b_fp8_tp4.json" 2>&1 | grep -vE "Warning|warn" | tail -25
nvidia-smi --query-gpu=memory.used --format=csv,noheader
