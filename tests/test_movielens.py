"""movielens ([MixedFL] Sec. 5.3): loaders on files in the real formats, examples,
losses, analytic client costs, and end-to-end runs of every mixed algorithm
and of the fedavg baseline."""

import collections
import csv
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import round_testing
from pipeline import driver
from pipeline.errors import UsageError
from tasks import base
from tasks import movielens
from tasks import movielens_files
from tasks import registry as task_registry
from tff_algos.algorithms import registry
from tff_algos.runtime import communication

REAL_MOVIELENS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '..',
    'shared', 'data', 'movielens-100k')

# user, movie, rating, timestamp; user 3's two movies share a timestamp.
RATINGS = [(1, 5, 4, 100), (1, 2, 3, 50), (1, 9, 5, 200), (2, 2, 1, 10),
           (2, 7, 2, 20), (3, 4, 5, 30), (3, 3, 4, 30)]


def _write(directory, name, lines):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, name), 'w', encoding='latin-1') as f:
    f.write(''.join(line + '\n' for line in lines))
  return str(directory)


def write_ratings_dat(directory, ratings=RATINGS):
  return _write(directory, 'ratings.dat',
                ['::'.join(map(str, row)) for row in ratings])


def write_u_data(directory, ratings=RATINGS):
  return _write(directory, 'u.data',
                ['\t'.join(map(str, row)) for row in ratings])


def synthetic_like_ratings(num_users=40, num_movies=30, seed=0):
  """Enough users for every split, as (user, movie, rating, time) rows."""
  rng = np.random.default_rng(seed)
  rows = []
  for user in range(1, num_users + 1):
    for t, movie in enumerate(rng.choice(num_movies, 8, replace=False) + 1):
      rows.append((user, int(movie), 3, 1000 + t))
  return rows


# --- Files -------------------------------------------------------------------


@pytest.mark.parametrize('write', [write_ratings_dat, write_u_data])
def test_both_rating_formats_read_the_same_columns(tmp_path, write):
  directory = write(tmp_path)
  ratings = movielens_files.read_ratings(movielens_files.find_ratings(
      directory))
  expected = np.array(RATINGS)
  np.testing.assert_array_equal(ratings['user'], expected[:, 0])
  np.testing.assert_array_equal(ratings['movie'], expected[:, 1])
  np.testing.assert_array_equal(ratings['rating'], expected[:, 2])
  np.testing.assert_array_equal(ratings['timestamp'], expected[:, 3])


def test_ml_1m_file_is_preferred_when_both_are_present(tmp_path):
  write_u_data(tmp_path)
  write_ratings_dat(tmp_path)
  assert movielens_files.find_ratings(str(tmp_path)).endswith('ratings.dat')


def test_bad_directories_and_files_are_usage_errors(tmp_path):
  def build(directory):
    return movielens.build_task(base.DataConfig(
        options={'movielens_dir': directory}))

  with pytest.raises(UsageError, match='--movielens_dir is required'):
    build(None)
  with pytest.raises(UsageError, match='does not exist'):
    build(str(tmp_path / 'missing'))
  with pytest.raises(UsageError, match='has neither ratings.dat'):
    build(str(tmp_path))
  _write(tmp_path / 'tabs', 'ratings.dat', ['1\t2\t3\t4'])
  with pytest.raises(UsageError, match='ratings.dat format'):
    build(str(tmp_path / 'tabs'))
  _write(tmp_path / 'short', 'u.data', ['1\t2\t3'])
  with pytest.raises(UsageError, match='u.data format'):
    build(str(tmp_path / 'short'))
  # An id sizes the embedding table: 10^11 rows would exhaust the memory.
  _write(tmp_path / 'huge', 'u.data', ['1\t99999999999\t3\t4'])
  with pytest.raises(UsageError, match='has movie id 99999999999: ids index '
                     'the embedding tables, so they must be at most 1000000'):
    build(str(tmp_path / 'huge'))
  # Beyond int64 it was an OverflowError traceback.
  _write(tmp_path / 'beyond', 'u.data', ['1\t2\t3\t4',
                                        '1\t99999999999999999999\t3\t4'])
  with pytest.raises(UsageError, match=re.escape(
      'u.data:2 is not in the u.data format (user<TAB>item<TAB>rating<TAB>'
      'timestamp): 99999999999999999999 is beyond a 64-bit integer')):
    build(str(tmp_path / 'beyond'))


