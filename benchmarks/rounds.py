r"""Cost of a round: this project's runtimes vs naive TFF vs plain TF.

On a CelebA-shaped synthetic task (84x84x3 images, flatten + Dense(64, relu)
+ Dense(1), 1.35M parameters; K=--client_steps local steps of
--client_batch_size examples), times rounds several ways on this machine,
each in its own process:

  (a) tff:    this project's driver (pipeline/driver.py) on TFF's C++
              runtime: clients passed by id, each group of clients one
              compiled computation that builds their datasets and reads and
              writes their states itself; `round_seconds` from metrics.csv,
              so evaluation and checkpointing are left out;
      native: the same driver and round definition with --runtime=native
              (in-process TF, the whole cohort one computation);
  (b) naive:  `tff.learning.algorithms.build_weighted_fed_avg` fed a Python
              list of the sampled clients' tf.data datasets each round, as
              TFF's tutorials do (FedAvg only);
  central:    mixed FL's central work alone (its central data's batches and
              the central update on the initial server state), in-process as
              the native runtime runs it: what a mixed FL round does on top of
              the clients' work. With it, (a) also runs FedAvg on mixed FL's
              federated clients (composite clients of three raw clients,
              smiling images only), and each mixed round is written as that
              FedAvg round times x plus its central work;
  (c) bound:  the same client steps and server update in-process, no TFF:
              one tf.function per client update (its dataset built
              in-graph), the clients spread over one thread per CPU, then
              the average; with grappler off, which only costs time here.
              FedAvg; SCAFFOLD (Option II) with each client's c_i, and
              FedResAvg (--fedres_option) with its theta_i (and c_i), read from and
              written to a file on local disk, as (a) does. A stateful
              algorithm's (c) minus FedAvg's (c) is its extra work, and its
              (a) round is written as FedAvg's (a) round times x plus that.

FedRes runs on the same task with a personal model of 12.5% of the global
model's size (flatten + Dense(8) + Dense(1)); mixed FL's central data are
raw clients kept out of the federated population.

The first --warmup_rounds of every run (tracing/compilation) are not timed;
a run's time per round is the median of the timed rounds, and so is its CPU
time per round (user + system of the measuring child and its TFF workers;
it leaves out the time other work on a shared machine takes from the run,
though it still moves with that work's load). Peak RSS is that
of the measuring child process plus its TFF worker processes, sampled every
0.2 s. The runs: FedAvg at --clients_per_round in every mode, then each of
--sweep_algorithms at each of --sweep_clients in the modes that run it. Then
a table of rounds/s (peak RSS), each algorithm's round time, CPU time and peak
RSS over FedAvg's in the same mode and cohort size, and, when (a), (b) and (c) ran,

  ratio_tff_over_bound=<(a)/(c)> ratio_naive_over_tff=<(b)/(a)> peak_rss_mb=<(a)>

for --clients_per_round clients (the line before it gives
ratio_naive_over_bound=<(b)/(c)>, the ceiling of (b)/(a) on this task).

  python -m benchmarks.rounds --quick        # small sizes: ~2 min idle
  python -m benchmarks.rounds --modes=tff,native,bound \
      --clients_per_round=100 --sweep_clients=100 \
      --sweep_algorithms=fedavg,scaffold,fedres_avg,mixed_2wgt  # README
  python -m benchmarks.rounds --modes=tff,native --sweep_clients=1000 \
      --clients_per_subround=100 --sweep_algorithms=...  # 1000 clients
  python -m benchmarks.rounds ... --run_root=/dev/shm  # states on a tmpfs
  python -m benchmarks.rounds ... --repeats=3  # medians of 3 alternated runs
"""

import concurrent.futures
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from absl import flags

from binaries import app  # First: imports TensorFlow quietly.
from benchmarks import report
from binaries import process_memory
from pipeline import interrupts
from pipeline import tff_runtime
from pipeline.errors import ENVIRONMENT_ERRNOS
from pipeline.errors import EnvironmentFault
from pipeline.errors import UsageError
# Imported before absl parses flags: TF imported later, inside main, builds
# Keras models as if executing eagerly and fails.
import tensorflow as tf  # pylint: disable=g-bad-import-order
from tff_algos.algorithms import sgd_step  # pylint: disable=g-bad-import-order
from tff_algos.runtime import client_states  # pylint: disable=g-bad-import-order

_CLIENTS_PER_ROUND = flags.DEFINE_integer(
    'clients_per_round', 100, 'Clients per round of the headline ratios.')
_SWEEP_CLIENTS = flags.DEFINE_list(
    'sweep_clients', ['100'],
    'Clients per round of the rounds/s sweep (empty: no sweep).')
_SWEEP_ALGORITHMS = flags.DEFINE_list(
    'sweep_algorithms', ['fedavg', 'scaffold', 'fedres_avg', 'mixed_2wgt'],
    'Algorithms the sweep measures, in every mode that runs them.')
_NAIVE_MAX_CLIENTS = flags.DEFINE_integer(
    'naive_max_clients', 100,
    'The naive baseline (b) is swept only up to this many clients (it '
    'serializes every dataset each round).')
_ROUNDS = flags.DEFINE_integer('rounds', 4, 'Timed rounds per run.')
_WARMUP_ROUNDS = flags.DEFINE_integer(
    'warmup_rounds', 1, 'Untimed first rounds per run (tracing).')
_CLIENT_STEPS = flags.DEFINE_integer('client_steps', 2, 'K local steps.')
_CLIENT_BATCH_SIZE = flags.DEFINE_integer('client_batch_size', 5,
                                          'Client batch size.')
_POPULATION = flags.DEFINE_integer(
    'population', 2000,
    'Train clients of the synthetic task (>= every clients per round).')
