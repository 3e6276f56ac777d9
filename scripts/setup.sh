#!/usr/bin/env bash
# Creates .venv with the pinned environment (idempotent: re-runs only when
# requirements/lock.txt changes). Every package is installed with --no-deps
# from the lock file: TFF 0.87 pins jaxlib==0.4.14, which the registry no longer
# serves, so pip's resolver cannot be used; the lock holds jax/jaxlib 0.4.13.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=.venv
stamp="$VENV/.lock.sha256"
want=$(sha256sum requirements/lock.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
# pip keeps downloaded wheels in its cache (~/.cache/pip), so a re-install or a
# fresh clone on the same machine does not download the ~2.5 GB again.
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -r requirements/lock.txt 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/python" - <<'PY'
from pipeline import tf_logs
tf_logs.quiet_tensorflow_import()  # TensorFlow's C++ import noise
import numpy, sklearn, tensorflow as tf, tensorflow_datasets as tfds
from tensorflow_datasets.testing import mock_data  # noqa: F401
import tensorflow_federated as tff
assert numpy.__version__.startswith("1."), numpy.__version__
assert tff.__version__ == "0.87.0", tff.__version__
# Pure-Python protobuf (what protobuf 3.20 falls back to on Python 3.11) makes
# TFF's tracing and its per-round computation transfer several times slower.
from google.protobuf.internal import api_implementation
assert api_implementation.Type() == "upb", api_implementation.Type()
from pipeline import tff_runtime
tff_runtime.shutdown_workers()  # stop TFF's worker before interpreter teardown
print(f"environment ok: tff {tff.__version__}, tf {tf.__version__}, tfds {tfds.__version__}, numpy {numpy.__version__}")
PY
echo "$want" > "$stamp"
