#!/usr/bin/env bash
# Builds the peer benchmark's own virtualenv (default: .peers-venv/ at the
# repository root, gitignored) with pfl-research and a CPU build of PyTorch.
# It is never the project's .venv and the tests do not use it.
#
#   bash benchmarks/peers/setup_pfl_venv.sh [VENV_DIR]
#
# Pins: torch 2.13.0 (CPU build), then requirements.txt beside this file
# (pfl 0.6.0, pfl-research's package on PyPI, and its dependencies as they
# resolved). torch goes first and on its own: a plain `torch`, or pfl's
# `pytorch` extra, resolves to a CUDA build of several GB; with torch 2.13.0
# installed, pfl's torch range is met and nothing more is fetched. Where pip
# is not set up to find a CPU wheel of torch 2.13.0, point it at PyTorch's
# CPU wheel index through TORCH_PIP_ARGS (e.g. TORCH_PIP_ARGS="--index-url
# <that index>"). PYTHON (default python3) must be 3.10-3.12 (pfl's range).
set -euo pipefail

TORCH_VERSION=2.13.0
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${1:-$repo/.peers-venv}"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))'; then
  echo "error: $python is $("$python" --version 2>&1); pfl 0.6.0 needs Python 3.10-3.12 (set PYTHON=...)" >&2
  exit 2
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
# shellcheck disable=SC2086
"${pip[@]}" install "torch==$TORCH_VERSION" ${TORCH_PIP_ARGS:-}
"${pip[@]}" install -r "$here/requirements.txt"
"$venv/bin/python" - <<'PY'
import sys
import pfl, psutil, torch
from pfl.algorithm.scaffold import SCAFFOLD  # noqa: F401
if torch.version.cuda is not None:
    sys.exit(f'error: torch {torch.__version__} is a CUDA build; install a '
             'CPU build of torch 2.13.0 (TORCH_PIP_ARGS)')
print(f'peers venv ready: pfl {pfl.__version__}, torch {torch.__version__}, '
      f'psutil {psutil.__version__}')
PY
du -sh "$venv" | awk '{print "size: " $1}'
