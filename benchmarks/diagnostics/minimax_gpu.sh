#!/usr/bin/env bash
# MiniMax-M2.7 on one GPU, in one call: the CUDA tests of its kernels (the FP8 attention kernel, the w2 epilogue with
# the routing weight, the whole tiny model eager and compiled against the float32 emulation), the attention kernel's
# rate against SDPA, the router GEMM against float64 (router_gemm.py), poc.bench W8L8 (the first 8 of its 62 layers)
# and the accuracy table. From the repo root on the GPU box (the image has no pytest-asyncio: the repo's pytest.ini is
# replaced by an empty one):
#
#     bash benchmarks/diagnostics/minimax_gpu.sh OUT_DIR [STEPS] [-- accuracy flags]
#
# STEPS: any of tests attention router bench accuracy (default: all five), comma-separated. Each step's output goes to
# OUT_DIR (gpu_tests.txt, attention_fp8.json, router_gemm.json, W8L8.json, minimax_accuracy.json); every step runs
# even when one fails, and the exit status is the number that failed.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
[ -d .dbg/shared ] && export POC_SHARED=${POC_SHARED:-$PWD/.dbg/shared}  # the golden files, carried to the GPU box
PY=${PYTHON:-python3}
out=${1:?usage: minimax_gpu.sh OUT_DIR [STEPS] [-- accuracy flags]}; shift
steps=${1:-tests,attention,router,bench,accuracy}; [ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
fails=0
has() { [[ ",$steps," == *",$1,"* ]]; }
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
if has tests; then
  "$PY" -m pytest -q -p no:cacheprovider -c /dev/null --rootdir="$PWD" -m gpu -rs \
      tests/test_attention.py tests/test_minimax.py tests/test_w8a8.py tests/test_route.py 2>&1 \
      | tee "$out/gpu_tests.txt" | tail -25 || fails=$((fails + 1))
fi
if has attention; then
  "$PY" benchmarks/diagnostics/attention_fp8.py --out "$out/attention_fp8.json" 2>&1 | tail -25 || fails=$((fails + 1))
fi
if has router; then
  "$PY" benchmarks/diagnostics/router_gemm.py --out "$out/router_gemm.json" 2>&1 | tail -8 || fails=$((fails + 1))
fi
if has bench; then
  "$PY" -m poc.bench --workload W8L8 --compile --out "$out/W8L8.json" 2>&1 | tail -8 || fails=$((fails + 1))
fi
if has accuracy; then
  "$PY" benchmarks/diagnostics/minimax_accuracy.py --out "$out/minimax_accuracy.json" "$@" 2>&1 | tail -40 \
      || fails=$((fails + 1))
fi
exit $fails
