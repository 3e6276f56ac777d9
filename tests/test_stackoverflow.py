"""stackoverflow_char / stackoverflow_word on tiny files in the real formats
(TFF's stackoverflow.sqlite, a prepared TFDS wikipedia/20201201.en), and on
synthetic data."""

import re
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tasks import base
from tasks import stackoverflow_char as so_char
from tasks import stackoverflow_word as so_word
from tests import stackoverflow_fixture as fixture

TINY_MODEL = {'char_embedding_dim': 4, 'gru_units': 4}


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
  cache_dir = tmp_path_factory.mktemp('tff_cache')
  written = fixture.write_stackoverflow_sqlite(
      cache_dir / so_char.SQLITE_NAME)
  words = fixture.write_word_counts(
      str(cache_dir), [s for c in written['train'].values() for s in c])
  data_dir = tmp_path_factory.mktemp('tfds')
  articles = fixture.write_wikipedia_tfds(str(data_dir))
  return dict(cache_dir=str(cache_dir), data_dir=str(data_dir),
              written=written, articles=articles, words=words)


def _config(sources, **kwargs):
  options = dict(TINY_MODEL, **kwargs.pop('options', {}))
  return base.DataConfig(cache_dir=sources['cache_dir'],
                         data_dir=sources['data_dir'], options=options,
                         **kwargs)


def _sequences(texts):
  """The expected packing: [bos] text [eos] back to back, 101-token chunks."""
  stream = []
  for text in texts:
    stream += [so_char.BOS] + list(
        so_char.char_ids(tf.constant(text)).numpy()) + [so_char.EOS]
  chunk = so_char.SEQUENCE_LENGTH + 1
  chunks = [stream[i:i + chunk] for i in range(0, len(stream), chunk)]
  return sorted(tuple(c + [so_char.PAD] * (chunk - len(c)))
                for c in chunks if len(c) > 1)


def _full_sequences(batches):
  """(input, target) batches -> the 101-token sequences they were cut from."""
  return sorted(tuple(np.concatenate([x, y[-1:]]).tolist())
                for inputs, targets in batches
                for x, y in zip(np.asarray(inputs), np.asarray(targets)))


def _texts(batches):
  return [so_char.ids_to_text(np.asarray(inputs)[i])
          for inputs, _ in batches for i in range(np.asarray(inputs).shape[0])]


def test_tff_and_tfds_loaders_read_the_fixtures(sources):
  train, heldout, test = tff.simulation.datasets.stackoverflow.load_data(
      cache_dir=sources['cache_dir'])
  for split, client_data in (('train', train), ('heldout', heldout),
                             ('test', test)):
    assert sorted(client_data.client_ids) == sorted(sources['written'][split])
  client_id = sorted(sources['written']['train'])[0]
  tokens = [e['tokens'].numpy().decode()
            for e in train.create_tf_dataset_for_client(client_id)]
  assert tokens == sources['written']['train'][client_id]
  articles = tfds.load(so_char.WIKIPEDIA, split='train',
                       data_dir=sources['data_dir'], download=False)
  assert {a['title'].numpy().decode(): a['text'].numpy().decode()
          for a in articles} == sources['articles']


def test_character_ids():
  ids = so_char.char_ids(tf.constant('a~ \n\u00e9!')).numpy().tolist()
  assert ids == [ord('a') - 31, 95, 1, so_char.NEWLINE, so_char.OOV,
                 ord('!') - 31]
  assert max(ids) < so_char.CHAR_VOCAB_SIZE
  assert so_char.ids_to_text(ids) == 'a~ \n<oov>!'


@pytest.fixture(scope='module')
def char_task(sources):
  return so_char.build_task(_config(
      sources, client_batch_size=1000, client_epochs=1, central_batch_size=3,
      central_steps=4, options={'max_eval_sequences': 1000}))