_MAX_CONCURRENT_CALLS = flags.DEFINE_integer(
    'max_concurrent_computation_calls', -1,
    'Passed to TFF\'s C++ runtime in (a) and (b) (<= 0: no cap).',
    upper_bound=tff_runtime.MAX_WORKER_CALLS)
_NUM_WORKERS = flags.DEFINE_integer(
    'num_workers', 1, 'Local TFF worker processes of the driver runs (a).')
_CLIENTS_PER_SUBROUND = flags.DEFINE_integer(
    'clients_per_subround', 0,
    '(a) and the sweep\'s driver runs: rounds with more clients run as '
    'sub-rounds of at most this many (train.py --num_subrounds), which bounds '
    'the worker\'s memory. 0: no sub-rounds.')
_FEDRES_OPTION = flags.DEFINE_enum(
    'fedres_option', '2', ['1', '2'],
    'FedResAvg\'s option in every mode: 2 (control variates c_i, the '
    'default) or 1 (c = c_i = 0: its state is theta_i alone).')
_CLIENTS_PER_GROUP = flags.DEFINE_integer(
    'clients_per_group', 0,
    'Driver runs (a): clients per compiled group (train.py '
    '--clients_per_group; 0: automatic).')
_BOUND_THREADS = flags.DEFINE_integer(
    'bound_threads', 0,
    'Threads running (c)\'s clients concurrently (0: one per CPU).')
_RUN_ROOT = flags.DEFINE_string(
    'run_root', None,
    'Where each run\'s directory (its client-state store and (c)\'s state '
    'files included) is made; default the system\'s temporary directory. A '
    'tmpfs (e.g. /dev/shm) leaves the file system out of the client-state '
    'store\'s cost.')
_MODES = flags.DEFINE_list(
    'modes', ['tff', 'native', 'naive', 'bound'],
    'Which of (a) tff and native, (b) naive, (c) bound and central (mixed '
    'FL\'s central work alone) to measure. The ratio lines need tff, naive '
    'and bound.')
_REPEATS = flags.DEFINE_integer(
    'repeats', 1, 'Runs of the whole set of measurements, every other one in '
    'reverse order (A B, B A, ...). With more than one, each figure is the '
    'median over the repeats and each ratio to FedAvg the median of the '
    'repeats\' ratios, with all of them listed: on a noisy machine one pair '
    'of runs can be off by 20%.')
_QUICK = flags.DEFINE_boolean(
    'quick', False,
    'Small sizes (10 clients, 1 timed round, no sweep) to check the '
    'benchmark runs; the numbers are not the README\'s.')
MODES = ('tff', 'native', 'naive', 'bound', 'central')
_CHILD = flags.DEFINE_enum('child', None, MODES,
                           'Internal: the run to measure.')
_CHILD_CLIENTS = flags.DEFINE_integer('child_clients', None, 'Internal.')
_CHILD_ALGORITHM = flags.DEFINE_string('child_algorithm', 'fedavg', 'Internal.')
_OUTPUT_DIR = flags.DEFINE_string('child_output_dir', None, 'Internal.')

FLAGS = flags.FLAGS
RESULT_PREFIX = 'BENCHMARK_RESULT '
# The algorithms each mode can run (None: every algorithm).
MODE_ALGORITHMS = {'tff': None, 'native': None, 'naive': ('fedavg',),
                   'bound': ('fedavg', 'scaffold', 'fedres_avg'),
                   'central': ('mixed_pt', 'mixed_1wgt', 'mixed_2wgt')}
CLIENT_LEARNING_RATE = 0.01
SERVER_LEARNING_RATE = 1.0
FEDRES_LOCAL_LEARNING_RATE = 0.01  # lambda, FedRes's default.
# FedAvg on mixed FL's federated clients (composite clients of three raw
# ones, smiling images only: `celeba_mode=fl_only`), the base a mixed round's
# client work compares with; run with mode central.
FEDAVG_ON_MIXED_CLIENTS = 'fedavg_on_mixed_clients'


def _registry_name(algorithm: str) -> str:
  return 'fedavg' if algorithm == FEDAVG_ON_MIXED_CLIENTS else algorithm


# ---------------------------------------------------------------- children --


def _data_config(algorithm: str):
  from tasks import base  # pylint: disable=g-import-not-at-top
  mixed = algorithm.startswith('mixed')
  mixed_clients = mixed or algorithm == FEDAVG_ON_MIXED_CLIENTS
  if mixed:
    mode = 'mixed'
  else:
    mode = 'fl_only' if mixed_clients else 'federated'
  return base.DataConfig(
      client_batch_size=_CLIENT_BATCH_SIZE.value,
      client_steps=_CLIENT_STEPS.value,
      central_batch_size=_CLIENT_BATCH_SIZE.value * _CHILD_CLIENTS.value,
      central_steps=_CLIENT_STEPS.value,
      use_synthetic_data=True,
      options={
          # Mixed FL needs central data: its composite clients are three raw
          # clients each, so the raw population is three times larger.
          'celeba_mode': mode,
          'synthetic_train_clients': _POPULATION.value * (
              3 if mixed_clients else 1),
      })


def _local_model() -> tf.keras.Model:
  """FedRes's personal model here: 12.5% of the global model's size."""
  from tasks import celeba  # pylint: disable=g-import-not-at-top
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=celeba.IMAGE_SHAPE),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(
          8, activation='relu',
          kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1)),
      tf.keras.layers.Dense(1, kernel_initializer='zeros'),
  ])


