#!/usr/bin/env bash
# 4 H200: Qwen3-235B-A22B, FP8 experts kept, one pipeline of 4 stages (pp=4: 23-24 layers and all 128 experts
# per GPU, no all-reduce; the engine keeps pp+1 batches in flight so every stage works on its own batch).
set -u
OUT=${OUT:-benchmarks/h200x4}
mkdir -p "$OUT"
export PYTHONPATH=src
timeout 560 python -m poc.bench --workload W7P --batch ${BATCHES:-64 96} --compile --warm 4 --timed 8 \
    --out "$OUT/w7p_pp4.json" 2>&1 | grep -E '^\{|Error|Traceback|File|rank' | tail -8
nvidia-smi --query-gpu=memory.used --format=csv,noheader
