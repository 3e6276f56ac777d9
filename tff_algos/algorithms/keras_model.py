"""What the algorithms on a `tff.learning.models.VariableModel` share.

FedAvg, FedProx, FedSGD, SCAFFOLD/FedPVR and mixed FL train the task's
model as a `tff.learning` VariableModel: they read its shapes and metric
finalizers once (`ModelInfo`), start the server from its weights, and report
the clients' metrics summed then finalized, as tff.learning does.
"""

import collections
import dataclasses
import threading
from typing import Any, Callable

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos import tff_internals

ModelWeights = tff.learning.models.ModelWeights
ModelFn = Callable[[], tff.learning.models.VariableModel]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  """A model's variables and metrics, read from one probe instance."""
  variable_names: tuple[str, ...]  # Trainable variables, in model order.
  trainable_specs: tuple[tf.TensorSpec, ...]
  non_trainable_specs: tuple[tf.TensorSpec, ...]
  metric_finalizers: Any


def model_info(model_fn: ModelFn) -> ModelInfo:
  with tf.Graph().as_default():
    probe = model_fn()
    return ModelInfo(
        variable_names=tuple(v.name for v in probe.trainable_variables),
        trainable_specs=tuple(tf.TensorSpec(v.shape, v.dtype)
                              for v in probe.trainable_variables),
        non_trainable_specs=tuple(tf.TensorSpec(v.shape, v.dtype)
                                  for v in probe.non_trainable_variables),
        metric_finalizers=probe.metric_finalizers())


def initial_weights(model_fn: ModelFn) -> ModelWeights:
  """The weights of a freshly built model (the driver then sets its own)."""
  weights = ModelWeights.from_model(model_fn())
  return ModelWeights(
      trainable=[tf.identity(v.read_value()) for v in weights.trainable],
      non_trainable=[tf.identity(v.read_value())
                     for v in weights.non_trainable])


def assign_weights(model: tff.learning.models.VariableModel,
                   weights: ModelWeights) -> ModelWeights:
  """Sets the model's variables to `weights`; returns them as variables."""
  variables = ModelWeights.from_model(model)
  tf.nest.map_structure(lambda v, t: v.assign(t), variables, weights)
  return variables


def num_examples(output: tff.learning.models.BatchOutput) -> tf.Tensor:
  """Examples in a batch's forward pass (int64), as tff.learning counts."""
  if output.num_examples is None:
    return tf.shape(output.predictions, out_type=tf.int64)[0]
  return tf.cast(output.num_examples, tf.int64)


def finalize_metrics(metric_finalizers, summed_metrics):
  """`tff.learning.metrics.sum_then_finalize`'s finalization of the sums."""
  if callable(metric_finalizers):
    return _in_context(metric_finalizers)(summed_metrics)
  return collections.OrderedDict(
      (name, _in_context(finalizer)(summed_metrics[name]))
      for name, finalizer in metric_finalizers.items())


def client_fields(model_fn: ModelFn, info: ModelInfo) -> dict[str, Any]:
  """A round definition's client context, per-client reset and metric
  finalization when the clients train a tff.learning model."""
  return dict(client_context=model_fn,
              reset_client=lambda model: model.reset_metrics(),
              finalize_metrics=lambda sums: finalize_metrics(
                  info.metric_finalizers, sums))


def _in_context(finalizer):
  # A Keras metric's finalizer is a tf.function that builds a fresh metric
  # (variables) per call: fine once in a TFF computation's graph, refused
  # when called again and again eagerly (the native runtime). There one
  # metric per finalizer is built once and reused (`_ReusedKerasMetric`):
  # building it took 5-6 ms, 23 ms a round for a task's five metrics. In a
  # graph it is traced without AutoGraph, which would convert TFF's and
  # Keras's metric-building code (~0.3 s a process) that has no control flow
  # to convert.
  python_function = getattr(finalizer, 'python_function', None)
  if python_function is None:
    return finalizer
  if tf.executing_eagerly():
    with _EAGER_FINALIZERS_LOCK:
      if finalizer not in _EAGER_FINALIZERS:
        metric = tff_internals.keras_metric_of_finalizer(finalizer)
        _EAGER_FINALIZERS[finalizer] = (
            python_function if metric is None else _ReusedKerasMetric(metric))
      return _EAGER_FINALIZERS[finalizer]
  return tf.function(python_function, autograph=False)


_EAGER_FINALIZERS: dict[Callable, Callable] = {}  # finalizer -> eager one
_EAGER_FINALIZERS_LOCK = threading.Lock()


class _ReusedKerasMetric:
  """What tff.learning's Keras metric finalizer computes (the metric's
  variables set to the summed values, then its result), on one metric."""

  def __init__(self, metric: tf.keras.metrics.Metric):
    self._metric = metric

  def __call__(self, unfinalized_values):
    variables = self._metric.variables
    if len(variables) != len(unfinalized_values):
      raise ValueError(
          f'the finalizer of Keras metric {self._metric.name} takes '
          f'{len(variables)} values, got {len(unfinalized_values)}')
    for variable, value in zip(variables, unfinalized_values):
      variable.assign(value)
    return self._metric.result()


def specs_bytes(specs) -> int:
  return sum(int(s.shape.num_elements()) * s.dtype.size for s in specs)
