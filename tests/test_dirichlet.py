"""tasks.dirichlet: FedDF's Dirichlet label partition."""

import warnings

import numpy as np
import pytest

from tasks import dirichlet


def feddf_reference(labels, num_clients, alpha, seed, num_classes):
  """FedDF's `build_non_iid_by_dirichlet` for one block of <= 10 workers.

  Transcribed from epfml/federated-learning-public-code (pcode/datasets/
  partition_data.py) so the partition can be checked draw for draw.
  """
  random_state = np.random.RandomState(seed)
  indices2targets = np.array(list(enumerate(labels)))
  random_state.shuffle(indices2targets)
  targets = indices2targets
  targets_size = len(targets)
  min_size = 0
  while min_size < int(0.50 * targets_size / num_clients):
    idx_batch = [[] for _ in range(num_clients)]
    for _class in range(num_classes):
      idx_class = np.where(targets[:, 1] == _class)[0]
      idx_class = targets[idx_class, 0]
      proportions = random_state.dirichlet(np.repeat(alpha, num_clients))
      proportions = np.array([
          p * (len(idx_j) < targets_size / num_clients)
          for p, idx_j in zip(proportions, idx_batch)])
      proportions = proportions / proportions.sum()
      proportions = (np.cumsum(proportions) *
                     len(idx_class)).astype(int)[:-1]
      idx_batch = [idx_j + idx.tolist() for idx_j, idx in
                   zip(idx_batch, np.split(idx_class, proportions))]
      min_size = min(len(idx_j) for idx_j in idx_batch)
  return idx_batch


def _labels(num_examples, num_classes, seed=0):
  # Every class present (FedDF draws for all classes 0..C-1).
  labels = np.arange(num_examples) % num_classes
  np.random.default_rng(seed).shuffle(labels)
  return labels


@pytest.mark.parametrize('alpha,num_clients,seed', [(0.1, 10, 0), (0.5, 10, 3),
                                                    (1.0, 4, 7)])
def test_matches_feddf_reference_draw_for_draw(alpha, num_clients, seed):
  labels = _labels(2000, 10)
  got = dirichlet.dirichlet_partition(labels, num_clients, alpha, seed)
  want = feddf_reference(labels, num_clients, alpha, seed, 10)
  assert len(got) == num_clients
  for client_got, client_want in zip(got, want):
    np.testing.assert_array_equal(client_got, np.asarray(client_want))


def test_every_example_in_exactly_one_client_and_min_size():
  labels = _labels(3000, 10)
  clients = dirichlet.dirichlet_partition(labels, 10, 0.1, seed=1)
  everything = np.concatenate(clients)
  np.testing.assert_array_equal(np.sort(everything), np.arange(3000))
  assert min(len(c) for c in clients) >= int(0.5 * 3000 / 10)


def test_deterministic_in_seed():
  labels = _labels(1000, 10)
  a = dirichlet.dirichlet_partition(labels, 5, 0.3, seed=11)
  b = dirichlet.dirichlet_partition(labels, 5, 0.3, seed=11)
  c = dirichlet.dirichlet_partition(labels, 5, 0.3, seed=12)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert any(len(x) != len(y) or np.any(x != y) for x, y in zip(a, c))


def _mean_classes_for_90_percent(labels, clients):
  """Mean number of classes it takes to cover 90% of a client's examples."""
  counts = []
  for client in clients:
    histogram = np.sort(np.bincount(labels[client], minlength=10))[::-1]
    counts.append(np.searchsorted(np.cumsum(histogram),
                                  0.9 * histogram.sum()) + 1)
  return float(np.mean(counts))


def test_alpha_controls_label_skew():
  labels = _labels(5000, 10)
  skewed = dirichlet.dirichlet_partition(labels, 10, 0.1, seed=0)
  uniform = dirichlet.dirichlet_partition(labels, 10, 100.0, seed=0)
  # alpha=0.1: a few classes dominate each client; alpha=100: close to i.i.d.
  # (9 of 10 classes are needed for 90% of an i.i.d. client's data).
  assert _mean_classes_for_90_percent(labels, skewed) <= 4.0
  assert _mean_classes_for_90_percent(labels, uniform) >= 8.5


def test_bad_arguments():
  labels = _labels(100, 10)
  with pytest.raises(ValueError, match='alpha'):
    dirichlet.dirichlet_partition(labels, 5, 0.0, seed=0)
  with pytest.raises(ValueError, match='num_clients'):
    dirichlet.dirichlet_partition(labels, 0, 0.5, seed=0)
  with pytest.raises(ValueError, match='cannot fill'):
    dirichlet.dirichlet_partition(labels[:3], 5, 0.5, seed=0)


def test_alpha_near_zero_is_a_partition_error_without_warnings():
  # Its draws are NaN; the cast of NaN cuts printed a RuntimeWarning.
  labels = np.repeat(np.arange(10), 20)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    with pytest.raises(dirichlet.PartitionError):
      dirichlet.dirichlet_partition(labels, 5, 1e-300, seed=0)