def test_client_data_are_the_clients_text_packed(sources, char_task):
  written = sources['written']['train']
  assert sorted(char_task.train_client_ids) == sorted(written)
  client_id = sorted(written)[1]
  batches = list(char_task.client_dataset_computation(id=client_id, seed=3))
  assert len(batches) == 1  # one epoch, batch larger than the client
  assert _full_sequences(batches) == _sequences(written[client_id])


def test_client_batches_are_seeded(sources):
  task = so_char.build_task(_config(sources, client_batch_size=2,
                                    client_steps=3))
  client_id = task.train_client_ids[0]

  def batches(seed):
    return [np.asarray(x) for x, _ in task.client_dataset_computation(
        id=client_id, seed=seed)]

  first = batches(1)
  assert [b.shape for b in first] == [(2, so_char.SEQUENCE_LENGTH)] * 3
  np.testing.assert_array_equal(first, batches(1))
  assert not np.array_equal(first, batches(2))


def test_central_batches_are_training_articles_only(char_task):
  batches = list(char_task.server_dataset_computation(7))
  assert [np.asarray(x).shape for x, _ in batches] == [
      (3, so_char.SEQUENCE_LENGTH)] * 4
  text = ' '.join(_texts(batches))
  assert any(word in text for word in fixture.TRAIN_WORDS)
  assert not any(word in text for word in fixture.HELD_OUT_WORDS)
  again = list(char_task.server_dataset_computation(7))
  np.testing.assert_array_equal(_full_sequences(batches),
                                _full_sequences(again))
  other = list(char_task.server_dataset_computation(8))
  assert _full_sequences(batches) != _full_sequences(other)


def test_eval_sets(sources, char_task):
  eval_sets = {name: list(dataset)
               for name, dataset in char_task.eval_datasets_fn().items()}
  assert set(eval_sets) == {'', 'stackoverflow', 'wikipedia'}
  test_clients = sources['written']['test']
  expected_so = sorted(sum((_sequences(test_clients[c])
                            for c in test_clients), []))
  assert _full_sequences(eval_sets['stackoverflow']) == expected_so
  held_out = [text for title, text in sources['articles'].items()
              if so_char.is_wikipedia_eval_title(tf.constant(title))]
  assert held_out
  wiki = _full_sequences(eval_sets['wikipedia'])
  assert wiki == _sequences(held_out)
  text = ' '.join(_texts(eval_sets['wikipedia']))
  assert not any(word in text for word in ('Rhine', 'flows'))
  # The mix: both sets, interleaved.
  assert _full_sequences(eval_sets['']) == sorted(expected_so + wiki)
  mix_order = [seq in set(wiki) for seq in (
      tuple(np.concatenate([x, y[-1:]]).tolist())
      for inputs, targets in eval_sets['']
      for x, y in zip(np.asarray(inputs), np.asarray(targets)))]
  assert mix_order != sorted(mix_order)


def test_eval_sets_are_bounded(sources):
  task = so_char.build_task(_config(sources,
                                    options={'max_eval_sequences': 2}))
  sizes = {name: sum(np.asarray(x).shape[0] for x, _ in dataset)
           for name, dataset in task.eval_datasets_fn().items()}
  assert sizes == {'': 4, 'stackoverflow': 2, 'wikipedia': 2}


def test_synthetic_data_has_the_real_element_structure(sources):
  real_train, _, _ = tff.simulation.datasets.stackoverflow.load_data(
      cache_dir=sources['cache_dir'])
  synthetic_train, synthetic_test = so_char.load_stackoverflow(
      base.DataConfig(use_synthetic_data=True))
  assert synthetic_train.element_type_structure == (
      real_train.element_type_structure)
  assert synthetic_test.element_type_structure == (
      real_train.element_type_structure)
  real_wiki = tfds.load(so_char.WIKIPEDIA, split='train',
                        data_dir=sources['data_dir'], download=False)
  synthetic_wiki = tf.data.Dataset.from_tensor_slices(
      so_char.synthetic_wikipedia_articles())
  assert dict(synthetic_wiki.element_spec) == dict(real_wiki.element_spec)
  task = so_char.build_task(base.DataConfig(
      use_synthetic_data=True, client_batch_size=2, client_steps=1,
      central_batch_size=2, options=dict(TINY_MODEL, max_eval_sequences=3)))
  assert task.num_train_clients == so_char.SYNTHETIC_TRAIN_CLIENTS
  assert all(sum(np.asarray(x).shape[0] for x, _ in d) > 0
             for d in task.eval_datasets_fn().values())