@pytest.mark.parametrize('content, problem', [
    # Both read as ratings: a model of 1..5 stars trained on them.
    ('1\t3\t7\t101\n', 'is not in the u.data format (user<TAB>item<TAB>'
     'rating<TAB>timestamp): rating 7 is outside 1..5 (whole stars)'),
    ('1\t3\t0\t101\n', 'is not in the u.data format (user<TAB>item<TAB>'
     'rating<TAB>timestamp): rating 0 is outside 1..5 (whole stars)'),
    # Cut off mid-line: the timestamp 881250949 read as 88.
    ('1\t3\t4\t88', "is cut short: the file's last line has no newline (a "
     'write or copy cut off mid-line); restore the file'),
    ('1\t3\t4', "is cut short: the file's last line has no newline (a write "
     'or copy cut off mid-line); restore the file'),
    # Counted twice in training, possibly in both splits.
    ('1\t2\t5\t200\n', 'rates movie 2 by user 1 again (line 1): a user '
     'rates a movie once in MovieLens; restore the file'),
], ids=['rating_above_5', 'rating_0', 'cut_in_a_field', 'cut_at_a_field',
        'second_rating_of_a_movie'])
def test_damaged_ratings_are_refused_by_line(
    tmp_path, content, problem):
  path = tmp_path / 'u.data'
  path.write_text('1\t2\t3\t100\n' + content, encoding='latin-1')
  with pytest.raises(UsageError) as raised:
    movielens_files.read_ratings(str(path))
  assert str(raised.value) == f'{path}:2 {problem}'


@pytest.mark.parametrize('kind', ['a directory', 'a broken link'])
def test_a_ratings_name_that_is_no_file_is_not_passed_over(tmp_path, kind):
  # The other format's file was read instead, without a word.
  directory = write_u_data(tmp_path)
  path = os.path.join(directory, movielens_files.ML_1M_RATINGS)
  if kind == 'a directory':
    os.mkdir(path)
  else:
    os.symlink(os.path.join(directory, 'gone'), path)
  with pytest.raises(UsageError) as raised:
    movielens_files.find_ratings(directory)
  assert str(raised.value) == (f'{path} is {kind}, not a ratings file; '
                               'restore it')


def test_users_of_one_rating_each_are_a_usage_error(tmp_path):
  # No example to train on or evaluate: the run trained on nothing (an
  # update of 0/0) and logged no evaluation, with status 0.
  rows = [(user, user % 15 + 1, 4, 1000 + user) for user in range(1, 40)]
  with pytest.raises(UsageError) as raised:
    movielens.build_task(base.DataConfig(
        options={'movielens_dir': write_u_data(tmp_path, rows)}))
  assert str(raised.value) == (
      'movielens: no train user has two or more ratings, so the data give no '
      "train example (an example is a movie after the user's earlier ones)")


# --- Examples and splits -----------------------------------------------------


