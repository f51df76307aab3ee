#!/usr/bin/env bash
# Session 2, first H100 call: where compiled bf16 rounds differently, CUDA graphs on W4, the MoE workloads.
# Run from the repo root on the GPU box; results under ${OUT:-benchmarks/h100}.
set -u
OUT=${OUT:-benchmarks/h100}
mkdir -p "$OUT"
export PYTHONPATH=src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 170 python benchmarks/diag_compile.py --out "$OUT/diag_compile.json" 2>&1 | grep -v Warning | tail -25
timeout 120 python -m poc.bench --workload W4 --batch 64 --compile --graphs --warm 2 --timed 8 --out "$OUT/w4_compile_graphs.json" 2>&1 | grep -E '^\{|ceiling|Error|error' | tail -5
timeout 90 python -m poc.bench --workload W4 --batch 64 --graphs --warm 2 --timed 6 --out "$OUT/w4_eager_graphs.json" 2>&1 | grep -E '^\{|ceiling|Error|error' | tail -5
timeout 170 python -m poc.bench --workload W6 W6F --batch 16 --warm 1 --timed 4 --out "$OUT/w6_moe.json" 2>&1 | grep -E '^\{|ceiling|Error|error|Traceback|File' | tail -12
