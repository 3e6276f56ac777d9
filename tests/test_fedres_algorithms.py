"""FedRes TFF rounds against hand-derived numpy rounds ([FedRes] Algs. 2-4).

One round of each variant on a linear residual model with an overlapping
global/local feature split, clients of different sizes (K_i = 2 and 3), non-zero
starting theta_i, c and c_i, and 2 of N = 3 clients sampled (|S|/N rule).
"""

import csv
import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import fedres_testing as ft
import round_testing
from pipeline import driver
from tasks import base
from tff_algos.algorithms import registry
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import settings as settings_lib
from tff_algos.algorithms.fedres import definition as fedres
from tff_algos.algorithms.fedres import evaluation as fedres_eval
from tff_algos.runtime import client_states as client_states_lib

ModelWeights = tff.learning.models.ModelWeights
ETA, LAMBDA, ALPHA = 0.05, 0.1, 0.5
P0 = np.array([0.3, -0.2, 0.1])
THETAS = {'0': np.array([0.5, -0.4]), '1': np.array([-0.3, 0.2])}
C = np.array([0.1, 0.2, -0.1])
C_IS = {'0': np.array([0.3, -0.1, 0.2]), '1': np.array([-0.2, 0.1, 0.05])}
DATA = ft.client_data()  # Clients '0', '1', '2' with 4, 6, 2 examples.
SAMPLED = ('0', '1')
# A client with client '0''s starting state and no data.
WITHOUT_DATA = '0_without_data'
# A client with client '0''s starting state whose update is NaN (a NaN label).
DIVERGED = '0_diverged'
# key -> (algorithm, fedres_option, reference variant)
VARIANTS = {
    'naive': ('fedres_naive', 1, 'naive'),
    'sgd': ('fedres_sgd', 1, 'sgd'),
    'avg1': ('fedres_avg', 1, 'avg'),
    'avg2': ('fedres_avg', 2, 'avg'),
}
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _settings(name, option=1, local_learning_rate=LAMBDA):
  if name == 'fedres_avg':
    return fedres.FedResAvgSettings(
        client_learning_rate=ETA, local_learning_rate=local_learning_rate,
        fedres_option=option, fedres_alpha=ALPHA)
  return fedres.FedResSettings(client_learning_rate=ETA,
                               local_learning_rate=local_learning_rate)


def test_lambda_may_be_zero_unlike_the_other_learning_rates():
  """lambda = 0 keeps theta_i at its start: FedResAvg-I/II are then FedAvg
  and SCAFFOLD, experiments.fedres_logistic's baselines (docs/fedres.md)."""
  assert _settings('fedres_avg', local_learning_rate=0.0)
  for name in ('local_learning_rate', 'client_learning_rate',
               'fedres_alpha'):
    bad = -1.0 if name == 'local_learning_rate' else 0.0
    with pytest.raises(settings_lib.SettingError, match=f'^{name} must be'):
      dataclasses.replace(_settings('fedres_avg'), **{name: bad})


@pytest.fixture(scope='module')
def task(tmp_path_factory):
  """The linear task; clients train on their unshuffled batches."""
  task = ft.linear_task(DATA)
  data = round_testing.FileData(tmp_path_factory.mktemp('fedres_data'),
                                task.batch_spec)
  for client_id, (x, y) in DATA.items():
    data.set_client(client_id, ft.unshuffled_batches(x, y))
  x, y = DATA['0']
  data.set_client(WITHOUT_DATA, ft.unshuffled_batches(x[:0], y[:0]))
  y_nan = np.array(y, np.float32)
  y_nan[0] = np.nan
  data.set_client(DIVERGED, ft.unshuffled_batches(x, y_nan))
  return data.task(task)


class Rounds(round_testing.StatefulRounds):
  """One variant's rounds on one runtime, from this module's start."""

  def __init__(self, key, task, runtime, directory):
    name, option, _ = VARIANTS[key]
    super().__init__(registry.build(name, task, _settings(name, option)),
                     task, runtime, directory)

  def start_at_p0(self, uses_control, c=C, c_is=C_IS, clients=SAMPLED,
                  states_of=None):
    """Server state at p = P0 (and c); the clients start from THETAS (and
    c_is) (`states_of`: client -> whose state it starts from)."""
    state = round_lib.set_model_weights(
        self.process.initialize(),
        ModelWeights(trainable=ft.model_weights(P0), non_trainable=[]))
    if uses_control:
      state['control'] = ft.model_weights(c)
    states = {}
    for client_id in clients:
      source = (states_of or {}).get(client_id, client_id)
      client_state = self.initial_client_state()
      client_state['local_model'] = ft.model_weights(P0, THETAS[source])[1]
      if uses_control:
        client_state['control'] = ft.model_weights(c_is[source])
      states[client_id] = client_state
    self.start(states)
    return state