def _task(algorithm: str):
  """The CelebA-shaped task; FedRes's gets a personal model of its own."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from tasks import celeba  # pylint: disable=g-import-not-at-top
  from tasks import registry as tasks  # pylint: disable=g-import-not-at-top
  from tasks import residual  # pylint: disable=g-import-not-at-top
  task = tasks.build_task('celeba_smile', _data_config(algorithm))
  if not algorithm.startswith('fedres'):
    return task
  spec = residual.ResidualModelSpec(
      global_model_fn=celeba.build_keras_model,
      local_model_fn=_local_model,
      split_inputs=lambda x: (x, x),
      input_spec=task.batch_spec[0],
      loss_fn=task.loss_fn,
      metrics_fn=task.metrics_fn)
  return dataclasses.replace(
      task, residual_spec=spec,
      keras_model_fn=lambda: residual.global_only_model(spec))


def _settings(algorithm: str):
  """The algorithm's defaults with the benchmark's learning rates."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from tff_algos.algorithms import registry  # pylint: disable=g-import-not-at-top
  settings_class = registry.settings_class(_registry_name(algorithm))
  values = dict(client_learning_rate=CLIENT_LEARNING_RATE,
                server_learning_rate=SERVER_LEARNING_RATE,
                central_learning_rate=CLIENT_LEARNING_RATE *
                SERVER_LEARNING_RATE,
                central_batch_size=_CLIENT_BATCH_SIZE.value *
                _CHILD_CLIENTS.value,
                fedres_option=int(_FEDRES_OPTION.value))
  names = {field.name for field in dataclasses.fields(settings_class)}
  return settings_class(**{k: v for k, v in values.items() if k in names})


def _timed(round_seconds: list[float]) -> list[float]:
  return round_seconds[_WARMUP_ROUNDS.value:]


