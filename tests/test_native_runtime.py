"""The native runtime (`--runtime=native`) gives the TFF runtime's rounds.

Both runtimes run the same by-id rounds (same client ids, shuffle seeds and
central seed) from the same state on a tiny task whose clients differ in size
and shuffle their data; after one and two rounds the server states, client
states and metrics must agree.
"""

import collections
import csv
import os

import numpy as np
import pytest
import tensorflow as tf

from pipeline import driver
from pipeline import export as export_lib
from pipeline import tff_runtime
from pipeline.errors import UsageError
from tasks import base
import fedres_testing
from tff_algos.algorithms import registry as algorithm_registry
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms.baselines import definition as baselines
from tff_algos.algorithms.fedres import definition as fedres
from tff_algos.algorithms.mixed import definition as mixed
from tff_algos.algorithms.scaffold import definition as scaffold
from tff_algos.runtime import client_states
from tff_algos.runtime import cohort
from tff_algos.runtime import native

NUM_CLIENTS = 6
NUM_FEATURES = 3
# Graph (TFF) and eager (native) execution of the same ops may round the
# last bit differently (e.g. Adam's sqrt); weights are O(1).
TOLERANCE = dict(rtol=1e-6, atol=1e-6)


def _examples(seed, n):
  x = tf.random.stateless_normal([n, NUM_FEATURES], seed)
  logits = tf.reduce_sum(x * [1.0, -2.0, 0.5], axis=1, keepdims=True)
  y = tf.cast(logits + 0.3 * tf.random.stateless_normal([n, 1], seed + 1) > 0,
              tf.float32)
  return tf.data.Dataset.from_tensor_slices((x, y))


def _keras_model():
  # Two layers, so FedPVR's last-layer mask is a proper subset.
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(NUM_FEATURES,)),
      tf.keras.layers.Dense(4, activation='tanh'),
      tf.keras.layers.Dense(1),
  ])


def tiny_task(client_steps=None) -> base.Task:
  """Clients of 3..8 examples, batches of 2, shuffled by the round's seed."""
  config = base.DataConfig(client_batch_size=2, client_steps=client_steps,
                           shuffle_buffer=16)

  def client_dataset(client_id, seed):
    key = tf.strings.to_number(client_id, tf.int64)
    examples = _examples(tf.stack([key, tf.constant(0, tf.int64)]), 8).take(
        3 + key)
    return base.client_batches(examples, config, seed)

  def server_dataset(seed):
    return _examples(tf.stack([seed, tf.constant(1, tf.int64)]),
                     24).shuffle(24, seed=seed).repeat().batch(4).take(3)

  return base.Task(
      name='tiny_logistic', data_config=config,
      train_client_ids=tuple(str(k) for k in range(NUM_CLIENTS)),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=_keras_model,
      loss_fn=lambda: tf.keras.losses.BinaryCrossentropy(from_logits=True),
      metrics_fn=lambda: [tf.keras.metrics.BinaryAccuracy(threshold=0.0)],
      batch_spec=(tf.TensorSpec([None, NUM_FEATURES], tf.float32),
                  tf.TensorSpec([None, 1], tf.float32)),
      eval_datasets_fn=lambda: {'': _examples(
          tf.constant([9, 9], tf.int64), 20).batch(10)},
      serving=base.ServingSpec(
          'x', tf.TensorSpec([None, NUM_FEATURES], tf.float32),
          lambda x: x, lambda y: {'logit': y}),
      server_dataset_computation=base.server_dataset_computation(
          server_dataset))


def test_native_datasets_are_the_tff_computations_datasets(task):
  # With a global seed set (as the driver sets it to initialize the model),
  # an eagerly built `shuffle(seed=s)` would draw other batches than the
  # same pipeline inside a TFF computation.
  tf.random.set_seed(1)
  client_dataset = tf.function(
      native.graph_mode_dataset_fn(task.client_dataset_fn),
      input_signature=(tf.TensorSpec([], tf.string),
                       tf.TensorSpec([], tf.int64)), autograph=False)
  for client_id, seed in (('4', 7), ('4', 8), ('2', 7)):
    from_tff = list(task.client_dataset_computation(client_id, seed))
    from_native = list(client_dataset(tf.constant(client_id),
                                      tf.constant(seed, tf.int64)))
    assert_structures_close(from_native, from_tff)
  assert not np.array_equal(
      *[np.asarray(list(task.client_dataset_computation('4', s))[0][0])
        for s in (7, 8)])


