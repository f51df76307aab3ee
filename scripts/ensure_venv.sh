#!/usr/bin/env bash
# Create a virtual environment (default .venv in the repo root) if missing and install the pinned requirements into
# it, once per change of the requirement files; pip's own output shows the progress (a first install takes minutes).
#
#   scripts/ensure_venv.sh [requirements-file] [venv-dir]
#   scripts/ensure_venv.sh requirements-worker.txt .venv-worker     # the Vast PyWorker alone: no torch
#
# Two commands started together (./start_server.sh and scripts/test.sh on a fresh clone) take turns on a lock
# (flock on <venv-dir>.lock): the second waits for the first and then finds the environment ready.
set -euo pipefail
cd "$(dirname "$0")/.."
req=${1:-requirements.txt}
venv=${2:-.venv}
py=${PYTHON:-python3}
if [[ ! -f $req ]]; then
    echo "ensure_venv: no requirements file $req" >&2
    exit 2
fi
# the stamp names what was installed: every requirement file (they include each other) and pyproject.toml
stamp="$venv/.installed-$(cat "$req" requirements.txt requirements-worker.txt requirements-test.txt pyproject.toml \
    | sha256sum | cut -c1-16)"
if [[ -f $stamp ]]; then
    exit 0  # installed: no lock, no output
fi
exec 9> "$venv.lock"
if ! flock -n 9; then
    echo "ensure_venv: another command is installing $venv; waiting for it to finish" >&2
    flock 9
fi
if [[ -f $stamp ]]; then
    exit 0  # the other command installed it
fi
if ! { [[ -x $venv/bin/python ]] && "$venv/bin/python" -m pip --version > /dev/null 2>&1; }; then
    echo "ensure_venv: creating $venv with $("$py" --version)" >&2
    "$py" -m venv --clear "$venv"  # --clear: a half-made environment (an interrupted first run) starts over
fi
echo "ensure_venv: installing $req into $venv (first run only; pip's progress follows)" >&2
"$venv/bin/python" -m pip install --upgrade pip
"$venv/bin/python" -m pip install -r "$req"
if [[ $req != requirements-worker.txt ]]; then  # the PyWorker's environment needs no poc package
    # the checkout's src/ on the path, as `pip install -e .` would, without a build step (no setuptools, offline)
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$PWD/src" > "$site/poc-checkout.pth"
fi
touch "$stamp"
echo "ensure_venv: $venv ready" >&2