def _num_subrounds() -> int:
  per_subround = _CLIENTS_PER_SUBROUND.value
  if per_subround <= 0 or _CHILD_CLIENTS.value <= per_subround:
    return 0
  return -(-_CHILD_CLIENTS.value // per_subround)


class _RoundCpu:
  """CPU seconds (user + system) of each round of a measuring child, with
  its TFF workers': the readings' differences from a round's start (or the
  previous round's end) to its end."""

  def __init__(self):
    self.seconds = []
    self._last = None

  def _read(self) -> float:
    import psutil  # pylint: disable=g-import-not-at-top
    return process_memory.cpu_seconds(psutil.Process())

  def round_started(self) -> None:
    self._last = self._read()

  def round_ended(self) -> None:
    now = self._read()
    self.seconds.append(now - self._last)
    self._last = now


_ROUND_CPU = _RoundCpu()


def _run_driver(runtime: str) -> list[float]:
  """(a): the driver's per-round seconds (eval and checkpoint excluded)."""
  import csv  # pylint: disable=g-import-not-at-top
  from pipeline import driver  # pylint: disable=g-import-not-at-top
  from tff_algos.algorithms import registry  # pylint: disable=g-import-not-at-top
  if runtime == 'tff':
    tff_runtime.configure_execution(_MAX_CONCURRENT_CALLS.value,
                                    num_workers=_NUM_WORKERS.value,
                                    num_subrounds=_num_subrounds())
  algorithm = _CHILD_ALGORITHM.value
  task = _task(algorithm)
  definition = registry.build(_registry_name(algorithm), task,
                              _settings(algorithm))
  total_rounds = _WARMUP_ROUNDS.value + _ROUNDS.value
  config = driver.RunConfig(
      root_output_dir=_OUTPUT_DIR.value, experiment_name=algorithm,
      total_rounds=total_rounds, clients_per_round=_CHILD_CLIENTS.value,
      rounds_per_eval=total_rounds, rounds_per_checkpoint=total_rounds,
      clients_per_group=_CLIENTS_PER_GROUP.value, export=False,
      runtime=runtime)
  def round_ended(round_num):
    del round_num
    _ROUND_CPU.round_ended()
    return {}  # No metrics: only the reading.

  # The driver calls it after each round (its evaluation and checkpoint
  # follow), so a round's CPU runs from the previous round's reading.
  _ROUND_CPU.round_started()
  driver.train(definition, task, config, round_metrics=round_ended)
  with open(os.path.join(config.run_dir, 'metrics.csv')) as f:
    return [float(row['round_seconds']) for row in csv.DictReader(f)]


def _run_central_alone() -> list[float]:
  """central: per round, the central work alone (native runtime's)."""
  from pipeline import driver  # pylint: disable=g-import-not-at-top
  from tff_algos.algorithms import registry  # pylint: disable=g-import-not-at-top
  from tff_algos.runtime import native  # pylint: disable=g-import-not-at-top
  algorithm = _CHILD_ALGORITHM.value
  task = _task(algorithm)
  process = driver.compose_process(
      registry.build(_registry_name(algorithm), task, _settings(algorithm)),
      task,
      runtime='native')
  state = process.initialize()
  seconds = []
  for round_num in range(_WARMUP_ROUNDS.value + _ROUNDS.value):
    started = time.perf_counter()
    _ROUND_CPU.round_started()
    native.to_numpy(process.central_result(
        state, driver.plan_round(0, round_num, task.num_train_clients,
                                 _CHILD_CLIENTS.value).server_seed))
    seconds.append(time.perf_counter() - started)
    _ROUND_CPU.round_ended()
  return seconds


def _sampled_ids(task, round_num: int):
  from pipeline import driver  # pylint: disable=g-import-not-at-top
  plan = driver.plan_round(0, round_num, task.num_train_clients,
                           _CHILD_CLIENTS.value)
  return [task.train_client_ids[i] for i in plan.client_indices], plan


def _run_naive_tff() -> list[float]:
  """(b): build_weighted_fed_avg on a Python list of datasets per round."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tasks import celeba  # pylint: disable=g-import-not-at-top
  tff_runtime.configure_execution(_MAX_CONCURRENT_CALLS.value)
  config = _data_config('fedavg')
  train, _ = celeba._load_client_data(config)  # pylint: disable=protected-access
  task = celeba.build_task(config)
  process = tff.learning.algorithms.build_weighted_fed_avg(
      task.model_fn,
      client_optimizer_fn=tff.learning.optimizers.build_sgdm(
          CLIENT_LEARNING_RATE),
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(
          SERVER_LEARNING_RATE))
  state = process.initialize()
  seconds = []
  for round_num in range(1, _WARMUP_ROUNDS.value + _ROUNDS.value + 1):
    started = time.perf_counter()
    _ROUND_CPU.round_started()
    ids, plan = _sampled_ids(task, round_num)
    # The tutorials' make_federated_data: one preprocessed dataset per
    # sampled client, built in Python.
    datasets = [
        train.create_tf_dataset_for_client(cid).shuffle(
            config.shuffle_buffer, seed=int(seed)).repeat().batch(
                config.client_batch_size).take(config.client_steps).map(
                    celeba._to_batch)  # pylint: disable=protected-access
        for cid, seed in zip(ids, plan.client_seeds)]
    state = process.next(state, datasets).state
    seconds.append(time.perf_counter() - started)
    _ROUND_CPU.round_ended()
  return seconds


class _StateFiles:
  """(c)'s per-client state: one file per client and round on local disk.

  The same shape of work as the project's store: a client reads the version
  it last wrote (none: the initial state) and writes a new one under the
  round's folder.
  """

  def __init__(self, root: str, initial_state):
    from tff_algos.runtime import page_cache  # pylint: disable=g-import-not-at-top
    self._root = root
    # As the driver does: written states leave the page cache unless the
    # next round reads them.
    self.evictor = page_cache.ClosedFileEvictor(client_states.SUFFIX)
    self._initial = [tf.constant(t) for t in initial_state]
    self._specs = [tf.TensorSpec(t.shape, t.dtype) for t in self._initial]
    self._latest = {}  # client index -> the round that wrote its state.

  def path(self, index: int, round_num: int) -> str:
    return os.path.join(self._root, f'round_{round_num}',
                        f'{index}{client_states.SUFFIX}')

  def start_round(self, round_num: int, next_indices) -> None:
    """Its states leave RAM as written, but those the next round reads."""
    directory = os.path.join(self._root, f'round_{round_num}')
    os.makedirs(directory, exist_ok=True)
    self.evictor.follow(directory, [f'{i}{client_states.SUFFIX}'
                                    for i in next_indices])

  def read_path(self, index: int) -> str:
    """'' when the client has no state yet."""
    if index not in self._latest:
      return ''
    return self.path(index, self._latest[index])

  def wrote(self, index: int, round_num: int) -> None:
    self._latest[index] = round_num

  def read(self, path):
    """The store's format: the same parse and checksum."""
    return tf.cond(
        tf.equal(path, ''), lambda: self._initial,
        lambda: client_states.decode(tf.io.read_file(path), self._specs, path,
                                     path))

  def write(self, path, tensors):
    return tf.io.write_file(path,
                            client_states.encode(tensors, self._specs, path))


def _bound_client_update(algorithm, global_model, server_c, states,
                         client_dataset, local_model_fn):
  """(c)'s update of one client, with its own models (for one thread):
  (client id, seed, read path, write path) -> (delta, delta c_i, weight)."""
  loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)
  from tasks import celeba  # pylint: disable=g-import-not-at-top
  client_model = celeba.build_keras_model()
  client_weights = client_model.trainable_variables
  global_weights = global_model.trainable_variables
  local_model = local_model_fn() if algorithm == 'fedres_avg' else None

  def gradients_of(images, labels, variables):
    with tf.GradientTape() as tape:
      outputs = client_model(images, training=True)
      if local_model is not None:
        outputs += local_model(images, training=True)
      loss = loss_fn(labels, outputs)
    return tape.gradient(loss, variables)

  @tf.function
  def client_update(client_id, seed, read_path, write_path):
    for local, server in zip(client_weights, global_weights):
      local.assign(server)
    state = states.read(read_path) if states else []
    # FedResAvg iterates it twice; a second pass reshuffles, as in (a).
    dataset = client_dataset(client_id, seed)
    client_c = state[-len(server_c):] if server_c else []
    if local_model is not None:
      # FedResAvg Step 1: a pass of K steps on theta_i, w fixed.
      for variable, value in zip(local_model.trainable_variables, state):
        variable.assign(value)
      for images, labels in iter(dataset):
        sgd_step.sgd_step(
            local_model.trainable_variables,
            gradients_of(images, labels, local_model.trainable_variables),
            FEDRES_LOCAL_LEARNING_RATE)
    num_examples = tf.constant(0.0)
    steps = tf.constant(0.0)
    client_minus_server = [ci - c for c, ci in zip(server_c, client_c)]
    gradient_sums = ([tf.zeros_like(c) for c in client_c]
                     if local_model is not None else [])
    # iter(): a tf.while_loop over the iterator, the fastest TF loop here
    # (the driver's LoopImplementation.DATASET_ITERATOR); `for .. in
    # dataset` would run each step inside tf.data's reduce, 3x slower.
    for images, labels in iter(dataset):
      gradients = gradients_of(images, labels, client_weights)
      if local_model is not None:
        gradient_sums = [s + g for s, g in zip(gradient_sums, gradients)]
      if server_c:  # The corrected step, as the driver takes it.
        sgd_step.corrected_sgd_step(client_weights, gradients,
                                    CLIENT_LEARNING_RATE, client_minus_server)
      else:
        sgd_step.sgd_step(client_weights, gradients, CLIENT_LEARNING_RATE)
      num_examples += tf.cast(tf.shape(labels)[0], tf.float32)
      steps += 1.0
    delta = [local - server for local, server in zip(client_weights,
                                                     global_weights)]
    if not states:  # FedAvg.
      return delta, [], num_examples
    if local_model is None:  # SCAFFOLD Option II: c_i - c + (x - y_i)/(K eta).
      new_c = [cmc - d / (steps * CLIENT_LEARNING_RATE)
               for cmc, d in zip(client_minus_server, delta)]
      new_state = new_c
    else:  # FedResAvg Option II: the mean gradient of the second pass
      # (Option I: none, gradient_sums is empty).
      new_c = [s / steps for s in gradient_sums]
      new_state = list(local_model.trainable_variables) + new_c
    with tf.control_dependencies([states.write(write_path, new_state)]):
      delta_c = [n - ci for n, ci in zip(new_c, client_c)]
    # FedRes weighs its clients uniformly.
    return delta, delta_c, (num_examples if local_model is None
                            else tf.constant(1.0))

  return client_update