CONFIGS = {
    'fedavg': baselines.FedAvgSettings(client_learning_rate=0.3,
                                       server_learning_rate=0.8),
    'fedprox': baselines.FedProxSettings(client_learning_rate=0.3,
                                         proximal_strength=0.5,
                                         server_optimizer='adam',
                                         server_learning_rate=0.05),
    'fedsgd': baselines.FedSgdSettings(server_learning_rate=0.5),
    # Server momentum: Python-float hyperparameters in the optimizer state.
    'fedavg_option_server_sgdm': baselines.FedAvgSettings(
        client_learning_rate=0.3, server_optimizer='sgdm',
        server_learning_rate=0.5),
    'scaffold': scaffold.ScaffoldSettings(client_learning_rate=0.3,
                                          server_learning_rate=0.9),
    # Option I passes over a client's dataset twice in one computation.
    'scaffold_option_1': scaffold.ScaffoldSettings(client_learning_rate=0.3,
                                                   server_learning_rate=0.9,
                                                   scaffold_option=1),
    'fedpvr': scaffold.FedPvrSettings(client_learning_rate=0.3,
                                      client_optimizer='sgdm',
                                      drift_diversity=True),
    'mixed_pt': mixed.ParallelTrainingSettings(client_learning_rate=0.3,
                                               central_learning_rate=0.2),
    'mixed_1wgt': mixed.OneWayGtSettings(client_learning_rate=0.3,
                                         mixed_diagnostics=True),
    'mixed_2wgt': mixed.TwoWayGtSettings(client_learning_rate=0.3,
                                         central_learning_rate=0.2,
                                         merge_learning_rate=0.7,
                                         mixed_diagnostics=True),
}


@pytest.fixture(scope='module')
def task():
  return tiny_task(client_steps=2)


def assert_structures_close(actual, expected):
  if expected is None:
    assert actual is None
    return
  flat_actual = tf.nest.flatten(actual)
  flat_expected = tf.nest.flatten(expected)
  assert len(flat_actual) == len(flat_expected)
  for a, e in zip(flat_actual, flat_expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOLERANCE)


def run_rounds(definition, task, runtime, store_dir, num_rounds=2,
               clients_per_round=3):
  """(server states, client states, metrics) after each round."""
  formats = driver.state_format(definition, str(store_dir))
  return run_process_rounds(
      definition, task,
      driver.compose_process(definition, task, runtime, formats), formats,
      num_rounds, clients_per_round)


def run_process_rounds(definition, task, process, formats, num_rounds=2,
                       clients_per_round=3, clients_per_group=2):
  """`run_rounds` on a composed process; client states read after each
  round from the store (`formats`)."""
  state = round_lib.set_model_weights(
      process.initialize(), driver.initial_model_weights(task, 0))
  index = client_states.StateIndex(task.train_client_ids)
  ids = np.asarray(task.train_client_ids, dtype=object)
  history = []
  for round_num in range(1, num_rounds + 1):
    plan = driver.plan_round(3, round_num, task.num_train_clients,
                             clients_per_round)
    versions = (index.versions_of(plan.client_indices)
                if formats is not None else None)
    state, metrics = process.next(
        state, cohort.groups(ids[plan.client_indices], plan.client_seeds,
                             versions, clients_per_group),
        round_num, plan.server_seed)
    states = None
    if formats is not None:
      index.commit(plan.client_indices, round_num)
      view = client_states.ClientStates(formats, index)
      sampled = sorted(cid for cid, seen in zip(
          task.train_client_ids, view.has_state(task.train_client_ids))
                       if seen)
      states = dict(zip(sampled, view.read(sampled)))
    history.append((state, states, metrics))
  return history


FEDRES_CONFIGS = {
    'fedres_naive': fedres.FedResSettings(client_learning_rate=0.1,
                                          local_learning_rate=0.2),
    'fedres_sgd': fedres.FedResSettings(client_learning_rate=0.1,
                                        local_learning_rate=0.2),
    'fedres_avg': fedres.FedResAvgSettings(client_learning_rate=0.1,
                                           local_learning_rate=0.2,
                                           fedres_option=2,
                                           fedres_alpha=0.8),
}


PARITY_CASES = list(CONFIGS) + list(FEDRES_CONFIGS)


@pytest.fixture(scope='module')
def fedres_task():
  return fedres_testing.linear_task(
      fedres_testing.client_data(seed=1, sizes=(4, 6, 2, 5)),
      base.DataConfig(client_batch_size=2, client_steps=2))


@pytest.fixture(scope='module')
def histories(task, fedres_task, tmp_path_factory):
  """name -> (algorithm, TFF runtime's rounds, native runtime's rounds)."""
  cache = {}

  def history_of(name):
    if name not in cache:
      case_task, settings = ((fedres_task, FEDRES_CONFIGS[name])
                             if name in FEDRES_CONFIGS
                             else (task, CONFIGS[name]))
      # A case's algorithm: its name up to `_option_`.
      definition = algorithm_registry.build(name.split('_option_')[0],
                                            case_task, settings)
      cache[name] = (definition,
                     run_rounds(definition, case_task, 'tff',
                                tmp_path_factory.mktemp(f'{name}_tff')),
                     run_rounds(definition, case_task, 'native',
                                tmp_path_factory.mktemp(f'{name}_native')))
    return cache[name]

  return history_of


