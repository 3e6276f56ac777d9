"""celeba_smile on a tiny celeba.sqlite in TFF's format, and synthetic data."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tasks import base
from tasks import celeba
from tasks import registry
from tests import celeba_fixture
from tests.celeba_fixture import write_celeba_sqlite


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp('tff_cache')
  written = write_celeba_sqlite(directory / 'celeba.sqlite')
  return str(directory), written


def test_tff_loader_reads_the_fixture(cache_dir):
  directory, written = cache_dir
  train, test = tff.simulation.datasets.celeba.load_data(
      split_by_clients=True, cache_dir=directory)
  assert sorted(train.client_ids) == sorted(written['split_by_clients_train'])
  assert sorted(test.client_ids) == sorted(written['split_by_clients_test'])
  element = next(iter(train.create_tf_dataset_for_client('0')))
  assert element['image'].shape == (84, 84, 3)
  assert element['smiling'].dtype == tf.bool


def _numpy_batches(dataset):
  return [tuple(np.asarray(part) for part in batch) for batch in dataset]


def _config(directory, mode, **kwargs):
  return base.DataConfig(**{
      'cache_dir': directory, 'client_batch_size': 2, 'client_steps': 2,
      'central_batch_size': 3, 'central_steps': 2,
      'options': {'celeba_mode': mode}, **kwargs})


def test_mixed_mode_composite_clients_and_label_split(cache_dir):
  directory, written = cache_dir
  task = celeba.build_task(_config(directory, 'mixed'))
  raw_ids = sorted(written['split_by_clients_train'])
  assert task.num_train_clients == len(raw_ids) // celeba.COMPOSITE_SIZE
  members = [cid.split(celeba.COMPOSITE_SEPARATOR)
             for cid in task.train_client_ids]
  assert sorted(sum(members, [])) == raw_ids
  # Federated data: smiling only; K=2 batches of 2.
  batches = _numpy_batches(task.client_dataset_computation(
      id=task.train_client_ids[0], seed=1))
  assert len(batches) == 2
  for images, labels in batches:
    assert images.shape[1:] == (84, 84, 3)
    assert np.all(labels == 1.0)
    assert 0.0 <= images.min() and images.max() <= 1.0
  # Central data: non-smiling images of the train clients.
  central = _numpy_batches(task.server_dataset_computation(5))
  assert len(central) == 2
  for images, labels in central:
    assert images.shape[0] == 3 and np.all(labels == 0.0)
  # Evaluation: every test image, both labels.
  [(images, labels)] = _numpy_batches(task.eval_datasets_fn()[''])
  num_test = sum(len(v) for v in written['split_by_clients_test'].values())
  assert images.shape[0] == num_test
  assert set(np.unique(labels)) == {0.0, 1.0}


def test_same_seed_same_batches_other_seed_other_order(cache_dir):
  directory, _ = cache_dir
  task = celeba.build_task(_config(directory, 'federated'))
  cid = task.train_client_ids[0]
  first = [b[0] for b in _numpy_batches(
      task.client_dataset_computation(id=cid, seed=3))]
  again = [b[0] for b in _numpy_batches(
      task.client_dataset_computation(id=cid, seed=3))]
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  other = [b[0] for b in _numpy_batches(
      task.client_dataset_computation(id=cid, seed=4))]
  assert any(not np.array_equal(a, b) for a, b in zip(first, other))


def test_federated_mode_has_both_labels_and_no_server_data(cache_dir):
  directory, written = cache_dir
  task = celeba.build_task(base.DataConfig(
      cache_dir=directory, client_batch_size=8,
      options={'celeba_mode': 'federated'}))
  assert sorted(task.train_client_ids) == sorted(
      written['split_by_clients_train'])
  assert task.server_dataset_computation is None
  [(_, labels)] = _numpy_batches(
      task.client_dataset_computation(id='0', seed=0))
  assert set(np.unique(labels)) == {0.0, 1.0}


def test_synthetic_data_has_the_real_element_structure(cache_dir):
  directory, _ = cache_dir
  real_train, _ = tff.simulation.datasets.celeba.load_data(cache_dir=directory)
  synthetic_train, _ = celeba._load_client_data(  # pylint: disable=protected-access
      base.DataConfig(use_synthetic_data=True))
  assert synthetic_train.element_type_structure == (
      real_train.element_type_structure)


def test_missing_cache_dir_is_a_usage_error(tmp_path):
  with pytest.raises(UsageError, match='--cache_dir=.*does not exist'):
    celeba.build_task(_config(str(tmp_path / 'missing'), 'mixed'))
  with pytest.raises(UsageError, match='has no celeba.sqlite'):
    celeba.build_task(_config(str(tmp_path), 'mixed'))


def test_another_datasets_file_is_a_usage_error_that_says_so(tmp_path):
  # StackOverflow's file as celeba.sqlite: TFF's loader raised a bare
  # StopIteration, and the error line ended with ': '.
  from tests import stackoverflow_fixture  # pylint: disable=g-import-not-at-top
  stackoverflow_fixture.write_stackoverflow_sqlite(tmp_path / 'celeba.sqlite')
  with pytest.raises(UsageError) as raised:
    celeba.build_task(_config(str(tmp_path), 'mixed'))
  assert str(raised.value) == (
      f'cannot read CelebA from {tmp_path}/celeba.sqlite: it holds no clients '
      "of the task's splits (another dataset's file?)")


@pytest.mark.parametrize('role', ['train', 'test'])
def test_a_split_without_examples_is_a_usage_error(tmp_path, role):
  # Its clients listed, their rows gone: the run trained on nothing (a
  # train loss of 0) or logged no evaluation, with status 0.
  split = f'split_by_clients_{role}'
  path, refusal = _refusal(
      tmp_path, lambda path: celeba_fixture.without_examples(path, split))
  assert refusal == celeba_fixture.no_examples_message(
      path, 'CelebA', role, split)


def _with_train_client(path, client_id):
  import sqlite3  # pylint: disable=g-import-not-at-top
  from tasks import client_database  # pylint: disable=g-import-not-at-top
  from tests import celeba_fixture  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  with sqlite3.connect(path) as connection:
    client_database.insert_client_examples(
        connection, 'split_by_clients_train', client_id,
        [celeba_fixture._example(rng, smiling) for smiling in (0, 1)])  # pylint: disable=protected-access


def _refusal(tmp_path, add_client):
  """(the fixture's file with `add_client(path)` applied, the UsageError's
  message of the task on it)."""
  path = tmp_path / 'celeba.sqlite'
  write_celeba_sqlite(path)
  add_client(path)
  with pytest.raises(UsageError) as raised:
    celeba.build_task(_config(str(tmp_path), 'federated'))
  return path, str(raised.value)


@pytest.mark.parametrize('client_id, character', [
    # TFF's reader pastes the id into its SQL query: a worker's syntax error
    # traceback.
    ("x'y", "'"),
    # A composite client's id is its raw ids joined by '|'.
    ('a|b', '|'),
])
def test_client_ids_tff_cannot_look_up_are_usage_errors(tmp_path, client_id,
                                                        character):
  path, refusal = _refusal(tmp_path, lambda path: _with_train_client(
      path, client_id))
  assert refusal == (
      f'{path} has client id {client_id!r}, which holds {character!r}: TFF\'s '
      'reader cannot look it up; rename that client in the file\'s examples '
      'and client_metadata tables')


@pytest.mark.parametrize('stored, shown', [
    # TFF's loader: "'<' not supported between instances of 'bytes' and
    # 'str'".
    ("x'fffe'", "x'fffe' (a blob, not text)"),
    ("x'6869'", "x'6869' (a blob, not text)"),
    # SQLite: "Could not decode to UTF-8 column 'client_id' with text '\ufffdA'".
    ("CAST(x'ff41' AS TEXT)", "b'\\xffA' (not UTF-8)"),
    # In a column declared without a type: an AttributeError traceback.
    ('5', '5 (of SQLite type integer, not text)'),
    ('2.5', '2.5 (of SQLite type real, not text)'),
], ids=['blob', 'utf8_blob', 'not_utf8_text', 'integer', 'real'])
def test_a_client_id_that_is_not_text_is_named(tmp_path, stored, shown):
  import sqlite3  # pylint: disable=g-import-not-at-top
  example = celeba_fixture._example(np.random.default_rng(1), True)  # pylint: disable=protected-access

  def add_client(path):
    with sqlite3.connect(path) as connection:
      # Its columns without a type: SQLite keeps numbers as numbers.
      connection.execute('ALTER TABLE client_metadata RENAME TO typed')
      connection.execute('CREATE TABLE client_metadata (client_id, '
                         'split_name, num_examples)')
      connection.execute('INSERT INTO client_metadata SELECT * FROM typed')
      connection.execute('INSERT INTO examples VALUES '
                         f'(\'split_by_clients_test\', {stored}, ?)', (example,))
      connection.execute(f'INSERT INTO client_metadata VALUES ({stored}, '
                         '\'split_by_clients_test\', 1)')

  path, refusal = _refusal(tmp_path, add_client)
  assert refusal == (
      f'{path} has client id {shown} in its split_by_clients_test split: '
      'TFF\'s reader takes only UTF-8 text ids; rename that client in the '
      'file\'s examples and client_metadata tables')


def test_a_group_passes_non_ascii_client_ids_to_tff():
  # TFF encoded str ids as ASCII: a client 'ü' was a UnicodeEncodeError.
  from tff_algos.runtime import cohort  # pylint: disable=g-import-not-at-top
  group, = cohort.groups(np.array(['ü', 'a'], object), np.zeros(2, np.int64),
                         None, 2)
  lengths = tff.tensorflow.computation(
      lambda ids: tf.strings.length(ids, unit='UTF8_CHAR'),
      tff.TensorType(np.str_, [None]))
  assert list(lengths(group['ids'])) == [1, 1]


def test_a_download_without_a_network_is_an_environment_fault(tmp_path,
                                                             monkeypatch):
  # It was a usage error (status 2), though the same command works once the
  # network is back.
  import socket  # pylint: disable=g-import-not-at-top
  import urllib.error  # pylint: disable=g-import-not-at-top
  from pipeline.errors import EnvironmentFault  # pylint: disable=g-import-not-at-top

  def offline(**kwargs):
    del kwargs
    raise urllib.error.URLError(socket.gaierror(-2, 'Name or service not known'))

  monkeypatch.setattr(tff.simulation.datasets.celeba, 'load_data', offline)
  with pytest.raises(EnvironmentFault) as raised:
    celeba.build_task(_config(str(tmp_path), 'mixed', download=True))
  assert str(raised.value) == (
      f'cannot download CelebA into {tmp_path}/celeba.sqlite: [Errno -2] Name '
      'or service not known; check the network (or put the file there '
      'yourself) and re-run the same command')


def test_unknown_mode_is_a_usage_error(cache_dir):
  with pytest.raises(UsageError, match='celeba_mode'):
    celeba.build_task(_config(cache_dir[0], 'sideways'))


def _all_batches(task):
  """A client's, the central and the evaluation batches of `task`."""
  return (_numpy_batches(task.client_dataset_computation(
      id=task.train_client_ids[0], seed=5)) +
          _numpy_batches(task.server_dataset_computation(5)) +
          _numpy_batches(task.eval_datasets_fn()['']))


