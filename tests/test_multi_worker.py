"""Clients split over several TFF workers give the one-worker run.

SCAFFOLD on the 4-client linear task (2 clients a round, so each of 2 workers
gets one): each client's new state is written by its own computation and
read in the next round, so a scrambled split would change the weights, the
server control variate and the stored c_i. Each client's update runs exactly
once per round (counted by a marker file its computation writes), and mixed
FL's central update once per round, not once per sub-round.
"""

import collections
import dataclasses
import errno
import os
import subprocess
import time

import numpy as np
import portpicker
import psutil
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from pipeline import driver
from pipeline import heap
from pipeline import tff_runtime
from pipeline.errors import EnvironmentFault
from pipeline.errors import UsageError
import scaffold_testlib as lib
from test_native_runtime import tiny_task
from tff_algos import tff_internals
from tff_algos.algorithms import registry
from tff_algos.algorithms.mixed import definition as mixed
from tff_algos.algorithms.scaffold import definition as scaffold

ROUNDS = 3


def _marker(directory: str) -> tf.Operation:
  """Writes an empty file with a random name into `directory`."""
  name = tf.strings.as_string(
      tf.random.uniform([], maxval=2**62, dtype=tf.int64))
  return tf.io.write_file(tf.strings.join([directory, '/', name]), '')


def counting_client_updates(definition, directory):
  """`definition` whose every client update also writes a marker file."""
  work = definition.client_work

  def finish(context, message, client_state, carry):
    _marker(directory)
    return work.finish(context, message, client_state, carry)

  return dataclasses.replace(definition, client_work=dataclasses.replace(
      work, finish=finish))


def counting_central_updates(definition, directory):
  central = definition.central

  def run(context, state, central_data):
    # The server update is a plain graph: ops run only when something
    # depends on them.
    with tf.control_dependencies([_marker(directory)]):
      return tf.nest.map_structure(tf.identity,
                                   central.run(context, state, central_data))

  return dataclasses.replace(definition, central=dataclasses.replace(
      central, run=run))


def _train(task, root, name, count_dir=None):
  definition = registry.build('scaffold', task, scaffold.ScaffoldSettings(
      client_learning_rate=lib.CLIENT_LR, server_learning_rate=lib.SERVER_LR))
  if count_dir is not None:
    definition = counting_client_updates(definition, str(count_dir))
  config = driver.RunConfig(
      root_output_dir=str(root), experiment_name=name, total_rounds=ROUNDS,
      clients_per_round=lib.CLIENTS_PER_ROUND, rounds_per_eval=ROUNDS,
      rounds_per_checkpoint=ROUNDS, seed=lib.SEED, export=False)
  result = driver.train(definition, task, config)
  client_states = dict(driver.committed_client_states(
      definition, task, config.run_dir).items())
  return result, client_states


def _flat(structure):
  return [np.asarray(x) for x in tf.nest.flatten(structure)]