def test_client_slices_are_found_by_search_not_by_arrays_as_long_as_ids():
  # A user id of 9999999 made two arrays of 10M entries graph constants: a
  # 480-line u.data took 8 GB of RAM and 107 s for one round.
  from tasks import client_arrays  # pylint: disable=g-import-not-at-top
  arrays = client_arrays.ClientArrays(np.array([5, 2, 9999999, 5, 2, 0]),
                                      {'v': np.arange(6)})
  assert arrays.client_ids == ('0', '2', '5', '9999999')
  graph_columns = tf.function(lambda client_id: arrays.graph_columns(
      client_id)['v'])
  for client_id, rows in (('0', [5]), ('2', [1, 4]), ('5', [0, 3]),
                          ('9999999', [2]), ('3', []), ('10000000', []),
                          ('99999999999', [])):
    assert graph_columns(tf.constant(client_id)).numpy().tolist() == rows
    assert arrays.rows(client_id)['v'].tolist() == rows
  graph = graph_columns.get_concrete_function(
      tf.TensorSpec([], tf.string)).graph.as_graph_def()
  assert graph.ByteSize() < 10_000


def test_examples_are_the_previous_movies_and_the_next_one():
  context, label = movielens.timeline_examples(
      tf.constant([5, 7, 9, 4], tf.int32), context_length=2)
  np.testing.assert_array_equal(context, [[0, 5], [5, 7], [7, 9]])
  np.testing.assert_array_equal(label, [7, 9, 4])
  context, label = movielens.timeline_examples(
      tf.constant([5], tf.int32), context_length=2)
  assert context.shape == (0, 2) and label.shape == (0,)


def test_timelines_are_in_time_order_ties_by_movie(tmp_path):
  ratings = movielens_files.read_ratings(os.path.join(
      write_u_data(tmp_path), 'u.data'))
  arrays = movielens.timelines(ratings, np.array([1, 3]))
  assert arrays.client_ids == ('1', '3')
  np.testing.assert_array_equal(arrays.rows('1')['movie'], [2, 5, 9])
  np.testing.assert_array_equal(arrays.rows('3')['movie'], [3, 4])


def test_users_split_into_server_train_val_test():
  users = np.arange(1, 101)
  split = movielens.split_users(np.repeat(users, 3), seed=4)
  sizes = {name: len(ids) for name, ids in split.items()}
  assert sizes == {'server': 20, 'train': 64, 'val': 8, 'test': 8}
  np.testing.assert_array_equal(np.sort(np.concatenate(list(split.values()))),
                                users)
  again = movielens.split_users(np.repeat(users, 3), seed=4)
  for name in split:
    np.testing.assert_array_equal(split[name], again[name])


# --- Losses -----------------------------------------------------------------


def test_spreadout_is_the_norm_of_off_diagonal_cosines():
  # Row 0 (padding) is ignored; rows are normalized first.
  orthogonal = tf.constant([[9., 9.], [3., 0.], [0., 0.5]])
  assert float(movielens.spreadout(orthogonal)) == pytest.approx(0.0)
  same = tf.constant([[0., 1.], [1., 1.], [2., 2.], [3., 3.]])
  # 3 identical unit rows: 6 off-diagonal cosines of 1.
  assert float(movielens.spreadout(same)) == pytest.approx(np.sqrt(6.0))


def test_hinge_reads_the_label_score_only():
  scores = tf.constant([[-2., 0.5, 0.95], [-2., 0.1, -0.3]])
  losses = movielens.PositiveHinge(margin=0.9).call(
      tf.constant([[1], [2]]), scores)
  np.testing.assert_allclose(losses, [0.4**2, 1.2**2], rtol=1e-6)


def test_model_scores_every_movie_and_never_the_padding():
  model = movielens.build_keras_model(num_rows=12, embedding_dim=3,
                                      context_length=4)
  scores = model(tf.constant([[1, 2, 0, 0], [5, 0, 0, 0]]))
  assert scores.shape == (2, 12)
  np.testing.assert_array_equal(scores[:, 0], [-2., -2.])
  assert np.all(np.abs(scores[:, 1:]) <= 1 + 1e-6)
  # One table: its rows are the bag inputs and the candidates.
  assert [w.name.split('/')[0] for w in model.trainable_weights] == [
      movielens.EMBEDDING_LAYER, 'context_hidden', 'context_hidden']


