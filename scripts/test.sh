#!/usr/bin/env bash
# Sets up the pinned environment (first run only) and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers, one test file each: module fixtures (TFF builds) stay per file.
# The slowest tests are listed so the suite time stays visible.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 "$@"