def _run_plain_tf_bound() -> list[float]:
  """(c): the same round as one in-process TF loop, no TFF.

  FedAvg, SCAFFOLD (Option II) with each client's c_i, or FedResAvg with
  its theta_i (and c_i, Option II) read from and written to local disk.
  """
  from pipeline import driver  # pylint: disable=g-import-not-at-top
  from tasks import base  # pylint: disable=g-import-not-at-top
  from tasks import celeba  # pylint: disable=g-import-not-at-top
  algorithm = _CHILD_ALGORITHM.value
  config = _data_config('fedavg')
  # No global TF seed: with one, shuffle(seed=<tensor>) inside tf.function
  # fails (TF compares the seed pair to (0, 0) in Python).
  # Grappler re-optimizes the dataset's functions for every client's iterator
  # and costs more than it saves here (1.6 vs 2.4 s a round at 100 clients):
  # off, so (c) stays the fastest plain-TF round we know.
  tf.config.optimizer.set_experimental_options(
      {'disable_meta_optimizer': True})
  global_model = celeba.build_keras_model()
  has_control_variates = algorithm == 'scaffold' or (
      algorithm == 'fedres_avg' and _FEDRES_OPTION.value == '2')
  server_c = [tf.Variable(tf.zeros_like(v))
              for v in global_model.trainable_variables
              ] if has_control_variates else []
  initial_state = [tf.zeros_like(c) for c in server_c]
  if algorithm == 'fedres_avg':
    initial_state = [v.numpy() for v in _local_model().trainable_variables
                     ] + initial_state
  states = _StateFiles(os.path.join(_OUTPUT_DIR.value, 'states'),
                       initial_state) if initial_state else None
  task = celeba.build_task(config)
  # The very pipeline (a) builds inside TFF, run here in-process.
  client_dataset = base.dataset_fn_of(task.client_dataset_computation)
  client_ids = task.train_client_ids

  @tf.function
  def server_update(delta_sums, total_weight, delta_c_sums):
    # The weighted mean of the deltas (FedRes: uniform), server SGD with
    # rate eta_s (FedRes: alpha, also 1); SCAFFOLD and FedResAvg:
    # c += (|S|/N) * the uniform mean of the c_i deltas.
    for variable, delta_sum in zip(global_model.trainable_variables,
                                   delta_sums):
      variable.assign_add(SERVER_LEARNING_RATE * delta_sum / total_weight)
    for variable, delta_c_sum in zip(server_c, delta_c_sums):
      variable.assign_add(delta_c_sum / len(client_ids))

  # TFF's worker runs a round's clients concurrently; so does the bound, one
  # thread per core (TF runs ops outside the GIL), else it is no bound.
  num_threads = _BOUND_THREADS.value or os.cpu_count()
  client_updates = [
      _bound_client_update(algorithm, global_model, server_c, states,
                           client_dataset, _local_model)
      for _ in range(num_threads)]

  def weighted_sums(client_update, clients, round_num):
    delta_sums = [tf.zeros_like(v) for v in global_model.trainable_variables]
    delta_c_sums = [tf.zeros_like(c) for c in server_c]
    total_weight = tf.constant(0.0)
    for index, seed in clients:
      delta, delta_c, weight = client_update(
          tf.constant(client_ids[index]), tf.constant(seed, tf.int64),
          tf.constant(states.read_path(index) if states else ''),
          tf.constant(states.path(index, round_num) if states else ''))
      delta_sums = [s + d * weight for s, d in zip(delta_sums, delta)]
      delta_c_sums = [s + d for s, d in zip(delta_c_sums, delta_c)]
      total_weight += weight
    return delta_sums, delta_c_sums, total_weight

  seconds = []
  with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
    for round_num in range(1, _WARMUP_ROUNDS.value + _ROUNDS.value + 1):
      started = time.perf_counter()
      _ROUND_CPU.round_started()
      plan = driver.plan_round(0, round_num, len(client_ids),
                               _CHILD_CLIENTS.value)
      clients = list(zip(plan.client_indices, plan.client_seeds))
      if states:
        states.start_round(round_num, driver.plan_round(
            0, round_num + 1, len(client_ids),
            _CHILD_CLIENTS.value).client_indices)
      parts = list(pool.map(
          weighted_sums, client_updates,
          [clients[t::num_threads] for t in range(num_threads)],
          [round_num] * num_threads))
      delta_sums, delta_c_sums = (
          [tf.add_n(list(sums)) for sums in zip(*[part[i] for part in parts])]
          for i in (0, 1))
      server_update(delta_sums, tf.add_n([part[2] for part in parts]),
                    delta_c_sums)
      if states:
        for index, _ in clients:
          states.wrote(index, round_num)
      seconds.append(time.perf_counter() - started)
      _ROUND_CPU.round_ended()
  if states:
    states.evictor.close()
  return seconds