def test_embedding_rows_start_at_about_unit_norm():
  # Not Keras' uniform(+-0.05) (|row| ~ 0.1): see embedding_initializer.
  tf.keras.utils.set_random_seed(0)
  model = movielens.build_keras_model(num_rows=2000, embedding_dim=16,
                                      context_length=4)
  table = model.get_layer(movielens.EMBEDDING_LAYER).embeddings.numpy()
  assert np.median(np.linalg.norm(table, axis=1)) == pytest.approx(1, abs=0.1)


# --- Task and costs -----------------------------------------------------------


@pytest.fixture(scope='module')
def fixture_dir(tmp_path_factory):
  return write_ratings_dat(tmp_path_factory.mktemp('ml-1m'),
                           synthetic_like_ratings())


def build_fixture_task(directory, **options):
  return movielens.build_task(base.DataConfig(
      client_steps=3, client_batch_size=2, central_steps=2,
      central_batch_size=4,
      options=dict(movielens_dir=directory, movielens_embedding_dim=4,
                   movielens_context_length=3, **options)))


@pytest.fixture(scope='module')
def fixture_tasks(fixture_dir):
  """spreadout_on_clients -> the task on the fixture files."""
  return {on_clients: build_fixture_task(fixture_dir,
                                         spreadout_on_clients=on_clients)
          for on_clients in (False, True)}


def test_client_dataset_holds_the_users_examples(fixture_dir, fixture_tasks):
  task = fixture_tasks[False]
  assert task.num_train_clients == 26  # 40 users: 8 server, 3 val, 3 test.
  client_id = task.train_client_ids[0]
  batches = list(task.client_dataset_computation((client_id, np.int64(1))))
  assert len(batches) == 3
  ratings = movielens_files.read_ratings(os.path.join(fixture_dir,
                                                      'ratings.dat'))
  timeline = ratings['movie'][ratings['user'] == int(client_id)]
  expected = {(tuple(c), int(l)) for c, l in zip(*map(np.asarray, (
      movielens.timeline_examples(tf.constant(timeline, tf.int32), 3))))}
  for context, label in batches:
    assert context.shape[1] == 3 and label.shape[1] == 1
    for c, l in zip(np.asarray(context), np.asarray(label)[:, 0]):
      assert (tuple(c), int(l)) in expected


def test_synthetic_data_has_the_real_element_structure(fixture_tasks):
  real = fixture_tasks[False]
  synthetic = movielens.build_task(base.DataConfig(
      use_synthetic_data=True, client_steps=3, client_batch_size=2,
      options=dict(movielens_context_length=3)))
  assert (synthetic.client_dataset_computation.type_signature ==
          real.client_dataset_computation.type_signature)
  assert (synthetic.server_dataset_computation.type_signature ==
          real.server_dataset_computation.type_signature)


