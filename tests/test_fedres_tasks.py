"""FedRes tasks: MovieLens loader on files in the real format, synthetic data,
and the residual model wrappers."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import fault_testlib as lib
from pipeline.errors import UsageError
from tasks import base
from tasks import fedres_synthetic
from tasks import movielens_ratings
from tasks import residual

REAL_MOVIELENS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), '..', '..', 'shared', 'data',
    'movielens-100k')
GENRE_FLAGS = {  # movie id -> 19 genre flags
    1: [0, 0, 0, 1, 1, 1] + [0] * 13,
    2: [0, 1, 1] + [0] * 13 + [1, 0, 0],
    3: [0] * 16 + [1, 0, 0],
    4: [0] * 8 + [1] + [0] * 10,
}
# user, movie, rating, timestamp (not in time order, as in u.data).
RATINGS = [
    (1, 3, 4, 880000300), (1, 1, 5, 880000100), (1, 4, 2, 880000500),
    (1, 2, 3, 880000200),
    (2, 1, 1, 880000900), (2, 2, 5, 880000800),
    (7, 3, 3, 880000000),
]


def _write_movielens(directory):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'u.data'), 'w') as f:
    for row in RATINGS:
      f.write('\t'.join(map(str, row)) + '\n')
  with open(os.path.join(directory, 'u.item'), 'w', encoding='latin-1') as f:
    for movie, flags in GENRE_FLAGS.items():
      title = 'Café (1995)' if movie == 2 else f'Movie {movie} (1995)'
      f.write('|'.join([str(movie), title, '01-Jan-1995', '',
                        'http://example.com'] + [str(g) for g in flags]) +
              '\n')
  return str(directory)


@pytest.mark.parametrize('lines, message', [
    ([], 'lists no movies'),
    (['99999999999999|T|d||u' + '|0' * 19], 'has movie id 99999999999999'),
    (['-1|T|d||u' + '|0' * 19], 'has movie id -1'),
    # Each trained silently on wrong genre rows (or was numpy's traceback).
    (['1|0|1'], r'u.item:1 is not in the u.item format .*: 3 fields, not 24'),
    (['1|T|d||u' + '|5' * 19], r':1 .*: a genre flag is not 0 or 1'),
    (['1|T|d||u' + '|0' * 19, '1|T|d||u' + '|1' * 19],
     r':2 .*: movie 1 is listed twice'),
    (['1|T|d||u' + '|0' * 19, '2|T|d||u' + '|0' * 19 + '\x00'],
     r':2 .*: the file\'s last line has no newline'),
    # Python's int() took them as 19 and 1.
    (['1_9|T|d||u' + '|0' * 19], r":1 .*: '1_9' is not an integer"),
    (['1|T|d||u' + '|0' * 18 + '| 1'], r":1 .*: ' 1' is not an integer"),
])
def test_damaged_movie_lists_are_usage_errors(tmp_path, lines, message):
  (tmp_path / 'u.item').write_text(
      ''.join(l + '\n' for l in lines).replace('\x00\n', ''),
      encoding='latin-1')
  with pytest.raises(UsageError, match=message):
    movielens_ratings.load_genres(str(tmp_path))


@pytest.mark.parametrize('unlisted_movie', [
    # Between listed movies, it trained with no genre at all.
    3,
    # Beyond the largest one, the line did not say which.
    4])
def test_ratings_of_movies_u_item_does_not_list_are_usage_errors(
    tmp_path, unlisted_movie):
  directory = _write_movielens(tmp_path / 'ml')
  with open(os.path.join(directory, 'u.item'), encoding='latin-1') as f:
    lines = [l for l in f if not l.startswith(f'{unlisted_movie}|')]
  with open(os.path.join(directory, 'u.item'), 'w', encoding='latin-1') as f:
    f.writelines(lines)
  with pytest.raises(UsageError, match=(
      f'^{directory}/u.data rates movie {unlisted_movie}, which u.item does '
      r'not list \(of \d+ ratings of unlisted movies\); use the u.item of '
      'the same MovieLens release$')):
    movielens_ratings.build_task(base.DataConfig(
        options={'movielens_dir': directory}))


def test_ratings_fields_are_decimal_integers(tmp_path):
  directory = _write_movielens(tmp_path / 'ml')
  with open(os.path.join(directory, 'u.data'), 'a') as f:
    f.write('1_9\t1\t3\t880000000\n')
  with pytest.raises(UsageError, match=r"u.data:8 is not in the u.data format "
                     r".*: '1_9' is not an integer"):
    movielens_ratings.build_task(base.DataConfig(
        options={'movielens_dir': directory}))


@pytest.fixture(scope='module')
def movielens_task(tmp_path_factory):
  directory = _write_movielens(tmp_path_factory.mktemp('ml') / 'ml-100k')
  return movielens_ratings.build_task(base.DataConfig(
      client_steps=2, client_batch_size=2, seed=0,
      options={'movielens_dir': directory}))


def _examples(dataset):
  """{(movie, rating)} and the genre rows seen, from batches of the task."""
  pairs, genres = set(), {}
  for x, y in dataset:
    for movie, flags, rating in zip(x['movie_id'].numpy(), x['genres'].numpy(),
                                    y.numpy()[:, 0]):
      pairs.add((int(movie), float(rating)))
      genres[int(movie)] = flags.tolist()
  return pairs, genres


def test_movielens_clients_and_temporal_split(movielens_task):
  task = movielens_task
  assert task.train_client_ids == ('1', '2', '7')
  # User 7's single rating stays train, so it has no held-out data.
  assert task.personal_eval_data.client_ids == ('1', '2')
  data = task.personal_eval_data
  # Latest max(1, round(0.2 n)) ratings are held out: user 1 (n=4) its last
  # one (movie 4 at t=500); user 2 (n=2) its last one (movie 1 at t=900).
  assert _examples(data.test_dataset_fn('1'))[0] == {(4, 2.0)}
  assert _examples(data.test_dataset_fn('2'))[0] == {(1, 1.0)}
  train_pairs, genres = _examples(data.train_dataset_fn('1', 0).take(2))
  assert train_pairs <= {(3, 4.0), (1, 5.0), (2, 3.0)}
  for movie, flags in genres.items():
    assert flags == GENRE_FLAGS[movie]
  pooled, _ = _examples(task.eval_datasets_fn()[''])
  assert pooled == {(4, 2.0), (1, 1.0)}


def test_movielens_client_dataset_computation_reads_one_user(movielens_task):
  dataset = movielens_task.client_dataset_computation(('1', np.int64(3)))
  batches = list(dataset)
  assert len(batches) == 2  # K = 2 batches of 2.
  pairs = {(int(m), float(r)) for x, y in batches
           for m, r in zip(x['movie_id'], y[:, 0])}
  assert pairs <= {(3, 4.0), (1, 5.0), (2, 3.0)}


def test_movielens_serving_input_is_movie_ids(movielens_task):
  model_input = movielens_task.serving.preprocess(tf.constant([2, 4]))
  np.testing.assert_array_equal(model_input['genres'].numpy(),
                                [GENRE_FLAGS[2], GENRE_FLAGS[4]])


def test_movielens_serving_refuses_movie_ids_beyond_the_table(
    movielens_task, tmp_path):
  # pylint: disable=g-import-not-at-top
  from pipeline import driver
  from tff_algos.algorithms import registry
  from tff_algos.algorithms.fedres import definition as fedres
  from tff_algos.algorithms.fedres import export as fedres_export
  # pylint: enable=g-import-not-at-top
  algorithm = registry.build('fedres_avg', movielens_task,
                             fedres.FedResAvgSettings())
  driver.train(algorithm, movielens_task, driver.RunConfig(
      root_output_dir=str(tmp_path), experiment_name='run', total_rounds=1,
      clients_per_round=2, runtime='native'))
  server = fedres_export.PersonalizedServer(str(tmp_path / 'run' / 'export'))
  assert server('1', np.array([1, 4], np.int32))['rating'].shape == (2,)
  # Each was TF's InvalidArgumentError traceback.
  for ids in ([1, 5], [-1]):
    with pytest.raises(fedres_export.InputError,
                       match=r'^the model cannot take these inputs \(indices'
                       rf'\[\d\] = {ids[-1]} is not in \[0, 5\)\)$'):
      server('1', np.array(ids, np.int32))
  # 2**32 was served as movie 0 (tf.constant wrapped it to int32).
  with pytest.raises(fedres_export.InputError,
                     match=r'^inputs hold 1 value\(s\) beyond int32 \(e.g. '
                     r'4294967296\)$'):
    server('1', np.array([1, 2**32], np.int64))


def test_movielens_users_of_one_rating_each_are_a_usage_error(tmp_path):
  # Nothing held out: the run trained, then evaluation was Keras'
  # "Expected input data to be non-empty" traceback.
  directory = _write_movielens(tmp_path)
  with open(os.path.join(directory, 'u.data'), 'w') as f:
    f.write('1\t3\t4\t880000300\n2\t1\t1\t880000900\n')
  with pytest.raises(UsageError, match=(
      r'^.*/u.data: no user has two or more ratings, so none is held out to '
      'evaluate on')):
    movielens_ratings.build_task(base.DataConfig(
        options={'movielens_dir': directory}))


def test_movielens_bad_directories_are_usage_errors(tmp_path):
  def build(directory):
    return movielens_ratings.build_task(
        base.DataConfig(options={'movielens_dir': directory}))

  with pytest.raises(UsageError, match='--movielens_dir is required'):
    build(None)
  with pytest.raises(UsageError, match='does not exist'):
    build(str(tmp_path / 'missing'))
  with pytest.raises(UsageError, match='has no u.data'):
    build(str(tmp_path))
  broken = _write_movielens(tmp_path / 'broken')
  with open(os.path.join(broken, 'u.data'), 'w') as f:
    f.write('1\t2\tthree\t4\n')
  with pytest.raises(UsageError, match='u.data format'):
    build(broken)


def test_movielens_synthetic_data_has_the_real_structure(movielens_task):
  synthetic = movielens_ratings.build_task(base.DataConfig(
      client_steps=2, client_batch_size=2, use_synthetic_data=True))
  assert synthetic.num_train_clients == movielens_ratings.SYNTHETIC_USERS
  assert (synthetic.client_dataset_computation.type_signature ==
          movielens_task.client_dataset_computation.type_signature)


@pytest.mark.skipif(not os.path.isdir(REAL_MOVIELENS_DIR),
                    reason='real MovieLens 100K files are not here')
def test_real_movielens_100k_split():
  ratings = movielens_ratings.load_ratings(REAL_MOVIELENS_DIR)
  genres, listed = movielens_ratings.load_genres(REAL_MOVIELENS_DIR)
  assert len(ratings['user']) == 100_000
  assert genres.shape == (1683, movielens_ratings.NUM_GENRES)
  assert listed[1:].all() and not listed[0]
  train, test = movielens_ratings.temporal_split(ratings)
  assert np.unique(ratings['user'][test]).size == 943
  assert abs(test.sum() / len(test) - movielens_ratings.TEST_FRACTION) < 0.01
  for user in (1, 100, 943):
    mine = ratings['user'] == user
    assert (ratings['timestamp'][mine & train].max() <=
            ratings['timestamp'][mine & test].min())


def test_logistic_data_is_seeded_and_only_labels_depend_on_alpha():
  x0, labels0 = fedres_synthetic.logistic_data(0.0, seed=3)
  x1, labels1 = fedres_synthetic.logistic_data(1.0, seed=3)
  x0_again, labels0_again = fedres_synthetic.logistic_data(0.0, seed=3)
  np.testing.assert_array_equal(x0, x1)
  np.testing.assert_array_equal(labels0, labels0_again)
  assert (labels0 != labels1).mean() > 0.2
  assert x0.shape == (10, fedres_synthetic.TRAIN_EXAMPLES +
                      fedres_synthetic.TEST_EXAMPLES, 10)
  for labels in (labels0, labels1):
    assert 0.2 < labels.mean() < 0.8


def test_residual_wrappers_share_the_global_weights():
  spec = fedres_synthetic.logistic_spec()
  global_only = residual.global_only_model(spec)
  inner = spec.global_model_fn()
  assert [w.shape for w in global_only.trainable_weights] == [
      w.shape for w in inner.trainable_weights]
  local = spec.local_model_fn()
  local.trainable_weights[0].assign(tf.ones_like(local.trainable_weights[0]))
  personalized = residual.personalized_model(spec, inner, local)
  x = tf.random.stateless_normal([4, 10], seed=[1, 2])
  np.testing.assert_allclose(personalized(x), inner(x) + local(x), rtol=1e-6)
  inner.trainable_weights[0].assign(
      tf.random.stateless_normal([10, 2], seed=[3, 4]))
  global_only.set_weights(inner.get_weights())
  np.testing.assert_allclose(global_only(x), inner(x), rtol=1e-6)


def test_fedres_movielens_setting_errors_are_one_error_line(tmp_path):
  # A negative or NaN learning rate was a SettingError traceback, status 1;
  # then one line, but only after the runs before (FedAvg's) had trained.
  _write_movielens(str(tmp_path))
  result = subprocess.run(
      [sys.executable, '-m', 'experiments.fedres_movielens',
       f'--movielens_dir={tmp_path}', f'--root_output_dir={tmp_path}/runs',
       '--rounds=1', '--algorithms=fedavg,fedres_avg',
       '--local_learning_rate=-1'],
      cwd=lib.REPO, env=lib.environment(), capture_output=True, text=True,
      timeout=600, check=False)
  assert (result.returncode, lib.error_lines(result)) == (
      2, ['error: --local_learning_rate must be a finite number >= 0, got '
          '-1.0']), result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert not (tmp_path / 'runs').exists()


def test_fedres_movielens_reruns_report_their_runs_or_refuse_other_flags(
    tmp_path, monkeypatch, capsys):
  # A re-run of finished runs was a KeyError traceback; one with another
  # --client_learning_rate resumed them with it, unrecorded.
  from experiments import fedres_movielens  # pylint: disable=g-import-not-at-top
  _write_movielens(str(tmp_path))

  def run(*flags):
    monkeypatch.setattr(sys, 'argv', [
        'fedres_movielens', f'--movielens_dir={tmp_path}',
        f'--root_output_dir={tmp_path}/runs', '--rounds=1',
        '--clients_per_round=2', '--client_steps=1',
        '--algorithms=fedavg,fedres_avg', *flags])
    fedres_movielens.main()
    return [l for l in capsys.readouterr().out.splitlines() if 'RMSE' in l]

  reported = run()
  assert len(reported) == 2 and 'personalized RMSE' in reported[1]
  assert run() == reported
  with pytest.raises(UsageError, match=(
      r'fedavg_seed0 was trained with other values of flags that change '
      r'results: --client_learning_rate \(run: 0.1, now: 0.2\)')):
    run('--client_learning_rate=0.2')


def test_personal_datasets_trace_the_tasks_batch_function_once(tmp_path):
  # Each client's `.map(to_batch)` traced it anew, with the tables it
  # captures: MovieLens' genres made a FedRes evaluation of 943 clients take
  # 16 GB for movie ids up to 100000.
  from tasks import client_arrays  # pylint: disable=import-outside-toplevel
  traces = []

  def to_batch(rows):
    traces.append(1)
    return rows['x'], rows['label']

  rng = np.random.default_rng(0)
  keys = np.repeat(np.arange(6), 3)
  arrays = client_arrays.ClientArrays(keys, {
      'x': rng.normal(size=(18, fedres_synthetic.LOGISTIC_DIM)).astype(
          np.float32),
      'label': rng.integers(0, 2, 18).astype(np.int32)})
  config = base.DataConfig(client_batch_size=2, client_steps=2,
                           eval_batch_size=2)
  task = client_arrays.build_task(
      'counted', config, arrays, arrays, to_batch,
      tf.TensorSpec([None], tf.int32),
      fedres_synthetic.logistic_spec(), None)
  data = task.personal_eval_data
  batches = [list(data.test_dataset_fn(client_id))
             for client_id in data.client_ids]
  fitted = [list(data.train_dataset_fn(client_id, 3))
            for client_id in data.client_ids]
  assert len(traces) <= 2  # reduce_retracing: one more for a new shape.
  # The same batches as the rows batched first and mapped after.
  for client_id, got, got_train in zip(data.client_ids, batches, fitted):
    rows = arrays.rows(client_id)
    want = list(tf.data.Dataset.from_tensor_slices(rows).batch(2).map(
        to_batch))
    want_train = list(base.client_batches(
        arrays.dataset(client_id), config, 3).map(to_batch))
    for a, b in zip(tf.nest.flatten(got + got_train),
                    tf.nest.flatten(want + want_train), strict=True):
      np.testing.assert_array_equal(a, b)
