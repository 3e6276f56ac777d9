"""Run machinery shared by every algorithm: driver, client-state store, outputs."""

import atexit
import sys


def _stop_tff_workers() -> None:
  # TFF's local context starts a worker_binary that outlives this process
  # (holding its stdout/stderr pipes) and prints an AttributeError at
  # teardown: a script or notebook that uses this project's modules without
  # its binaries gets them stopped at exit too. tff_runtime is imported only
  # now: at import it sets TensorFlow's log level, which the binaries' quiet
  # import must see unset.
  if 'tensorflow_federated' in sys.modules:
    from pipeline import tff_runtime  # pylint: disable=g-import-not-at-top
    tff_runtime.shutdown_workers()


atexit.register(_stop_tff_workers)
