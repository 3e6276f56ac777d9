"""The native runtime's metric finalization equals tff.learning's.

The TFF runtime finalizes the clients' summed metrics with tff.learning's
finalizers inside its server computation; the native runtime, eagerly, with
one Keras metric per finalizer built once and reused
(`keras_model.finalize_metrics`). Checked on a task model's every metric,
for several rounds' sums in a row (a reused metric must not carry anything
from one round to the next) and against each finalizer called as
tff.learning calls it, in a graph.
"""

import numpy as np
import pytest
import tensorflow as tf

from tasks import base
from tasks import registry as tasks
from tff_algos.algorithms import keras_model


def _rounds_of_sums(num_rounds):
  """Random positive sums shaped as each metric's (as a round's)."""
  rng = np.random.default_rng(0)
  with tf.Graph().as_default():
    model = _task().model_fn()
    unfinalized = model.report_local_unfinalized_metrics()
  shapes = {name: [(v.shape, v.dtype) for v in tf.nest.flatten(values)]
            for name, values in unfinalized.items()}
  return [{name: [tf.constant(rng.uniform(1, 50, size=s.as_list()), d)
                  for s, d in specs]
           for name, specs in shapes.items()}
          for _ in range(num_rounds)]


def _task():
  return tasks.build_task('celeba_smile', base.DataConfig(
      client_batch_size=2, client_steps=1, use_synthetic_data=True,
      options={'celeba_mode': 'federated'}))


def test_eager_finalization_equals_tff_learnings_round_after_round():
  info = keras_model.model_info(_task().model_fn)
  names = sorted(info.metric_finalizers)
  # Loss, examples and batches besides the task's own (accuracy, AUC).
  assert len(names) >= 4 and 'auc' in names, names
  # Each finalizer's metric is built once, not at each call.
  reused = keras_model._ReusedKerasMetric  # pylint: disable=protected-access
  assert all(isinstance(keras_model._in_context(f), reused)  # pylint: disable=protected-access
             for f in info.metric_finalizers.values())
  for sums in _rounds_of_sums(3):
    eager = keras_model.finalize_metrics(info.metric_finalizers, sums)
    with tf.Graph().as_default() as graph:
      # tff.learning's own finalizers, each building its metric.
      expected = {name: info.metric_finalizers[name](sums_list)
                  for name, sums_list in
                  {n: [tf.constant(v.numpy()) for v in values]
                   for n, values in sums.items()}.items()}
      with tf.compat.v1.Session(graph=graph) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        expected = session.run(expected)
    for name in names:
      np.testing.assert_array_equal(np.asarray(eager[name]),
                                    expected[name], err_msg=name)


def test_a_finalizer_given_the_wrong_number_of_values_is_refused():
  info = keras_model.model_info(_task().model_fn)
  name = sorted(info.metric_finalizers)[0]
  with pytest.raises(ValueError) as error:
    keras_model.finalize_metrics({name: info.metric_finalizers[name]},
                                 {name: []})
  assert 'takes' in str(error.value) and 'got 0' in str(error.value)
