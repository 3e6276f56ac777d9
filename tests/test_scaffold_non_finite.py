"""SCAFFOLD and FedPVR with clients that send nothing usable, as FedAvg.

A round whose sampled clients all have weight 0 (no data, with
`--client_weighting=num_examples`) has a 0 / 0 mean update: the model and the
server optimizer state stay, as tff.learning's FedAvg keeps them (uniformly
weighted, such clients count with a zero delta: a zero mean update). A client whose update is not finite (it diverged) is
dropped with weight 0, keeps its c_i and adds nothing to c or to the
metrics. Before, both turned the model into NaN for good.
"""

import numpy as np
import pytest
import tensorflow as tf

from pipeline import driver
from tasks import base
from tff_algos.algorithms import registry
from tff_algos.algorithms import round as round_lib
from tests import round_testing

BATCH_SPEC = (tf.TensorSpec([None, 1], tf.float32),
              tf.TensorSpec([None, 1], tf.float32))
# 'A' trains; 'E' has no examples; 'N' has a NaN target, so its update is NaN.
CLIENT_DATA = {
    'A': ([[1.0], [2.0], [-1.0]], [[2.0], [3.0], [0.0]]),
    'E': ([], []),
    'N': ([[1.0], [0.5]], [[np.nan], [1.0]]),
}


def _keras_model():
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(1,)),
      tf.keras.layers.Dense(
          1, kernel_initializer=tf.keras.initializers.Constant(0.5),
          bias_initializer=tf.keras.initializers.Constant(-0.1))])


@pytest.fixture(scope='module')
def task(tmp_path_factory):
  data = round_testing.FileData(tmp_path_factory.mktemp('non_finite_data'),
                                BATCH_SPEC)
  for client_id, (x, y) in CLIENT_DATA.items():
    data.set_client(client_id, tf.data.Dataset.from_tensor_slices((
        np.array(x, np.float32).reshape([-1, 1]),
        np.array(y, np.float32).reshape([-1, 1]))).batch(2))
  return data.task(base.Task(
      name='non_finite', train_client_ids=tuple(CLIENT_DATA),
      client_dataset_computation=None, keras_model_fn=_keras_model,
      loss_fn=tf.keras.losses.MeanSquaredError, metrics_fn=list,
      batch_spec=BATCH_SPEC, eval_datasets_fn=dict, serving=None))


def _process(name, task, runtime, tmp_path, **values):
  values = dict(dict(client_learning_rate=0.1, server_learning_rate=1.0),
                **values)
  definition = registry.build(name, task,
                              round_testing.settings_of(name, **values))
  formats = driver.state_format(definition, str(tmp_path))
  return driver.compose_process(definition, task, runtime, formats), formats


def _assert_all_equal(a, b):
  tf.nest.assert_same_structure(a, b)
  for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('runtime', ['tff', 'native'])
@pytest.mark.parametrize('name,server_optimizer', [
    ('scaffold', 'sgd'), ('scaffold', 'adam'), ('fedpvr', 'sgdm')])
def test_a_round_without_data_leaves_the_server_state(task, tmp_path, runtime,
                                                      name, server_optimizer):
  process, _ = _process(name, task, runtime, tmp_path,
                        server_optimizer=server_optimizer,
                        client_weighting='num_examples')
  state = process.initialize()
  trained, _ = round_testing.run_round(process, state, ['A'], round_num=1,
                                       versions=[-1])
  # Round 2 samples only the empty client.
  after, metrics = round_testing.run_round(process, trained, ['E'],
                                           round_num=2, versions=[-1])
  _assert_all_equal(after, trained)
  assert int(metrics['train']['num_examples']) == 0


@pytest.mark.parametrize('runtime', ['tff', 'native'])
@pytest.mark.parametrize('weighting', ['num_examples', 'uniform'])
def test_a_diverged_client_is_dropped_and_keeps_its_control_variate(
    task, tmp_path, runtime, weighting):
  with_nan, formats = _process('scaffold', task, runtime, tmp_path / 'nan',
                               client_weighting=weighting)
  alone, _ = _process('scaffold', task, runtime, tmp_path / 'alone',
                      client_weighting=weighting)
  state, metrics = round_testing.run_round(with_nan, with_nan.initialize(),
                                           ['A', 'N'], versions=[-1, -1])
  expected, expected_metrics = round_testing.run_round(
      alone, alone.initialize(), ['A'], versions=[-1])
  for value in tf.nest.flatten(state):
    assert np.all(np.isfinite(np.asarray(value)))
  # x as if 'N' were not sampled; c <- c + (1/N) sum (c_i+ - c_i) either way.
  _assert_all_equal(round_lib.get_model_weights(state),
                    round_lib.get_model_weights(expected))
  np.testing.assert_array_equal(
      np.concatenate([np.ravel(c) for c in state['control_variate']]),
      np.concatenate([np.ravel(c) for c in expected['control_variate']]))
  assert any(np.any(np.asarray(c) != 0) for c in state['control_variate'])
  # Its metrics are not reported; its stored c_i is its old one (0).
  assert int(metrics['train']['num_examples']) == 3
  np.testing.assert_array_equal(metrics['train']['loss'],
                                expected_metrics['train']['loss'])
  stored = formats.read(tf.constant('N'), tf.constant(1, tf.int64))
  for c in tf.nest.flatten(stored):
    np.testing.assert_array_equal(c.numpy(), np.zeros_like(c.numpy()))


@pytest.mark.parametrize('runtime', ['tff', 'native'])
@pytest.mark.parametrize('weighting', ['num_examples', 'uniform'])
def test_with_a_diverged_client_the_first_round_is_still_fedavgs(
    task, tmp_path, runtime, weighting):
  # c = c_i = 0 in round 1: SCAFFOLD's x is FedAvg's, bit for bit, also
  # when a client is dropped.
  results = []
  for name in ('scaffold', 'fedavg'):
    process, _ = _process(name, task, runtime, tmp_path / name,
                          client_weighting=weighting)
    state, metrics = round_testing.run_round(
        process, process.initialize(), ['A', 'N', 'E'],
        versions=[-1] * 3 if name == 'scaffold' else None)
    results.append((round_lib.get_model_weights(state),
                    metrics['train']['loss']))
  _assert_all_equal(results[0], results[1])
