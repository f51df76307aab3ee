#!/usr/bin/env bash
# The image's command: the model server (start_server.sh), and the Vast PyWorker (worker.py) beside it when this
# container is a Vast serverless worker (REPORT_ADDR, CONTAINER_ID and WORKER_PORT set) whose template does not
# start the PyWorker itself (Vast's bootstrap does when PYWORKER_REPO is set; two would fight for WORKER_PORT).
# POC_START_PYWORKER=0 or 1 overrides the guess.
set -euo pipefail
cd "$(dirname "$0")/.."

start=${POC_START_PYWORKER:-auto}
if [[ $start == auto ]]; then
    start=0
    if [[ -n ${REPORT_ADDR:-} && -n ${CONTAINER_ID:-} && -n ${WORKER_PORT:-} && -z ${PYWORKER_REPO:-} ]]; then
        start=1
    fi
fi
if [[ $start == 1 ]]; then
    log_dir=$(dirname "${MODEL_LOG:-/var/log/model/server.log}")
    mkdir -p "$log_dir"
    echo "docker_entrypoint: starting worker.py (log $log_dir/pyworker.log)" >&2
    .venv/bin/python -u worker.py >> "$log_dir/pyworker.log" 2>&1 &
fi
exec ./start_server.sh "$@"
