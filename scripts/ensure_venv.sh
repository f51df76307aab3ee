#!/usr/bin/env bash
# Create .venv in the repo root (if missing) and install the pinned requirements into it, once per change of
# the requirement files. Usage: scripts/ensure_venv.sh [requirements-file]
set -euo pipefail
cd "$(dirname "$0")/.."
req=${1:-requirements.txt}
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $($py --version)" >&2
    "$py" -m venv .venv
fi
stamp=".venv/.installed-$(cat "$req" requirements.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "installing $req into .venv (first run only)" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r "$req"
    .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
    touch "$stamp"
fi
