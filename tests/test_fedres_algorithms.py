"""FedRes TFF rounds against hand-derived numpy rounds ([FedRes] Algs. 2-4).

One round of each variant on a linear residual model with an overlapping
global/local feature split, clients of different sizes (K_i = 2 and 3), non-zero
starting theta_i, c and c_i, and 2 of N = 3 clients sampled (|S|/N rule).
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import fedres_testing as ft
from pipeline import client_store
from tff_algos import fedres_eval
from tff_algos import fedres_native
from tff_algos import registry
from tff_algos.config import AlgorithmConfig

ModelWeights = tff.learning.models.ModelWeights
ETA, LAMBDA, ALPHA = 0.05, 0.1, 0.5
P0 = np.array([0.3, -0.2, 0.1])
THETAS = {'0': np.array([0.5, -0.4]), '1': np.array([-0.3, 0.2])}
C = np.array([0.1, 0.2, -0.1])
C_IS = {'0': np.array([0.3, -0.1, 0.2]), '1': np.array([-0.2, 0.1, 0.05])}
DATA = ft.client_data()  # Clients '0', '1', '2' with 4, 6, 2 examples.
SAMPLED = ('0', '1')
# key -> (algorithm, fedres_option, reference variant)
VARIANTS = {
    'naive': ('fedres_naive', 1, 'naive'),
    'sgd': ('fedres_sgd', 1, 'sgd'),
    'avg1': ('fedres_avg', 1, 'avg'),
    'avg2': ('fedres_avg', 2, 'avg'),
}
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _config(option=1, local_learning_rate=LAMBDA):
  return AlgorithmConfig(client_learning_rate=ETA,
                         local_learning_rate=local_learning_rate,
                         fedres_option=option, fedres_alpha=ALPHA)


@pytest.fixture(scope='module')
def task():
  return ft.linear_task(DATA)


@pytest.fixture(scope='module')
def algorithms(task):
  return {key: registry.build_algorithm(name, task.model_fn, _config(option),
                                        task=task)
          for key, (name, option, _) in VARIANTS.items()}


def _start(algorithm, uses_control, c=C, c_is=C_IS, clients=SAMPLED):
  """Server state at p = P0 (and c); client inputs with THETAS (and c_is)."""
  state = algorithm.set_model_weights(
      algorithm.process.initialize(),
      ModelWeights(trainable=ft.model_weights(P0), non_trainable=[]))
  if uses_control:
    state['control'] = ft.model_weights(c)
  client_inputs = []
  for client_id in clients:
    client_state = algorithm.client_state_fn()
    client_state['local_model'] = ft.model_weights(P0, THETAS[client_id])[1]
    if uses_control:
      client_state['control'] = ft.model_weights(c_is[client_id])
    client_inputs.append(collections.OrderedDict(
        data=ft.unshuffled_batches(*DATA[client_id]), state=client_state))
  return state, client_inputs


def _flat(weights):
  return ft.flat_global(weights)


@pytest.mark.parametrize('key', list(VARIANTS))
def test_one_round_matches_numpy_reference(algorithms, key):
  algorithm = algorithms[key]
  _, _, variant = VARIANTS[key]
  uses_control = key == 'avg2'
  state, client_inputs = _start(algorithm, uses_control)

  new_state, outputs, metrics = algorithm.process.next(state, client_inputs)

  expected = ft.reference_round(
      variant, P0, THETAS, {c: DATA[c] for c in SAMPLED}, ETA, LAMBDA,
      alpha=ALPHA if variant == 'avg' else 1.0,
      c=C if uses_control else None, c_is=C_IS if uses_control else None,
      num_train_clients=3)
  np.testing.assert_allclose(
      _flat(algorithm.get_model_weights(new_state).trainable), expected['p'],
      **TOLERANCE)
  for client_id, output in zip(SAMPLED, outputs):
    reference = expected['clients'][client_id]
    np.testing.assert_allclose(_flat(output['state']['local_model']),
                               reference['theta'], **TOLERANCE)
    if uses_control:
      np.testing.assert_allclose(_flat(output['state']['control']),
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


def test_option2_with_zero_controls_is_option1(algorithms):
  # With c = c_i = 0, Option II's first round is Option I's (the controls
  # only differ from zero afterwards).
  zeros = {k: np.zeros(3) for k in SAMPLED}
  state2, inputs2 = _start(algorithms['avg2'], True, np.zeros(3), zeros)
  state1, inputs1 = _start(algorithms['avg1'], False)
  new2, outputs2, _ = algorithms['avg2'].process.next(state2, inputs2)
  new1, outputs1, _ = algorithms['avg1'].process.next(state1, inputs1)
  np.testing.assert_allclose(_flat(new2['global_model_weights'].trainable),
                             _flat(new1['global_model_weights'].trainable),
                             **TOLERANCE)
  for out1, out2 in zip(outputs1, outputs2):
    np.testing.assert_allclose(_flat(out2['state']['local_model']),
                               _flat(out1['state']['local_model']),
                               **TOLERANCE)


def test_client_without_data_keeps_its_state(algorithms):
  algorithm = algorithms['avg2']
  state, client_inputs = _start(algorithm, True)
  x, y = DATA['0']
  client_inputs[0]['data'] = ft.unshuffled_batches(x[:0], y[:0])
  new_state, outputs, metrics = algorithm.process.next(state, client_inputs)
  np.testing.assert_allclose(_flat(outputs[0]['state']['local_model']),
                             THETAS['0'], **TOLERANCE)
  np.testing.assert_allclose(_flat(outputs[0]['state']['control']), C_IS['0'],
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


@pytest.mark.parametrize('key', ['naive', 'avg2'])
def test_in_process_rounds_match_tff_process(algorithms, task, key):
  name, option, _ = VARIANTS[key]
  algorithm = algorithms[key]
  in_process = fedres_native.InProcessRounds(name.split('_')[1], task,
                                             _config(option))
  uses_control = key == 'avg2'
  state, client_inputs = _start(algorithm, uses_control)
  native_state = tf.nest.map_structure(np.asarray, state)
  client_states = [i['state'] for i in client_inputs]
  native_client_states = client_states
  datasets = [i['data'] for i in client_inputs]
  for _ in range(2):
    state, outputs, metrics = algorithm.process.next(state, [
        collections.OrderedDict(data=d, state=s)
        for d, s in zip(datasets, client_states)])
    client_states = [o['state'] for o in outputs]
    native_state, native_client_states, native_metrics = in_process.next(
        native_state, datasets, native_client_states)
  tf.nest.map_structure(
      lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE),
      (state, client_states), (native_state, native_client_states))
  np.testing.assert_allclose(metrics['train']['loss'],
                             native_metrics['train']['loss'], **TOLERANCE)


@pytest.mark.parametrize('fit_unseen', [False, True])
def test_personalized_evaluation_uses_each_clients_theta(task, fit_unseen):
  # Client '0' has a stored theta; '1' and '2' were never sampled: they use
  # the initial theta (0), or with fit_unseen the theta Step 1 fits on their
  # train batches (w fixed).
  evaluator = fedres_eval.PersonalizedEvaluator(
      task.residual_spec, task.personal_eval_data, LAMBDA, fit_unseen, seed=5)
  algorithm_state = {'local_model': ft.model_weights(P0, THETAS['0'])[1]}
  store = client_store.ClientStateStore(
      lambda: {'local_model': [np.zeros((2, 1), np.float32)]})
  store.write(1, ['0'], [algorithm_state])
  results = evaluator(ft.model_weights(P0), store, lambda s: s['local_model'])
  store.close()

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