def test_missing_data_directories_are_usage_errors(sources, tmp_path):
  def build(**kwargs):
    config = dict(cache_dir=sources['cache_dir'],
                  data_dir=sources['data_dir'], options=TINY_MODEL)
    config.update(kwargs)
    return so_char.build_task(base.DataConfig(**config))

  with pytest.raises(UsageError, match='--cache_dir is required'):
    build(cache_dir=None)
  with pytest.raises(UsageError, match='--cache_dir=.*does not exist'):
    build(cache_dir=str(tmp_path / 'missing'))
  with pytest.raises(UsageError, match='has no stackoverflow.sqlite'):
    build(cache_dir=str(tmp_path))
  with pytest.raises(UsageError, match='--data_dir is required'):
    build(data_dir=None)
  with pytest.raises(UsageError, match='--data_dir=.* has no prepared TFDS '
                     'wikipedia/20201201.en'):
    build(data_dir=str(tmp_path))
  with pytest.raises(UsageError, match='--gru_units must be >= 1'):
    build(options={'gru_units': 0})


def test_word_task_on_the_fixture(sources):
  task = so_word.build_task(base.DataConfig(
      cache_dir=sources['cache_dir'], client_batch_size=2, client_steps=2,
      options={'word_vocab_size': 5, 'model_width': 0.02,
               'max_eval_sequences': 4}))
  vocab = sources['words'][:5]
  client_id = sorted(sources['written']['train'])[0]
  batches = [(np.asarray(x), np.asarray(y)) for x, y in
             task.client_dataset_computation(id=client_id, seed=0)]
  length = so_word.SEQUENCE_LENGTH
  assert [x.shape for x, _ in batches] == [(2, length)] * 2
  # 5 words + pad, oov, bos, eos.
  num_tokens = 5 + 4
  bos = 5 + 1 + 1
  for inputs, targets in batches:
    assert np.all(inputs[:, 0] == bos)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert inputs.max() < num_tokens
  # Every sentence of the client, mapped through the vocabulary (TFF's ids:
  # word i -> i + 1, unknown words -> the oov id 6), heads some row.
  ids = {w: i + 1 for i, w in enumerate(vocab)}
  rows = {tuple(row[1:4]) for inputs, _ in batches for row in inputs}
  sentences = {tuple(ids.get(w, 6) for w in s.split()[:3])
               for s in sources['written']['train'][client_id]}
  assert rows <= sentences
  [eval_batch] = list(task.eval_datasets_fn()[''])
  assert np.asarray(eval_batch[0]).shape == (4, length)
  assert task.keras_model_fn().output_shape == (None, None, num_tokens)