@pytest.mark.parametrize('on_clients', [False, True])
def test_client_cost_counts_touched_rows_and_flops(fixture_tasks, on_clients):
  task = fixture_tasks[on_clients]
  context = np.array([[0, 3, 5], [0, 0, 3], [1, 2, 3]], np.int32)
  label = np.array([[7], [5], [4]], np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((context, label)).batch(2)
  cost = task.client_cost_fn(dataset)
  d, num_rows = 4, 31  # Movies 1..30.
  assert float(cost['touched_rows']) == 6  # 1, 2, 3, 4, 5, 7.
  expected_flops = sum(
      movielens.client_step_flops(b, c, d, num_rows - 1, on_clients)
      for b, c in ((2, 3), (1, 3)))
  assert float(cost['flops']) == pytest.approx(expected_flops, rel=1e-6)
  full = num_rows * d + d * d + d
  assert float(cost['full_model_floats']) == full
  assert float(cost['model_floats']) == (full if on_clients else
                                         6 * d + d * d + d)
  assert float(cost['central_gradient_floats']) == 6 * d


def test_costs_replace_whole_model_copies_by_the_touched_rows():
  full, sparse = 1000.0, 100.0
  metrics = collections.OrderedDict(
      train=collections.OrderedDict(loss=tf.constant(1.0)),
      communication=collections.OrderedDict(
          # Two model copies + 8 bytes down; one copy + 12 bytes up.
          bytes_down_per_client=tf.constant(2 * 4000 + 8, tf.int64),
          bytes_up_per_client=tf.constant(4000 + 12, tf.int64)))
  costs = collections.OrderedDict(
      flops=tf.constant(5.0), touched_rows=tf.constant(25.0),
      model_floats=tf.constant(sparse), full_model_floats=tf.constant(full),
      central_gradient_floats=tf.constant(60.0))
  train = communication.with_client_costs(metrics, costs)['train']
  assert float(train['client_floats_down']) == 2 * sparse + 2
  assert float(train['client_floats_up']) == sparse + 3
  assert float(train['client_comm_floats']) == 3 * sparse + 5
  assert float(train['client_flops']) == 5.0
  assert float(train['loss']) == 1.0
  # GT: one of the two copies down is the augmenting gradient, counted at its
  # own sparse size (the rows of the variables the central loss reads).
  metrics['communication']['augmenting_bytes_down_per_client'] = tf.constant(
      4000, tf.int64)
  train = communication.with_client_costs(metrics, costs)['train']
  assert float(train['client_floats_down']) == sparse + 60 + 2
  assert float(train['client_floats_up']) == sparse + 3


@pytest.mark.skipif(not os.path.isfile(os.path.join(REAL_MOVIELENS_DIR,
                                                    'u.data')),
                    reason='MovieLens 100K is not in ../shared/data')
def test_real_movielens_100k():
  ratings = movielens_files.read_ratings(movielens_files.find_ratings(
      REAL_MOVIELENS_DIR))
  assert len(ratings['user']) == 100_000
  split = movielens.split_users(ratings['user'], seed=0)
  assert {k: len(v) for k, v in split.items()} == {
      'server': 189, 'train': 604, 'val': 75, 'test': 75}
  arrays = movielens.timelines(ratings, split['train'])
  # Every rating of a train user gives an example but the user's first.
  assert arrays.num_examples - len(arrays.client_ids) == sum(
      int(np.sum(ratings['user'] == u)) - 1 for u in split['train'])


# --- End to end ----------------------------------------------------------------

# mixed_1wgt runs through the binary (test_cli_run_applies_the_paper_defaults).
ALGORITHMS = ('fedavg', 'mixed_pt', 'mixed_2wgt')


@pytest.fixture(scope='module')
def one_round_runs(tmp_path_factory):
  """One round of each algorithm on synthetic data, as the binaries set it up
  (spreadout on clients for the baseline only)."""
  root = str(tmp_path_factory.mktemp('runs'))
  # K = 2: the clients' steps and the central model's.
  tasks = {
      spreadout_on_clients: task_registry.build_task(
          'movielens', base.DataConfig(
              use_synthetic_data=True, client_steps=2, client_batch_size=4,
              central_steps=2, options=dict(
                  movielens_embedding_dim=4,
                  spreadout_on_clients=spreadout_on_clients)))
      for spreadout_on_clients in (False, True)}
  results = {}
  for name in ALGORITHMS:
    task = tasks[not name.startswith('mixed_')]
    algorithm = registry.build(name, task, round_testing.settings_of(
        name, client_learning_rate=0.5, central_learning_rate=0.5))
    results[name] = driver.train(algorithm, task, driver.RunConfig(
        root, name, total_rounds=1, clients_per_round=4, export=False))
    if name == 'mixed_2wgt':
      results['mixed_2wgt_native'] = driver.train(
          algorithm, task, driver.RunConfig(
              root, 'mixed_2wgt_native', total_rounds=1, clients_per_round=4,
              export=False, runtime='native'))
  return results


@pytest.mark.parametrize('name', ALGORITHMS)
def test_every_algorithm_trains_and_reports_recall_and_costs(
    one_round_runs, name):
  metrics = one_round_runs[name].last_metrics
  assert 0 <= metrics['eval/recall_at_10'] <= 1
  assert 0 <= metrics['eval_val/recall_at_10'] <= 1
  assert np.isfinite(metrics['train/loss'])
  for cost in ('client_flops', 'client_comm_floats', 'client_floats_down',
               'client_floats_up', 'client_touched_rows'):
    assert metrics[f'train/{cost}'] > 0
  if name.startswith('mixed_'):
    assert np.isfinite(metrics['central/loss'])


def test_native_runtime_reports_the_same_costs(one_round_runs):
  tff_metrics = one_round_runs['mixed_2wgt'].last_metrics
  native_metrics = one_round_runs['mixed_2wgt_native'].last_metrics
  train_keys = [k for k in tff_metrics if k.startswith('train/')]
  assert 'train/client_comm_floats' in train_keys
  for key in train_keys + ['eval/recall_at_10']:
    np.testing.assert_allclose(native_metrics[key], tff_metrics[key],
                               rtol=1e-5, err_msg=key)


def test_mixed_clients_compute_and_send_far_less(one_round_runs):
  metrics = {name: run.last_metrics for name, run in one_round_runs.items()
             if name in ALGORITHMS}
  d, num_rows = 4, movielens.SYNTHETIC_MOVIES + 1
  full = num_rows * d + d * d + d
  baseline = metrics['fedavg']
  # The baseline moves the full table both ways (plus a few metric floats).
  assert full <= baseline['train/client_floats_down'] < full + 10
  assert full <= baseline['train/client_floats_up'] < full + 10
  for name in ('mixed_pt', 'mixed_2wgt'):
    mixed = metrics[name]
    rows = mixed['train/client_touched_rows']
    assert rows < movielens.SYNTHETIC_MOVIES
    assert mixed['train/client_flops'] < 0.5 * baseline['train/client_flops']
    # PT sends the touched rows down; GT adds their augmenting gradient
    # (table rows only: the spreadout does not read the dense layer).
    sparse = rows * d + d * d + d
    augmenting = 0 if name == 'mixed_pt' else rows * d
    assert mixed['train/client_floats_down'] == pytest.approx(
        sparse + augmenting, abs=10)
    assert mixed['train/client_floats_up'] == pytest.approx(sparse, abs=10)


def test_cli_run_applies_the_paper_defaults(tmp_path):
  from tests.test_cli import run_binary  # pylint: disable=g-import-not-at-top
  result = run_binary(
      'binaries.train', '--task=movielens', '--algorithm=mixed_1wgt',
      '--use_synthetic_data', '--experiment_name=ml',
      f'--root_output_dir={tmp_path}', '--total_rounds=1',
      '--clients_per_round=3', '--client_steps=2',
      '--movielens_embedding_dim=4')
  assert result.returncode == 0, result.stderr[-2000:]
  with open(tmp_path / 'ml' / 'metrics.csv') as f:
    row = next(csv.DictReader(f))
  for column in ('eval/recall_at_10', 'train/client_comm_floats',
                 'train/client_flops', 'central/loss'):
    assert float(row[column]) >= 0
  # 1-w GT sends the touched rows and their augmenting gradient down.
  touched_rows = float(row['train/client_touched_rows'])
  assert float(row['train/client_floats_down']) == pytest.approx(
      (touched_rows * 4 + 4 * 4 + 4) + touched_rows * 4, abs=10)
  assert float(row['communication/augmenting_bytes_down_per_client']) > 0
  import json  # pylint: disable=g-import-not-at-top
  with open(tmp_path / 'ml' / 'hparams.json') as f:
    hparams = json.load(f)
  assert hparams['spreadout_on_clients'] is False
  assert hparams['client_learning_rate'] == 0.5
  assert hparams['client_batch_size'] == 16
  assert hparams['central_learning_rate'] == 0.5
