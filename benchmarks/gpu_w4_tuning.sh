#!/usr/bin/env bash
# W4 (Qwen3-0.6B shape, seq 1024, bf16, compiled) under inductor tuning switches, each in its own process.
set -u
OUT=${OUT:-benchmarks/h100}
mkdir -p "$OUT"
export PYTHONPATH=src
run() {  # name, env...
  local name=$1; shift
  env "$@" timeout 260 python -m poc.bench --workload W4 --batch 64 --compile --warm 2 --timed 8 --out "$OUT/w4_$name.json" 2>&1 \
    | grep -E '^\{|Error|Traceback' | tail -2 | sed "s/^/$name: /"
}
run baseline A=1
run coord_pointwise TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1
run max_autotune TORCHINDUCTOR_MAX_AUTOTUNE=1 TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1
