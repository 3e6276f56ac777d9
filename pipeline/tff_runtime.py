"""TFF execution context set-up and the lifetime of TFF's C++ worker process.

`import tensorflow_federated` installs a local C++ execution context that
starts a `worker_binary` child on first use. TFF only stops it from a
`__del__` that fails at interpreter teardown (module globals are already
None), so the worker outlives Python and keeps inherited stdout/stderr pipes
open, hanging shell pipelines and CI. `shutdown_workers` releases the context
while the interpreter is still whole and then kills any worker child left;
`install_shutdown_hooks` runs it on every exit path (normal exit, uncaught
exception, SIGTERM/SIGHUP/SIGINT). Against SIGKILL, which no hook sees, the
local workers this module starts carry a parent-death signal: the kernel
kills them when this process dies. A local worker that exits at start-up, or
a --worker_addresses address that does not answer, is an EnvironmentFault
within seconds (TFF itself would wait for it forever).

The TFF 0.87 internals this needs (TFF's native-context argument transforms,
its worker channels' gRPC options, the default context's reset, the
ServiceManagers of the contexts TFF builds itself, the mergeable context's
partitioning fixes) are used through `tff_algos.tff_internals`, imported
when TFF is (this module is imported before TensorFlow, see below).
"""

import atexit
import concurrent.futures
import errno
import gc
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

from typing import Optional

import psutil

from pipeline import heap
from pipeline import tf_logs

# The worker inherits the environment at first use; INFO lines from its graph
# optimizer would otherwise flood every run's output.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')

_WORKER_NAME = 'worker_binary'
_hooks_installed = False
# Partitions TFF's mergeable context splits a round's clients into (1: the
# plain local context).
_partitions = 1


def partitions() -> int:
  """How many parts the configured context splits a round's clients into."""
  return _partitions


# A context of its own on the (first) worker, for computations without
# clients (see server_context).
_server_context = None


def server_context():
  """The configured context for computations without clients, or None.

  A sync context on the first worker, beside the default one: the mergeable
  context would ingest such a computation's arguments once per sub-round,
  and a computation invoked through it (or through the default sync
  context) while another runs waits for that one on the context's event
  loop. Through this context it runs alongside (mixed FL's central work
  while the clients train).
  """
  return _server_context


# A local worker that neither answers nor exits within this is given up on.
WORKER_START_SECONDS = 60
# A local worker that dies more often than this within the window ends the
# run: TFF retries a round's calls on a restarted worker without end, so a
# crash that comes back on every retry (a fault in a TF kernel, the kernel's
# OOM killer) would loop forever. One death now and then is survived.
WORKER_DEATHS_ALLOWED = 3
WORKER_DEATH_WINDOW_SECONDS = 600
# How long a --worker_addresses address may take to accept a connection.
REMOTE_CONNECT_SECONDS = 10


def _worker_children() -> list[psutil.Process]:
  """The worker processes among this process's descendants.

  psutil reads them from /proc: out of file descriptors (EMFILE, ENFILE)
  that raises an OSError, and those it cannot read are left out. A local
  worker this module started dies with this process all the same (its
  parent-death signal)."""
  try:
    children = psutil.Process(os.getpid()).children(recursive=True)
  except (psutil.Error, OSError):
    return []
  workers = []
  for child in children:
    try:
      if _WORKER_NAME in child.name() or any(
          _WORKER_NAME in part for part in child.cmdline()[:1]):
        workers.append(child)
    except (psutil.Error, OSError):
      continue
  return workers


# The default context the last complete shutdown left in place. While it is
# still TFF's current context, no context was made since (configuring one,
# ours or TFF's, replaces it), so a shutdown has nothing to release beyond
# worker children. The binaries shut down up to three times on the way out
# (their error path, their `finally`, atexit); each complete shutdown scans
# every Python object and collects garbage, a third of a second with TFF
# loaded.
_context_after_shutdown = None


