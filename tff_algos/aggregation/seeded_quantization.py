"""A sum of uniformly quantized values whose stochastic rounding is seeded.

TFF's `EncodedSumFactory.quantize_above_threshold` (tensor_encoding's uniform
quantization) rounds with an unseeded `tf.random.uniform`: two runs with the
same flags differ, and a run resumed from a checkpoint does not repeat an
uninterrupted one. This factory computes the same quantization - per tensor
above `threshold` elements, values scaled to [0, 2^bits - 1] between the
tensor's min and max, rounded down or up with probability equal to the
fraction (unbiased), then scaled back - but draws the rounding's uniforms
with `stateless_uniform` from a key folded from (seed, round, the client's
tensor): the round counter lives in the aggregator state, which checkpoints
carry, and the tensor's fingerprint gives every client (and every tensor)
its own draws without the aggregator knowing client ids. Clients with equal
tensors in a round round them alike. Tensors of at most `threshold`
elements are summed exactly, as TFF's.
"""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


def quantized(x: tf.Tensor, bits: int, key: tf.Tensor) -> tf.Tensor:
  """x quantized to `bits` bits and scaled back (tensor_encoding's uniform
  quantization and its decoding), rounding with uniforms drawn from `key`
  (int64 [2]) and x's fingerprint."""
  min_x, max_x = tf.reduce_min(x), tf.reduce_max(x)
  max_value = tf.constant(2**bits - 1, x.dtype)
  scaled = tf.compat.v1.div_no_nan(x - min_x, max_x - min_x) * max_value
  floored = tf.floor(scaled)
  fingerprint = tf.bitcast(tf.fingerprint(tf.reshape(x, [1, -1]))[0],
                           tf.int64)
  uniform = tf.random.stateless_uniform(
      tf.shape(x), tf.random.experimental.stateless_fold_in(key, fingerprint),
      dtype=x.dtype)
  rounded = floored + tf.cast(uniform < scaled - floored, x.dtype)
  return rounded / max_value * (max_x - min_x) + min_x


class SeededQuantizedSumFactory(tff.aggregators.UnweightedAggregationFactory):
  """Sum of client values, those above `threshold` elements quantized."""

  def __init__(self, bits: int, threshold: int, seed: int):
    if not 1 <= bits <= 16:
      raise ValueError(f'bits must be in 1..16, got {bits}')
    if threshold < 0:
      raise ValueError(f'threshold must be >= 0, got {threshold}')
    self._bits = bits
    self._threshold = threshold
    self._seed = seed

  def create(self, value_type) -> tff.templates.AggregationProcess:

    @tff.tensorflow.computation
    def initialize():
      return collections.OrderedDict(seed=np.int64(self._seed),
                                     round=np.int64(0))

    state_type = initialize.type_signature.result

    @tff.tensorflow.computation(value_type, state_type)
    def client_value(value, state):
      key = tf.stack([state['seed'], state['round']])
      return tf.nest.map_structure(
          lambda x: x if x.shape.num_elements() <= self._threshold
          else quantized(x, self._bits, key), value)

    @tff.tensorflow.computation(state_type)
    def advance(state):
      return collections.OrderedDict(seed=state['seed'],
                                     round=state['round'] + 1)

    @tff.federated_computation(tff.FederatedType(state_type, tff.SERVER),
                               tff.FederatedType(value_type, tff.CLIENTS))
    def next_fn(state, value):
      values = tff.federated_map(client_value,
                                 (value, tff.federated_broadcast(state)))
      return tff.templates.MeasuredProcessOutput(
          state=tff.federated_map(advance, state),
          result=tff.federated_sum(values),
          measurements=tff.federated_value((), tff.SERVER))

    return tff.templates.AggregationProcess(
        tff.federated_computation(
            lambda: tff.federated_eval(initialize, tff.SERVER)), next_fn)
