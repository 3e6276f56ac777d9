"""FedProx: the paper's proximal term, on both runtimes.

The client objective is F_k(w) + (mu/2) ||w - w^t||^2 ([FedProx] eq. 2), so
each local step adds mu * (w - w^t) to the gradient. TFF 0.87's
`build_weighted_fed_prox` adds mu * (w^t - w): tested here to be the
algorithm with -mu, so a fix upstream fails this test and can be adopted.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_algos import baselines_native
from tff_algos import fedprox
from tff_algos import registry
from tff_algos.config import AlgorithmConfig

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


def _model_fn():
  keras_model = tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(1,)),
      tf.keras.layers.Dense(1, use_bias=False,
                            kernel_initializer=tf.keras.initializers.Constant(
                                W0)),
  ])
  return tff.learning.models.from_keras_model(
      keras_model, loss=tf.keras.losses.MeanSquaredError(),
      input_spec=(tf.TensorSpec([None, 1], tf.float32),
                  tf.TensorSpec([None, 1], tf.float32)))


def _client_datasets():
  return [tf.data.Dataset.from_tensor_slices((
      np.array([[x] for x, _ in examples], np.float32),
      np.array([[y] for _, y in examples], np.float32))).batch(1)
          for examples in CLIENT_EXAMPLES]


def _one_round(algorithm, runtime):
  """(server state, metrics) after one round from the model's initial w."""
  if runtime == 'native':
    rounds = algorithm.native_process_fn()
    state, _, metrics = rounds.next(rounds.initialize(), _client_datasets(),
                                    None)
  else:
    state, _, metrics = algorithm.process.next(
        algorithm.process.initialize(), _client_datasets())
  return state, metrics


def _fedprox(mu):
  return registry.build_algorithm('fedprox', _model_fn, AlgorithmConfig(
      client_learning_rate=ETA, server_learning_rate=1.0,
      proximal_strength=mu))


def _kernel(state):
  return float(np.asarray(state.global_model_weights.trainable[0]).item())


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_one_round_matches_hand_computation(runtime):
  state, metrics = _one_round(_fedprox(MU), runtime)
  assert _kernel(state) == pytest.approx(hand_computed_round(MU), abs=1e-6)
  # Losses before each step: (0.5-2)^2, (1.6-3)^2, (0.5-0)^2, (-0.4-1)^2.
  assert float(metrics['train']['loss']) == pytest.approx(
      (2.25 + 1.96 + 0.25 + 1.96) / 4, abs=1e-6)
  assert int(metrics['train']['num_examples']) == 4


def test_tff_fed_prox_is_the_algorithm_with_negated_strength():
  """TFF 0.87's builder adds mu * (w^t - w): FedProx with -mu.

  If this fails after a TFF upgrade, TFF may have fixed the sign: compare
  its builder with `fedprox.build_weighted_fed_prox` at +mu and switch.
  """
  optimizers = dict(
      client_optimizer_fn=tff.learning.optimizers.build_sgdm(ETA),
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0),
      client_weighting=tff.learning.ClientWeighting.NUM_EXAMPLES,
      loop_implementation=baselines_native.LOOP)
  tff_process = tff.learning.algorithms.build_weighted_fed_prox(
      _model_fn, proximal_strength=MU, **optimizers)
  tff_state = tff_process.next(tff_process.initialize(),
                               _client_datasets()).state
  negated = fedprox.build_weighted_fed_prox(_model_fn, proximal_strength=-MU,
                                            **optimizers)
  negated_state = negated.next(negated.initialize(), _client_datasets()).state
  assert _kernel(tff_state) == pytest.approx(hand_computed_round(-MU),
                                             abs=1e-6)
  assert _kernel(tff_state) == pytest.approx(_kernel(negated_state), abs=1e-7)
  assert abs(_kernel(tff_state) - hand_computed_round(MU)) > 5e-3


@pytest.fixture(scope='module')
def task():
  return test_native_runtime.tiny_task(client_steps=3)


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_zero_proximal_strength_equals_fedavg_exactly(task, runtime):
  # Clients of unequal sizes and shuffled batches, a non-SGD server
  # optimizer, two rounds: every state and metric value bit for bit.
  config = AlgorithmConfig(client_learning_rate=0.3, server_optimizer='adam',
                           server_learning_rate=0.05, proximal_strength=0.0)
  histories = [
      test_native_runtime.run_rounds(
          registry.build_algorithm(name, task.model_fn, config), task,
          runtime)
      for name in ('fedavg', 'fedprox')]
  fedavg, fedprox_at_zero = histories
  for (state_a, _, metrics_a), (state_p, _, metrics_p) in zip(
      fedavg, fedprox_at_zero, strict=True):
    tf.nest.assert_same_structure(state_a, state_p)
    for a, p in zip(tf.nest.flatten(state_a), tf.nest.flatten(state_p)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(p))
    for a, p in zip(tf.nest.flatten(metrics_a), tf.nest.flatten(metrics_p)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(p))
  # The proximal term is active otherwise.
  with_term = test_native_runtime.run_rounds(
      registry.build_algorithm('fedprox', task.model_fn,
                               AlgorithmConfig(client_learning_rate=0.3,
                                               server_optimizer='adam',
                                               server_learning_rate=0.05,
                                               proximal_strength=1.0)),
      task, runtime)
  assert not np.array_equal(
      with_term[-1][0].global_model_weights.trainable[0],
      fedavg[-1][0].global_model_weights.trainable[0])
