"""TFF execution context set-up and shutdown of TFF's C++ worker process.

`import tensorflow_federated` installs a local C++ execution context that
starts a `worker_binary` child on first use. TFF only stops it from a
`__del__` that fails at interpreter teardown (module globals are already
None), so the worker outlives Python and keeps inherited stdout/stderr pipes
open, hanging shell pipelines and CI. `shutdown_workers` releases the context
while the interpreter is still whole and then kills any worker child left;
`install_shutdown_hooks` runs it on every exit path (normal exit, uncaught
exception, SIGTERM/SIGHUP/SIGINT).
"""

import atexit
import gc
import os
import signal
import sys

import psutil

# The worker inherits the environment at first use; INFO lines from its graph
# optimizer would otherwise flood every run's output.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')

_WORKER_NAME = 'worker_binary'
_hooks_installed = False


def _worker_children() -> list[psutil.Process]:
  try:
    children = psutil.Process(os.getpid()).children(recursive=True)
  except psutil.Error:
    return []
  workers = []
  for child in children:
    try:
      if _WORKER_NAME in child.name() or any(
          _WORKER_NAME in part for part in child.cmdline()[:1]):
        workers.append(child)
    except psutil.Error:
      continue
  return workers


def shutdown_workers() -> None:
  """Stops every TFF worker process started by this process. Idempotent."""
  tff_module = sys.modules.get('tensorflow_federated')
  if tff_module is not None:
    # Dropping the default context lets TFF's own ServiceManager stop its
    # worker (SIGINT + wait) while the interpreter is still intact.
    from tensorflow_federated.python.core.impl.context_stack import set_default_context  # pylint: disable=g-import-not-at-top
    set_default_context.set_no_default_context()
    # Contexts sit in reference cycles; collect them now, not at teardown.
    gc.collect()
  workers = _worker_children()
  for worker in workers:
    try:
      worker.terminate()
    except psutil.Error:
      pass
  _, alive = psutil.wait_procs(workers, timeout=5)
  for worker in alive:
    try:
      worker.kill()
    except psutil.Error:
      pass
  _disarm_service_managers()


def _disarm_service_managers() -> None:
  # A ServiceManager still referenced (e.g. from an exception's traceback)
  # would run its __del__ at teardown, when its module globals are None, and
  # print an AttributeError. Its worker is stopped above, so disarm it.
  for obj in gc.get_objects():
    cls = type(obj)
    if (cls.__name__ == 'ServiceManager' and
        cls.__module__.endswith('executor_factory')):
      obj._process = None  # pylint: disable=protected-access
      cls.__del__ = lambda self: None


def _exit_on_signal(signum, frame):
  del frame
  shutdown_workers()
  # Re-raise the default behaviour so the exit status reflects the signal.
  signal.signal(signum, signal.SIG_DFL)
  os.kill(os.getpid(), signum)


def install_shutdown_hooks() -> None:
  """Makes every exit path of this process stop TFF workers. Idempotent."""
  global _hooks_installed
  if _hooks_installed:
    return
  atexit.register(shutdown_workers)
  for signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, _exit_on_signal)
  _hooks_installed = True


def configure_execution(max_concurrent_computation_calls: int = -1) -> None:
  """Sets TFF's local C++ execution context (the default runtime)."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  install_shutdown_hooks()
  tff.backends.native.set_sync_local_cpp_execution_context(
      max_concurrent_computation_calls=max_concurrent_computation_calls)
  gc.collect()  # The replaced context's (unstarted) service manager.
