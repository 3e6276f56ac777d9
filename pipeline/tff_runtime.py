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

import asyncio
import atexit
import gc
import os
import signal
import subprocess
import sys

import psutil

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
  _disarm_service_managers()
  tff_module = sys.modules.get('tensorflow_federated')
  if tff_module is not None:
    # Drop the default context (its executors hold gRPC channels to the
    # stopped workers); contexts sit in reference cycles, so collect now,
    # not at interpreter teardown.
    from tensorflow_federated.python.core.impl.context_stack import set_default_context  # pylint: disable=g-import-not-at-top
    set_default_context.set_no_default_context()
    gc.collect()


def _service_managers() -> list:
  # TFF defines its ServiceManager class inside local_cpp_executor_factory,
  # a new class per factory, so live instances are found, not the class.
  return [obj for obj in gc.get_objects()
          if type(obj).__name__ == 'ServiceManager' and
          type(obj).__module__.endswith('executor_factory')]


def _stop_context_workers() -> None:
  """Stops, with a deadline, the workers of the installed local contexts.

  Replacing TFF's default context drops its ServiceManager, whose __del__
  sends SIGINT to its worker and waits without a timeout; a worker that
  ignores the SIGINT hangs this process for good (seen in the test suite,
  twice in one session). Workers this process started some other way (e.g.
  remote workers on loopback) are left alone.
  """
  processes = []
  for manager in _service_managers():
    process = getattr(manager, '_process', None)
    if process is not None and process.poll() is None:
      processes.append(process)
    manager._process = None  # pylint: disable=protected-access
  for process in processes:
    process.terminate()
  for process in processes:
    try:
      process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait(timeout=5)


def _disarm_service_managers() -> None:
  # A ServiceManager still referenced (e.g. from an exception's traceback)
  # would run its __del__ at teardown, when its module globals are None, and
  # print an AttributeError. Its worker is stopped above, so disarm it.
  for manager in _service_managers():
    manager._process = None  # pylint: disable=protected-access
    type(manager).__del__ = lambda self: None


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


def worker_binary_path() -> str:
  """TFF's C++ worker; `<path> --port=N` serves one worker on port N."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  # Where TFF's local_cpp_executor_factory looks for it.
  return os.path.join(os.path.dirname(tff.__file__), 'data', _WORKER_NAME)


def parse_worker_addresses(addresses: str) -> tuple[str, ...]:
  """`host:port,host:port` -> ('host:port', ...); UsageError if malformed."""
  from pipeline.errors import UsageError  # pylint: disable=g-import-not-at-top
  parsed = []
  for address in (a.strip() for a in addresses.split(',') if a.strip()):
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise UsageError(f'--worker_addresses: {address!r} is not host:port '
                       '(e.g. localhost:8000)')
    parsed.append(address)
  return tuple(parsed)


def _remote_worker_context(address: str):
  """An async context on an already-running TFF worker at `address`."""
  import grpc  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.executor_stacks import executor_factory  # pylint: disable=g-import-not-at-top
  from tff_algos.runtime import tff_compiler  # pylint: disable=g-import-not-at-top
  # The channel options of TFF's own local factory (2 GB messages), which
  # TFF 0.87 keeps private; its remote-context helpers were removed.
  channel = grpc.insecure_channel(
      address, executor_factory._GRPC_CHANNEL_OPTIONS)  # pylint: disable=protected-access
  stub = tff.framework.RemoteExecutorGrpcStub(channel)

  def executor_fn(cardinalities):
    # As TFF's local factory does: computations without clients-placed
    # arguments still need a clients cardinality.
    cardinalities.setdefault(tff.CLIENTS, 0)
    executor = tff.framework.RemoteExecutor(stub)
    executor.set_cardinalities(cardinalities)
    return executor

  return tff.framework.AsyncExecutionContext(
      executor_fn=tff.framework.ResourceManagingExecutorFactory(executor_fn),
      compiler_fn=tff_compiler.compile_for_native_runtime,
      transform_args=tensorflow_computation.transform_args,
      transform_result=tensorflow_computation.transform_result)


def _local_worker_context(max_concurrent_computation_calls: int,
                          asynchronous: bool):
  """TFF's local C++ context (it starts its own `worker_binary`), compiling
  with `tff_compiler` instead of TFF's `desugar_and_transform_to_native`."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.executor_stacks import executor_factory  # pylint: disable=g-import-not-at-top
  from tff_algos.runtime import tff_compiler  # pylint: disable=g-import-not-at-top
  context_class = (tff.framework.AsyncExecutionContext if asynchronous else
                   tff.framework.SyncExecutionContext)
  return context_class(
      executor_fn=executor_factory.local_cpp_executor_factory(
          max_concurrent_computation_calls=max_concurrent_computation_calls),
      compiler_fn=tff_compiler.compile_for_native_runtime,
      transform_args=tensorflow_computation.transform_args,
      transform_result=tensorflow_computation.transform_result)


