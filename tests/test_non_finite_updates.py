"""FedAvg/FedSGD's non-finite check: every value zeroed if any is not finite.

The check sums the tensors first and tests values one by one only when the
total is not finite; these cases pin that it decides exactly as the elementwise
test (tff.learning's), including finite values whose sum overflows.
"""

import numpy as np
import pytest
import tensorflow as tf

from tff_algos.algorithms import non_finite

BIG = np.float32(3e38)


@pytest.mark.parametrize('values, expect_zeroed', [
    ([np.ones([3, 2], np.float32), np.arange(4, dtype=np.float32)], False),
    ([np.ones([3, 2], np.float32), np.array([1, np.nan], np.float32)], True),
    ([np.array([np.inf], np.float32), np.zeros([2], np.float32)], True),
    ([np.array([-np.inf, 1], np.float32)], True),
    # Opposite infinities sum to NaN: still not finite.
    ([np.array([np.inf, -np.inf], np.float32)], True),
    # Finite values whose float32 sum overflows to inf: kept.
    ([np.array([BIG, BIG, BIG], np.float32), np.ones([2], np.float32)], False),
    ([np.array([-1e308, -1e308], np.float64)], False),
    # Each tensor's sum finite, their total not: kept.
    ([np.array([BIG], np.float32), np.array([BIG, 1], np.float32)], False),
    # Tensors of two dtypes, the non-finite value in either.
    ([np.ones([2], np.float64), np.array([np.nan], np.float32)], True),
    ([np.array([-np.inf], np.float64), np.ones([2], np.float32)], True),
    ([np.array([BIG], np.float32), np.array([1e308], np.float64),
      np.array([BIG], np.float32)], False),
])
def test_zeroes_exactly_when_a_value_is_not_finite(values, expect_zeroed):
  assert expect_zeroed == (not all(np.all(np.isfinite(v)) for v in values))
  for run in (lambda f, x: f(x), lambda f, x: tf.function(f)(x)):
    result, flag = run(non_finite.zero_all_if_any_non_finite,
                       [tf.constant(v) for v in values])
    assert int(flag) == int(expect_zeroed)
    for got, value in zip(result, values):
      np.testing.assert_array_equal(
          got.numpy(), np.zeros_like(value) if expect_zeroed else value)


def test_empty_structure_is_kept():
  result, flag = non_finite.zero_all_if_any_non_finite([])
  assert result == [] and int(flag) == 0
