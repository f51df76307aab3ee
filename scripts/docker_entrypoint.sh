#!/usr/bin/env bash
# The image's command: the model server (start_server.sh), and the Vast PyWorker (worker.py) beside it when this
# container is a Vast serverless worker (REPORT_ADDR, CONTAINER_ID and WORKER_PORT set) whose template does not
# start the PyWorker itself (Vast's bootstrap does when PYWORKER_REPO is set; two would fight for WORKER_PORT).
# POC_START_PYWORKER=0 or 1 overrides the guess; POC_WORKER_PYTHON is the PyWorker's interpreter (default
# .venv-worker/bin/python when that exists, else POC_PYTHON or .venv/bin/python).
#
# The log is made fresh (the old one kept as MODEL_LOG.1) BEFORE the PyWorker starts reading it, so a restarted
# container is not marked failed by the previous run's FATAL line. POC_FATAL_KEEPALIVE defaults to 1 here: after a
# fatal start-up failure the server stays up and GET /health answers 503 with the reason (the PyWorker's
# healthcheck), rather than exit and leave the container restarting in a loop.
set -euo pipefail
cd "$(dirname "$0")/.."

export POC_FATAL_KEEPALIVE=${POC_FATAL_KEEPALIVE:-1}
# On a Vast worker, compile the PyWorker benchmark's shape (worker.py's bench_payload) before the readiness line, so
# the benchmark and the first job run at full speed; POC_COMPILE_AT_START="" turns it off (warm_start.py).
if [[ -n ${REPORT_ADDR:-} && -z ${POC_COMPILE_AT_START+set} ]]; then
    bench_batch=${POC_BENCH_BATCH:-256}
    if [[ -n ${POC_BENCH_PARAMS:-} ]]; then
        POC_COMPILE_AT_START="[{\"batch_size\": $bench_batch, \"params\": $POC_BENCH_PARAMS}]"
    elif [[ -n ${POC_MODEL:-} ]]; then
        POC_COMPILE_AT_START="v2:$bench_batch:${POC_BENCH_SEQ_LEN:-256}"
    else
        POC_COMPILE_AT_START="v1:$bench_batch"
    fi
    export POC_COMPILE_AT_START
fi
MODEL_LOG=$(scripts/fresh_log.sh "${MODEL_LOG:-/var/log/model/server.log}")
export MODEL_LOG

start=${POC_START_PYWORKER:-auto}
if [[ $start == auto ]]; then
    start=0
    if [[ -n ${REPORT_ADDR:-} && -n ${CONTAINER_ID:-} && -n ${WORKER_PORT:-} && -z ${PYWORKER_REPO:-} ]]; then
        start=1
    fi
fi
if [[ $start == 1 ]]; then
    worker_python=${POC_WORKER_PYTHON:-}
    if [[ -z $worker_python ]]; then
        if [[ -x .venv-worker/bin/python ]]; then worker_python=.venv-worker/bin/python
        else worker_python=${POC_PYTHON:-.venv/bin/python}; fi
    fi
    log_dir=$(dirname "$MODEL_LOG")
    echo "docker_entrypoint: starting worker.py (log $log_dir/pyworker.log)" >&2
    "$worker_python" -u worker.py >> "$log_dir/pyworker.log" 2>&1 &
fi
exec ./start_server.sh "$@"
