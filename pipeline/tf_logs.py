"""TensorFlow's C++ log output: a quiet import and the project's default level.

Importing TensorFlow 2.14 on a machine without CUDA prints, from C++, lines a
user reads as failures although nothing failed:

  E ... cuda_dnn.cc:...] Unable to register cuDNN factory: Attempting to
        register factory for plugin cuDNN when one has already been registered
        (also cuFFT and cuBLAS: TF registers its CUDA plugins twice)
  W ... py_utils.cc:...] TF-TRT Warning: Could not find TensorRT

`TF_CPP_MIN_LOG_LEVEL=3` would hide the first kind too, but TF reads the level
once per process, so every later C++ error would be hidden as well. Instead,
`quiet_tensorflow_import` makes the process's first `import tensorflow` run
with file descriptor 2 captured, then writes what was captured to stderr
without those lines. It also sets TF_CPP_MIN_LOG_LEVEL=2 (errors only: TFF's
graph optimizer writes many INFO and WARNING notes on every run).

Switches: TF_CPP_MIN_LOG_LEVEL set in the environment (e.g.
`TF_CPP_MIN_LOG_LEVEL=0`: every C++ line), or `--verbosity`/`-v` on a
binary's command line, leaves TensorFlow's output alone.

Imports nothing heavy: the binaries call it before anything imports TF.
"""

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile
from typing import Optional, Sequence

LOG_LEVEL_VARIABLE = 'TF_CPP_MIN_LOG_LEVEL'
DEFAULT_LOG_LEVEL = '2'
# Set with our default level, so that a child process (e.g. a binary run by
# the tests) tells our level from one its user chose.
_QUIET_VARIABLE = 'TFF_ALGOS_QUIET_TF_IMPORT'

IMPORT_NOISE = re.compile(
    r'Unable to register cu(DNN|FFT|BLAS) factory: Attempting to register '
    r'factory for plugin cu(DNN|FFT|BLAS) when one has already been '
    r'registered|TF-TRT Warning: Could not find TensorRT')


def worker_environment() -> dict:
  """The environment for a local TFF worker (a C++ child process).

  An error a worker hits fails the call the driver made, whose status
  carries the worker's message; the binaries report it from there in one
  line. Unless the user chose TensorFlow's level (see the module doc), the
  worker's own ERROR lines would only repeat it, so it logs FATAL only.
  """
  env = dict(os.environ)
  if env.get(_QUIET_VARIABLE):
    env[LOG_LEVEL_VARIABLE] = '3'
  return env


def _asks_for_verbosity(argv: Sequence[str]) -> bool:
  return any(arg in ('-v', '--v') or
             arg.startswith(('--verbosity', '-verbosity', '-v=', '--v='))
             for arg in argv[1:])


def quiet_tensorflow_import(argv: Optional[Sequence[str]] = None) -> bool:
  """Quiets the first `import tensorflow` of this process (see module doc).

  Args:
    argv: a binary's command line, whose `--verbosity` turns this off; None
      for other programs (pytest's `-v` means something else).

  Returns whether TensorFlow's output is quieted.
  """
  user_level = (LOG_LEVEL_VARIABLE in os.environ and
                _QUIET_VARIABLE not in os.environ)
  if user_level or (argv is not None and _asks_for_verbosity(argv)):
    return False
  os.environ[LOG_LEVEL_VARIABLE] = DEFAULT_LOG_LEVEL
  os.environ[_QUIET_VARIABLE] = '1'
  if 'tensorflow' not in sys.modules and not any(
      isinstance(finder, _QuietImportFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _QuietImportFinder())
  return True


@contextlib.contextmanager
def stderr_without(noise: re.Pattern):
  """Captures file descriptor 2 (C++ and Python writes alike); on exit
  writes the captured lines, less those `noise` matches, to stderr."""
  sys.stderr.flush()
  saved_fd = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved_fd, 2)
      os.close(saved_fd)
      captured.seek(0)
      text = captured.read().decode('utf-8', errors='replace')
      kept = [line for line in text.splitlines(keepends=True)
              if not noise.search(line)]
      if kept:
        sys.stderr.write(''.join(kept))
        sys.stderr.flush()


class _QuietLoader(importlib.abc.Loader):
  """Runs the wrapped loader's `exec_module` with the noise filtered."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    # The module keeps the real loader (what introspection expects).
    module.__loader__ = self._loader
    module.__spec__.loader = self._loader
    with stderr_without(IMPORT_NOISE):
      self._loader.exec_module(module)


class _QuietImportFinder(importlib.abc.MetaPathFinder):
  """Finds `tensorflow` as the other finders do, with a `_QuietLoader`; once."""

  def find_spec(self, fullname, path, target=None):
    del path, target
    if fullname != 'tensorflow':
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(fullname)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec
