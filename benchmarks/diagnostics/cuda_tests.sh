#!/usr/bin/env bash
# The CPU suite's numerics tests on CUDA: the golden data (float32), the protocols, the engine, the fast paths,
# the compiled path's eager bits and the threaded v1 weight pool, with POC_TEST_DEVICE=cuda. From the repo root on
# the GPU box (tests/golden.py finds the golden files in ../shared, ./shared or tests/golden_copy):
#
#     bash benchmarks/diagnostics/cuda_tests.sh [more pytest args]
#
# The GPU image has no pytest-asyncio, so the repo's pytest.ini is replaced by an empty one.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
"${PYTHON:-python3}" -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())"
POC_TEST_DEVICE=cuda "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider -c /dev/null --rootdir="$PWD" \
    tests/test_golden.py tests/test_protocol_v1.py tests/test_protocol_v2.py tests/test_engine.py tests/test_fast_paths.py \
    tests/test_eager_numerics.py tests/test_pool_parallel.py "$@"
