#!/usr/bin/env bash
# The golden suite on CUDA (float32), as issue 2 asks. Run from the repo root on the GPU box with shared/golden
# copied into the repo. The GPU image has no pytest-asyncio, so the CI pytest.ini is replaced by an empty one.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())"
POC_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=$PWD \
    tests/test_golden.py tests/test_protocol_v1.py tests/test_protocol_v2.py tests/test_engine.py tests/test_fast_paths.py "$@"
