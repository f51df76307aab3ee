#!/usr/bin/env bash
# 4 H200: where the time of Qwen3-235B-A22B (FP8 experts kept, two replicas of tp=2) goes, per rank: kernel time
# by kind (GEMM, attention, NCCL, compiled elementwise, other) over 4 steady-state batches (POC_RANK_PROFILE).
set -u
OUT=${OUT:-benchmarks/h200x4}
mkdir -p "$OUT/w7r_profile"
export PYTHONPATH=src
POC_RANK_PROFILE="$OUT/w7r_profile" POC_TP_REDUCE=model timeout 400 python -m poc.bench --workload W7R --batch 48 \
    --compile --warm 6 --timed 4 --out "$OUT/w7r_profiled_run.json" 2>&1 | grep -E '^\{|Error|Traceback|profile of' | tail -8
