#!/usr/bin/env bash
# Session 2, third H100 call: the golden suite and the threaded pool on CUDA, W1 model-ready time, W6 with the
# static-shape MoE dispatch.
set -u
OUT=${OUT:-benchmarks/h100}
mkdir -p "$OUT"
export PYTHONPATH=src
bash benchmarks/gpu_golden.sh tests/test_pool_parallel.py -m "gpu or not gpu" 2>&1 | tail -4
timeout 200 python -m poc.bench --workload W1 --batch 64 --compile --warm 1 --timed 4 --out "$OUT/w1_parallel_pool.json" 2>&1 | grep -E '^\{|ceiling|Error|Traceback' | tail -5
timeout 260 python -m poc.bench --workload W6 W6F --batch 32 --compile --warm 1 --timed 4 --out "$OUT/w6_moe_static_dispatch.json" 2>&1 | grep -E '^\{|ceiling|Error|Traceback|File' | tail -8