def check_child_flags() -> None:
  """UsageError for the internal flags of a measuring child (the parent
  passes good ones; run by hand, a missing or bad one was a traceback)."""
  from pipeline import run_directory  # pylint: disable=g-import-not-at-top
  from tff_algos.algorithms import registry  # pylint: disable=g-import-not-at-top
  mode = _CHILD.value
  if _CHILD_CLIENTS.value is None or _CHILD_CLIENTS.value < 1:
    raise UsageError(f'--child={mode} needs --child_clients >= 1, got '
                     f'{_CHILD_CLIENTS.value}')
  if _OUTPUT_DIR.value is None:
    raise UsageError(f'--child={mode} needs --child_output_dir (the '
                     'directory of its run)')
  run_directory.check_output_root(_OUTPUT_DIR.value, _OUTPUT_DIR.name)
  known = MODE_ALGORITHMS[mode] or (*registry.NAMES, FEDAVG_ON_MIXED_CLIENTS)
  if _CHILD_ALGORITHM.value not in known:
    raise UsageError(f'--child_algorithm={_CHILD_ALGORITHM.value!r} is unknown '
                     f'to --child={mode}; allowed: {", ".join(known)}')


def run_child() -> None:
  check_child_flags()
  runner = {'tff': lambda: _run_driver('tff'),
            'native': lambda: _run_driver('native'),
            'naive': _run_naive_tff, 'bound': _run_plain_tf_bound,
            'central': _run_central_alone}[_CHILD.value]
  seconds = runner()
  print(RESULT_PREFIX + json.dumps({'round_seconds': seconds,
                                    'round_cpu_seconds': _ROUND_CPU.seconds}),
        flush=True)


# ------------------------------------------------------------------ parent --


def measure(mode: str, clients: int, algorithm: str = 'fedavg') -> dict:
  """Runs one child; returns its median timed round and peak RSS."""
  import psutil  # pylint: disable=g-import-not-at-top
  output_dir = tempfile.mkdtemp(prefix='benchmark_', dir=_RUN_ROOT.value)
  command = [sys.executable, '-m', 'benchmarks.rounds', f'--child={mode}',
             f'--child_clients={clients}', f'--child_algorithm={algorithm}',
             f'--child_output_dir={output_dir}']
  command += [f'--{name}={FLAGS[name].value}' for name in (
      'rounds', 'warmup_rounds', 'client_steps', 'client_batch_size',
      'population', 'max_concurrent_computation_calls', 'num_workers',
      'clients_per_subround', 'clients_per_group', 'bound_threads',
      'fedres_option')]
  started = time.perf_counter()
  # SIGTERM when this process dies: a killed benchmark left its measuring
  # child running on (its TFF workers with it).
  child = subprocess.Popen(tff_runtime.die_with_parent(command,
                                                       signal.SIGTERM),
                           stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           cwd=os.path.dirname(os.path.dirname(
                               os.path.abspath(__file__))))
  process = psutil.Process(child.pid)
  peak_rss = peak_python = peak_workers = 0.0
  try:
    while child.poll() is None:
      interrupts.check()
      python_mb, workers_mb = process_memory.rss_mb(process)
      peak_rss = max(peak_rss, python_mb + workers_mb)
      peak_python = max(peak_python, python_mb)
      peak_workers = max(peak_workers, workers_mb)
      time.sleep(0.2)
    stdout, stderr = child.communicate()
  finally:
    if child.poll() is None:
      # Its own handler removes its temp directory; SIGKILL left it.
      child.terminate()
      try:
        child.wait(timeout=10)
      except subprocess.TimeoutExpired:
        child.kill()
    shutil.rmtree(output_dir, ignore_errors=True)
  results = [l for l in stdout.splitlines() if l.startswith(RESULT_PREFIX)]
  refusal = [l for l in stderr.splitlines() if l.startswith('error: ')]
  if child.returncode in (2, 3) and refusal:
    # The child's one line (e.g. a batch beyond the memory), as its own.
    fault = UsageError if child.returncode == 2 else EnvironmentFault
    raise fault(refusal[-1][len('error: '):])
  if child.returncode or not results:
    raise RuntimeError(f'{" ".join(command)} failed ({child.returncode}):\n'
                       + stderr[-3000:])
  result = json.loads(results[-1][len(RESULT_PREFIX):])
  seconds = _timed(result['round_seconds'])
  cpu_seconds = _timed(result['round_cpu_seconds'])
  record = dict(mode=mode, algorithm=algorithm, clients=clients,
                seconds_per_round=statistics.median(seconds),
                cpu_seconds_per_round=statistics.median(cpu_seconds),
                round_seconds=seconds, peak_rss_mb=peak_rss,
                peak_python_mb=peak_python, peak_workers_mb=peak_workers,
                wall_seconds=time.perf_counter() - started)
  print(format_measurement(record), flush=True)
  return record


def format_measurement(record: dict) -> str:
  """One measurement's line (benchmarks/peers/compare.py parses it)."""
  return (f'  {record["mode"]:6s} {record["algorithm"]:10s} '
          f'{record["clients"]:5d} clients: '
          f'{record["seconds_per_round"]:8.3f} s/round (rounds: '
          + ', '.join(f'{s:.2f}' for s in record['round_seconds']) +
          f'), peak RSS {record["peak_rss_mb"]:6.0f} MB (Python '
          f'{record["peak_python_mb"]:.0f}, workers '
          f'{record["peak_workers_mb"]:.0f}), '
          f'{record["wall_seconds"]:.0f} s wall, CPU '
          f'{record["cpu_seconds_per_round"]:.3f} s/round')


