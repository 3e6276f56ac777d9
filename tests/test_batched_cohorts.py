"""The batched (GPU) form of a group, forced on, against the loop, on CPU.

Clients of 3..8 examples in batches of 2 (shuffled by the round's seed): step
counts K_i differ within a group and odd clients end on a batch of one, so
the batched form pads batches and masks clients out of their missing steps.
Two rounds of 5 clients in groups of 3 and 2; the server states and metrics
must equal the loop's. Models or algorithms it cannot express run as the
loop, with one log line saying why.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

from pipeline import driver
from tasks import base
from tff_algos.algorithms import registry
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms.baselines import definition as baselines
from tff_algos.runtime import batched
from tff_algos.runtime import cohort
from tff_algos.runtime import native

NUM_CLIENTS = 6
FEATURES = (2, 3)
CLASSES = 3
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _examples(key, n, classes):
  x = tf.random.stateless_normal([n, *FEATURES], tf.stack([key, 0]))
  scores = tf.reshape(x, [n, -1])[:, :max(classes, 2)]
  if classes:  # Integer labels in [0, classes).
    y = tf.argmax(scores, axis=1)[:, tf.newaxis]
  else:  # A binary label.
    y = tf.cast(scores[:, :1] > scores[:, 1:2], tf.float32)
  return tf.data.Dataset.from_tensor_slices((x, y))


def _task(keras_model_fn, classes, loss_fn, metrics_fn) -> base.Task:
  config = base.DataConfig(client_batch_size=2, shuffle_buffer=16)

  def client_dataset(client_id, seed):
    key = tf.strings.to_number(client_id, tf.int64)
    examples = _examples(key, 8, classes).take(3 + key)
    return base.client_batches(examples, config, seed)

  label = (tf.TensorSpec([None, 1], tf.int64) if classes
           else tf.TensorSpec([None, 1], tf.float32))
  return base.Task(
      name='tiny', data_config=config,
      train_client_ids=tuple(str(k) for k in range(NUM_CLIENTS)),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=keras_model_fn, loss_fn=loss_fn, metrics_fn=metrics_fn,
      batch_spec=(tf.TensorSpec([None, *FEATURES], tf.float32), label),
      eval_datasets_fn=lambda: {},
      serving=base.ServingSpec('x', tf.TensorSpec([None, *FEATURES]),
                               lambda x: x, lambda y: {'y': y}))


def _sequential(outputs, hidden_activation='relu'):
  return lambda: tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=FEATURES),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(4, activation=hidden_activation),
      tf.keras.layers.Dense(outputs)])


def _functional_softmax():
  inputs = tf.keras.Input(FEATURES)
  hidden = tf.keras.layers.Dense(5, activation='tanh')(
      tf.keras.layers.Flatten()(inputs))
  return tf.keras.Model(inputs, tf.keras.layers.Dense(
      CLASSES, activation='softmax', use_bias=False)(hidden))


def binary_task():
  return _task(_sequential(1), 0,
               lambda: tf.keras.losses.BinaryCrossentropy(from_logits=True),
               lambda: [tf.keras.metrics.BinaryAccuracy(threshold=0.0)])


def multiclass_task():
  return _task(
      _sequential(CLASSES, 'sigmoid'), CLASSES,
      lambda: tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      lambda: [tf.keras.metrics.SparseCategoricalAccuracy()])


def regression_task():
  # A functional model's class probabilities, scored by their squared (and,
  # as a metric, absolute) distance to the label index: not a sensible
  # loss, but one of the supported Keras losses on a functional model.
  return _task(_functional_softmax, CLASSES,
               tf.keras.losses.MeanSquaredError,
               lambda: [tf.keras.metrics.MeanAbsoluteError()])


def _rounds(definition, task, mode, num_rounds=2, clients=5, group_size=3):
  process = driver.compose_process(definition, task, 'native',
                                   batched_cohorts=mode)
  state = round_lib.set_model_weights(
      process.initialize(), driver.initial_model_weights(task, 0))
  ids = np.asarray(task.train_client_ids, dtype=object)
  history = []
  for round_num in range(1, num_rounds + 1):
    plan = driver.plan_round(7, round_num, len(ids), clients)
    state, metrics = process.next(
        state, cohort.groups(ids[plan.client_indices], plan.client_seeds,
                             None, group_size), round_num, plan.server_seed)
    history.append((state, metrics))
  return process, history


def _assert_close(a, b):
  tf.nest.map_structure(
      lambda x, y: np.testing.assert_allclose(x, y, **TOLERANCE), a, b)


CASES = {
    'fedavg_binary': ('fedavg', binary_task, baselines.FedAvgSettings(
        client_learning_rate=0.5)),
    'fedavg_multiclass_uniform': ('fedavg', multiclass_task,
                                  baselines.FedAvgSettings(
                                      client_learning_rate=0.3,
                                      client_weighting='uniform')),
    'fedprox_functional_mse': ('fedprox', regression_task,
                               baselines.FedProxSettings(
                                   client_learning_rate=0.5,
                                   proximal_strength=0.3,
                                   server_learning_rate=0.8)),
}


@pytest.mark.parametrize('name', list(CASES))
def test_batched_cohorts_equal_the_loop(name, caplog):
  algorithm, task_fn, settings = CASES[name]
  task = task_fn()
  definition = registry.build(algorithm, task, settings)
  with caplog.at_level(logging.INFO):
    batched_process, batched_history = _rounds(definition, task, 'on')
  assert batched_process.batched, caplog.text
  assert 'Batched cohorts' not in caplog.text
  loop_process, loop_history = _rounds(definition, task, 'off')
  assert not loop_process.batched
  for (batched_state, batched_metrics), (state, metrics) in zip(
      batched_history, loop_history):
    _assert_close(batched_state, state)
    _assert_close(batched_metrics, metrics)
  # Unequal K_i: 5 clients of 3..8 examples in batches of 2 take 10+ steps.
  assert loop_history[0][1]['train']['num_batches'] > 10
  first, last = (round_lib.get_model_weights(s).trainable[0]
                 for s, _ in (loop_history[0], loop_history[-1]))
  assert not np.allclose(first, last)


def test_a_group_of_clients_padded_and_masked_equals_each_client_alone():
  # The group's sums against the sums of each client's own (loop) result.
  task = binary_task()
  definition = registry.build('fedavg', task, baselines.FedAvgSettings(
      client_learning_rate=0.5))
  dataset_fn = native.graph_mode_dataset_fn(task.client_dataset_fn)
  run = batched.build_group_update(definition, dataset_fn)
  message = definition.broadcast(round_lib.set_model_weights(
      definition.initial_server_state(),
      driver.initial_model_weights(task, 0)), None)
  ids = ['5', '0', '2']  # 8, 3 and 5 examples: 4, 2 and 3 steps.
  group = {'ids': tf.constant(ids), 'seeds': tf.constant([4, 5, 6], tf.int64)}
  together = run(message, tf.constant(1, tf.int64), group)
  loop = cohort.build_group_update(definition, dataset_fn, None)(
      definition.client_context())
  alone = [loop(message, tf.constant(1, tf.int64),
                {'ids': tf.constant([i]), 'seeds': tf.constant([s], tf.int64)})
           for i, s in zip(ids, [4, 5, 6])]
  summed = tf.nest.map_structure(lambda *parts: sum(parts), *alone)
  assert together['num_clients'] == 3
  assert together['metrics']['num_batches'][0] == 9
  _assert_close(together, summed)


def _with_dropout():
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=FEATURES),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dropout(0.0, name='dropout'),
      tf.keras.layers.Dense(1)])


@pytest.mark.parametrize('case,reason', [
    ('dropout', 'layer dropout (Dropout) is not supported'),
    ('adam', 'the client optimizer is adam, not sgd'),
])
def test_what_it_cannot_express_runs_as_the_loop_said_once(case, reason,
                                                           caplog):
  task = binary_task()
  settings = baselines.FedAvgSettings(client_learning_rate=0.5)
  if case == 'dropout':
    task = _task(_with_dropout, 0, task.loss_fn, task.metrics_fn)
  else:
    settings = baselines.FedAvgSettings(client_optimizer='adam')
  definition = registry.build('fedavg', task, settings)
  with caplog.at_level(logging.INFO):
    process, history = _rounds(definition, task, 'on', num_rounds=1)
  assert not process.batched
  lines = [r.getMessage() for r in caplog.records
           if r.getMessage().startswith('Batched cohorts')]
  assert lines == [f'Batched cohorts: {reason}; clients run one after '
                   'another in each group instead.']
  _, loop_history = _rounds(definition, task, 'off', num_rounds=1)
  _assert_close(history, loop_history)


def test_auto_keeps_the_loop_without_a_gpu(caplog):
  if tf.config.list_logical_devices('GPU'):
    pytest.skip('TF sees a GPU here')
  task = binary_task()
  definition = registry.build('fedavg', task, baselines.FedAvgSettings())
  with caplog.at_level(logging.INFO):
    process = driver.compose_process(definition, task, 'native')
  assert not process.batched
  assert 'Batched cohorts' not in caplog.text