def _fix_mergeable_context_partitioning() -> None:
  """Fixes two bugs of TFF 0.87's mergeable context that scramble clients.

  1. `_partition_value` takes the partition bookkeeping of a struct from its
     *last* element, so when a non-CLIENTS value follows the clients' values
     (as in `next(server_state, client_inputs, server_seed)`) every sub-round
     gets the first sub-round's clients.
  2. `_invoke_after_merge_in_async_pool` concatenates the sub-rounds'
     CLIENTS-placed results in completion order, so client outputs (new
     client states) come back permuted against the client inputs.
  Both are private functions the module looks up at call time; the fixed
  versions below replace them. Idempotent.
  """
  from tensorflow_federated.python.common_libs import structure  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.execution_contexts import mergeable_comp_execution_context as mergeable  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.types import computation_types  # pylint: disable=g-import-not-at-top
  if getattr(mergeable, '_project_fixed', False):
    return
  partition_leaf = mergeable._partition_value  # pylint: disable=protected-access

  def partition_value(val, type_signature):
    if not isinstance(type_signature, computation_types.StructType):
      return partition_leaf(val, type_signature)
    elements = []
    advanced = val  # Bookkeeping of the element that held clients' values.
    for (_, value), (name, element_type) in zip(
        structure.iter_elements(structure.from_container(val.payload)),
        structure.iter_elements(type_signature)):
      result = partition_value(
          mergeable._PartitioningValue(  # pylint: disable=protected-access
              value, val.num_remaining_clients, val.num_remaining_partitions,
              val.last_client_index), element_type)
      elements.append((name, result.payload))
      if result.num_remaining_partitions != val.num_remaining_partitions:
        advanced = result
    return mergeable._PartitioningValue(  # pylint: disable=protected-access
        structure.Struct(elements), advanced.num_remaining_clients,
        advanced.num_remaining_partitions, advanced.last_client_index)

  async def after_merge_in_argument_order(comp, merge_result, arg_list,
                                          execution_contexts):
    def task_fn(indexed_arg, context):
      index, arg = indexed_arg

      async def run():
        return index, await mergeable._compute_after_merged(  # pylint: disable=protected-access
            comp, arg, merge_result, context)

      return asyncio.create_task(run())

    async def collect(results, indexed_result, context):
      del context
      return (*results, indexed_result)

    results, _ = await mergeable._run_in_async_context_pool(  # pylint: disable=protected-access
        task_fn, list(enumerate(arg_list)), execution_contexts, (), collect)
    return [result for _, result in sorted(results, key=lambda r: r[0])]

  mergeable._partition_value = partition_value  # pylint: disable=protected-access
  mergeable._invoke_after_merge_in_async_pool = after_merge_in_argument_order  # pylint: disable=protected-access
  mergeable._project_fixed = True  # pylint: disable=protected-access


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
  many sub-rounds, run one after another on each worker (0: one per worker).
  In all three cases TFF's mergeable execution context runs each sub-round up
  to the aggregation and merges the aggregates, so a computation must not
  feed one aggregation's result into another (TFF raises a ValueError when
  compiling one that does); SCAFFOLD's `next` is tested to give the
  one-worker results. A worker holds the values of one sub-round's clients
  at a time, which bounds its memory at large cohorts. Client-placed outputs
  computed before the aggregation (e.g. new client states) are recomputed
  after the merge, so stateful algorithms do their client work twice on this
  path.
  """
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from pipeline.errors import UsageError  # pylint: disable=g-import-not-at-top
  install_shutdown_hooks()
  if num_workers < 1:
    raise UsageError(f'--num_workers must be >= 1, got {num_workers}')
  if worker_addresses and num_workers != 1:
    raise UsageError('--num_workers starts local workers and '
                     '--worker_addresses uses running ones; pass one of them')
  if num_subrounds < 0:
    raise UsageError(f'--num_subrounds must be >= 0, got {num_subrounds}')
  _stop_context_workers()
  global _partitions
  mergeable = worker_addresses or num_workers > 1 or num_subrounds > 1
  _partitions = (num_subrounds or len(worker_addresses) or num_workers
                 if mergeable else 1)
  if mergeable:
    _fix_mergeable_context_partitioning()
  if worker_addresses:
    contexts = [_remote_worker_context(a) for a in worker_addresses]
  elif mergeable:
    # Each local context starts (and owns) its own worker_binary child.
    contexts = [_local_worker_context(max_concurrent_computation_calls,
                                      asynchronous=True)
                for _ in range(num_workers)]
  if mergeable:
    tff.backends.native.set_mergeable_comp_execution_context(
        contexts, num_subrounds=num_subrounds or None)
  else:
    tff.framework.set_default_context(_local_worker_context(
        max_concurrent_computation_calls, asynchronous=False))
  gc.collect()  # The replaced context's (unstarted) service manager.
