"""Split conformal prediction sets for a trained classifier.

FedPVR ([FedPVR], Fig. 3 and App. C.1) compares methods by the coverage of
conformal prediction sets against their mean size. Split conformal with the
threshold score (Angelopoulos & Bates, "A gentle introduction to conformal
prediction", Sec. 1):
- score of a labelled example: s = 1 - p_y, one minus the model's probability
  of the true class, on n held-out calibration examples;
- for a miscoverage level alpha, qhat is the k-th smallest calibration score
  with k = ceil((n + 1)(1 - alpha)) (the finite-sample corrected
  ceil((n+1)(1-alpha))/n quantile); when k > n, qhat = inf (every class);
- the prediction set of a test input is {y : 1 - p_y <= qhat}.
If calibration and test examples are exchangeable, P(y in set) >= 1 - alpha.
"""

import dataclasses
import math
from typing import Sequence

import numpy as np
import tensorflow as tf

# Guards ceil((n+1)(1-alpha)) against float error, e.g. 20 * 0.95 = 19.000...1.
_RANK_TOLERANCE = 1e-9
DEFAULT_ALPHAS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


@dataclasses.dataclass(frozen=True)
class ConformalRow:
  """Conformal sets at one miscoverage level, measured on the test examples."""
  alpha: float
  # qhat: classes with 1 - p_y <= threshold are in the set.
  threshold: float
  coverage: float
  mean_set_size: float
  empty_set_fraction: float
  calibration_examples: int
  test_examples: int


def nonconformity_scores(probabilities: np.ndarray,
                         labels: np.ndarray) -> np.ndarray:
  """1 - probability of the true class, per example."""
  probabilities = np.asarray(probabilities)
  labels = np.asarray(labels).astype(np.int64).reshape(-1)
  return 1.0 - probabilities[np.arange(len(labels)), labels]


def calibrated_threshold(calibration_scores: np.ndarray, alpha: float) -> float:
  """qhat: the ceil((n+1)(1-alpha))-th smallest score (inf if beyond n)."""
  if not 0.0 < alpha < 1.0:
    raise ValueError(f'alpha must be in (0, 1), got {alpha}')
  scores = np.sort(np.asarray(calibration_scores, dtype=np.float64))
  n = len(scores)
  if n == 0:
    raise ValueError('no calibration examples')
  rank = math.ceil((n + 1) * (1.0 - alpha) - _RANK_TOLERANCE)
  if rank > n:
    return math.inf
  return float(scores[max(rank, 1) - 1])


def prediction_sets(probabilities: np.ndarray, threshold: float) -> np.ndarray:
  """Boolean [examples, classes]: class y is in the set iff 1 - p_y <= qhat."""
  return 1.0 - np.asarray(probabilities, dtype=np.float64) <= threshold


def conformal_table(calibration_probabilities: np.ndarray,
                    calibration_labels: np.ndarray,
                    test_probabilities: np.ndarray, test_labels: np.ndarray,
                    alphas: Sequence[float]) -> list[ConformalRow]:
  """Coverage and mean set size on the test examples for every alpha."""
  scores = nonconformity_scores(calibration_probabilities, calibration_labels)
  test_labels = np.asarray(test_labels).astype(np.int64).reshape(-1)
  if len(test_labels) == 0:
    raise ValueError('no test examples')
  rows = []
  for alpha in alphas:
    threshold = calibrated_threshold(scores, alpha)
    sets = prediction_sets(test_probabilities, threshold)
    sizes = sets.sum(axis=1)
    covered = sets[np.arange(len(test_labels)), test_labels]
    rows.append(ConformalRow(
        alpha=float(alpha), threshold=threshold,
        coverage=float(covered.mean()), mean_set_size=float(sizes.mean()),
        empty_set_fraction=float((sizes == 0).mean()),
        calibration_examples=len(scores), test_examples=len(test_labels)))
  return rows


def class_probabilities(outputs: np.ndarray, from_logits: bool) -> np.ndarray:
  """Model outputs -> [examples, classes] probabilities.

  A single output column is a binary model's positive class (sigmoid); it
  becomes the two columns (p(0), p(1)).
  """
  outputs = np.asarray(outputs, dtype=np.float64)
  if outputs.ndim == 1 or outputs.shape[-1] == 1:
    positive = outputs.reshape(-1)
    if from_logits:
      positive = 1.0 / (1.0 + np.exp(-positive))
    return np.stack([1.0 - positive, positive], axis=1)
  if from_logits:
    shifted = outputs - outputs.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)
  return outputs


def predict(model: tf.keras.Model, dataset: tf.data.Dataset,
            from_logits: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """(class probabilities, integer labels) over a dataset of (x, y) batches."""
  outputs, labels = [], []
  for inputs, batch_labels in dataset:
    outputs.append(model(inputs, training=False).numpy())
    labels.append(np.asarray(batch_labels).reshape(-1))
  if not outputs:
    raise ValueError('the dataset is empty')
  return (class_probabilities(np.concatenate(outputs), from_logits),
          np.concatenate(labels).astype(np.int64))


def split_indices(num_examples: int, calibration_fraction: float,
                  seed: int) -> tuple[np.ndarray, np.ndarray]:
  """A seeded random (calibration, test) split of range(num_examples).

  A uniformly random split keeps calibration and test examples exchangeable,
  which is all the coverage guarantee needs.
  """
  if not 0.0 < calibration_fraction < 1.0:
    raise ValueError('calibration_fraction must be in (0, 1), got '
                     f'{calibration_fraction}')
  num_calibration = int(round(calibration_fraction * num_examples))
  if not 0 < num_calibration < num_examples:
    raise ValueError(f'{num_examples} examples cannot be split into '
                     f'calibration and test at {calibration_fraction}')
  order = np.random.default_rng(seed).permutation(num_examples)
  return np.sort(order[:num_calibration]), np.sort(order[num_calibration:])


def conformal_report(model: tf.keras.Model,
                     calibration_ds: tf.data.Dataset, test_ds: tf.data.Dataset,
                     alphas: Sequence[float] = DEFAULT_ALPHAS,
                     from_logits: bool = True) -> list[ConformalRow]:
  """Calibrates on `calibration_ds` and measures the sets on `test_ds`."""
  calibration_probabilities, calibration_labels = predict(
      model, calibration_ds, from_logits)
  test_probabilities, test_labels = predict(model, test_ds, from_logits)
  return conformal_table(calibration_probabilities, calibration_labels,
                         test_probabilities, test_labels, alphas)