def _assert_same_run(expected, actual):
  (expected_result, expected_states), (result, states) = expected, actual
  # Sub-rounds change only the order of float sums.
  for want, got in zip(_flat(expected_result.server_state),
                       _flat(result.server_state)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert sorted(states) == sorted(expected_states)
  assert len(states) > lib.CLIENTS_PER_ROUND  # States of several rounds.
  for client_id, want in expected_states.items():
    for w, g in zip(_flat(want), _flat(states[client_id])):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert result.last_metrics['train/loss'] == pytest.approx(
      expected_result.last_metrics['train/loss'], rel=1e-5)


def _worker_pids():
  return {p.pid for p in tff_runtime._worker_children()}  # pylint: disable=protected-access


@pytest.fixture(scope='module')
def task():
  return lib.build_linear_task()


@pytest.fixture(scope='module')
def one_worker_run(task, tmp_path_factory):
  return _train(task, tmp_path_factory.mktemp('one_worker'), 'scaffold')


@pytest.fixture(scope='module')
def two_sub_rounds_run(task, tmp_path_factory):
  """The one-worker run in 2 sub-rounds, and how many client updates it
  ran."""
  tff_runtime.configure_execution(num_subrounds=2)
  try:
    root = tmp_path_factory.mktemp('two_sub_rounds')
    counts = root / 'client_updates'
    counts.mkdir()
    run = _train(task, root, 'scaffold', counts)
    return run, len(os.listdir(counts))
  finally:
    tff_runtime.configure_execution()


def _assert_identical_runs(expected, actual):
  (expected_result, expected_states), (result, states) = expected, actual
  for want, got in zip(_flat(expected_result.server_state),
                       _flat(result.server_state)):
    np.testing.assert_array_equal(got, want)
  assert sorted(states) == sorted(expected_states)
  for client_id, want in expected_states.items():
    for w, g in zip(_flat(want), _flat(states[client_id])):
      np.testing.assert_array_equal(g, w)
  def values(metrics):
    return {k: v for k, v in metrics.items() if not k.endswith('_seconds')}

  assert values(result.last_metrics) == values(expected_result.last_metrics)


@pytest.fixture
def restore_default_context():
  workers_before = _worker_pids()
  yield
  tff_runtime.configure_execution()
  # The multi-worker context's local workers were stopped with it.
  assert _worker_pids() <= workers_before


def test_num_workers_splits_rounds_over_local_workers(
    restore_default_context):
  # The numbers of a split run are checked on loopback workers below; this
  # path differs only in letting TFF start the workers (one compile of the
  # mergeable form costs minutes on a loaded 2-core machine, so not twice).
  del restore_default_context
  tff_runtime.configure_execution(num_workers=3)
  context = tff.framework.get_context_stack().current
  assert isinstance(context, tff.framework.MergeableCompExecutionContext)
  assert len(context._async_execution_contexts) == 3  # pylint: disable=protected-access


def test_two_remote_workers_on_loopback_give_the_one_worker_run(
    task, one_worker_run, two_sub_rounds_run, tmp_path,
    restore_default_context):
  del restore_default_context
  ports = [portpicker.pick_unused_port() for _ in range(2)]
  workers = [subprocess.Popen(
      [tff_runtime.worker_binary_path(), f'--port={port}'],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      stdin=subprocess.DEVNULL) for port in ports]
  try:
    tff_runtime.configure_execution(
        worker_addresses=tff_runtime.parse_worker_addresses(
            ','.join(f'localhost:{port}' for port in ports)))
    counts = tmp_path / 'client_updates'
    counts.mkdir()
    run = _train(task, tmp_path, 'scaffold', counts)
    # Every client update ran once, on one of the workers.
    assert len(os.listdir(counts)) == ROUNDS * lib.CLIENTS_PER_ROUND
    for worker in workers:
      # Both served computations (TFF's worker grows once it has run one).
      assert worker.poll() is None
      assert psutil.Process(worker.pid).cpu_times().user > 0
  finally:
    for worker in workers:
      worker.kill()
    for worker in workers:
      worker.wait(timeout=30)
  _assert_same_run(one_worker_run, run)
  # Sub-rounds merge in their order, whichever worker finishes first: the
  # bits of the same sub-rounds on one worker.
  _assert_identical_runs(two_sub_rounds_run[0], run)
  time.sleep(0.1)
  assert all(not psutil.pid_exists(w.pid) or
             psutil.Process(w.pid).status() == psutil.STATUS_ZOMBIE
             for w in workers)


@pytest.mark.time_limit(120)
def test_a_remote_worker_that_stops_is_an_error_not_a_hang(
    restore_default_context, monkeypatch):
  # TFF retried the call forever: training hung at 0% CPU.
  del restore_default_context
  port = portpicker.pick_unused_port()
  worker = subprocess.Popen(
      [tff_runtime.worker_binary_path(), f'--port={port}'],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      stdin=subprocess.DEVNULL)
  try:
    tff_runtime.configure_execution(worker_addresses=(f'localhost:{port}',))
    add_one = tff.tensorflow.computation(lambda x: x + 1, np.int32)
    assert add_one(1) == 2
    # The wait for a stopped worker to answer again, shortened (read at
    # each call): the test waits for it in full.
    monkeypatch.setattr(tff_runtime, 'REMOTE_CONNECT_SECONDS', 1)
    worker.kill()
    worker.wait(timeout=30)
    with pytest.raises(EnvironmentFault, match='stopped answering'):
      add_one(2)
  finally:
    worker.kill()
    worker.wait(timeout=30)


def test_sub_rounds_on_one_worker_give_the_one_worker_run(
    one_worker_run, two_sub_rounds_run, restore_default_context):
  del restore_default_context
  tff_runtime.configure_execution(num_subrounds=2)
  context = tff.framework.get_context_stack().current
  assert len(context._async_execution_contexts) == 1  # pylint: disable=protected-access
  run, client_updates = two_sub_rounds_run
  _assert_same_run(one_worker_run, run)
  assert client_updates == ROUNDS * lib.CLIENTS_PER_ROUND


class _DelayedContext:
  """A sync context whose calls start `seconds` late."""

  def __init__(self, context, seconds):
    self._context, self._seconds = context, seconds

  def invoke(self, comp, arg):
    time.sleep(self._seconds)
    return self._context.invoke(comp, arg)


def test_sub_rounds_merge_in_their_order_not_as_they_finish(
    restore_default_context):
  # One client per sub-round; float32 sums whose value depends on the order:
  # (1e8 + 1) - 1e8 = 0 in sub-round order, (-1e8 + 1e8) + 1 = 1 in the
  # order these finish (sub-round 2 first, then 0, then 1).
  del restore_default_context
  tff_runtime.configure_execution(num_subrounds=3)  # Installs the fixes.
  worker = tff_runtime._local_worker()  # pylint: disable=protected-access
  lanes = [tff_internals.threaded_async_context(_DelayedContext(
      tff_runtime._native_context(worker, asynchronous=False), seconds))  # pylint: disable=protected-access
           for seconds in (0.5, 1.5, 0.0)]
  context = tff.backends.native.create_mergeable_comp_execution_context(
      lanes, num_subrounds=3)

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def total(values):
    return tff.federated_sum(values)

  try:
    with tff.framework.get_context_stack().install(context):
      assert total([1e8, 1.0, -1e8]) == 0.0
  finally:
    tff_runtime.shutdown_workers()  # This test's worker, too.


def _sums_and_mean():
  values = tff.FederatedType(collections.OrderedDict(
      x=tff.TensorType(np.float32, [3]), n=tff.TensorType(np.int32)),
      tff.CLIENTS)

  @tff.federated_computation(tff.FederatedType(np.float32, tff.SERVER),
                             values)
  def sums_and_mean(server_value, client_values):
    return (tff.federated_sum(client_values.x),
            tff.federated_sum(client_values.n),
            tff.federated_mean(client_values.x), server_value)

  return sums_and_mean


def test_sum_merges_are_made_in_this_process_with_the_workers_bits(
    monkeypatch, restore_default_context):
  # Three clients in three sub-rounds: two merges. The first adds two normal
  # floats into a subnormal one, which TF's add (the worker's) flushes to
  # zero and NumPy's would keep; the int32 sum wraps around.
  del restore_default_context
  tff_runtime.configure_execution(num_subrounds=3)
  rng = np.random.default_rng(0)
  clients = [collections.OrderedDict(
      x=np.asarray([*rng.normal(size=2), tiny], np.float32), n=np.int32(2**30))
             for tiny in (1.5e-38, -1.4e-38, 0.0)]
  sums_and_mean = _sums_and_mean()
  local_merges = []
  add_leafwise = tff_internals._add_leafwise  # pylint: disable=protected-access
  monkeypatch.setattr(tff_internals, '_add_leafwise', lambda *args: (
      local_merges.append(1), add_leafwise(*args))[1])
  local = sums_and_mean(np.float32(2.0), clients)
  assert len(local_merges) == 2
  monkeypatch.setattr(tff_internals, '_reads_as_leafwise_sum',
                      lambda merge: False)
  tff_internals._LEAFWISE_SUMS.clear()  # pylint: disable=protected-access
  on_worker = sums_and_mean(np.float32(2.0), clients)
  assert len(local_merges) == 2  # This call's merges ran on the worker.
  for got, want in zip(tf.nest.flatten(local), tf.nest.flatten(on_worker)):
    assert np.asarray(got).dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(got, want)
  assert local[0][2] == 0.0  # 1e-39 flushed to zero, as the worker does.
  assert local[1] == np.int32(-2**31 + 2**30)  # Wrapped, as TF's does.


def _pair_sum(a, b):
  return a[0] + b[0], a[1] + b[1]


def _merge_of(merge_fn, value=tff.TensorType(np.float32, [3]),
              accumulate=lambda a, b: a + b):

  @tff.federated_computation(tff.FederatedType(value, tff.CLIENTS))
  def aggregate(values):
    return tff.federated_aggregate(
        values, _zeros(value),
        tff.tensorflow.computation(accumulate, value, value),
        tff.tensorflow.computation(merge_fn, value, value),
        tff.tensorflow.computation(lambda a: a, value))

  return tff_internals.merge_computation(aggregate)


def _zeros(value):
  if isinstance(value, tff.StructType):
    return tuple(_zeros(element) for element in value)
  return np.zeros(value.shape, value.dtype)


def _checked_sum(a, b):
  with tf.control_dependencies([tf.debugging.assert_less(a + b, 100.0)]):
    return tf.identity(a + b)


def test_only_a_leafwise_sum_is_merged_in_this_process():
  assert tff_internals.adds_leafwise(_merge_of(lambda a, b: a + b))
  # b + a: the same sum but for which NaN it returns; a call to a worker.
  for merge_fn in (lambda a, b: tf.maximum(a, b), lambda a, b: a - b,
                   lambda a, b: a + a, lambda a, b: b + a,
                   lambda a, b: 2.0 * (a + b), lambda a, b: a + b + 1.0,
                   lambda a, b: tf.reverse(a + b, [0]), _checked_sum):
    assert not tff_internals.adds_leafwise(_merge_of(merge_fn)), merge_fn
  pair = tff.StructType([tff.TensorType(np.float32, [3]),
                         tff.TensorType(np.float32, [3])])
  assert tff_internals.adds_leafwise(_merge_of(_pair_sum, pair, _pair_sum))
  for crossed in (lambda a, b: (a[1] + b[1], a[0] + b[0]),
                  lambda a, b: (a[0] + b[1], a[1] + b[0])):
    assert not tff_internals.adds_leafwise(_merge_of(crossed, pair,
                                                     _pair_sum))


def test_central_update_runs_once_per_round_with_sub_rounds(
    tmp_path, restore_default_context):
  # 2-w GT's central update runs alongside the clients: with sub-rounds as
  # computations of its own beside them, on one worker inside the round's
  # computation. Both run it once a round and give the same model.
  del restore_default_context
  task = tiny_task(client_steps=2)
  rounds = 2
  results = {}
  for name, num_subrounds in (('sub_rounds', 2), ('one_worker', 0)):
    tff_runtime.configure_execution(num_subrounds=num_subrounds)
    counts = tmp_path / f'central_updates_{name}'
    counts.mkdir()
    definition = counting_central_updates(
        registry.build('mixed_2wgt', task, mixed.TwoWayGtSettings(
            client_learning_rate=0.3, central_learning_rate=0.2)),
        str(counts))
    results[name] = driver.train(definition, task, driver.RunConfig(
        root_output_dir=str(tmp_path), experiment_name=name,
        total_rounds=rounds, clients_per_round=4, rounds_per_eval=rounds,
        rounds_per_checkpoint=rounds, export=False))
    assert len(os.listdir(counts)) == rounds
  # Sub-rounds change only the order of float sums.
  for want, got in zip(_flat(results['one_worker'].server_state),
                       _flat(results['sub_rounds'].server_state)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert any(np.any(x != 0) for x in _flat(
      results['one_worker'].server_state['gtilde_f']))


@pytest.mark.parametrize('addresses', ['localhost', 'localhost:port',
                                       'localhost:8000,:8001', 'h:70000'])
def test_malformed_worker_address_is_a_usage_error(addresses):
  with pytest.raises(UsageError, match='--worker_addresses'):
    tff_runtime.parse_worker_addresses(addresses)


def test_an_out_of_range_port_is_named():
  with pytest.raises(UsageError, match=r"the port of 'h:70000' is out of "
                     r'range \(1-65535\)'):
    tff_runtime.parse_worker_addresses('h:70000')


def test_another_grpc_server_is_not_taken_for_a_worker():
  # It accepts the connection; TFF's first call in the round then failed
  # with UNIMPLEMENTED and a traceback.
  import grpc  # pylint: disable=g-import-not-at-top
  from concurrent import futures  # pylint: disable=g-import-not-at-top
  server = grpc.server(futures.ThreadPoolExecutor(1))
  port = server.add_insecure_port('localhost:0')
  server.start()
  try:
    with pytest.raises(EnvironmentFault,
                       match=f'the server at localhost:{port} is not a TFF '
                       'worker'):
      tff_runtime.configure_execution(
          worker_addresses=(f'localhost:{port}',))
  finally:
    server.stop(None)


def test_worker_addresses_are_parsed():
  assert tff_runtime.parse_worker_addresses(' a:1, 10.0.0.2:8000 ,') == (
      'a:1', '10.0.0.2:8000')


def test_bad_worker_counts_are_usage_errors():
  with pytest.raises(UsageError, match='--num_workers'):
    tff_runtime.configure_execution(num_workers=0)
  with pytest.raises(UsageError, match='one of them'):
    tff_runtime.configure_execution(num_workers=2,
                                    worker_addresses=('localhost:1',))
  with pytest.raises(UsageError, match='--num_subrounds'):
    tff_runtime.configure_execution(num_subrounds=-1)
  # Remote workers' caps are their own: the flag was ignored.
  with pytest.raises(UsageError, match='starts none'):
    tff_runtime.configure_execution(4, worker_addresses=('localhost:1',))


def test_running_out_of_file_descriptors_is_an_environment_fault(
    monkeypatch):
  # Each worker's context holds an event loop's descriptors: at
  # --num_workers=100000 the OSError (EMFILE) was a traceback, and so was
  # the shutdown's listing of the workers after it.
  def out_of_descriptors(context):
    del context
    raise OSError(errno.EMFILE, 'Too many open files')

  monkeypatch.setattr(tff_internals, 'threaded_async_context',
                      out_of_descriptors)
  with pytest.raises(EnvironmentFault, match=(
      r'^cannot set up the TFF contexts of 2 workers: Too many open files '
      r'\(each worker takes file descriptors of its own\); use fewer '
      r'workers, or raise the limit \(ulimit -n\)$')) as raised:
    tff_runtime.configure_execution(num_workers=2)
  assert raised.value.__context__ is None  # No traceback of its OSError.
  monkeypatch.undo()
  tff_runtime.configure_execution()


def test_worker_listing_out_of_file_descriptors_is_empty(monkeypatch):
  def out_of_descriptors(*args, **kwargs):
    raise OSError(errno.EMFILE, 'Too many open files', '/proc/1/stat')

  monkeypatch.setattr(psutil, 'Process', out_of_descriptors)
  assert tff_runtime._worker_children() == []  # pylint: disable=protected-access
  tff_runtime.shutdown_workers()


def test_replacing_the_context_does_not_wait_on_an_unresponsive_worker():
  # TFF's ServiceManager.__del__ sends SIGINT to its worker and waits with no
  # timeout; twice a suite run hung there when a context was replaced. A
  # stopped worker reacts to no signal but SIGKILL.
  tff_runtime.configure_execution()
  add_one = tff.tensorflow.computation(lambda x: x + 1, np.int32)
  # Workers of this process that are not the new context's (e.g. another
  # test's loopback workers on their way out) are not this test's.
  others = {w.pid for w in tff_runtime._worker_children()}  # pylint: disable=protected-access
  assert add_one(1) == 2  # Starts the context's worker.
  (worker,) = [w for w in tff_runtime._worker_children()  # pylint: disable=protected-access
               if w.pid not in others]
  worker.suspend()
  started = time.monotonic()
  tff_runtime.configure_execution()
  assert time.monotonic() - started < 30
  assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
  assert add_one(2) == 3  # The new context starts a fresh worker.


def test_readme_worker_path_command_prints_the_path_and_nothing_else():
  """The README's `WORKER=$(...)` line: the worker's path on stdout, and no
  TensorFlow start-up lines on the user's terminal."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(repo, 'README.md'), encoding='utf-8') as f:
    line = next(l for l in f if l.startswith('WORKER=$('))
  command = line[len('WORKER=$('):line.rindex(')')]
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  result = subprocess.run(command, shell=True, cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr
  assert result.stderr == ''
  path = result.stdout.strip()
  assert os.access(path, os.X_OK) and os.path.basename(path) == 'worker_binary'


def _started_worker_environment() -> dict:
  """The environment of a local worker started now (then shut down)."""
  before = {p.pid for p in psutil.Process().children(recursive=True)}
  try:
    tff_runtime._local_worker()()  # pylint: disable=protected-access
    started = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and
               tff_runtime.worker_binary_path() in p.cmdline()]
    assert len(started) == 1, started
    return started[0].environ()
  finally:
    tff_runtime.shutdown_workers()


def test_a_local_worker_keeps_freed_heap_memory_as_the_driver_does(
    monkeypatch, restore_default_context):
  # glibc reads the thresholds from its environment at the worker's start;
  # a value the user set stays.
  del restore_default_context
  monkeypatch.delenv('MALLOC_TRIM_THRESHOLD_', raising=False)
  monkeypatch.setenv('MALLOC_MMAP_THRESHOLD_', '65536')
  environment = _started_worker_environment()
  assert environment.get('MALLOC_TRIM_THRESHOLD_') == str(
      heap.TRIM_THRESHOLD_BYTES)
  assert environment.get('MALLOC_MMAP_THRESHOLD_') == '65536'


@pytest.mark.parametrize('user_value, expected', [(None, '1'), ('2', '2')])
def test_a_local_worker_splits_no_op_over_threads_unless_the_user_says(
    monkeypatch, restore_default_context, user_value, expected):
  # Its groups already take a core each; an op's shards waited behind them.
  del restore_default_context
  variable = tff_runtime.INTRA_OP_THREADS_VARIABLE
  if user_value is None:
    monkeypatch.delenv(variable, raising=False)
  else:
    monkeypatch.setenv(variable, user_value)
  assert _started_worker_environment().get(variable) == expected
