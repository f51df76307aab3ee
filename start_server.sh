#!/usr/bin/env bash
# The Vast.ai start script: environment defaults, the log file the PyWorker watches, then the model server.
#
#   ./start_server.sh [model_server.py flags...]
#
# POC_HOST/POC_PORT/POC_MODEL/POC_DTYPE/POC_DEVICE/POC_LOG_LEVEL and the other POC_* of README.md's Configuration
# table configure the server (flags win); MODEL_LOG is the log file (default /var/log/model/server.log,
# ./logs/server.log when that is not writable), fresh each run: the previous one is kept as MODEL_LOG.1
# (scripts/fresh_log.sh). On a fresh machine the first run creates .venv from requirements.txt, showing pip's
# progress; POC_PYTHON names another interpreter (one whose environment already has requirements.txt) and skips
# that. TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR keep compiled kernels across restarts (default ./.cache/).
set -euo pipefail
cd "$(dirname "$0")"

export POC_HOST=${POC_HOST:-127.0.0.1}  # the PyWorker proxies from the same host
export POC_PORT=${POC_PORT:-18000}
export POC_DTYPE=${POC_DTYPE:-auto}
export POC_LOG_LEVEL=${POC_LOG_LEVEL:-info}
# POC_MODEL (a checkpoint directory: serve PoC v2 for it) and POC_DEVICE (cpu|cuda) are optional.

# torch.compile's caches, kept across restarts so that a restarted server does not compile again (~20 s a shape)
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/torchinductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.cache/triton}

MODEL_LOG=$(scripts/fresh_log.sh "${MODEL_LOG:-/var/log/model/server.log}")  # the old log -> MODEL_LOG.1
export MODEL_LOG
echo "start_server: logging to $MODEL_LOG" >&2

python=${POC_PYTHON:-}
if [[ -z $python ]]; then
    scripts/ensure_venv.sh requirements.txt  # quick no-op once .venv is installed
    python=.venv/bin/python
fi

exec > >(tee -a "$MODEL_LOG") 2>&1
exec "$python" -u model_server.py "$@"