@pytest.fixture(scope='module')
def rounds(task, tmp_path_factory):
  """(key, runtime) -> Rounds, built on first use."""
  built = {}

  def get(key, runtime='tff'):
    if (key, runtime) not in built:
      built[key, runtime] = Rounds(
          key, task, runtime,
          tmp_path_factory.mktemp(f'states_{key}_{runtime}'))
    return built[key, runtime]

  return get


def _flat(weights):
  return ft.flat_global(weights)


@pytest.mark.parametrize('key', list(VARIANTS))
def test_one_round_matches_numpy_reference(rounds, key):
  run = rounds(key)
  _, _, variant = VARIANTS[key]
  uses_control = key == 'avg2'
  state = run.start_at_p0(uses_control)

  new_state, client_states, metrics = run.next(state, SAMPLED)

  expected = ft.reference_round(
      variant, P0, THETAS, {c: DATA[c] for c in SAMPLED}, ETA, LAMBDA,
      alpha=ALPHA if variant == 'avg' else 1.0,
      c=C if uses_control else None, c_is=C_IS if uses_control else None,
      num_train_clients=3)
  np.testing.assert_allclose(
      _flat(round_lib.get_model_weights(new_state).trainable), expected['p'],
      **TOLERANCE)
  for client_id, client_state in zip(SAMPLED, client_states):
    reference = expected['clients'][client_id]
    np.testing.assert_allclose(_flat(client_state['local_model']),
                               reference['theta'], **TOLERANCE)
    if uses_control:
      np.testing.assert_allclose(_flat(client_state['control']),
                                 reference['c_i'], **TOLERANCE)
  if uses_control:
    np.testing.assert_allclose(_flat(new_state['control']), expected['c'],
                               **TOLERANCE)
  else:
    assert set(new_state) == {'global_model_weights'}
  assert metrics['train']['num_examples'] == 10
  np.testing.assert_allclose(metrics['train']['loss'], expected['loss'],
                             **TOLERANCE)


def test_reference_variants_differ():
  # The round test above would not notice a variant running another's code
  # if their results coincided on this data; they do not.
  rounds = {key: ft.reference_round(
      variant, P0, THETAS, {c: DATA[c] for c in SAMPLED}, ETA, LAMBDA,
      alpha=ALPHA if variant == 'avg' else 1.0,
      c=C if key == 'avg2' else None, c_is=C_IS if key == 'avg2' else None,
      num_train_clients=3)['p'] for key, (_, _, variant) in VARIANTS.items()}
  keys = list(rounds)
  for i, a in enumerate(keys):
    for b in keys[i + 1:]:
      assert np.abs(rounds[a] - rounds[b]).max() > 1e-3, (a, b)


def test_option2_with_zero_controls_is_option1(rounds):
  # With c = c_i = 0, Option II's first round is Option I's (the controls
  # only differ from zero afterwards).
  zeros = {k: np.zeros(3) for k in SAMPLED}
  option2, option1 = rounds('avg2'), rounds('avg1')
  new2, client_states2, _ = option2.next(
      option2.start_at_p0(True, np.zeros(3), zeros), SAMPLED)
  new1, client_states1, _ = option1.next(option1.start_at_p0(False), SAMPLED)
  np.testing.assert_allclose(_flat(new2['global_model_weights'].trainable),
                             _flat(new1['global_model_weights'].trainable),
                             **TOLERANCE)
  for state1, state2 in zip(client_states1, client_states2):
    np.testing.assert_allclose(_flat(state2['local_model']),
                               _flat(state1['local_model']), **TOLERANCE)


def test_client_without_data_keeps_its_state(rounds):
  run = rounds('avg2')
  # Client '0' without its data: the client WITHOUT_DATA, in '0''s state.
  clients = (WITHOUT_DATA, '1')
  state = run.start_at_p0(True, clients=clients,
                          states_of={WITHOUT_DATA: '0'})
  new_state, client_states, metrics = run.next(state, clients)
  np.testing.assert_allclose(_flat(client_states[0]['local_model']),
                             THETAS['0'], **TOLERANCE)
  np.testing.assert_allclose(_flat(client_states[0]['control']), C_IS['0'],
                             **TOLERANCE)
  # Client '0' uploads a zero delta that still counts in the uniform mean.
  expected = ft.reference_round('avg', P0, THETAS, {'1': DATA['1']}, ETA,
                                LAMBDA, alpha=ALPHA, c=C, c_is=C_IS,
                                num_train_clients=3)
  np.testing.assert_allclose(
      _flat(new_state['global_model_weights'].trainable),
      P0 + (expected['p'] - P0) / 2, **TOLERANCE)
  np.testing.assert_allclose(_flat(new_state['control']), expected['c'],
                             **TOLERANCE)
  assert metrics['train']['num_examples'] == 6


