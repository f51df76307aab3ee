#!/usr/bin/env bash
# Session 2, second H100 call: FP8 GEMM vs dequantise, the MoE workloads compiled, the accuracy check.
set -u
OUT=${OUT:-benchmarks/h100}
mkdir -p "$OUT"
export PYTHONPATH=src
timeout 90 python benchmarks/fp8_gemm.py --out "$OUT/fp8_gemm.json" 2>&1 | grep -E '^\{|Error' | tail -10
timeout 240 python -m poc.bench --workload W6 W6F --batch 32 --compile --warm 1 --timed 4 --out "$OUT/w6_moe_compile.json" 2>&1 | grep -E '^\{|ceiling|Error|error|Traceback|File' | tail -12
timeout 260 python -m poc.bench --check --out "$OUT/accuracy2.json" 2>&1 | grep -E '^\{|Error|Traceback' | tail -5
