"""Tests of the s% similarity partition ([SCAFFOLD] Sec. 7)."""

import numpy as np
import pytest

from pipeline.errors import UsageError
from tasks import partition


def _labels(num_examples=1000, num_classes=10, seed=0):
  return np.random.default_rng(seed).integers(0, num_classes, num_examples)


@pytest.mark.parametrize('similarity', [0.0, 10.0, 37.5, 100.0])
def test_equal_sizes_disjoint_and_in_range(similarity):
  labels = _labels(1003)
  clients = partition.similarity_partition(labels, 10, similarity, seed=1)
  assert len(clients) == 10
  assert {len(c) for c in clients} == {100}
  flat = np.concatenate(clients)
  assert len(np.unique(flat)) == len(flat) == 1000
  assert flat.min() >= 0 and flat.max() < 1003


def test_zero_similarity_is_label_sorted_shards():
  labels = _labels(1000)
  clients = partition.similarity_partition(labels, 20, 0.0, seed=3)
  # Concatenating the shards in client order gives the labels sorted.
  in_order = labels[np.concatenate(clients)]
  np.testing.assert_array_equal(in_order, np.sort(labels))
  # Each client of 50 examples spans at most two labels here (every label has
  # roughly 100 examples).
  assert max(len(np.unique(labels[c])) for c in clients) <= 2


def test_iid_share_and_sorted_share_sizes():
  labels = _labels(2000)
  num_clients, similarity = 10, 30.0
  clients = partition.similarity_partition(labels, num_clients, similarity,
                                           seed=5)
  client_size = 200
  iid_per_client = 60
  sorted_shards = [c[iid_per_client:] for c in clients]
  # The sorted shards, in client order, are label-sorted.
  in_order = labels[np.concatenate(sorted_shards)]
  assert np.all(np.diff(in_order) >= 0)
  # The i.i.d. shares have roughly the global label mix: every client's
  # i.i.d. share of 60 examples sees at least 5 of the 10 labels (a
  # label-sorted block of 60 would see at most 2).
  for c in clients:
    assert len(c) == client_size
    assert len(np.unique(labels[c[:iid_per_client]])) >= 5


def test_full_similarity_is_iid():
  labels = _labels(5000)
  clients = partition.similarity_partition(labels, 10, 100.0, seed=7)
  global_mix = np.bincount(labels, minlength=10) / len(labels)
  for c in clients:
    mix = np.bincount(labels[c], minlength=10) / len(c)
    # 500 examples per client: the standard deviation of one label's share
    # is about sqrt(0.1 * 0.9 / 500) = 0.013; 0.06 is more than 4 sigma.
    assert np.max(np.abs(mix - global_mix)) < 0.06


def test_heterogeneity_decreases_with_similarity():
  labels = _labels(5000)

  def mean_labels_per_client(similarity):
    clients = partition.similarity_partition(labels, 50, similarity, seed=0)
    return np.mean([len(np.unique(labels[c])) for c in clients])

  counts = [mean_labels_per_client(s) for s in (0, 10, 50, 100)]
  assert counts == sorted(counts)
  assert counts[0] <= 2 and counts[-1] == 10


def test_deterministic_in_seed():
  labels = _labels()
  a = partition.similarity_partition(labels, 10, 20.0, seed=11)
  b = partition.similarity_partition(labels, 10, 20.0, seed=11)
  c = partition.similarity_partition(labels, 10, 20.0, seed=12)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, z) for x, z in zip(a, c))


@pytest.mark.parametrize('num_clients,similarity,flag', [
    (0, 0.0, '--num_clients'), (1001, 0.0, '--num_clients'),
    (10, -1.0, '--similarity'), (10, 100.5, '--similarity')])
def test_bad_arguments_name_the_flag(num_clients, similarity, flag):
  with pytest.raises(UsageError, match=flag):
    partition.similarity_partition(_labels(), num_clients, similarity, seed=0)


def test_no_examples_is_named_as_such():
  # It said "impossible for 0 examples (allowed: 1..0)".
  with pytest.raises(UsageError, match=r'^the task\'s data hold no training '
                     r'examples to deal to --num_clients=4 clients$'):
    partition.similarity_partition(np.zeros([0], np.int64), 4, 0.0, seed=0)


def test_a_killed_builds_staging_file_is_removed_by_the_next_build(tmp_path):
  # A partition build SIGKILLed mid-write left its staging file (hundreds
  # of MB for EMNIST) and SQLite journal for good; a live build's stay.
  import fcntl  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from tasks import client_database  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'part.sqlite'
  abandoned = [tmp_path / 'part.sqlite.staging-99999999',
               tmp_path / 'part.sqlite.staging-99999999-journal',
               tmp_path / 'part.sqlite.staging-88888888-journal']
  live = tmp_path / 'part.sqlite.staging-77777777'
  others = [tmp_path / 'part.sqlite.staging-x', tmp_path / 'notes.staging-1']
  for staged in abandoned + [live] + others:
    staged.write_bytes(b'partial')
  fd = os.open(live, os.O_RDONLY)
  fcntl.flock(fd, fcntl.LOCK_EX)
  try:
    clients = client_database.materialize(
        str(path), 'v1', lambda: ([np.array([0, 1]), np.array([2])],
                                  [b'a', b'b', b'c']))
  finally:
    os.close(fd)
  assert sorted(clients.client_ids) == ['client_0', 'client_1']
  assert sorted(tmp_path.iterdir()) == sorted([path, live] + others)
