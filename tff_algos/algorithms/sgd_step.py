"""Plain SGD steps applied in place, one fused kernel per variable.

A client round of a large model with few local steps is bound by passes over
its weights. `variable.assign_sub(eta * g)` makes two of them (the product,
then the update); ResourceApplyGradientDescent makes one and rounds the same
way, fl(w - fl(eta * g)). Inside a tf.function the unfused form can round
differently: TF's graph optimizer folds eta into a constant factor of g
(eta * (s * t) becomes (eta * s) * t), one last-bit difference the fused
kernel does not make. It computes the step as written.

SCAFFOLD's corrected step w <- w - eta (g - c_i + c) is taken as two such
updates, w - eta g and then w + eta (c_i - c): two passes where the sum
g + (c - c_i), its product and the update made three. The two forms are the
same step in exact arithmetic; in floats they can differ in the last bit
(one rounding more). With c = c_i the second update adds exactly zero, so the
step is FedAvg's bit for bit.

Mixed FL's gradient-transfer client step w <- w - eta (g + a), with a the
broadcast augmenting gradient (1-w and 2-w GT with plain SGD), is taken the
same way: w - eta g, then w - eta a. With a = 0 it is plain SGD bit for bit.
"""

from typing import Sequence

import tensorflow as tf


def _apply(variable: tf.Variable, rate, delta) -> None:
  """variable <- variable - rate * delta (delta dense)."""
  delta = tf.convert_to_tensor(delta)
  handle = getattr(variable, 'handle', None)
  if handle is None:  # Not a resource variable: the unfused form.
    variable.assign_sub(tf.cast(rate, variable.dtype) * delta)
    return
  tf.raw_ops.ResourceApplyGradientDescent(
      var=handle, alpha=tf.cast(rate, variable.dtype), delta=delta)


def sgd_step(variables: Sequence[tf.Variable], gradients,
             learning_rate) -> None:
  """w <- w - eta * g for each variable (gradients dense or IndexedSlices)."""
  for variable, gradient in zip(variables, gradients, strict=True):
    _apply(variable, learning_rate, gradient)


def _two_updates(variables: Sequence[tf.Variable], gradients, learning_rate,
                 seconds, second_rate) -> None:
  """w <- w - eta g, then w <- w - second_rate * s, for each variable."""
  for variable, gradient, second in zip(variables, gradients, seconds,
                                        strict=True):
    _apply(variable, learning_rate, gradient)
    _apply(variable, second_rate, second)


def corrected_sgd_step(variables: Sequence[tf.Variable], gradients,
                       learning_rate, client_minus_server) -> None:
  """w <- w - eta (g - c_i + c), given c_i - c per variable (see above)."""
  _two_updates(variables, gradients, learning_rate, client_minus_server,
               -learning_rate)


def augmented_sgd_step(variables: Sequence[tf.Variable], gradients,
                       learning_rate, augmenting_gradient) -> None:
  """w <- w - eta (g + a), a the augmenting gradient (see above)."""
  _two_updates(variables, gradients, learning_rate, augmenting_gradient,
               learning_rate)
