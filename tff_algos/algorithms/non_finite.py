"""What a round does with values that are not finite, as tff.learning does.

tff.learning's FedAvg drops a client whose model update holds an inf or NaN
(its update zeroed, its weight 0, its metrics not reported), and its server
keeps the model and optimizer state when the mean update is not finite (for
instance when no client of the round had a non-zero weight: 0 / 0). The
baselines follow it exactly; SCAFFOLD and FedPVR apply the same rules, so
that with zero control variates they stay FedAvg in every case.
"""

import collections
import functools

import tensorflow as tf

from tff_algos import tff_internals


def zero_all_if_any_non_finite(structure):
  """(structure, 0), or (zeros like it, 1) if any value is not finite.

  What tff.learning's client updates apply (its `tensor_utils` function of
  the same name), with one read of each tensor in the common case: a sum
  with an inf or NaN term is not finite, so when the total of the tensors'
  sums is finite so is every value. Only a non-finite total (a non-finite
  value, or finite values whose sum overflows) takes tff.learning's
  elementwise test, which writes a mask as large as the update. One total,
  not a test per tensor: a client's state and update are a dozen tensors,
  and each op costs a TF executor 7-9 us besides its work (a TF profile of
  the benchmark's rounds), more than these small ones take.
  """
  flat = tf.nest.flatten(structure)
  if not flat:
    return structure, tf.constant(0)

  def all_true(flags):
    return functools.reduce(tf.logical_and, flags)

  sums = collections.defaultdict(list)  # add_n takes one dtype.
  for t in map(tf.convert_to_tensor, flat):
    sums[t.dtype].append(tf.reduce_sum(t))
  all_finite = tf.cond(
      all_true([tf.math.is_finite(tf.add_n(s)) for s in sums.values()]),
      lambda: tf.constant(True),
      lambda: all_true([tf.reduce_all(tf.math.is_finite(t)) for t in flat]))
  return tf.cond(
      all_finite, lambda: (structure, tf.constant(0)),
      lambda: (tf.nest.map_structure(tf.zeros_like, structure),
               tf.constant(1)))


def reset_metrics_if(dropped: tf.Tensor, model) -> None:
  """Resets `model`'s metrics when the client is dropped: a dropped client
  reports none (the runtime orders this before a later read of them, as
  the program order)."""

  def reset():
    model.reset_metrics()
    return tf.constant(True)

  tf.cond(dropped > 0, reset, lambda: tf.constant(False))


def apply_optimizer(optimizer, optimizer_state, weights, update):
  """tff.learning's finalizer: a step with `update` as the gradient, unless
  it is not finite (then weights and state stay). Returns (state, weights,
  measurements)."""
  new_state, new_weights = optimizer.next(optimizer_state, weights, update)
  reject, measurements = tff_internals.reject_non_finite_update(new_state,
                                                                update)
  kept_state, kept_weights = tf.cond(
      reject, lambda: (optimizer_state, weights),
      lambda: (new_state, new_weights))
  return kept_state, kept_weights, measurements
