"""A Gaussian sum query whose noise is a function of a seed and the round.

tensorflow_privacy's `GaussianSumQuery` draws its noise from an unseeded
stateful op: inside a TFF computation every run draws fresh, unrepeatable
noise, so a run resumed from a checkpoint could not repeat an uninterrupted
one. Here the noise of the n-th release is `stateless_normal(seed=(seed, n))`
and n lives in the query's global state, which is part of the aggregator
state the checkpoints carry: a resumed run adds exactly the noise the
uninterrupted run added. Clipping and the released DP event are
`GaussianSumQuery`'s. Whoever knows the seed can regenerate the noise, so
the guarantee holds for a released model only if the seed stays secret
(docs/aggregators.md).
"""

import collections

import dp_accounting
import tensorflow as tf
import tensorflow_privacy as tfp


class SeededGaussianSumQuery(tfp.GaussianSumQuery):
  """Clips each record to `l2_norm_clip`; adds N(0, stddev^2) to the sum."""

  # pylint: disable=invalid-name
  _GlobalState = collections.namedtuple(
      '_GlobalState', ['l2_norm_clip', 'stddev', 'seed', 'releases'])

  def __init__(self, l2_norm_clip: float, stddev: float, seed: int):
    super().__init__(l2_norm_clip, stddev)
    self._seed = seed

  def make_global_state(self, l2_norm_clip, stddev, seed=None, releases=0):
    return self._GlobalState(
        tf.cast(l2_norm_clip, tf.float32), tf.cast(stddev, tf.float32),
        tf.cast(self._seed if seed is None else seed, tf.int64),
        tf.cast(releases, tf.int64))

  def get_noised_result(self, sample_state, global_state):
    key = tf.stack([global_state.seed, global_state.releases])
    leaves = tf.nest.flatten(sample_state)
    noised = []
    for index, value in enumerate(leaves):
      leaf_key = tf.random.experimental.stateless_fold_in(key, index)
      noise = tf.random.stateless_normal(tf.shape(value), leaf_key,
                                         stddev=global_state.stddev)
      noised.append(value + tf.cast(noise, value.dtype))
    result = tf.nest.pack_sequence_as(sample_state, noised)
    new_state = global_state._replace(releases=global_state.releases + 1)
    event = dp_accounting.GaussianDpEvent(global_state.stddev /
                                          global_state.l2_norm_clip)
    return result, new_state, event

  def derive_metrics(self, global_state):
    return collections.OrderedDict(clip_norm=global_state.l2_norm_clip,
                                   noise_stddev=global_state.stddev)
