#!/usr/bin/env bash
# The next 4x H200 session in one call: Qwen3-235B-A22B (FP8 experts kept) as two replicas of tp=2 with the
# session-3 MoE changes (combine as a gather, rounded in-kernel: less memory traffic and ~3 GB less peak per GPU,
# so larger batches may fit), then the same layout profiled per rank (POC_RANK_PROFILE).
set -u
OUT=${OUT:-benchmarks/h200x4}
mkdir -p "$OUT"
export PYTHONPATH=src
POC_TP_REDUCE=model timeout 330 python -m poc.bench --workload W7R --batch ${BATCHES:-48 64} --compile --warm 3 \
    --timed 8 --out "$OUT/w7r_tp2_x2_combine_gather.json" 2>&1 | grep -E '^\{|Error|Traceback' | tail -4
OUT="$OUT" bash benchmarks/gpu_w7r_profile.sh
