"""Centralized evaluation of a global model on a task's evaluation sets."""

from typing import Mapping

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tasks import base


def metric_prefix(eval_set_name: str) -> str:
  return 'eval' if not eval_set_name else f'eval_{eval_set_name}'


class Evaluator:
  """Evaluates model weights in-process; the Keras model is built once."""

  def __init__(self, task: base.Task):
    self._model = task.keras_model_fn()
    self._model.compile(loss=task.loss_fn(), metrics=task.metrics_fn())
    self._datasets = task.eval_datasets_fn()

  def __call__(
      self, weights: tff.learning.models.ModelWeights) -> dict[str, float]:
    weights.assign_weights_to(self._model)
    results = {}
    for name, dataset in self._datasets.items():
      values = self._model.evaluate(dataset, return_dict=True, verbose=0)
      for metric, value in values.items():
        results[f'{metric_prefix(name)}/{metric}'] = float(np.asarray(value))
    return results


def keras_model_with_weights(task: base.Task,
                             weights: tff.learning.models.ModelWeights
                             ) -> tf.keras.Model:
  model = task.keras_model_fn()
  weights.assign_weights_to(model)
  return model


def flatten_metrics(metrics: Mapping, prefix: str = '') -> dict[str, float]:
  """Nested metric structures -> {'train/loss': 0.3, ...} of Python floats."""
  flat = {}
  for key, value in metrics.items():
    name = f'{prefix}{key}'
    if hasattr(value, '_asdict'):  # A namedtuple (aggregator states).
      value = value._asdict()
    if isinstance(value, Mapping):
      flat.update(flatten_metrics(value, name + '/'))
    elif isinstance(value, (list, tuple)):
      # Aggregator measurements hold sequences, often empty ones.
      flat.update(flatten_metrics(dict(enumerate(value)), name + '/'))
    else:
      flat[name] = float(np.asarray(value))
  return flat