@pytest.mark.parametrize('name', PARITY_CASES)
def test_native_rounds_equal_tff_rounds(histories, name):
  algorithm, tff_history, native_history = histories(name)
  for (tff_state, tff_clients, tff_metrics), (
      native_state, native_clients, native_metrics) in zip(tff_history,
                                                           native_history):
    tf.nest.assert_same_structure(native_state, tff_state, check_types=False)
    assert_structures_close(native_state, tff_state)
    assert_structures_close(native_clients, tff_clients)
    assert_structures_close(native_metrics, tff_metrics)
  # The rounds trained: the model moved.
  first, last = tff_history[0][0], tff_history[-1][0]
  assert not np.allclose(
      round_lib.get_model_weights(first).trainable[0],
      round_lib.get_model_weights(last).trainable[0])


def _state_field(state, name):
  return state[name] if isinstance(state, dict) else getattr(state, name)


def _state_fields(state):
  return list(state) if isinstance(state, dict) else list(state._fields)


@pytest.mark.parametrize('name', PARITY_CASES)
def test_every_algorithm_has_one_metrics_and_state_vocabulary(histories,
                                                              name):
  algorithm, tff_history, native_history = histories(name)
  for state, _, metrics in (tff_history[-1], native_history[-1]):
    # The global model: one key, tff.learning's, in every server state.
    assert 'global_model_weights' in _state_fields(state)
    weights = _state_field(state, 'global_model_weights')
    assert_structures_close(round_lib.get_model_weights(state), weights)
    assert not {'model', 'model_weights', 'global_model'} & set(
        _state_fields(state))
    # Communication per client, in bytes, every round.
    communication = metrics['communication']
    down = int(communication['bytes_down_per_client'])
    up = int(communication['bytes_up_per_client'])
    model_bytes = sum(np.asarray(w).nbytes for w in weights.trainable)
    assert down >= model_bytes and up >= model_bytes
    if name.startswith('fedres_'):
      # w (and c) down; w_i - w (and c_i+ - c_i), the float32 loss sum and
      # the int64 example count up.
      copies = 2 if 'control' in state else 1
      assert down == copies * model_bytes
      assert up == copies * model_bytes + 4 + 8


# ---------------------------------------------------------------------------
# The driver on the native runtime.


def _train(algorithm, task, root, name, total_rounds, export=False):
  config = driver.RunConfig(
      root_output_dir=str(root), experiment_name=name,
      total_rounds=total_rounds, clients_per_round=3, rounds_per_eval=2,
      rounds_per_checkpoint=2, runtime='native', export=export)
  return driver.train(algorithm, task, config, {'runtime': 'native'})


def _metric_rows(path):
  with open(path) as f:
    rows = list(csv.DictReader(f))
  return [{k: v for k, v in row.items() if not k.endswith('_seconds')}
          for row in rows]


def test_native_driver_run_resumes_bit_identically_and_exports(task,
                                                               tmp_path):
  algorithm = algorithm_registry.build('scaffold', task, CONFIGS['scaffold'])
  # No TFF execution context at all: a native run that invoked a TFF
  # computation (and so started TFF's worker) would fail here.
  tff_runtime.shutdown_workers()
  try:
    _train(algorithm, task, tmp_path, 'resumed', 3)
    resumed = _train(algorithm, task, tmp_path, 'resumed', 4, export=True)
    straight = _train(algorithm, task, tmp_path, 'straight', 4)
    assert not tff_runtime._worker_children()  # pylint: disable=protected-access
  finally:
    tff_runtime.configure_execution()
  for a, b in zip(tf.nest.flatten(resumed.server_state),
                  tf.nest.flatten(straight.server_state)):
    np.testing.assert_array_equal(a, b)
  resumed_rows = _metric_rows(tmp_path / 'resumed' / 'metrics.csv')
  straight_rows = _metric_rows(tmp_path / 'straight' / 'metrics.csv')
  assert [r['round_num'] for r in resumed_rows] == ['1', '2', '3', '4']
  # Round 3 ended the first run, so only there was it evaluated.
  for resumed_row, straight_row in zip(resumed_rows, straight_rows):
    if resumed_row['round_num'] != '3':
      assert resumed_row == straight_row
  # The checkpoint format is the TFF runtime's: it loads into the structure
  # of the TFF process's state.
  checkpoints = driver.CheckpointManager(
      str(tmp_path / 'resumed' / 'checkpoints'), keep=0)
  assert checkpoints.latest_round() == 4
  process = driver.compose_process(
      algorithm, task, 'tff',
      driver.state_format(algorithm, str(tmp_path / 'resumed' /
                                         driver.CLIENT_STATE_DIR)))
  loaded = checkpoints.load(4, driver.program_state_structure(
      process, 4, task.num_train_clients, algorithm.has_client_state))
  tf.nest.assert_same_structure(loaded['server_state'], resumed.server_state,
                                check_types=False)
  for a, b in zip(tf.nest.flatten(loaded['server_state']),
                  tf.nest.flatten(resumed.server_state)):
    np.testing.assert_array_equal(a, b)
  exported = export_lib.load_model_weights(
      str(tmp_path / 'resumed' / 'export'))
  for a, b in zip(exported.trainable, resumed.model_weights.trainable):
    np.testing.assert_array_equal(a, b)
  served = tf.saved_model.load(str(tmp_path / 'resumed' / 'export'))
  logits = served.signatures['serving_default'](
      x=tf.ones([2, NUM_FEATURES]))['logit']
  assert logits.shape == (2, 1)


