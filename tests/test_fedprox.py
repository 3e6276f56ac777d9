"""FedProx: the paper's proximal term, on both runtimes.

The client objective is F_k(w) + (mu/2) ||w - w^t||^2 ([FedProx] eq. 2), so
each local step adds mu * (w - w^t) to the gradient. TFF 0.87's
`build_weighted_fed_prox` adds mu * (w^t - w): tested here to be the
algorithm with -mu, so a fix upstream fails this test and can be adopted.
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from pipeline import driver
from tasks import base
from tff_algos.algorithms import keras_model
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import settings as settings_lib
from tff_algos.algorithms.baselines import definition as baselines

import round_testing
import scaffold_testlib as lib
import test_native_runtime

# One round by hand: y = w * x, squared error, w^t = 0.5, two clients of two
# examples each, batches of one (K = 2 steps), eta = 0.1, mu = 0.5, server
# SGD at eta_s = 1, clients weighted by examples (2 each: a plain mean).
W0, ETA, MU = 0.5, 0.1, 0.5
CLIENT_EXAMPLES = (((1.0, 2.0), (2.0, 3.0)),   # client A: (x, y) per step
                   ((1.0, 0.0), (-1.0, 1.0)))  # client B


def _step(w, x, y, mu):
  # d/dw (w x - y)^2 = 2 x (w x - y), plus the proximal gradient mu (w - w^t).
  return w - ETA * (2 * x * (w * x - y) + mu * (w - W0))


def hand_computed_round(mu):
  """The server model after one round of FedProx with strength `mu`."""
  finals = []
  for examples in CLIENT_EXAMPLES:
    w = W0
    for x, y in examples:
      w = _step(w, x, y, mu)
    finals.append(w)
  return W0 + sum(w - W0 for w in finals) / len(finals)


def test_hand_computation_written_out():
  # Client A: 0.5 -> 0.5 - 0.1 * (2*1*(0.5 - 2) + 0) = 0.8
  #           -> 0.8 - 0.1 * (2*2*(1.6 - 3) + 0.5*(0.8 - 0.5)) = 1.345
  # Client B: 0.5 -> 0.5 - 0.1 * (2*1*(0.5 - 0) + 0) = 0.4
  #           -> 0.4 - 0.1 * (2*(-1)*(-0.4 - 1) + 0.5*(0.4 - 0.5)) = 0.125
  # Server:   0.5 + ((1.345 - 0.5) + (0.125 - 0.5)) / 2 = 0.735
  assert hand_computed_round(MU) == pytest.approx(0.735, abs=1e-12)
  # FedAvg (mu = 0): 0.74; the reversed term (-mu): 0.745.
  assert hand_computed_round(0.0) == pytest.approx(0.74, abs=1e-12)
  assert hand_computed_round(-MU) == pytest.approx(0.745, abs=1e-12)


def _keras_model():
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(1,)),
      tf.keras.layers.Dense(1, use_bias=False,
                            kernel_initializer=tf.keras.initializers.Constant(
                                W0)),
  ])


BATCH_SPEC = (tf.TensorSpec([None, 1], tf.float32),
              tf.TensorSpec([None, 1], tf.float32))
CLIENT_IDS = ('A', 'B')


def _model_fn():
  return tff.learning.models.from_keras_model(
      _keras_model(), loss=tf.keras.losses.MeanSquaredError(),
      input_spec=BATCH_SPEC)


def _client_datasets():
  return [tf.data.Dataset.from_tensor_slices((
      np.array([[x] for x, _ in examples], np.float32),
      np.array([[y] for _, y in examples], np.float32))).batch(1)
          for examples in CLIENT_EXAMPLES]


@pytest.fixture(scope='module')
def two_client_task(tmp_path_factory):
  """Clients 'A' and 'B' train on `_client_datasets()`."""
  data = round_testing.FileData(tmp_path_factory.mktemp('fedprox_data'),
                                BATCH_SPEC)
  for client_id, dataset in zip(CLIENT_IDS, _client_datasets()):
    data.set_client(client_id, dataset)
  return data.task(base.Task(
      name='two_clients', train_client_ids=CLIENT_IDS,
      client_dataset_computation=None, keras_model_fn=_keras_model,
      loss_fn=tf.keras.losses.MeanSquaredError, metrics_fn=list,
      batch_spec=BATCH_SPEC, eval_datasets_fn=dict, serving=None))


def _one_round(definition, task, runtime):
  """(server state, metrics) after one round from the model's initial w."""
  process = driver.compose_process(definition, task, runtime)
  return round_testing.run_round(process, process.initialize(), CLIENT_IDS)


def _settings(mu):
  return baselines.FedProxSettings(client_learning_rate=ETA,
                                   server_learning_rate=1.0,
                                   proximal_strength=mu)


def _fedprox(mu):
  return baselines.fedprox(_model_fn, _settings(mu))