@pytest.mark.parametrize('key,runtime', [
    ('naive', 'tff'), ('sgd', 'tff'), ('avg2', 'tff'), ('avg2', 'native')])
def test_a_diverged_client_is_dropped_as_a_client_without_data(rounds, key,
                                                               runtime):
  """A client whose update is NaN sends 0, keeps theta_i and c_i and reports
  no metrics: the round is the one where it had no data, bit for bit
  (before, w turned NaN for good)."""
  run = rounds(key, runtime)
  uses_control = key == 'avg2'
  results = []
  for client in (DIVERGED, WITHOUT_DATA):
    clients = (client, '1')
    state = run.start_at_p0(uses_control, clients=clients,
                            states_of={client: '0'})
    results.append(run.next(state, clients))
  (state, client_states, metrics), (expected, expected_states, _) = results
  for a, b in zip(tf.nest.flatten(state), tf.nest.flatten(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(np.all(np.isfinite(np.asarray(v)))
             for v in tf.nest.flatten(state))
  for a, b in zip(tf.nest.flatten(client_states),
                  tf.nest.flatten(expected_states)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_allclose(_flat(client_states[0]['local_model']),
                             THETAS['0'], **TOLERANCE)
  assert metrics['train']['num_examples'] == 6
  assert np.isfinite(metrics['train']['loss'])


@pytest.mark.parametrize('key', ['naive', 'avg2'])
def test_native_rounds_match_tff_process(rounds, key):
  uses_control = key == 'avg2'
  results = {}
  for runtime in ('tff', 'native'):
    run = rounds(key, runtime)
    state = run.start_at_p0(uses_control)
    for round_num in (1, 2):
      state, client_states, metrics = run.next(state, SAMPLED, round_num)
    results[runtime] = (state, client_states, metrics)
  (state, client_states, metrics), (native_state, native_client_states,
                                    native_metrics) = (results['tff'],
                                                       results['native'])
  tf.nest.map_structure(
      lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE),
      (state, client_states), (native_state, native_client_states))
  np.testing.assert_allclose(metrics['train']['loss'],
                             native_metrics['train']['loss'], **TOLERANCE)


@pytest.mark.parametrize('fit_unseen', [False, True])
def test_personalized_evaluation_uses_each_clients_theta(task, tmp_path,
                                                        fit_unseen):
  # Client '0' has a stored theta; '1' and '2' were never sampled: they use
  # the initial theta (0), or with fit_unseen the theta Step 1 fits on their
  # train batches (w fixed).
  evaluator = fedres_eval.PersonalizedEvaluator(
      task.residual_spec, task.personal_eval_data, LAMBDA, fit_unseen, seed=5)
  algorithm_state = {'local_model': ft.model_weights(P0, THETAS['0'])[1]}
  state_format = driver.state_format(
      registry.build('fedres_naive', task, _settings('fedres_naive')),
      tmp_path)
  round_testing.write_client_states(state_format, {'0': algorithm_state}, 1)
  index = client_states_lib.StateIndex(task.train_client_ids)
  index.commit([index.position('0')], 1)
  store = client_states_lib.ClientStates(state_format, index)
  results = evaluator(ft.model_weights(P0), store, lambda s: s['local_model'])

  squared_errors = []
  for client_id, (x, y) in DATA.items():
    theta = THETAS['0'] if client_id == '0' else np.zeros(2)
    if client_id != '0' and fit_unseen:
      for xb, yb in task.personal_eval_data.train_dataset_fn(client_id, 5):
        _, g_theta, _ = ft.gradients(P0, theta, xb.numpy(), yb.numpy()[:, 0])
        theta = theta - LAMBDA * g_theta
    x64 = x.astype(np.float64)
    prediction = np.c_[x64[:, :2], np.ones(len(x))] @ P0 + x64[:, 1:] @ theta
    squared_errors.extend((y - prediction)**2)
  assert results['num_clients'] == 3
  assert results['num_unseen_clients'] == 2
  np.testing.assert_allclose(results['loss'], np.mean(squared_errors),
                             rtol=1e-5)
  np.testing.assert_allclose(results['rmse'],
                             np.sqrt(np.mean(squared_errors)), rtol=1e-5)


# Rounds through the driver: theta_i and c_i persist across rounds.

MULTI_ROUND_SIZES = (4, 5, 2)
MULTI_ROUND_STEPS = 3  # K = 3 batches of 2: client '1' (5 examples) wraps
# around its data mid-batch, client '2' (2 examples) repeats its data.


def _revisiting_seed(num_rounds=3, num_clients=3, per_round=2):
  """A sampling seed under which some client is sampled in round 1, skips
  round 2 and returns in round 3 (it must read its round-1 state)."""
  for seed in range(100):
    plans = [set(driver.plan_round(seed, r, num_clients,
                                   per_round).client_indices)
             for r in range(1, num_rounds + 1)]
    if plans[0] - plans[1] & plans[2]:
      return seed, plans
  raise AssertionError('no suitable seed')


def _steps_batches(x, y, steps=MULTI_ROUND_STEPS, batch_size=ft.BATCH_SIZE):
  """The first `steps` batches of the client's data repeated (unshuffled)."""
  repeats = steps * batch_size // len(y) + 1
  x, y = np.concatenate([x] * repeats), np.concatenate([y] * repeats)
  return ft.batches(x, y, batch_size)[:steps]


def test_three_driver_rounds_carry_theta_and_controls(tmp_path):
  """FedResAvg-II, 3 rounds of 2 of 3 clients through `driver.train` (the
  CLI's loop), K = 3 steps a pass: each sampled client starts from the
  theta_i and c_i it left the last time it was sampled (a round earlier or
  two), the others keep theta_0 and c_i = 0, and w, c (the |S|/N rule) and
  train/loss follow the numpy rounds."""
  data = ft.client_data(sizes=MULTI_ROUND_SIZES)
  task = ft.linear_task(data, base.DataConfig(
      client_batch_size=ft.BATCH_SIZE, client_steps=MULTI_ROUND_STEPS,
      shuffle_buffer=1))  # A buffer of one keeps the examples' order.
  seed, plans = _revisiting_seed()
  definition = registry.build('fedres_avg', task, _settings('fedres_avg', 2))
  config = driver.RunConfig(
      root_output_dir=str(tmp_path), experiment_name='fedres_avg2',
      total_rounds=3, clients_per_round=2, rounds_per_eval=3,
      rounds_per_checkpoint=3, seed=seed, export=False)
  theta_0 = _flat(definition.initial_client_state()['local_model'])
  p = _flat(driver.initial_model_weights(task, seed).trainable)
  result = driver.train(definition, task, config)

  thetas = {c: theta_0 for c in data}
  c, c_is = np.zeros(3), {k: np.zeros(3) for k in data}
  losses = []
  for sampled in plans:
    ids = [str(k) for k in sorted(sampled)]
    expected = ft.reference_round(
        'avg', p, thetas, {k: data[k] for k in ids}, ETA, LAMBDA,
        alpha=ALPHA, c=c, c_is=c_is, num_train_clients=3,
        batch_fn=_steps_batches)
    p, c = expected['p'], expected['c']
    for k in ids:
      thetas[k] = expected['clients'][k]['theta']
      c_is[k] = expected['clients'][k]['c_i']
    losses.append(expected['loss'])
  np.testing.assert_allclose(_flat(result.model_weights.trainable), p,
                             **TOLERANCE)
  np.testing.assert_allclose(_flat(result.server_state['control']), c,
                             **TOLERANCE)
  stored = driver.committed_client_states(definition, task, config.run_dir)
  for client_id, state in zip(data, stored.read(list(data))):
    np.testing.assert_allclose(_flat(state['local_model']),
                               thetas[client_id], **TOLERANCE)
    np.testing.assert_allclose(_flat(state['control']), c_is[client_id],
                               **TOLERANCE)
  # Every client has been sampled, and c is the mean of their c_i.
  assert set().union(*plans) == {0, 1, 2}
  np.testing.assert_allclose(c, np.mean(list(c_is.values()), axis=0),
                             rtol=1e-12)
  with open(os.path.join(config.run_dir, 'metrics.csv')) as f:
    logged = [float(row['train/loss']) for row in csv.DictReader(f)]
  np.testing.assert_allclose(logged, losses, **TOLERANCE)


def test_unseen_clients_are_fitted_on_batches_of_the_runs_seed(task,
                                                              monkeypatch):
  made = []

  class Recorder:

    def __init__(self, *args, seed):
      del args
      made.append(seed)

    def __call__(self, *args):
      return {}

  monkeypatch.setattr(fedres_eval, 'PersonalizedEvaluator', Recorder)
  seeded = dataclasses.replace(task, data_config=base.DataConfig(seed=7))
  definition = registry.build('fedres_naive', seeded,
                              _settings('fedres_naive'))
  server_state = {'global_model_weights': tff.learning.models.ModelWeights(
      trainable=ft.model_weights(P0), non_trainable=[])}
  definition.personalization.evaluate(server_state, None)
  assert made == [7]
