#!/usr/bin/env bash
# The compiled path rounding as eager does (compute.eager_numerics + exact reductions), on one GPU:
# which steps (diag_bits) and ops (diag_compile) still differ, the 1000-nonce accuracy check, W4's speed with it, and the golden suite on CUDA.
#   bash benchmarks/gpu_exact.sh            (OUT=benchmarks/h100 by default)
set -u
OUT=${OUT:-benchmarks/h100}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python - <<'PY'
import torch, triton
from poc.engine.compute import eager_numerics
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
print("knobs set:", eager_numerics())
PY
timeout 120 python benchmarks/diag_bits.py --out "$OUT/diag_bits.json" 2>&1 | grep -vE "Warning|warn" | cut -c1-300
timeout 200 python benchmarks/diag_compile.py --exact --out "$OUT/diag_compile_exact.json" 2>&1 | grep -vE "Warning|warn" | tail -6 | cut -c1-400
timeout 400 python -m poc.bench --check --out "$OUT/accuracy_exact.json" 2>&1 | grep -E '^\{|Error|Traceback' | tail -3
timeout 260 python -m poc.bench --workload W4 --batch 64 --compile --warm 2 --timed 8 --out "$OUT/w4_exact.json" 2>&1 \
    | grep -E '^\{|Error|Traceback' | tail -2
POC_TEST_DEVICE=cuda timeout 300 python -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=$PWD \
    tests/test_golden.py tests/test_protocol_v2.py tests/test_fast_paths.py 2>&1 | tail -3
TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1 timeout 260 python -m poc.bench \
    --workload W4 --batch 64 --compile --warm 2 --timed 8 --out "$OUT/w4_exact_coord.json" 2>&1 | grep -E '^\{|Error|Traceback' | tail -2