def test_uint8_pixels_give_the_same_floats(cache_dir, monkeypatch):
  # Client, central and evaluation examples are narrowed (and checked).
  directory, _ = cache_dir
  config = _config(directory, 'mixed')
  narrowed = _all_batches(celeba.build_task(config))
  monkeypatch.setattr(celeba, '_as_uint8_pixels', lambda example: example)
  wide = _all_batches(celeba.build_task(config))
  assert len(narrowed) == len(wide) == 5
  for (images, labels), (wide_images, wide_labels) in zip(narrowed, wide):
    np.testing.assert_array_equal(images, wide_images)
    np.testing.assert_array_equal(labels, wide_labels)
  # Pixels are k / 255 for integers k, not all 0.
  assert np.any(np.concatenate([b[0].ravel() for b in narrowed]) > 0)


def test_a_pixel_outside_0_255_is_an_error_not_wrapped():
  example = {'image': tf.constant([[[0, 255, 256]]], tf.int64),
             'smiling': tf.constant(False)}
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='pixel outside 0..255'):
    celeba._as_uint8_pixels(example)  # pylint: disable=protected-access
  narrowed = celeba._as_uint8_pixels(  # pylint: disable=protected-access
      {'image': tf.constant([[[0, 17, 255]]], tf.int64)})
  assert narrowed['image'].dtype == tf.uint8
  np.testing.assert_array_equal(narrowed['image'], [[[0, 17, 255]]])


