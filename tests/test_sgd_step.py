"""The fused in-place SGD steps against their unfused definitions."""

import numpy as np
import tensorflow as tf

from tff_algos.algorithms import sgd_step


def _values(seed, *shapes):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(s).astype(np.float32) * 3 for s in shapes]


SHAPES = ((257, 31), (31,), (5,))


def test_sgd_step_rounds_as_assign_sub():
  weights = _values(0, *SHAPES)
  gradients = _values(1, *SHAPES)
  fused = [tf.Variable(w) for w in weights]
  unfused = [tf.Variable(w) for w in weights]
  rate = 0.0731
  tf.function(lambda: sgd_step.sgd_step(fused, gradients, rate))()
  for variable, gradient in zip(unfused, gradients):
    variable.assign_sub(rate * gradient)
  for a, b in zip(fused, unfused):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_sgd_step_takes_indexed_slices():
  variable = tf.Variable(np.ones([4, 2], np.float32))
  gradient = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([2]),
                              tf.constant([4, 2]))
  sgd_step.sgd_step([variable], [gradient], 0.5)
  np.testing.assert_array_equal(
      variable.numpy(), [[1, 1], [1, 1], [0.5, 0], [1, 1]])


def test_corrected_step_with_equal_control_variates_is_plain_sgd():
  weights = _values(2, *SHAPES)
  gradients = _values(3, *SHAPES)
  corrected = [tf.Variable(w) for w in weights]
  plain = [tf.Variable(w) for w in weights]
  zeros = [np.zeros(s, np.float32) for s in SHAPES]
  sgd_step.corrected_sgd_step(corrected, gradients, 0.1, zeros)
  sgd_step.sgd_step(plain, gradients, 0.1)
  for a, b in zip(corrected, plain):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_corrected_step_is_the_scaffold_step():
  weights = _values(4, *SHAPES)
  gradients = _values(5, *SHAPES)
  client_cv = _values(6, *SHAPES)
  server_cv = _values(7, *SHAPES)
  rate = 0.05
  variables = [tf.Variable(w) for w in weights]
  sgd_step.corrected_sgd_step(
      variables, gradients, rate,
      [ci - c for ci, c in zip(client_cv, server_cv)])
  for variable, w, g, ci, c in zip(variables, weights, gradients, client_cv,
                                   server_cv):
    expected = w.astype(np.float64) - rate * (
        g.astype(np.float64) - ci + c)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=0,
                               atol=1e-5)
    assert not np.array_equal(variable.numpy(), w)


def test_sgd_step_in_a_graph_computes_the_step_as_written():
  # A gradient with a constant factor: TF's graph optimizer may fold eta into
  # it in the unfused form; the fused step must round fl(w - fl(eta * g)).
  rng = np.random.default_rng(6)
  weights = rng.standard_normal(10_000).astype(np.float32)
  values = rng.standard_normal(10_000).astype(np.float32)
  variable = tf.Variable(weights)
  rate, factor = 0.0731, 0.37
  tf.function(lambda t: sgd_step.sgd_step([variable], [factor * t], rate))(
      tf.constant(values))
  gradient = np.float32(factor) * values
  np.testing.assert_array_equal(variable.numpy(),
                                weights - np.float32(rate) * gradient)


def test_augmented_step_is_two_rounded_updates():
  # Mixed FL's gradient-transfer step w - eta (g + a): w - eta g, then
  # w - eta a, each rounded as written; with a = 0 it is plain SGD.
  weights = _values(8, *SHAPES)
  gradients = _values(9, *SHAPES)
  augmenting = _values(10, *SHAPES)
  rate = np.float32(0.0731)
  variables = [tf.Variable(w) for w in weights]
  tf.function(lambda: sgd_step.augmented_sgd_step(
      variables, gradients, rate, augmenting))()
  for variable, w, g, a in zip(variables, weights, gradients, augmenting):
    np.testing.assert_array_equal(variable.numpy(),
                                  (w - rate * g) - rate * a)
    np.testing.assert_allclose(
        variable.numpy(), w.astype(np.float64) - np.float64(rate) * (
            g.astype(np.float64) + a), rtol=0, atol=1e-5)
  with_zero = [tf.Variable(w) for w in weights]
  plain = [tf.Variable(w) for w in weights]
  sgd_step.augmented_sgd_step(with_zero, gradients, rate,
                              [np.zeros(s, np.float32) for s in SHAPES])
  sgd_step.sgd_step(plain, gradients, rate)
  for a, b in zip(with_zero, plain):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