def _fedprox_with_any_strength(mu):
  """FedProx with strength `mu`, negative too (its settings refuse one)."""

  def proximal_gradient(trainable, server_trainable):
    return tf.nest.map_structure(lambda w, w_server: mu * (w - w_server),
                                 trainable, server_trainable)

  return dataclasses.replace(
      _fedprox(0.0), client_work=baselines.model_delta_work(
          settings_lib.optimizer('sgd', ETA),
          tff.learning.ClientWeighting.NUM_EXAMPLES,
          keras_model.model_info(_model_fn), gradient_term=proximal_gradient))


def _kernel(state):
  return float(np.asarray(
      round_lib.get_model_weights(state).trainable[0]).item())


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_one_round_matches_hand_computation(two_client_task, runtime):
  state, metrics = _one_round(_fedprox(MU), two_client_task, runtime)
  assert _kernel(state) == pytest.approx(hand_computed_round(MU), abs=1e-6)
  # Losses before each step: (0.5-2)^2, (1.6-3)^2, (0.5-0)^2, (-0.4-1)^2.
  assert float(metrics['train']['loss']) == pytest.approx(
      (2.25 + 1.96 + 0.25 + 1.96) / 4, abs=1e-6)
  assert int(metrics['train']['num_examples']) == 4


def test_tff_fed_prox_is_the_algorithm_with_negated_strength(
    two_client_task):
  """TFF 0.87's builder adds mu * (w^t - w): FedProx with -mu.

  If this fails after a TFF upgrade, TFF may have fixed the sign: compare
  its builder with `baselines.fedprox` at +mu and switch.
  """
  tff_process = tff.learning.algorithms.build_weighted_fed_prox(
      _model_fn, proximal_strength=MU,
      client_optimizer_fn=tff.learning.optimizers.build_sgdm(ETA),
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0),
      client_weighting=tff.learning.ClientWeighting.NUM_EXAMPLES,
      loop_implementation=tff.learning.LoopImplementation.DATASET_ITERATOR)
  tff_state = tff_process.next(tff_process.initialize(),
                               _client_datasets()).state
  negated_state, _ = _one_round(_fedprox_with_any_strength(-MU),
                                two_client_task, 'tff')
  tff_kernel = float(np.asarray(
      tff_state.global_model_weights.trainable[0]).item())
  assert tff_kernel == pytest.approx(hand_computed_round(-MU), abs=1e-6)
  assert tff_kernel == pytest.approx(_kernel(negated_state), abs=1e-7)
  assert abs(tff_kernel - hand_computed_round(MU)) > 5e-3


@pytest.fixture(scope='module')
def task():
  return test_native_runtime.tiny_task(client_steps=3)


def _settings_of(settings_class, proximal_strength=None):
  values = dict(client_learning_rate=0.3, server_optimizer='adam',
                server_learning_rate=0.05)
  if proximal_strength is not None:
    values['proximal_strength'] = proximal_strength
  return settings_class(**values)


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_zero_proximal_strength_equals_fedavg_exactly(task, runtime):
  # Clients of unequal sizes and shuffled batches, a non-SGD server
  # optimizer, two rounds: every state and metric value bit for bit.
  fedavg, fedprox_at_zero = [
      round_testing.run_planned_rounds(definition, task, runtime)
      for definition in (
          baselines.fedavg(task.model_fn,
                           _settings_of(baselines.FedAvgSettings)),
          baselines.fedprox(task.model_fn,
                            _settings_of(baselines.FedProxSettings, 0.0)))]
  for (state_a, metrics_a), (state_p, metrics_p) in zip(
      fedavg, fedprox_at_zero, strict=True):
    tf.nest.assert_same_structure(state_a, state_p)
    for a, p in zip(tf.nest.flatten(state_a), tf.nest.flatten(state_p)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(p))
    for a, p in zip(tf.nest.flatten(metrics_a), tf.nest.flatten(metrics_p)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(p))
  # The proximal term is active otherwise.
  with_term = round_testing.run_planned_rounds(
      baselines.fedprox(task.model_fn,
                        _settings_of(baselines.FedProxSettings, 1.0)),
      task, runtime)
  assert not np.array_equal(
      round_lib.get_model_weights(with_term[-1][0]).trainable[0],
      round_lib.get_model_weights(fedavg[-1][0]).trainable[0])