def shutdown_workers() -> None:
  """Stops every TFF worker process started by this process. Idempotent."""
  global _server_context, _context_after_shutdown
  # Stop the workers ourselves, with a deadline, before TFF's ServiceManager
  # can: its __del__ sends SIGINT and then waits without a timeout, and a
  # worker that ignores the SIGINT (seen once: a run hung in that wait for
  # half an hour) would hang this process for good.
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
  psutil.wait_procs(alive, timeout=5)
  tff = sys.modules.get('tensorflow_federated')
  if tff is not None:
    from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
    current = tff.framework.get_context_stack().current
    if not workers and _server_context is None and (
        current is _context_after_shutdown or
        # The context TFF installed at import, never used (e.g. a flag
        # error): its ServiceManager is all there is to disarm.
        tff_internals.disarm_idle_service_manager(current)):
      return
    # A ServiceManager still referenced (e.g. from an exception's traceback)
    # would run its __del__ at teardown, when its module globals are None,
    # and print an AttributeError. Its worker is stopped above.
    tff_internals.disarm_service_managers()
    # Drop the default context (its executors hold gRPC channels to the
    # stopped workers); contexts sit in reference cycles, so collect now,
    # not at interpreter teardown.
    tff_internals.set_no_default_context()
    _server_context = None
    gc.collect()
    _context_after_shutdown = tff.framework.get_context_stack().current


def _stop_context_workers() -> None:
  """Stops, with a deadline, the workers of the installed local contexts.

  Replacing TFF's default context drops its ServiceManager, whose __del__
  sends SIGINT to its worker and waits without a timeout; a worker that
  ignores the SIGINT hangs this process for good (seen in the test suite,
  twice in one session). Workers this process started some other way (e.g.
  remote workers on loopback) are left alone.
  """
  from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
  processes = tff_internals.detach_service_manager_workers()
  for manager in list(_local_workers):
    process = manager.detach()
    if process is not None and process.poll() is None:
      processes.append(process)
  for process in processes:
    process.terminate()
  for process in processes:
    try:
      process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait(timeout=5)


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
    # One ignored stays so (SIGHUP under `nohup`): no exit to hook.
    if signal.getsignal(signum) != signal.SIG_IGN:
      signal.signal(signum, _exit_on_signal)
  _hooks_installed = True


def worker_binary_path() -> str:
  """TFF's C++ worker; `<path> --port=N` serves one worker on port N.

  Found without importing TFF, which would import TensorFlow and print its
  start-up log lines (the README's command for remote workers calls this).
  """
  from pipeline.errors import EnvironmentFault  # pylint: disable=g-import-not-at-top
  spec = importlib.util.find_spec('tensorflow_federated')
  if spec is None or not spec.submodule_search_locations:
    raise EnvironmentFault('tensorflow_federated is not installed')
  # Where TFF's local_cpp_executor_factory looks for it.
  return os.path.join(list(spec.submodule_search_locations)[0], 'data',
                      _WORKER_NAME)


# Local workers are started from this one thread, which lives as long as the
# process: Linux sends the parent-death signal when the *thread* that forked
# the child exits, and TFF would fork from its contexts' event-loop threads,
# which end when a context is replaced.
_spawner: Optional[concurrent.futures.ThreadPoolExecutor] = None
_spawner_lock = threading.Lock()
_local_workers: 'weakref.WeakSet[_LocalWorker]' = weakref.WeakSet()


# Sets the parent-death signal, then becomes the worker (the signal survives
# exec). A launcher rather than a Popen `preexec_fn`: that would make Python
# fork() instead of vfork(), which runs gRPC's fork handlers in a process
# full of gRPC threads (and logs about it).
_DIE_WITH_PARENT_LAUNCHER = (
    'import ctypes, os, sys\n'
    'PR_SET_PDEATHSIG = 1  # <linux/prctl.h>\n'
    'if ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(sys.argv[1]), 0, 0, '
    '0):\n'
    '  sys.exit("cannot set the parent-death signal")\n'
    'if os.getppid() != int(sys.argv[2]):\n'
    '  sys.exit(1)  # The parent died before the prctl.\n'
    'os.execv(sys.argv[3], sys.argv[3:])\n')


def die_with_parent(args: list[str],
                    signum: int = signal.SIGKILL) -> list[str]:
  """`args` run so that the kernel sends them `signum` when this process
  dies."""
  if not sys.platform.startswith('linux'):
    return args
  return [sys.executable, '-S', '-E', '-c', _DIE_WITH_PARENT_LAUNCHER,
          str(int(signum)), str(os.getpid()), *args]


