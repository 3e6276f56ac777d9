"""tasks.emnist on a tiny database in TFF's EMNIST sqlite format."""

import collections
import os
import sqlite3

import numpy as np
import pytest
import tensorflow as tf

from pipeline.errors import UsageError
from tasks import base
from tasks import client_database
from tasks import emnist
from tasks import partition

WRITERS = ('f0003_12', 'f0001_40', 'f0002_07', 'f0000_31', 'f0004_25')
TRAIN_PER_WRITER = (7, 5, 9, 6, 8)
TEST_PER_WRITER = 2
NUM_CLIENTS = 4
SEED = 5


def _example(label: int, pixels: np.ndarray) -> bytes:
  # TFF's EMNIST records: 'pixels' float [28, 28] and 'label' int64.
  return tf.train.Example(features=tf.train.Features(feature={
      'pixels': tf.train.Feature(
          float_list=tf.train.FloatList(value=pixels.ravel())),
      'label': tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
  })).SerializeToString()


def _write_emnist_sqlite(directory: str, parts=('train', 'test'),
                         label_of=lambda number, label: label):
  """emnist_all.sqlite with TFF's tables, split names and record format.

  Returns {split: {writer: [(label, pixels), ...]}}. Pixels encode a unique
  example number so examples can be matched after the round trip.
  """
  rng = np.random.default_rng(0)
  content = collections.defaultdict(dict)
  counter = 0
  connection = sqlite3.connect(os.path.join(directory, 'emnist_all.sqlite'))
  client_database.create_sql_client_data_tables(connection)
  for split, num_classes in (('all', 62), ('digits_only', 10)):
    for part, sizes in (('train', TRAIN_PER_WRITER),
                        ('test', (TEST_PER_WRITER,) * len(WRITERS))):
      if part not in parts:
        continue
      split_name = f'{split}_{part}'
      for writer, size in zip(WRITERS, sizes):
        examples = []
        for _ in range(size):
          pixels = rng.uniform(size=(28, 28)).astype(np.float32)
          pixels[0, 0] = counter * 2.0**-20  # A tag in [0, 1): exact.
          counter += 1
          examples.append((label_of(counter - 1,
                                    int(rng.integers(0, num_classes))), pixels))
        client_database.insert_client_examples(
            connection, split_name, writer,
            [_example(label, pixels) for label, pixels in examples])
        content[split_name][writer] = examples
  connection.commit()
  connection.close()
  return content


@pytest.fixture(scope='module')
def emnist_cache(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('tff_cache'))
  return directory, _write_emnist_sqlite(directory)


def _config(cache_dir, **options):
  options = {'num_clients': NUM_CLIENTS, 'similarity': 0.0, **options}
  return base.DataConfig(client_batch_size=100, client_epochs=1, seed=SEED,
                         cache_dir=cache_dir, options=options)


def _pooled(content, split_name):
  """The pool in the documented order: writers sorted, then row order."""
  return [example for writer in sorted(content[split_name])
          for example in content[split_name][writer]]


def _client_examples(task, client_id):
  examples = []
  for pixels, labels in task.client_dataset_computation(client_id, 1):
    for p, y in zip(pixels.numpy(), labels.numpy()):
      examples.append((int(y), p.reshape(28, 28)))
  return examples


@pytest.fixture(scope='module')
def task(emnist_cache):
  return emnist.build_task(_config(emnist_cache[0], similarity=0.0))


@pytest.mark.parametrize('only_digits', [False, True])
def test_clients_hold_the_similarity_partition_of_the_pooled_writers(
    emnist_cache, only_digits):
  cache_dir, content = emnist_cache
  task = emnist.build_task(_config(cache_dir, similarity=50.0,
                                   emnist_only_digits=only_digits))
  split = 'digits_only_train' if only_digits else 'all_train'
  pooled = _pooled(content, split)
  labels = np.array([label for label, _ in pooled])
  expected = partition.similarity_partition(labels, NUM_CLIENTS, 50.0, SEED)
  assert task.train_client_ids == tuple(
      f'client_{j}' for j in range(NUM_CLIENTS))
  for client_id, indices in zip(task.train_client_ids, expected):
    got = sorted((label, float(pixels[0, 0]))
                 for label, pixels in _client_examples(task, client_id))
    want = sorted((pooled[i][0], float(pooled[i][1][0, 0])) for i in indices)
    assert got == want
  # Pixels survive the round trip bit for bit (flattened to 784 features).
  label, pixels = _client_examples(task, task.train_client_ids[0])[0]
  original = {float(p[0, 0]): p for _, p in pooled}[float(pixels[0, 0])]
  np.testing.assert_array_equal(pixels, original)
  model = task.keras_model_fn()
  assert model.output_shape == (None, 10 if only_digits else 62)