def test_word_task_without_vocabulary_is_a_usage_error(sources, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  shutil.copy(f'{sources["cache_dir"]}/{so_char.SQLITE_NAME}', tmp_path)
  with pytest.raises(UsageError, match='has no stackoverflow.word_count'):
    so_word.build_task(base.DataConfig(cache_dir=str(tmp_path)))


def test_vocabulary_download_without_a_network_is_an_environment_fault(
    sources, tmp_path, monkeypatch):
  # It was a urllib traceback (status 1).
  import shutil  # pylint: disable=import-outside-toplevel
  import socket  # pylint: disable=import-outside-toplevel
  import urllib.error  # pylint: disable=import-outside-toplevel
  from pipeline.errors import EnvironmentFault  # pylint: disable=import-outside-toplevel
  shutil.copy(f'{sources["cache_dir"]}/{so_char.SQLITE_NAME}', tmp_path)

  def offline(**kwargs):
    del kwargs
    raise urllib.error.URLError(socket.gaierror(-2, 'Name or service not known'))

  monkeypatch.setattr(tff.simulation.datasets.stackoverflow,
                      'load_word_counts', offline)
  with pytest.raises(EnvironmentFault) as raised:
    so_word.build_task(base.DataConfig(cache_dir=str(tmp_path), download=True))
  assert str(raised.value) == (
      'cannot download the StackOverflow vocabulary into '
      f'{tmp_path}/datasets/stackoverflow.word_count: [Errno -2] Name or '
      'service not known; check the network (or put the file there yourself) '
      'and re-run the same command')


def test_another_datasets_file_is_a_usage_error_that_says_so(tmp_path):
  # CelebA's file as stackoverflow.sqlite: the error line ended with ': '.
  from tests import celeba_fixture  # pylint: disable=g-import-not-at-top
  celeba_fixture.write_celeba_sqlite(tmp_path / so_char.SQLITE_NAME)
  with pytest.raises(UsageError) as raised:
    so_char.load_stackoverflow(base.DataConfig(cache_dir=str(tmp_path)))
  assert str(raised.value) == (
      f'cannot read StackOverflow from {tmp_path}/stackoverflow.sqlite: it '
      "holds no clients of the task's splits (another dataset's file?)")


@pytest.mark.parametrize('split', ['train', 'test'])
def test_a_split_without_examples_is_a_usage_error(sources, tmp_path, split):
  # Both tasks (this is their loader) trained on nothing, or logged no
  # evaluation, with status 0.
  import shutil  # pylint: disable=import-outside-toplevel
  from tests import celeba_fixture  # pylint: disable=g-import-not-at-top
  path = tmp_path / so_char.SQLITE_NAME
  shutil.copy(f'{sources["cache_dir"]}/{so_char.SQLITE_NAME}', path)
  celeba_fixture.without_examples(path, split)
  with pytest.raises(UsageError) as raised:
    so_char.load_stackoverflow(base.DataConfig(cache_dir=str(tmp_path)))
  assert str(raised.value) == celeba_fixture.no_examples_message(
      path, 'StackOverflow', split, split)


def test_a_client_id_that_is_not_text_is_named(sources, tmp_path):
  # TFF's loader: "'<' not supported between instances of 'bytes' and 'str'".
  import shutil  # pylint: disable=import-outside-toplevel
  import sqlite3  # pylint: disable=import-outside-toplevel
  path = tmp_path / so_char.SQLITE_NAME
  shutil.copy(f'{sources["cache_dir"]}/{so_char.SQLITE_NAME}', path)
  with sqlite3.connect(path) as connection:
    connection.execute('INSERT INTO client_metadata VALUES (?, ?, 1)',
                       (b'\xff', 'heldout'))
  with pytest.raises(UsageError) as raised:
    so_char.load_stackoverflow(base.DataConfig(cache_dir=str(tmp_path)))
  assert str(raised.value) == (
      f"{path} has client id x'ff' (a blob, not text) in its heldout split: "
      "TFF's reader takes only UTF-8 text ids; rename that client in the "
      "file's examples and client_metadata tables")


def _cache_with_word_counts(sources, directory, text: str) -> str:
  """A --cache_dir of the fixture's StackOverflow data and `text` as its
  stackoverflow.word_count."""
  import shutil  # pylint: disable=import-outside-toplevel
  shutil.copy(f'{sources["cache_dir"]}/{so_char.SQLITE_NAME}', directory)
  (directory / 'stackoverflow.word_count').write_text(text)
  return str(directory)


@pytest.mark.parametrize('text, error', [
    # TFF's task builder raised a ValueError: a traceback.
    ('', 'stackoverflow.word_count holds no words'),
    # "code 12" of "code 1234": the cut count parsed and the file trained.
    ('the 5000\ncode 12',
     r"^cannot read the StackOverflow vocabulary .*stackoverflow.word_count: "
     r"its last line 'code 12' has no newline"),
    # It trained a model of 2 words + 4 special tokens, recorded as 10000.
    ('the 5000\ncode 12\n',
     r"^the StackOverflow vocabulary .*stackoverflow.word_count holds 2 "
     r"words, fewer than --word_vocab_size=10000; pass a --word_vocab_size "
     r"of at most 2, or restore the file$"),
    # Not a count table: the vocabulary took one more line, silently.
    ('the 5000\ncode 12\nthe 7\n',
     r"^cannot read the StackOverflow vocabulary .*stackoverflow.word_count: "
     r"line 3 counts 'the' again \(line 1\)$"),
    ('the 5000\ncode -12\n',
     r"^cannot read the StackOverflow vocabulary .*stackoverflow.word_count: "
     r"line 2 gives 'code' the negative count -12$"),
])
def test_word_task_with_a_damaged_vocabulary_is_a_usage_error(
    sources, tmp_path, text, error):
  with pytest.raises(UsageError, match=error):
    so_word.build_task(base.DataConfig(
        cache_dir=_cache_with_word_counts(sources, tmp_path, text)))


def test_word_task_takes_a_vocabulary_as_large_as_its_file(sources, tmp_path):
  task = so_word.build_task(base.DataConfig(
      cache_dir=_cache_with_word_counts(sources, tmp_path,
                                        'the 5000\ncode 12\n'),
      options={'word_vocab_size': 2, 'model_width': 0.02}))
  # 2 words + pad, oov, bos, eos.
  assert task.keras_model_fn().output_shape == (None, None, 6)


@pytest.mark.parametrize('damage, found', [
    # Read by the evaluation in this process.
    (lambda content: content[:len(content) // 2], 'truncated record at 3301'),
    # Read by the central model's stream in the worker, through gRPC.
    (lambda content: b'garbage' * 400, 'corrupted record at 0'),
])
def test_damaged_wikipedia_shard_ends_training_with_one_error_line(
    sources, tmp_path, damage, found):
  # Both were DataLossError tracebacks.
  import shutil  # pylint: disable=g-import-not-at-top
  from tests import fault_testlib  # pylint: disable=g-import-not-at-top
  data_dir = tmp_path / 'tfds'
  shutil.copytree(sources['data_dir'], data_dir)
  (shard,) = data_dir.glob('wikipedia/*/*/*.tfrecord-00000-of-*')
  shard.write_bytes(damage(shard.read_bytes()))
  result = fault_testlib.run_binary(
      'binaries.train', '--task=stackoverflow_char', '--algorithm=mixed_pt',
      f'--cache_dir={sources["cache_dir"]}', f'--data_dir={data_dir}',
      '--gru_units=8', '--char_embedding_dim=4', '--client_steps=1',
      '--clients_per_round=2', '--central_batch_size=4', '--total_rounds=1',
      '--experiment_name=bad', f'--root_output_dir={tmp_path / "runs"}')
  assert result.returncode == 2, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      "error: the task's data files hold a damaged TFRecord file "
      f'({found}): restore them, or use the files of this task '
      '(--cache_dir, --data_dir)')


@pytest.mark.parametrize('num_articles,num_held_out,removed_shard', [
    (3, 3, False), (4, 1, True)], ids=['all_held_out', 'shard_missing'])
def test_wikipedia_without_central_articles_is_a_usage_error(
    sources, tmp_path, num_articles, num_held_out, removed_shard):
  """With every article held out for evaluation, the central stream (an
  endless repeat, filtered) never yielded a batch: training hung."""
  data_dir = tmp_path / 'tfds'
  fixture.write_wikipedia_tfds(str(data_dir), num_articles=num_articles,
                               num_held_out=num_held_out)
  if removed_shard:
    (shard,) = data_dir.glob('wikipedia/*/*/*.tfrecord-00001-of-*')
    shard.unlink()
    expected = f'lacks its file {shard}; restore it'
  else:
    expected = ('holds no article for the central data: all 3 are held out '
                'for evaluation')
  with pytest.raises(UsageError, match=re.escape(expected)):
    so_char.build_task(base.DataConfig(
        cache_dir=sources['cache_dir'], data_dir=str(data_dir),
        options=TINY_MODEL))
