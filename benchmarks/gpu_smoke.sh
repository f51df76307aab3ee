#!/usr/bin/env bash
# First call on a lent GPU: environment, the golden suite on CUDA, ceilings, eager engine vs transformers.
# Run from the repo root on the device (the device tool sets $OUT); needs shared/golden copied into the repo.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, numpy, transformers, scipy, safetensors, aiohttp, sys; print(sys.version.split()[0], torch.__version__, numpy.__version__, transformers.__version__, scipy.__version__, safetensors.__version__, aiohttp.__version__)"
POC_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -c benchmarks/pytest-gpu.ini \
    tests/test_golden.py tests/test_protocol_v1.py tests/test_protocol_v2.py tests/test_engine.py 2>&1 | tee $OUT/golden_cuda.log | tail -15
