"""Residual models of Federated Residual Learning ([FedRes] Sec. 2).

A prediction is f_w(x_g) + f_theta(x_l): a global model shared by all clients
on the global features x_g, plus the client's own local model on the local
features x_l, added in output (value or logit) space. The task decides what
x_g and x_l are (the same features, disjoint feature sets, or overlapping
ones) through `split_inputs`, which maps the task's model input to
`(x_g, x_l)`. The server never needs to know the local model's design.
"""

import dataclasses
from typing import Any, Callable, Optional

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class ResidualModelSpec:
  """A task's global + local model, as FedRes trains it."""
  # x_g -> outputs. Its weights are w, the global model of the server state.
  global_model_fn: Callable[[], tf.keras.Model]
  # x_l -> outputs of the same shape as the global model's. Its initial
  # weights are every client's initial theta, so they must not depend on
  # when the model is built: use zeros or seeded initializers.
  local_model_fn: Callable[[], tf.keras.Model]
  # Model input x (the first element of a batch) -> (x_g, x_l). Must only
  # select or transform features: it also runs on Keras symbolic inputs.
  split_inputs: Callable[[Any], tuple[Any, Any]]
  # Element spec of the model input x, batch dimension first.
  input_spec: Any
  loss_fn: Callable[[], tf.keras.losses.Loss]
  metrics_fn: Callable[[], list[tf.keras.metrics.Metric]]


def _symbolic_inputs(input_spec):
  """Keras inputs with the structure of `input_spec` (names from dict keys)."""
  if isinstance(input_spec, dict):
    return type(input_spec)(
        (name, tf.keras.Input(shape=spec.shape[1:], dtype=spec.dtype,
                              name=name))
        for name, spec in input_spec.items())
  return tf.nest.map_structure(
      lambda spec: tf.keras.Input(shape=spec.shape[1:], dtype=spec.dtype),
      input_spec)


def global_only_model(spec: ResidualModelSpec) -> tf.keras.Model:
  """x -> f_w(x_g): the global part alone, on the task's full model input.

  Its weights are exactly the global model's (same order), so it serves as
  the task's `keras_model_fn`: global-only evaluation, export, and baselines
  such as FedAvg train it directly.
  """
  inputs = _symbolic_inputs(spec.input_spec)
  global_inputs, _ = spec.split_inputs(inputs)
  return tf.keras.Model(inputs, spec.global_model_fn()(global_inputs),
                        name='global_part')


def personalized_model(spec: ResidualModelSpec,
                       global_model: Optional[tf.keras.Model] = None,
                       local_model: Optional[tf.keras.Model] = None
                       ) -> tf.keras.Model:
  """x -> f_w(x_g) + f_theta(x_l) on the task's full model input."""
  global_model = global_model or spec.global_model_fn()
  local_model = local_model or spec.local_model_fn()
  inputs = _symbolic_inputs(spec.input_spec)
  global_inputs, local_inputs = spec.split_inputs(inputs)
  outputs = tf.keras.layers.Add()(
      [global_model(global_inputs), local_model(local_inputs)])
  return tf.keras.Model(inputs, outputs, name='personalized_model')


def linear_model(input_shape: tuple[int, ...], output_dim: int,
                 use_bias: bool = False,
                 kernel_initializer: Any = 'zeros',
                 name: Optional[str] = None) -> tf.keras.Model:
  """x -> x A (+ b): linear regression, or the logits of logistic regression."""
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=input_shape),
      tf.keras.layers.Dense(output_dim, use_bias=use_bias,
                            kernel_initializer=kernel_initializer),
  ], name=name)


def mlp_model(input_shape: tuple[int, ...], hidden_units: tuple[int, ...],
              output_dim: int, seed: int,
              name: Optional[str] = None) -> tf.keras.Model:
  """A ReLU MLP with seeded initializers (usable as a local model)."""
  layers = [tf.keras.layers.InputLayer(input_shape=input_shape)]
  for i, units in enumerate(hidden_units):
    layers.append(tf.keras.layers.Dense(
        units, activation='relu',
        kernel_initializer=tf.keras.initializers.GlorotUniform(seed=seed + i)))
  layers.append(tf.keras.layers.Dense(output_dim, kernel_initializer='zeros'))
  return tf.keras.Sequential(layers, name=name)
