#!/usr/bin/env bash
# Sets up the pinned environment (first run only) and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