# TensorFlow's own variable (read when a process makes its devices): how many
# threads one op may split its work over.
INTRA_OP_THREADS_VARIABLE = 'TF_NUM_INTRAOP_THREADS'


def _worker_environment() -> dict:
  """A local worker's environment: TensorFlow's log level (`tf_logs`),
  the driver's heap thresholds (`heap.child_environment`) and, unless the
  user set it, one intra-op thread.

  The worker already runs a group of clients per core at once; an op that
  split its work over the cores queued its shards behind the other groups'
  ops. On the benchmark's 100-client rounds (2 cores, alternated with the
  commit before) FedAvg's round was 8% shorter, faster in 7 of 7 pairs;
  SCAFFOLD's and FedResAvg's within the noise. Results are bit-identical.

  The worker moves and holds model-sized values as the driver does. With the
  driver's heap thresholds, FedAvg's TFF round was 1-9% shorter in 5 of 5
  alternated pairs (100 and 1000 clients), at 20-29% more peak worker RSS
  at 1000 clients (docs/performance_log.md).
  """
  env = heap.child_environment(tf_logs.worker_environment())
  env.setdefault(INTRA_OP_THREADS_VARIABLE, '1')
  return env


def _spawn_worker(args: list[str]) -> subprocess.Popen:
  global _spawner
  with _spawner_lock:
    if _spawner is None:
      _spawner = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix='tff-worker-spawner')
  # stdout/stderr are inherited as TFF does, so a worker's fatal errors
  # are seen; the others reach the driver as the status of its call.
  return _spawner.submit(subprocess.Popen, die_with_parent(args),
                         stdin=subprocess.DEVNULL,
                         env=_worker_environment()).result()


class _LocalWorker:
  """One local `worker_binary` and the gRPC stub to it (TFF's ServiceManager,
  with a parent-death signal and a start-up deadline)."""

  def __init__(self, binary_path: str, max_concurrent_computation_calls: int):
    self._binary_path = binary_path
    # Any value <= 0 is no cap; the worker's flag is 32-bit.
    self._max_calls = max(max_concurrent_computation_calls, -1)
    self._process: Optional[subprocess.Popen] = None
    self._stub = None
    self._lock = threading.Lock()
    self._deaths: list[float] = []
    _local_workers.add(self)

  def stub(self):
    """The stub of a running worker; starts (or restarts) it if needed."""
    with self._lock:
      if self._stub is not None and self._stub.is_ready:
        return self._stub
      status = self._process.poll() if self._process is not None else None
      self._stop()  # Not ready: the worker died; TFF restarts it too.
      if status is not None:
        self._count_death(status)
      return self._start()

  def _count_death(self, status: int) -> None:
    from pipeline.errors import EnvironmentFault  # pylint: disable=g-import-not-at-top
    now = time.monotonic()
    self._deaths = [t for t in self._deaths
                    if now - t < WORKER_DEATH_WINDOW_SECONDS] + [now]
    if len(self._deaths) > WORKER_DEATHS_ALLOWED:
      how = (f'signal {signal.Signals(-status).name}' if status < 0 else
             f'status {status}')
      raise EnvironmentFault(
          f'the TFF worker {self._binary_path} died {len(self._deaths)} '
          f'times within {WORKER_DEATH_WINDOW_SECONDS} s, the last with '
          f'{how} (see its messages above); re-run the same command to '
          'resume')

  def _start(self):
    import grpc  # pylint: disable=g-import-not-at-top
    import portpicker  # pylint: disable=g-import-not-at-top
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
    from pipeline.errors import EnvironmentFault  # pylint: disable=g-import-not-at-top
    from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
    port = portpicker.pick_unused_port()
    try:
      process = _spawn_worker([
          self._binary_path, f'--port={port}',
          f'--max_concurrent_computation_calls={self._max_calls}'])
    except OSError as e:
      raise EnvironmentFault(f'cannot start the TFF worker {self._binary_path}:'
                             f' {e}') from e
    self._process = process
    channel = grpc.insecure_channel(f'localhost:{port}',
                                    tff_internals.GRPC_CHANNEL_OPTIONS)
    stub = tff.framework.RemoteExecutorGrpcStub(channel)
    deadline = time.monotonic() + WORKER_START_SECONDS
    while not stub.is_ready:
      status = process.poll()
      if status is not None:
        self._process = None
        raise EnvironmentFault(
            f'the TFF worker {self._binary_path} exited at start-up with '
            f'status {status} (see its messages above)')
      if time.monotonic() > deadline:
        self._stop()
        raise EnvironmentFault(
            f'the TFF worker {self._binary_path} did not answer on port '
            f'{port} within {WORKER_START_SECONDS} s')
      time.sleep(0.05)
    self._stub = stub
    return stub

  def _stop(self) -> None:
    process = self.detach()
    if process is not None and process.poll() is None:
      process.terminate()
      try:
        process.wait(timeout=5)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)

  def detach(self) -> Optional[subprocess.Popen]:
    """Forgets the worker process (the caller stops it) and returns it."""
    process, self._process, self._stub = self._process, None, None
    return process