# A compiled cohort against the per-client path: the same clients run as one
# group computation and as groups of one client each. Clients take unequal
# step counts K_i (epochs of 3..8 examples in batches of 2; FedRes's clients
# have 1 or 2 batches). The group computation is the one both runtimes run;
# the parity test above covers TFF against native.
COHORT_CASES = {
    'fedavg': ('epochs', CONFIGS['fedavg']),
    'scaffold_option_1': ('epochs', CONFIGS['scaffold_option_1']),
    'scaffold_option_2': ('epochs', CONFIGS['scaffold']),
    'mixed_2wgt': ('steps', CONFIGS['mixed_2wgt']),
    'fedres_avg': ('fedres', FEDRES_CONFIGS['fedres_avg']),
}


@pytest.mark.parametrize('name', list(COHORT_CASES))
def test_compiled_cohort_equals_per_client_rounds(name, task, fedres_task,
                                                  tmp_path):
  kind, settings = COHORT_CASES[name]
  case_task = {'epochs': tiny_task(), 'steps': task,
               'fedres': fedres_task}[kind]
  definition = algorithm_registry.build(name.split('_option_')[0], case_task,
                                        settings)
  clients = 4
  histories = []
  for clients_per_group in (1, clients):
    formats = driver.state_format(definition,
                                  str(tmp_path / f'group_{clients_per_group}'))
    process = driver.compose_process(definition, case_task, 'native', formats)
    histories.append(run_process_rounds(
        definition, case_task, process, formats, num_rounds=2,
        clients_per_round=clients, clients_per_group=clients_per_group))
  for per_client, grouped in zip(*histories):
    for grouped_part, per_client_part in zip(grouped, per_client):
      assert_structures_close(grouped_part, per_client_part)
  # The rounds trained: the model moved.
  assert not np.allclose(
      round_lib.get_model_weights(histories[0][0][0]).trainable[0],
      round_lib.get_model_weights(histories[0][-1][0]).trainable[0])


def test_lanes_run_at_once_or_one_at_a_time_to_the_same_bits(
    task, tmp_path, monkeypatch):
  # The test script runs one lane at a time (cohort.CONCURRENT_LANES_ENV);
  # users get one per core at once. The groups are the same either way.
  monkeypatch.setattr(os, 'cpu_count', lambda: 3)
  definition = algorithm_registry.build('scaffold', task, CONFIGS['scaffold'])
  histories, lanes = [], []
  for cap in ('', '1'):
    monkeypatch.setenv(cohort.CONCURRENT_LANES_ENV, cap)
    formats = driver.state_format(definition, str(tmp_path / f'cap{cap}'))
    process = driver.compose_process(definition, task, 'native', formats)
    lanes.append(len(process._lanes))  # pylint: disable=protected-access
    histories.append(run_process_rounds(
        definition, task, process, formats, num_rounds=2,
        clients_per_round=NUM_CLIENTS, clients_per_group=2))
  assert lanes == [3, 1]
  for at_once, one_at_a_time in zip(*histories):
    for a, b in zip(tf.nest.flatten(at_once), tf.nest.flatten(one_at_a_time),
                    strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('value', ['0', '-1', 'two', '²'])
def test_an_impossible_lane_cap_is_one_clear_error(monkeypatch, value):
  monkeypatch.setenv(cohort.CONCURRENT_LANES_ENV, value)
  with pytest.raises(UsageError, match=cohort.CONCURRENT_LANES_ENV):
    cohort.concurrent_native_lanes()