def _load() -> str:
  return ', '.join(f'{x:.2f}' for x in os.getloadavg())


def _mode_runs(mode: str, algorithm: str) -> bool:
  runs = MODE_ALGORITHMS[mode]
  return runs is None or algorithm in runs


def run_parent() -> None:
  if _QUICK.value:
    for name, value in (('clients_per_round', 10), ('rounds', 1),
                        ('sweep_clients', [])):
      if not FLAGS[name].present:
        FLAGS[name].value = value
  try:
    sweep = sorted({int(c) for c in _SWEEP_CLIENTS.value})
  except ValueError as e:  # It was a traceback.
    raise UsageError(f'--sweep_clients={",".join(_SWEEP_CLIENTS.value)} must '
                     'be integers') from e
  largest = max([_CLIENTS_PER_ROUND.value] + sweep)
  if _ROUNDS.value < 1 or _WARMUP_ROUNDS.value < 0:
    raise UsageError('--rounds must be >= 1 and --warmup_rounds >= 0')
  if min([_CLIENTS_PER_ROUND.value] + sweep) < 1:
    raise UsageError('--clients_per_round and --sweep_clients must be >= 1')
  # Checked here, not by the measuring children: K=0 timed empty rounds, K<0
  # never ended (an endless dataset), and a child's refusal was a
  # RuntimeError traceback around its error line.
  for flag, minimum in ((_CLIENT_STEPS, 1), (_CLIENT_BATCH_SIZE, 1),
                        (_REPEATS, 1),
                        (_NUM_WORKERS, 1), (_CLIENTS_PER_GROUP, 0),
                        (_BOUND_THREADS, 0), (_CLIENTS_PER_SUBROUND, 0),
                        (_NAIVE_MAX_CLIENTS, 0)):
    if flag.value < minimum:
      raise UsageError(f'--{flag.name} must be >= {minimum}, got {flag.value}')
  if _RUN_ROOT.value is not None:
    root = _RUN_ROOT.value
    if not os.path.exists(root):
      problem = 'does not exist (make it first)'
    elif not os.path.isdir(root):
      problem = 'is not a directory'
    elif not os.access(root, os.W_OK | os.X_OK):
      problem = 'is not writable'
    else:
      problem = None
    if problem:
      raise UsageError(f'--run_root={root} {problem}')
    try:  # Writable by its mode, yet the kernel may make nothing there.
      os.rmdir(tempfile.mkdtemp(prefix='benchmark_', dir=root))
    except OSError as e:
      if e.errno in ENVIRONMENT_ERRNOS:
        raise  # binaries.app names these faults with the path.
      # E.g. /proc (ENOENT): a FileNotFoundError traceback in the first
      # measurement.
      raise EnvironmentFault(f'--run_root={root} cannot hold the runs\' '
                             f'directories ({e.strerror}); use another '
                             '--run_root') from None
  modes = [m for m in MODES if m in _MODES.value]
  unknown = sorted(set(_MODES.value) - set(MODES))
  if unknown or not modes:
    raise UsageError(f'--modes={",".join(_MODES.value)} must name some of '
                     f'{", ".join(MODES)}')
  from tff_algos.algorithms import registry  # pylint: disable=g-import-not-at-top
  for algorithm in _SWEEP_ALGORITHMS.value:
    if algorithm not in registry.NAMES:
      raise UsageError(f'--sweep_algorithms: {algorithm!r} is unknown; '
                       f'allowed: {", ".join(registry.NAMES)}')
  if _POPULATION.value < largest:
    raise UsageError(f'--population={_POPULATION.value} is below the '
                     'largest clients per round of --clients_per_round and '
                     f'--sweep_clients ({largest})')
  print(f'benchmark: K={_CLIENT_STEPS.value}, B={_CLIENT_BATCH_SIZE.value}, '
        f'{_ROUNDS.value} timed + {_WARMUP_ROUNDS.value} warm-up rounds, '
        f'population {_POPULATION.value}, FedResAvg option '
        f'{_FEDRES_OPTION.value}, {os.cpu_count()} CPUs, load '
        f'average {_load()}' + (
            f', driver sub-rounds of <= {_CLIENTS_PER_SUBROUND.value} clients'
            if _CLIENTS_PER_SUBROUND.value > 0 else ''), flush=True)
  jobs = [(mode, _CLIENTS_PER_ROUND.value, 'fedavg')
          for mode in modes if _mode_runs(mode, 'fedavg')]
  for algorithm in _SWEEP_ALGORITHMS.value:
    for clients in sweep:
      for mode in modes:
        if not _mode_runs(mode, algorithm):
          continue
        if mode == 'naive' and clients > _NAIVE_MAX_CLIENTS.value:
          continue
        if algorithm == 'fedavg' and clients == _CLIENTS_PER_ROUND.value:
          continue  # The headline runs.
        jobs.append((mode, clients, algorithm))
  if 'central' in modes and any(a.startswith('mixed')
                                for a in _SWEEP_ALGORITHMS.value):
    for clients in sweep:
      for mode in ('tff', 'native'):
        if mode in modes:
          jobs.append((mode, clients, FEDAVG_ON_MIXED_CLIENTS))
  repeats = []
  for repeat in range(_REPEATS.value):
    if _REPEATS.value > 1:
      print(f'repeat {repeat + 1} of {_REPEATS.value}', flush=True)
    order = jobs if repeat % 2 == 0 else jobs[::-1]
    repeats.append([measure(*job) for job in order])
  records = median_records(repeats)
  print_summary(records, modes, repeats)
  headline = {r['mode']: r for r in records if r['algorithm'] == 'fedavg'
              and r['clients'] == _CLIENTS_PER_ROUND.value}
  if not all(m in modes for m in ('tff', 'naive', 'bound')):
    return  # The ratio lines compare these three.
  tff_s, naive_s, bound_s = (headline[m]['seconds_per_round']
                             for m in ('tff', 'naive', 'bound'))
  print(f'\n{_CLIENTS_PER_ROUND.value} clients/round: (a) TFF driver '
        f'{tff_s:.3f} s, (b) naive TFF {naive_s:.3f} s, (c) plain TF '
        f'{bound_s:.3f} s per round; peak RSS (a) '
        f'{headline["tff"]["peak_rss_mb"]:.0f} MB, (b) '
        f'{headline["naive"]["peak_rss_mb"]:.0f} MB, (c) '
        f'{headline["bound"]["peak_rss_mb"]:.0f} MB')
  # (a) >= (c), so (b)/(a) <= (b)/(c): the most passing clients by id can
  # gain over the naive loop on this task.
  print(f'ratio_naive_over_bound={naive_s / bound_s:.3f} (the ceiling of '
        'ratio_naive_over_tff on this task)')
  print(f'ratio_tff_over_bound={tff_s / bound_s:.3f} '
        f'ratio_naive_over_tff={naive_s / tff_s:.3f} '
        f'peak_rss_mb={headline["tff"]["peak_rss_mb"]:.0f}')