@pytest.mark.parametrize('mode', ['federated', 'mixed'])
def test_a_pixel_outside_0_255_in_the_file_is_bad_data(tmp_path, mode):
  # A client's or a test image's pixel of 100000 trained and evaluated
  # silently (exit 0: eval/loss 207); a central one was a traceback.
  import sqlite3  # pylint: disable=g-import-not-at-top
  from binaries import app  # pylint: disable=g-import-not-at-top
  write_celeba_sqlite(tmp_path / 'celeba.sqlite')
  with sqlite3.connect(tmp_path / 'celeba.sqlite') as connection:
    for rowid, blob in connection.execute(
        'SELECT rowid, serialized_example_proto FROM examples').fetchall():
      example = tf.train.Example.FromString(blob)
      example.features.feature['image'].int64_list.value[7] = 100000
      connection.execute(
          'UPDATE examples SET serialized_example_proto = ? WHERE rowid = ?',
          (example.SerializeToString(), rowid))
  task = celeba.build_task(_config(str(tmp_path), mode))
  reads = [lambda: task.client_dataset_computation(
      id=task.train_client_ids[0], seed=1),
           lambda: task.eval_datasets_fn()['']]
  if mode == 'mixed':
    reads.append(lambda: task.server_dataset_computation(1))
  for read in reads:
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
      list(read())
    assert app.bad_data_message(raised.value) == (
        "the task's data files hold CelebA image pixel outside 0..255: they "
        'are damaged or not the files of this task (--cache_dir, --data_dir)')