def test_label_sorted_clients_at_zero_similarity(task, emnist_cache):
  _, content = emnist_cache
  client_labels = [sorted(label for label, _ in _client_examples(task, c))
                   for c in task.train_client_ids]
  # Contiguous label-sorted shards: client k's labels all <= client k+1's.
  for low, high in zip(client_labels, client_labels[1:]):
    assert low[-1] <= high[0]
  assert sum(map(len, client_labels)) == (
      len(_pooled(content, 'all_train')) // NUM_CLIENTS * NUM_CLIENTS)


def test_evaluation_is_the_pooled_test_split(task, emnist_cache):
  _, content = emnist_cache
  (dataset,) = task.eval_datasets_fn().values()
  got = sorted((int(y), float(x[0])) for xs, ys in dataset
               for x, y in zip(xs.numpy(), ys.numpy()))
  want = sorted((label, float(pixels[0, 0]))
                for label, pixels in _pooled(content, 'all_test'))
  assert got == want


def test_partition_file_is_reused_and_keyed_by_parameters(emnist_cache):
  cache_dir, _ = emnist_cache
  emnist.build_task(_config(cache_dir, similarity=10.0))
  files = sorted(os.listdir(os.path.join(cache_dir, 'partitions')))
  path = os.path.join(cache_dir, 'partitions',
                      [f for f in files if 'similarity10_' in f][0])
  mtime = os.stat(path).st_mtime_ns
  emnist.build_task(_config(cache_dir, similarity=10.0))
  assert os.stat(path).st_mtime_ns == mtime
  emnist.build_task(_config(cache_dir, similarity=10.0, num_clients=3))
  assert len(os.listdir(os.path.join(cache_dir, 'partitions'))) == len(files) + 1


def test_synthetic_data_has_the_real_structure(task):
  synthetic = emnist.build_task(base.DataConfig(
      client_batch_size=4, client_steps=2, use_synthetic_data=True,
      options={'num_clients': 6}))
  assert synthetic.train_client_ids == tuple(f'client_{j}' for j in range(6))
  assert synthetic.batch_spec == task.batch_spec
  assert (synthetic.client_dataset_computation.type_signature.result ==
          task.client_dataset_computation.type_signature.result)
  real_eval = next(iter(task.eval_datasets_fn().values()))
  synthetic_eval = next(iter(synthetic.eval_datasets_fn().values()))
  assert synthetic_eval.element_spec == real_eval.element_spec
  batches = list(synthetic.client_dataset_computation('client_3', 9))
  assert len(batches) == 2 and batches[0][0].shape == (4, 784)
  assert synthetic.default_clients_per_round == 1  # 20% of 6, rounded


def test_models(emnist_cache):
  cache_dir, _ = emnist_cache
  mlp = emnist.build_task(_config(cache_dir, model='mlp')).keras_model_fn()
  assert [v.shape.as_list() for v in mlp.trainable_variables] == [
      [784, 200], [200], [200, 62], [62]]
  logistic = emnist.build_task(_config(cache_dir)).keras_model_fn()
  assert [v.shape.as_list() for v in logistic.trainable_variables] == [
      [784, 62], [62]]


def test_usage_errors(tmp_path, emnist_cache):
  with pytest.raises(UsageError, match='has no emnist_all.sqlite'):
    emnist.build_task(_config(str(tmp_path)))
  cache_dir, _ = emnist_cache
  with pytest.raises(UsageError, match='--model=.vgg11. is not an emnist'):
    emnist.build_task(_config(cache_dir, model='vgg11'))
  with pytest.raises(UsageError, match='--similarity'):
    emnist.build_task(_config(cache_dir, similarity=101.0))
  with pytest.raises(UsageError, match='--num_clients'):
    emnist.build_task(_config(cache_dir, num_clients=1000))


@pytest.mark.parametrize('parts, label_of, message', [
    # The message ended in ': ' (TFF's loader raised a bare StopIteration).
    (('test',), lambda number, label: label,
     "cannot read EMNIST from {db}: it holds no clients of the task's "
     'splits (another dataset\'s file?)'),
    # A worker's traceback when a batch held it; -1 trained silently.
    (('train', 'test'), lambda number, label: 99 if number == 3 else label,
     '{db} holds all_train label 99, outside the 62 classes (0..61): it is '
     "damaged or not TFF's EMNIST"),
    (('train', 'test'), lambda number, label: -1 if number == 3 else label,
     '{db} holds all_train label -1, outside the 62 classes (0..61): it is '
     "damaged or not TFF's EMNIST"),
])
def test_damaged_databases_are_usage_errors(tmp_path, parts, label_of,
                                            message):
  _write_emnist_sqlite(str(tmp_path), parts, label_of)
  db = tmp_path / 'emnist_all.sqlite'
  with pytest.raises(UsageError) as raised:
    emnist.build_task(_config(str(tmp_path)))
  assert str(raised.value) == message.format(db=db)


def _two_values_label(blob):
  example = tf.train.Example.FromString(blob)
  example.features.feature['label'].int64_list.value.append(1)
  return example.SerializeToString()


@pytest.mark.parametrize('damage, reason', [
    # A NULL (in a file without TFF's NOT NULL) and a label of two values
    # were tracebacks while the partition was made.
    (lambda blob: 'text', 'a record is str, not the bytes of a '
     'tf.train.Example'),
    (_two_values_label, 'Name: <unknown>, Key: label, Index: 0.  Number of '
     'int64 values != expected.  Values size: 2 but output shape: []'),
])
def test_a_train_record_that_is_no_emnist_example_is_a_usage_error(
    tmp_path, damage, reason):
  _write_emnist_sqlite(str(tmp_path))
  db = tmp_path / 'emnist_all.sqlite'
  with sqlite3.connect(db) as connection:
    (rowid, blob), = connection.execute(
        'SELECT rowid, serialized_example_proto FROM examples WHERE '
        "split_name = 'all_train' ORDER BY client_id, rowid LIMIT 1"
    ).fetchall()
    connection.execute(
        'UPDATE examples SET serialized_example_proto = ? WHERE rowid = ?',
        (damage(blob), rowid))
  with pytest.raises(UsageError) as raised:
    emnist.build_task(_config(str(tmp_path)))
  assert str(raised.value) == (
      f'{db} holds all_train examples that are not EMNIST examples '
      f"({reason}): it is damaged or not TFF's EMNIST")


@pytest.mark.parametrize('dangling', [False, True])
def test_a_file_in_place_of_the_partitions_directory_is_a_usage_error(
    tmp_path, dangling):
  _write_emnist_sqlite(str(tmp_path))
  partitions = tmp_path / 'partitions'
  if dangling:
    partitions.symlink_to(tmp_path / 'nowhere')
  else:
    partitions.write_text('mine')
  with pytest.raises(UsageError) as raised:
    emnist.build_task(_config(str(tmp_path)))
  assert str(raised.value) == (
      f'{partitions} cannot hold the cached client partitions: {partitions} '
      'is not a directory; move it, or pass another --cache_dir')
  assert dangling or partitions.read_text() == 'mine'


@pytest.mark.parametrize('role', ['train', 'test'])
def test_a_split_without_examples_is_a_usage_error(tmp_path, role):
  # The test split's clients without rows: no evaluation was logged, with
  # status 0 (the train split's was refused, but not naming the file).
  from tests import celeba_fixture  # pylint: disable=g-import-not-at-top
  _write_emnist_sqlite(str(tmp_path))
  path = tmp_path / 'emnist_all.sqlite'
  celeba_fixture.without_examples(path, f'all_{role}')
  with pytest.raises(UsageError) as raised:
    emnist.build_task(_config(str(tmp_path)))
  assert str(raised.value) == celeba_fixture.no_examples_message(
      path, 'EMNIST', role, f'all_{role}')


@pytest.mark.parametrize('split_name', ['all_train', 'all_test'])
def test_a_client_id_with_a_quote(tmp_path, split_name):
  # A test writer's id with ' was a SQL syntax error in TFF's reader at the
  # first evaluation, after a round had trained (a traceback); a train
  # writer's is read by the pooling query, which takes it.
  _write_emnist_sqlite(str(tmp_path))
  path = tmp_path / 'emnist_all.sqlite'
  with sqlite3.connect(path) as connection:
    (writer,) = connection.execute(
        'SELECT client_id FROM client_metadata WHERE split_name = ? LIMIT 1',
        (split_name,)).fetchone()
    for table in ('examples', 'client_metadata'):
      connection.execute(
          f'UPDATE {table} SET client_id = ? WHERE client_id = ? AND '
          'split_name = ?', (f"{writer}'x", writer, split_name))
  if split_name == 'all_train':
    task = emnist.build_task(_config(str(tmp_path), similarity=100.0))
    assert len(task.train_client_ids) == NUM_CLIENTS
    return
  with pytest.raises(UsageError, match=(
      rf"^{path} has client id \"{writer}'x\", which holds \"'\": TFF's "
      'reader cannot look it up')):
    emnist.build_task(_config(str(tmp_path)))


def _write_with_pixel(directory, split_name, value):
  """The fixture's EMNIST file with one pixel of `split_name` set to
  `value`."""
  _write_emnist_sqlite(str(directory))
  with sqlite3.connect(directory / 'emnist_all.sqlite') as connection:
    (rowid, blob), = connection.execute(
        'SELECT rowid, serialized_example_proto FROM examples WHERE '
        'split_name = ? LIMIT 1', (split_name,)).fetchall()
    example = tf.train.Example.FromString(blob)
    example.features.feature['pixels'].float_list.value[5] = value
    connection.execute(
        'UPDATE examples SET serialized_example_proto = ? WHERE rowid = ?',
        (example.SerializeToString(), rowid))


@pytest.mark.parametrize('value, found', [
    (np.nan, 'EMNIST pixels that are not finite (NaN)'),
    (np.inf, 'EMNIST pixels that are not finite (Inf)'),
    # Finite: it trained to an infinite loss, exit 0.
    (1e38, 'EMNIST pixels outside [0, 1]'),
    (-0.5, 'EMNIST pixels outside [0, 1]'),
    (1.5, 'EMNIST pixels outside [0, 1]')])
def test_a_pixel_that_is_not_finite_or_in_0_1_is_bad_data(tmp_path, value,
                                                          found):
  # It trained silently: each client it reached was dropped as non-finite
  # and the metrics were NaN. Now reading the client's batches fails, in
  # this process (the native runtime, evaluation) or in a TFF worker, and
  # the binaries print one line for it.
  from binaries import app  # pylint: disable=import-outside-toplevel
  _write_with_pixel(tmp_path, 'all_train', value)
  task = emnist.build_task(_config(str(tmp_path), similarity=100.0))
  errors = []
  for client_id in task.train_client_ids:
    try:
      list(task.client_dataset_computation(client_id, 1))
    except tf.errors.InvalidArgumentError as error:
      errors.append(error)
  assert len(errors) == 1, errors
  assert app.bad_data_message(errors[0]) == (
      f"the task's data files hold {found}: they are damaged or not the "
      'files of this task (--cache_dir, --data_dir)')


@pytest.mark.parametrize('value', [np.nan, np.inf])
def test_a_test_pixel_that_is_not_finite_is_bad_data(tmp_path, value):
  # Evaluation reported a NaN loss and the run exited 0.
  from binaries import app  # pylint: disable=import-outside-toplevel
  _write_with_pixel(tmp_path, 'all_test', value)
  task = emnist.build_task(_config(str(tmp_path), similarity=100.0))
  with pytest.raises(tf.errors.InvalidArgumentError) as raised:
    for dataset in task.eval_datasets_fn().values():
      list(dataset)
  assert app.bad_data_message(raised.value).startswith(
      "the task's data files hold EMNIST pixels that are not finite")


def test_a_damaged_cached_partition_is_bad_data(tmp_path):
  """Its fingerprint still readable, the partition is reused; its clients'
  reads failed with a traceback (and again on every re-run)."""
  from binaries import app  # pylint: disable=import-outside-toplevel
  _write_emnist_sqlite(str(tmp_path))
  emnist.build_task(_config(str(tmp_path), similarity=100.0))
  (partition,) = (tmp_path / 'partitions').glob('*.sqlite')
  size = partition.stat().st_size
  with open(partition, 'r+b') as f:
    f.seek(size // 2)
    f.write(np.random.default_rng(0).bytes(size // 4))
  task = emnist.build_task(_config(str(tmp_path), similarity=100.0))
  with pytest.raises(tf.errors.OpError) as raised:
    for client_id in task.train_client_ids:
      list(task.client_dataset_computation(client_id, 1))
  assert app.bad_data_message(raised.value) == (
      "the task's data files hold a damaged SQLite file (database disk image "
      'is malformed): restore it; a partition this project made '
      '(<--cache_dir>/partitions/*.sqlite) is made again once deleted')
  partition.unlink()
  task = emnist.build_task(_config(str(tmp_path), similarity=100.0))
  for client_id in task.train_client_ids:
    list(task.client_dataset_computation(client_id, 1))
