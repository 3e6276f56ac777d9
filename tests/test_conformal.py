"""pipeline.conformal: split conformal prediction sets."""

import math

import numpy as np
import pytest
import tensorflow as tf

from pipeline import conformal

# True-class probabilities 0.95..0.3: scores 0.05, 0.1, ..., 0.7 (n = 9).
CALIBRATION_TRUE_PROBABILITY = np.array(
    [0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
TEST_PROBABILITIES = np.array([[0.6, 0.3, 0.1],
                               [0.2, 0.5, 0.3],
                               [0.25, 0.25, 0.5],
                               [0.1, 0.1, 0.8]])
TEST_LABELS = np.array([0, 0, 2, 1])


def _calibration():
  """Three classes; the true class is 0 and the rest share what is left."""
  p = CALIBRATION_TRUE_PROBABILITY
  probabilities = np.stack([p, (1 - p) / 2, (1 - p) / 2], axis=1)
  return probabilities, np.zeros(len(p), np.int64)


def test_scores_are_one_minus_true_class_probability():
  probabilities = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
  np.testing.assert_allclose(
      conformal.nonconformity_scores(probabilities, np.array([0, 1])),
      [0.3, 0.7])


@pytest.mark.parametrize('alpha,rank', [(0.1, 9), (0.2, 8), (0.5, 5),
                                        (0.3, 7)])
def test_threshold_is_finite_sample_corrected_order_statistic(alpha, rank):
  # rank = ceil((n + 1)(1 - alpha)) with n = 9.
  scores = 1 - CALIBRATION_TRUE_PROBABILITY
  assert conformal.calibrated_threshold(scores, alpha) == pytest.approx(
      np.sort(scores)[rank - 1], abs=0)


def test_threshold_is_infinite_when_rank_exceeds_n():
  scores = 1 - CALIBRATION_TRUE_PROBABILITY
  # ceil(10 * 0.95) = 10 > 9.
  assert conformal.calibrated_threshold(scores, 0.05) == math.inf


def test_rank_is_exact_despite_float_error():
  # 20 * (1 - 0.05) is 19 up to rounding: the 19th of 19 scores, not inf.
  scores = np.arange(19, dtype=np.float64)
  assert conformal.calibrated_threshold(scores, 0.05) == 18.0
  # n = 18: ceil(19 * 0.95) = ceil(18.05) = 19 > 18.
  assert conformal.calibrated_threshold(scores[:18], 0.05) == math.inf


def test_table_on_hand_computed_sets():
  probabilities, labels = _calibration()
  rows = conformal.conformal_table(probabilities, labels, TEST_PROBABILITIES,
                                   TEST_LABELS, alphas=[0.05, 0.1, 0.5])
  by_alpha = {row.alpha: row for row in rows}
  # alpha=0.05: qhat = inf, every set is all three classes.
  assert by_alpha[0.05].threshold == math.inf
  assert by_alpha[0.05].coverage == 1.0
  assert by_alpha[0.05].mean_set_size == 3.0
  # alpha=0.1: qhat = 0.7, sets {y : p_y >= 0.3}:
  # {0,1} covered, {1,2} missed, {2} covered, {2} missed.
  assert by_alpha[0.1].threshold == pytest.approx(0.7)
  assert by_alpha[0.1].coverage == 0.5
  assert by_alpha[0.1].mean_set_size == 1.5
  assert by_alpha[0.1].empty_set_fraction == 0.0
  # alpha=0.5: qhat = 0.3, sets {y : p_y >= 0.7}: {}, {}, {}, {2}.
  assert by_alpha[0.5].threshold == pytest.approx(0.3)
  assert by_alpha[0.5].coverage == 0.0
  assert by_alpha[0.5].mean_set_size == 0.25
  assert by_alpha[0.5].empty_set_fraction == 0.75
  assert all(row.calibration_examples == 9 and row.test_examples == 4
             for row in rows)


def test_boundary_class_is_included():
  # A class whose score equals qhat is in the set (the guarantee needs <=).
  sets = conformal.prediction_sets(np.array([[0.3, 0.7]]), 1 - 0.3)
  np.testing.assert_array_equal(sets, [[True, True]])


def test_marginal_coverage_guarantee_on_exchangeable_data():
  """Average coverage lies in [1 - alpha, 1 - alpha + 1/(n+1)] (+ noise)."""
  rng = np.random.default_rng(0)
  n, num_test, num_classes, trials = 50, 200, 5, 300
  alphas = [0.1, 0.3]
  coverages = {a: [] for a in alphas}
  for _ in range(trials):
    probabilities = rng.dirichlet(np.ones(num_classes), size=n + num_test)
    # Labels drawn from a different distribution than the model's: coverage
    # must hold whatever the model's quality.
    labels = rng.integers(0, num_classes, size=n + num_test)
    rows = conformal.conformal_table(probabilities[:n], labels[:n],
                                     probabilities[n:], labels[n:], alphas)
    for row in rows:
      coverages[row.alpha].append(row.coverage)
  for alpha in alphas:
    mean = np.mean(coverages[alpha])
    # Standard error of the mean over 300 trials is below 0.005.
    assert 1 - alpha - 0.015 <= mean <= 1 - alpha + 1 / (n + 1) + 0.015, (
        alpha, mean)


def test_sets_shrink_as_alpha_grows():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(400, 6)) * 3
  probabilities = conformal.class_probabilities(logits, from_logits=True)
  labels = np.array([rng.choice(6, p=p) for p in probabilities])
  rows = conformal.conformal_table(probabilities[:200], labels[:200],
                                   probabilities[200:], labels[200:],
                                   [0.02, 0.1, 0.2, 0.4])
  sizes = [row.mean_set_size for row in rows]
  coverages = [row.coverage for row in rows]
  assert sizes == sorted(sizes, reverse=True)
  assert coverages == sorted(coverages, reverse=True)


def test_class_probabilities_softmax_and_binary():
  logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
  expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  np.testing.assert_allclose(
      conformal.class_probabilities(logits, from_logits=True), expected)
  binary = conformal.class_probabilities(np.array([[0.0], [np.log(3.0)]]),
                                         from_logits=True)
  np.testing.assert_allclose(binary, [[0.5, 0.5], [0.25, 0.75]])
  np.testing.assert_allclose(
      conformal.class_probabilities(np.array([[0.2, 0.8]]),
                                    from_logits=False), [[0.2, 0.8]])


def test_split_indices_partition_and_determinism():
  calibration, test = conformal.split_indices(11, 0.5, seed=3)
  assert len(calibration) == 6 and len(test) == 5
  np.testing.assert_array_equal(
      np.sort(np.concatenate([calibration, test])), np.arange(11))
  again = conformal.split_indices(11, 0.5, seed=3)
  np.testing.assert_array_equal(calibration, again[0])
  with pytest.raises(ValueError):
    conformal.split_indices(1, 0.5, seed=0)
  with pytest.raises(ValueError):
    conformal.split_indices(10, 1.0, seed=0)


def test_report_runs_the_model_on_both_datasets():
  # A linear model with known weights: logits = x @ W.
  weights = np.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]], np.float32)
  model = tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(2,)),
                               tf.keras.layers.Dense(3, use_bias=False)])
  model.set_weights([weights])
  rng = np.random.default_rng(2)
  x = rng.normal(size=(30, 2)).astype(np.float32)
  y = rng.integers(0, 3, size=30)
  calibration = tf.data.Dataset.from_tensor_slices((x[:20], y[:20])).batch(7)
  test = tf.data.Dataset.from_tensor_slices((x[20:], y[20:])).batch(4)
  rows = conformal.conformal_report(model, calibration, test, [0.2, 0.5])
  probabilities = conformal.class_probabilities(x @ weights, from_logits=True)
  expected = conformal.conformal_table(probabilities[:20], y[:20],
                                       probabilities[20:], y[20:], [0.2, 0.5])
  for got, want in zip(rows, expected):
    assert got.coverage == want.coverage
    assert got.mean_set_size == want.mean_set_size
    assert got.threshold == pytest.approx(want.threshold, rel=1e-5)
