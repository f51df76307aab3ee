#!/usr/bin/env bash
# The Vast.ai start script: environment defaults, the log file the PyWorker watches, then the model server.
#
#   ./start_server.sh [model_server.py flags...]
#
# POC_HOST/POC_PORT/POC_MODEL/POC_DTYPE/POC_DEVICE/POC_LOG_LEVEL and the other POC_* of README.md's Configuration
# table configure the server (flags win); MODEL_LOG is the log file (default /var/log/model/server.log,
# ./logs/server.log when that is not writable). On a fresh machine the first run creates .venv from
# requirements.txt.
set -euo pipefail
cd "$(dirname "$0")"

export POC_HOST=${POC_HOST:-127.0.0.1}  # the PyWorker proxies from the same host
export POC_PORT=${POC_PORT:-18000}
export POC_DTYPE=${POC_DTYPE:-auto}
export POC_LOG_LEVEL=${POC_LOG_LEVEL:-info}
# POC_MODEL (a checkpoint directory: serve PoC v2 for it) and POC_DEVICE (cpu|cuda) are optional.

MODEL_LOG=${MODEL_LOG:-/var/log/model/server.log}
if ! { mkdir -p "$(dirname "$MODEL_LOG")" && touch "$MODEL_LOG"; } 2>/dev/null; then
    MODEL_LOG=$PWD/logs/server.log
    mkdir -p logs
fi
export MODEL_LOG
echo "start_server: logging to $MODEL_LOG" >&2

scripts/ensure_venv.sh requirements.txt  # quick no-op once .venv is installed

exec > >(tee -a "$MODEL_LOG") 2>&1
exec .venv/bin/python -u model_server.py "$@"