def test_the_task_reads_the_examples_tffs_loader_reads(cache_dir):
  directory, written = cache_dir
  ours = celeba._load_client_data(  # pylint: disable=protected-access
      _config(directory, 'federated'))
  tffs = tff.simulation.datasets.celeba.load_data(cache_dir=directory)
  for split, mine, theirs in zip(written, ours, tffs):
    assert mine.element_type_structure == theirs.element_type_structure
    for client_id in written[split]:
      for a, b in zip(mine.create_tf_dataset_for_client(client_id),
                      theirs.create_tf_dataset_for_client(client_id),
                      strict=True):
        tf.nest.map_structure(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize('tables', [('client_metadata',),
                                    ('examples', 'client_metadata')])
def test_a_file_without_its_tables_names_them(tmp_path, tables):
  # TFF's message showed them as a Python frozenset.
  import sqlite3  # pylint: disable=g-import-not-at-top
  write_celeba_sqlite(tmp_path / 'celeba.sqlite')
  with sqlite3.connect(tmp_path / 'celeba.sqlite') as connection:
    for table in tables:
      connection.execute(f'DROP TABLE {table}')
  with pytest.raises(UsageError) as raised:
    celeba.build_task(_config(str(tmp_path), 'federated'))
  assert str(raised.value) == (
      f'cannot read CelebA from {tmp_path}/celeba.sqlite: it has no '
      f'{" or ".join(sorted(tables))} table (a file of TFF\'s SqlClientData '
      'has tables examples and client_metadata)')


@pytest.mark.parametrize('smiling', [2, -1])
def test_a_smiling_label_other_than_0_or_1_is_bad_data(tmp_path, smiling):
  # TFF's loader casts it to bool: it trained as smiling, exit 0.
  import sqlite3  # pylint: disable=g-import-not-at-top
  from binaries import app  # pylint: disable=g-import-not-at-top
  write_celeba_sqlite(tmp_path / 'celeba.sqlite')
  with sqlite3.connect(tmp_path / 'celeba.sqlite') as connection:
    rowid, blob = connection.execute(
        'SELECT rowid, serialized_example_proto FROM examples WHERE '
        "split_name = 'split_by_clients_train' AND client_id = '0'"
    ).fetchone()
    example = tf.train.Example.FromString(blob)
    example.features.feature['smiling'].int64_list.value[0] = smiling
    connection.execute(
        'UPDATE examples SET serialized_example_proto = ? WHERE rowid = ?',
        (example.SerializeToString(), rowid))
  task = celeba.build_task(_config(str(tmp_path), 'federated'))
  with pytest.raises(tf.errors.InvalidArgumentError) as raised:
    list(task.client_dataset_computation(id='0', seed=1))
  assert app.bad_data_message(raised.value) == (
      "the task's data files hold CelebA smiling label other than 0 or 1: "
      'they are damaged or not the files of this task (--cache_dir, '
      '--data_dir)')
  assert list(task.client_dataset_computation(id='1', seed=1))


def _example_with(**features) -> bytes:
  """A CelebA Example whose features are `features` (lists of ints or
  floats), the other attributes 0."""
  values = {name: [0] for name in celeba_fixture.ATTRIBUTES}
  values['image'] = [0] * (84 * 84 * 3)
  values.update(features)
  return tf.train.Example(features=tf.train.Features(feature={
      name: (tf.train.Feature(float_list=tf.train.FloatList(value=value))
             if isinstance(value[0], float) else
             tf.train.Feature(int64_list=tf.train.Int64List(value=value)))
      for name, value in values.items() if value is not None
  })).SerializeToString()


@pytest.mark.parametrize('record,found', [
    (b'not an example proto', 'Could not parse example input'),
    (_example_with(image=[0] * 100), "Key: image.  Can't parse serialized "
     'Example'),
    (_example_with(smiling=None), 'Feature: smiling (data type: int64) is '
     'required but could not be found'),
    (_example_with(image=[0.5] * (84 * 84 * 3)), "Key: image.  Data types "
     "don't match"),
], ids=['not_a_proto', 'wrong_shape', 'missing_feature', 'wrong_dtype'])
def test_unparsable_examples_end_training_with_one_error_line(
    tmp_path, record, found):
  # A celeba.sqlite of the right schema whose examples are not the task's
  # Example protos: the worker finds it while training, TF's error comes
  # back through gRPC, and the run ends as bad input, not with a traceback.
  import sqlite3  # pylint: disable=g-import-not-at-top
  from tasks import client_database  # pylint: disable=g-import-not-at-top
  from tests import fault_testlib  # pylint: disable=g-import-not-at-top
  with sqlite3.connect(tmp_path / 'celeba.sqlite') as connection:
    client_database.create_sql_client_data_tables(connection)
    for split in ('split_by_clients_train', 'split_by_clients_test'):
      for client in ('1', '2'):
        client_database.insert_client_examples(
            connection, split, client, [record] * 3)
  result = fault_testlib.run_binary(
      'binaries.train', '--task=celeba_smile', '--algorithm=fedavg',
      '--celeba_mode=federated', f'--cache_dir={tmp_path}',
      '--total_rounds=1', '--clients_per_round=2', '--client_steps=1',
      '--experiment_name=bad', f'--root_output_dir={tmp_path / "runs"}')
  assert result.returncode == 2, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      "error: the task's data files hold records that cannot be parsed "
      f'({found}): they are damaged or not the files of this task '
      '(--cache_dir, --data_dir)')


def test_a_central_batch_beyond_the_memory_is_a_usage_error(cache_dir):
  # Central batches repeat, so a batch of that size is really built.
  directory, _ = cache_dir
  with pytest.raises(UsageError, match=(
      r'^--central_batch_size=2147483647 is impossible: one batch of '
      r'celeba_smile examples takes at least [\d,.]+ GB')):
    registry.build_task('celeba_smile', _config(
        directory, 'mixed', central_batch_size=2**31 - 1))