# FedAvg and FedSGD are declared as round definitions of their own (steps of
# a compiled group); they compute what tff.learning's builders compute.
@pytest.mark.parametrize('name', ['fedavg', 'fedsgd'])
def test_fedavg_and_fedsgd_equal_tff_learnings_builders(two_client_task, name):
  if name == 'fedavg':
    tff_process = tff.learning.algorithms.build_weighted_fed_avg(
        _model_fn,
        client_optimizer_fn=tff.learning.optimizers.build_sgdm(ETA),
        server_optimizer_fn=tff.learning.optimizers.build_adam(0.05),
        client_weighting=tff.learning.ClientWeighting.NUM_EXAMPLES)
    definition = baselines.fedavg(_model_fn, baselines.FedAvgSettings(
        client_learning_rate=ETA, server_optimizer='adam',
        server_learning_rate=0.05))
  else:
    tff_process = tff.learning.algorithms.build_fed_sgd(
        _model_fn,
        server_optimizer_fn=tff.learning.optimizers.build_sgdm(0.5))
    definition = baselines.fedsgd(_model_fn, baselines.FedSgdSettings(
        server_learning_rate=0.5))
  tff_state = tff_process.initialize()
  process = driver.compose_process(definition, two_client_task, 'tff')
  state = process.initialize()
  for _ in range(2):
    tff_output = tff_process.next(tff_state, _client_datasets())
    tff_state = tff_output.state
    state, metrics = round_testing.run_round(process, state, CLIENT_IDS)
    for ours, theirs in zip(
        round_lib.get_model_weights(state).trainable,
        tff_state.global_model_weights.trainable):
      np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs),
                                 rtol=1e-6, atol=1e-7)
    tff_train = tff_output.metrics['client_work']['train']
    assert float(metrics['train']['loss']) == pytest.approx(
        float(tff_train['loss']), rel=1e-6)
    assert int(metrics['train']['num_examples']) == int(
        tff_train['num_examples'])
  assert _kernel(state) != _kernel(process.initialize())


def _heavy_ball(momentum, learning_rate):
  """tff.learning's sgdm as a numpy step: a <- m a + g; w <- w - lr a."""
  accumulators = {}

  def step(name, w, g):
    accumulators[name] = momentum * accumulators.get(name, 0.0) + g
    return w - learning_rate * accumulators[name]

  return step


def _fedprox_momentum_reference(mu, rounds):
  """FedProx ([FedProx] Alg. 2, eq. 2) on scaffold_testlib's clients, numpy
  float64: each sampled client takes heavy-ball steps (momentum 0.9, fresh
  every round) on grad F_k(w) + mu (w - w^t); the server's heavy ball
  (momentum 0.9, kept across rounds) takes the clients' uniform mean of
  w^t - w_k as its gradient."""
  x = [lib.INITIAL_KERNEL.astype(np.float64), lib.INITIAL_BIAS.astype(np.float64)]
  server = _heavy_ball(0.9, lib.SERVER_LR)
  for round_num in range(1, rounds + 1):
    plan = driver.plan_round(lib.SEED, round_num, lib.NUM_CLIENTS,
                             lib.CLIENTS_PER_ROUND)
    updates = []
    for k in plan.client_indices:
      xs, ys = (lib.FEATURES[k].astype(np.float64),
                lib.TARGETS[k].astype(np.float64))
      client = _heavy_ball(0.9, lib.CLIENT_LR)
      w = [v.copy() for v in x]
      for start in range(0, len(xs), lib.BATCH_SIZE):
        _, grads = lib._loss_and_gradient(  # pylint: disable=protected-access
            w, xs[start:start + lib.BATCH_SIZE], ys[start:start + lib.BATCH_SIZE])
        w = [client(j, w[j], grads[j] + mu * (w[j] - x[j])) for j in range(2)]
      updates.append([x[j] - w[j] for j in range(2)])
    x = [server(j, x[j], np.mean([u[j] for u in updates], axis=0))
         for j in range(2)]
  return x


def test_fedprox_with_momentum_on_both_sides_over_rounds():
  """Three rounds with the driver's sampling, 2 of 4 unequal clients a round,
  client and server sgdm, uniform weighting: the proximal term enters each
  client momentum step's gradient, the client momentum restarts every round
  and the server's carries over, as the numpy rounds."""
  task = lib.build_linear_task()
  definition = baselines.fedprox(task.model_fn, baselines.FedProxSettings(
      client_learning_rate=lib.CLIENT_LR, client_optimizer='sgdm',
      server_learning_rate=lib.SERVER_LR, server_optimizer='sgdm',
      proximal_strength=0.7, client_weighting='uniform'))
  (state, _), = round_testing.run_planned_rounds(
      definition, task, 'tff', num_rounds=3,
      clients_per_round=lib.CLIENTS_PER_ROUND, seed=lib.SEED)[-1:]
  expected = _fedprox_momentum_reference(0.7, rounds=3)
  for actual, want in zip(round_lib.get_model_weights(state).trainable,
                          expected, strict=True):
    np.testing.assert_allclose(actual, want, rtol=2e-5, atol=1e-6)
  # The proximal term matters on this data.
  without = _fedprox_momentum_reference(0.0, rounds=3)
  assert np.abs(expected[0] - without[0]).max() > 1e-2