def _key(record: dict) -> tuple:
  return (record['algorithm'], record['mode'], record['clients'])


def median_records(repeats: list[list[dict]]) -> list[dict]:
  """One record per measurement: its round time and peak RSS, the medians
  over the repeats (the record itself for one repeat)."""
  if len(repeats) == 1:
    return repeats[0]
  by_key = {}
  for records in repeats:
    for record in records:
      by_key.setdefault(_key(record), []).append(record)
  return [dict(runs[0], **{
      field: statistics.median(r[field] for r in runs)
      for field in ('seconds_per_round', 'cpu_seconds_per_round',
                    'peak_rss_mb', 'peak_python_mb', 'peak_workers_mb')})
          for runs in by_key.values()]


def _ratio_to_fedavg(record: dict, repeats: list[list[dict]],
                     field: str = 'seconds_per_round') -> str:
  """The record's `field` (round time, CPU time) over FedAvg's in the same
  mode and cohort size: with repeats, the median of each repeat's ratio,
  and the ratios."""
  algorithm, mode, clients = _key(record)
  ratios = []
  for records in repeats:
    by_key = {_key(r): r for r in records}
    ratios.append(by_key[_key(record)][field] /
                  by_key[('fedavg', mode, clients)][field])
  if len(ratios) == 1:
    return f'x{ratios[0]:.2f}'
  return (f'x{statistics.median(ratios):.2f} (median of '
          + ', '.join(f'x{r:.2f}' for r in ratios) + ')')


def print_summary(records: list[dict], modes: list[str],
                  repeats: Optional[list[list[dict]]] = None) -> None:
  """The rounds/s table and each algorithm's cost over FedAvg's."""
  repeats = repeats or [records]
  print(f'\nrounds/s (peak RSS MB), K={_CLIENT_STEPS.value}, '
        f'B={_CLIENT_BATCH_SIZE.value}; load average at the end {_load()}'
        + (f'; medians over {len(repeats)} repeats' if len(repeats) > 1
           else ''))
  columns = sorted({(r['algorithm'], r['mode']) for r in records},
                   key=lambda c: (c[0] != 'fedavg', c[0], MODES.index(c[1])))
  print('| clients/round | ' + ' | '.join(
      f'{a} {m}' for a, m in columns) + ' |')
  print('|---' * (len(columns) + 1) + '|')
  by_key = {_key(r): r for r in records}
  for clients in sorted({r['clients'] for r in records}):
    cells = []
    for algorithm, mode in columns:
      found = by_key.get((algorithm, mode, clients))
      cells.append(f'{1 / found["seconds_per_round"]:.3g} '
                   f'({found["peak_rss_mb"]:.0f})' if found else '-')
    print(f'| {clients} | ' + ' | '.join(cells) + ' |')
  ratios = []
  for (algorithm, mode, clients), record in sorted(by_key.items()):
    fedavg = by_key.get(('fedavg', mode, clients))
    if algorithm == 'fedavg' or fedavg is None:
      continue
    ratios.append(
        f'  {algorithm} / fedavg, {mode}, {clients} clients: round time '
        f'{_ratio_to_fedavg(record, repeats)}, CPU time '
        f'{_ratio_to_fedavg(record, repeats, "cpu_seconds_per_round")}, '
        f'peak RSS x{record["peak_rss_mb"] / fedavg["peak_rss_mb"]:.2f} '
        f'({record["peak_rss_mb"]:.0f} MB)')
  if ratios:
    print('\nover FedAvg in the same mode and cohort size:')
    print('\n'.join(ratios))
  extra = report.central_work_lines(by_key, FEDAVG_ON_MIXED_CLIENTS)
  if extra:
    print('\nrounds with central work, against FedAvg\'s round on the same '
          'clients plus that work:')
    print('\n'.join(extra))
  extra = report.bound_extra_work_lines(by_key)
  if extra:
    print('\nstateful rounds, against FedAvg\'s round plus their extra work '
          'as the plain-TF bounds (c) measure it:')
    print('\n'.join(extra))


def main(argv):
  del argv
  if _CHILD.value:
    run_child()
  else:
    run_parent()


if __name__ == '__main__':
  app.run(main)