def _worker_executor_factory(stub_fn):
  """TFF's executor factory on one worker (`stub_fn()` -> its gRPC stub), as
  TFF's `local_cpp_executor_factory` builds it."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  def executor_fn(cardinalities):
    # Computations without clients-placed arguments still need a clients
    # cardinality.
    if cardinalities.get(tff.CLIENTS) is None:
      cardinalities[tff.CLIENTS] = 0
    executor = tff.framework.RemoteExecutor(stub_fn())
    executor.set_cardinalities(cardinalities)
    return executor

  return tff.framework.ResourceManagingExecutorFactory(executor_fn)


def _shared_compiler():
  """`tff_compiler.compile_for_native_runtime`, once per computation for all
  the contexts given it (a context caches only its own compilations, and the
  workers' contexts start their sub-rounds at the same time)."""
  from tff_algos.runtime import tff_compiler  # pylint: disable=g-import-not-at-top
  compiled = {}
  lock = threading.Lock()

  def compile_once(computation):
    with lock:
      if computation not in compiled:
        compiled[computation] = tff_compiler.compile_for_native_runtime(
            computation)
      return compiled[computation]

  return compile_once


def _native_context(stub_fn, asynchronous: bool, compiler_fn=None):
  """A context on one worker, compiled with `tff_compiler` (TFF's own
  compiler, with its graph-optimizer errors avoided)."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
  from tff_algos.runtime import tff_compiler  # pylint: disable=g-import-not-at-top
  return tff_internals.native_context(
      tff.framework.AsyncExecutionContext if asynchronous else
      tff.framework.SyncExecutionContext,
      _worker_executor_factory(stub_fn),
      compiler_fn or tff_compiler.compile_for_native_runtime)


def _local_worker(max_concurrent_computation_calls: int = -1,
                  binary_path: Optional[str] = None):
  """The stub function of a new local worker (started on first use; it
  lives as long as a context holds the function)."""
  return _LocalWorker(binary_path or worker_binary_path(),
                      max_concurrent_computation_calls).stub


def local_worker_context(max_concurrent_computation_calls: int = -1,
                         asynchronous: bool = False,
                         binary_path: Optional[str] = None):
  """A context on its own local C++ worker (started on first use)."""
  return _native_context(
      _local_worker(max_concurrent_computation_calls, binary_path),
      asynchronous)


def parse_worker_addresses(addresses: str) -> tuple[str, ...]:
  """`host:port,host:port` -> ('host:port', ...); UsageError if malformed."""
  from pipeline.errors import UsageError  # pylint: disable=g-import-not-at-top
  parsed = []
  for address in (a.strip() for a in addresses.split(',') if a.strip()):
    host, _, port = address.rpartition(':')
    # A scheme or path (http://host:port) would only fail after the wait.
    if (not host or '/' in host or any(c.isspace() for c in host) or
        not port.isdigit()):
      raise UsageError(f'--worker_addresses: {address!r} is not host:port '
                       '(e.g. localhost:8000)')
    if not 0 < int(port) < 65536:
      raise UsageError(f'--worker_addresses: the port of {address!r} is out '
                       'of range (1-65535)')
    parsed.append(address)
  if addresses.strip() and not parsed:
    raise UsageError(f'--worker_addresses={addresses!r} names no worker '
                     '(host:port,host:port; empty runs locally)')
  return tuple(parsed)


def _remote_worker(address: str):
  """The stub function of an already-running TFF worker at `address`;
  EnvironmentFault if nothing answers there within REMOTE_CONNECT_SECONDS
  (TFF would retry the connection forever)."""
  import grpc  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from pipeline.errors import EnvironmentFault  # pylint: disable=g-import-not-at-top
  from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
  # The channel options of TFF's own local factory (2 GB messages).
  channel = grpc.insecure_channel(address, tff_internals.GRPC_CHANNEL_OPTIONS)
  try:
    grpc.channel_ready_future(channel).result(timeout=REMOTE_CONNECT_SECONDS)
  except grpc.FutureTimeoutError:
    channel.close()
    raise EnvironmentFault(
        f'--worker_addresses: no TFF worker answers at {address} within '
        f'{REMOTE_CONNECT_SECONDS} s (start one there with `worker_binary '
        '--port=PORT`)') from None
  _check_is_tff_worker(channel, address)
  stub = tff.framework.RemoteExecutorGrpcStub(channel)

  def stub_fn():
    # TFF retries a call to a worker that stopped answering forever; it
    # asks for the stub again before each retry.
    if not stub.is_ready:
      try:
        grpc.channel_ready_future(channel).result(
            timeout=REMOTE_CONNECT_SECONDS)
      except grpc.FutureTimeoutError:
        raise EnvironmentFault(
            f'--worker_addresses: the TFF worker at {address} stopped '
            f'answering (not within {REMOTE_CONNECT_SECONDS} s); restart it '
            'and re-run the same command to resume') from None
    return stub

  return stub_fn


def _check_is_tff_worker(channel, address: str) -> None:
  """EnvironmentFault unless a TFF executor service answers on `channel`.

  Another gRPC server at the address (a port reused by some other service)
  accepts the connection, and TFF's first call then fails deep in the
  round with UNIMPLEMENTED. Disposing of no executor is a no-op for a TFF
  worker (it answers OK) and unknown to any other service."""
  import grpc  # pylint: disable=g-import-not-at-top
  from pipeline.errors import EnvironmentFault  # pylint: disable=g-import-not-at-top
  from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
  try:
    tff_internals.dispose_no_executor(channel, REMOTE_CONNECT_SECONDS)
  except grpc.RpcError as error:
    code = error.code() if isinstance(error, grpc.Call) else None
    channel.close()
    what = ('is not a TFF worker (it does not know TFF\'s executor service)'
            if code == grpc.StatusCode.UNIMPLEMENTED else
            f'does not answer as a TFF worker ({code.name if code else error})')
    raise EnvironmentFault(
        f'--worker_addresses: the server at {address} {what}; start one '
        'there with `worker_binary --port=PORT`') from None


def configure_execution(max_concurrent_computation_calls: int = -1,
                        num_workers: int = 1,
                        worker_addresses: tuple[str, ...] = (),
                        num_subrounds: int = 0) -> None:
  """Sets the TFF execution context.

  Every context compiles with `tff_compiler.compile_for_native_runtime`
  (TFF's own compiler, with its graph-optimizer errors avoided).
  Default (one worker, no addresses, no sub-rounds): TFF's local C++
  execution context. `num_workers` > 1 starts that many local C++ workers;
  `worker_addresses` uses already-running workers (`worker_binary --port=N`
  on other hosts); `num_subrounds` > 1 splits each round's clients into that
  many sub-rounds, run one after another on each worker, the workers at the
  same time, and merged in their order (0: one per worker).
  In all three cases TFF's mergeable execution context runs each sub-round up
  to the aggregation and merges the aggregates, so a computation must not
  feed one aggregation's result into another (TFF raises a ValueError when
  compiling one that does); SCAFFOLD's `next` is tested to give the
  one-worker results. A worker holds the values of one sub-round's clients
  at a time, which bounds its memory at large cohorts. (Client-placed
  outputs computed before the aggregation would be recomputed after the
  merge; this project's rounds return none, so each client's work runs
  once.) Computations without clients go to `server_context()`.
  """
  from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
  install_shutdown_hooks()
  check_execution_settings(max_concurrent_computation_calls, num_workers,
                           worker_addresses, num_subrounds)
  _stop_context_workers()
  global _partitions
  mergeable = worker_addresses or num_workers > 1 or num_subrounds > 1
  _partitions = (num_subrounds or len(worker_addresses) or num_workers
                 if mergeable else 1)
  if mergeable:
    tff_internals.fix_mergeable_context()
  try:
    _set_contexts(max_concurrent_computation_calls, num_workers,
                  worker_addresses, mergeable)
  except OSError as error:
    if error.errno not in (errno.EMFILE, errno.ENFILE):
      raise
    fault = _out_of_file_descriptors(error, num_workers, worker_addresses)
  else:
    gc.collect()  # The replaced context's (unstarted) service manager.
    return
  raise fault


def _out_of_file_descriptors(error: OSError, num_workers: int,
                             worker_addresses: tuple[str, ...]):
  """The EnvironmentFault of contexts that ran out of file descriptors
  (each worker's context holds an event loop's), once the half-built ones
  are collected: their finalizers report attributes their failed
  constructors never set, and their descriptors are what a shutdown needs to
  list the worker processes."""
  from pipeline.errors import EnvironmentFault  # pylint: disable=g-import-not-at-top
  hook = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    error.__traceback__ = None
    gc.collect()
  finally:
    sys.unraisablehook = hook
  workers = (f'{len(worker_addresses)} worker addresses' if worker_addresses
             else f'{num_workers} workers')
  return EnvironmentFault(
      f'cannot set up the TFF contexts of {workers}: {error.strerror} (each '
      'worker takes file descriptors of its own); use fewer workers, or '
      'raise the limit (ulimit -n)')


# The largest --max_concurrent_computation_calls `worker_binary` takes.
MAX_WORKER_CALLS = 2**31 - 1


def check_execution_settings(max_concurrent_computation_calls: int = -1,
                             num_workers: int = 1,
                             worker_addresses: tuple[str, ...] = (),
                             num_subrounds: int = 0) -> None:
  """UsageError for settings `configure_execution` cannot take; builds
  nothing (a binary checks them before its slow steps)."""
  from pipeline.errors import UsageError  # pylint: disable=g-import-not-at-top
  if num_workers < 1:
    raise UsageError(f'--num_workers must be >= 1, got {num_workers}')
  if worker_addresses and num_workers != 1:
    raise UsageError('--num_workers starts local workers and '
                     '--worker_addresses uses running ones; pass one of them')
  if num_subrounds < 0:
    raise UsageError(f'--num_subrounds must be >= 0, got {num_subrounds}')
  if max_concurrent_computation_calls > MAX_WORKER_CALLS:
    # The worker's flag is a 32-bit integer: it refused the value at
    # start-up, reported as a worker that cannot start (status 3).
    raise UsageError('--max_concurrent_computation_calls must be at most '
                     f'{MAX_WORKER_CALLS} (<= 0: no cap), got '
                     f'{max_concurrent_computation_calls}')
  if worker_addresses and max_concurrent_computation_calls > 0:
    # It was ignored: a running worker's cap is set where it was started.
    raise UsageError('--max_concurrent_computation_calls caps the workers '
                     'this process starts, and --worker_addresses starts '
                     'none: start each worker with `worker_binary '
                     '--max_concurrent_computation_calls=N` instead')


def _set_contexts(max_concurrent_computation_calls: int, num_workers: int,
                  worker_addresses: tuple[str, ...], mergeable: bool) -> None:
  """Installs the contexts `configure_execution` describes."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
  global _server_context
  if worker_addresses:
    workers = [_remote_worker(a) for a in worker_addresses]
  else:
    # Each local worker_binary child lives as long as a context on it.
    workers = [_local_worker(max_concurrent_computation_calls)
               for _ in range(num_workers)]
  if mergeable:
    compile_once = _shared_compiler()
    tff.backends.native.set_mergeable_comp_execution_context(
        [tff_internals.threaded_async_context(_native_context(
            w, asynchronous=False, compiler_fn=compile_once))
         for w in workers],
        num_subrounds=_partitions)
  else:
    tff.framework.set_default_context(
        _native_context(workers[0], asynchronous=False))
  _server_context = _native_context(workers[0], asynchronous=False)
