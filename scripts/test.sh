#!/usr/bin/env bash
# The test command of the README: sets up .venv (first run) and runs the whole CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure_venv.sh requirements-test.txt
exec .venv/bin/python -m pytest -q "$@"
