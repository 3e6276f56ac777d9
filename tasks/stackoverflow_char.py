"""stackoverflow_char: next-character prediction, Mixed FL ([MixedFL] Sec. 5.2).

[MixedFL] Sec. 5.2 / App. C.2.2: federated data are TFF's StackOverflow
train clients (the `tokens` field: lowercased, space-separated tokens of a
question or answer); central (server) data are Wikipedia articles from TFDS
`wikipedia/20201201.en`. Both are cut the same way into 100-character
sequences: each example (StackOverflow sentence, Wikipedia article) becomes
[bos] + its characters + [eos]; a client's (or the article stream's) tokens are
packed back to back and cut into chunks of 101 tokens, the last chunk padded.
A chunk gives the model input (its first 100 tokens) and the target (its last
100: the next character at every position).

Character vocabulary (CHAR_VOCAB_SIZE = 100 ids, fixed, no data needed):
  0        pad
  1..95    printable ASCII ' ' (32) .. '~' (126), id = code point - 31
  96       '\\n' (Wikipedia paragraphs)
  97       out of vocabulary (any other Unicode character, e.g. 'e' with an
           accent: one id per character, not per UTF-8 byte)
  98, 99   beginning / end of an example (bos, eos)
Ids are computed arithmetically from code points (no lookup table), so the
same function runs in client computations, the central stream and serving.

Evaluation sets (each bounded by `--max_eval_sequences` per source, read once
and cached): `stackoverflow` (sequences of the StackOverflow test clients, in
a fixed shuffled client order), `wikipedia` (articles held out of the central
stream: those whose title hashes to bucket 0 of WIKIPEDIA_EVAL_BUCKETS) and
'' (reported as eval/<metric>): a seeded random mix of both, the paper's
evaluation data. Accuracy counts every target but pad (TFF's
MaskedCategoricalAccuracy); the loss is TFF's char-baseline loss, cross-entropy
over every position.

Model (`--char_embedding_dim`, `--gru_units`; the paper's 256 / 1024):
Embedding + GRU + Dense(CHAR_VOCAB_SIZE) logits at every position.
"""

import collections
import os
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from pipeline.errors import load_error
from pipeline.errors import not_a_directory
from tasks import base
from tasks import client_database
from tff_algos import tff_internals

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('char_embedding_dim', 'gru_units', 'max_eval_sequences')
# The data-location flags it reads (registry.data_locations).
DATA_LOCATIONS = ('cache_dir', 'data_dir', 'download')

SEQUENCE_LENGTH = 100
PAD = 0
_FIRST_PRINTABLE = 32  # ' '
_LAST_PRINTABLE = 126  # '~'
NEWLINE = 96
OOV = 97
BOS = 98
EOS = 99
CHAR_VOCAB_SIZE = 100

SQLITE_NAME = 'stackoverflow.sqlite'
WIKIPEDIA = 'wikipedia/20201201.en'
# 1 in WIKIPEDIA_EVAL_BUCKETS articles (by title hash) is held out for eval.
WIKIPEDIA_EVAL_BUCKETS = 100
# Shards read at once in the central stream, and the most sequences shuffled
# across them (4 central batches, up to this).
_WIKIPEDIA_CYCLE_LENGTH = 4
_CENTRAL_SHUFFLE_SEQUENCES = 10000
DEFAULT_EMBEDDING_DIM = 256
DEFAULT_GRU_UNITS = 1024
DEFAULT_MAX_EVAL_SEQUENCES = 5000

# Synthetic stand-ins (same element structure as the real sources).
SYNTHETIC_TRAIN_CLIENTS = 20
SYNTHETIC_TEST_CLIENTS = 6
SYNTHETIC_ARTICLES = 60
SYNTHETIC_SENTENCES = 400


def char_ids(text: tf.Tensor) -> tf.Tensor:
  """UTF-8 string (scalar) -> int64 character ids (see the module docstring)."""
  code_points = tf.cast(
      tf.strings.unicode_decode(text, 'UTF-8', errors='replace'), tf.int64)
  printable = (code_points >= _FIRST_PRINTABLE) & (
      code_points <= _LAST_PRINTABLE)
  ids = tf.where(printable, code_points - (_FIRST_PRINTABLE - 1),
                 tf.constant(OOV, tf.int64))
  return tf.where(code_points == 10, tf.constant(NEWLINE, tf.int64), ids)


def ids_to_text(ids) -> str:
  """Inverse of `char_ids` for inspection (special ids as <pad> etc.)."""
  special = {PAD: '<pad>', OOV: '<oov>', BOS: '<bos>', EOS: '<eos>',
             NEWLINE: '\n'}
  return ''.join(special.get(int(i), chr(int(i) + _FIRST_PRINTABLE - 1))
                 for i in ids)


def _example_ids(text: tf.Tensor) -> tf.Tensor:
  return tf.concat([[BOS], char_ids(text), [EOS]], 0)


def to_sequences(texts: tf.data.Dataset) -> tf.data.Dataset:
  """Dataset of strings -> packed int64 sequences of SEQUENCE_LENGTH + 1."""
  chunk = SEQUENCE_LENGTH + 1

  def pad(sequence):
    return tf.ensure_shape(
        tf.pad(sequence, [[0, chunk - tf.shape(sequence)[0]]]), [chunk])

  return texts.map(_example_ids).unbatch().batch(chunk).filter(
      # A lone trailing token has no next character to predict.
      lambda sequence: tf.shape(sequence)[0] > 1).map(pad)


def split_input_target(sequences: tf.Tensor):
  return sequences[..., :-1], sequences[..., 1:]


def _stackoverflow_text(example):
  return example['tokens']


def is_wikipedia_eval_title(title: tf.Tensor) -> tf.Tensor:
  return tf.equal(
      tf.strings.to_hash_bucket_fast(title, WIKIPEDIA_EVAL_BUCKETS), 0)


def _is_wikipedia_train_article(article):
  return tf.logical_not(is_wikipedia_eval_title(article['title']))


def _is_wikipedia_eval_article(article):
  return is_wikipedia_eval_title(article['title'])


# --- StackOverflow ---------------------------------------------------------

def _synthetic_sentences() -> list[bytes]:
  """A pool of sentences over the words of TFF's synthetic StackOverflow."""
  words = sorted(set(b' '.join(
      tokens for client in tff.simulation.datasets.stackoverflow
      .create_synthetic_data_dictionary().values()
      for tokens in client['tokens']).split()))
  rng = np.random.default_rng(1)
  return [b' '.join(rng.choice(words, size=int(rng.integers(4, 25))))
          for _ in range(SYNTHETIC_SENTENCES)]


def _synthetic_client_examples(sentences: list[bytes]) -> Callable:
  """client id -> deterministic examples with StackOverflow's features."""

  def examples(client_id):
    key = tf.strings.to_hash_bucket_fast(client_id, 2**31 - 1)
    seed = tf.stack([key, tf.constant(11, tf.int64)])
    n = tf.random.stateless_uniform([], seed, minval=8, maxval=20,
                                    dtype=tf.int64)
    picks = tf.random.stateless_uniform(
        [n], seed + 1, minval=0, maxval=len(sentences), dtype=tf.int64)
    kinds = tf.constant([b'question', b'answer'])
    return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        creation_date=tf.fill([n], b'2010-01-08 09:34:05 UTC'),
        score=tf.random.stateless_uniform([n], seed + 2, minval=-2,
                                          maxval=50, dtype=tf.int64),
        tags=tf.fill([n], b'python|tensorflow'),
        title=tf.fill([n], b'synthetic question'),
        tokens=tf.gather(tf.constant(sentences), picks),
        type=tf.gather(kinds, tf.range(n) % 2)))

  return examples


def load_stackoverflow(config: base.DataConfig):
  """(train, test) ClientData with TFF StackOverflow's element structure."""
  if config.use_synthetic_data:
    make = tff.simulation.datasets.ClientData.from_clients_and_tf_fn
    examples = _synthetic_client_examples(_synthetic_sentences())
    return (make([f'synthetic_train_{i:03d}'
                  for i in range(SYNTHETIC_TRAIN_CLIENTS)], examples),
            make([f'synthetic_test_{i:03d}'
                  for i in range(SYNTHETIC_TEST_CLIENTS)], examples))
  cache_dir = config.cache_dir
  if not cache_dir:
    raise UsageError(f'--cache_dir is required: a directory holding '
                     f'{SQLITE_NAME} (TFF StackOverflow), or pass '
                     '--use_synthetic_data')
  if not config.download:
    if not os.path.isdir(cache_dir):
      raise UsageError(f'--cache_dir={cache_dir} {not_a_directory(cache_dir)}; it must hold '
                       f'{SQLITE_NAME} (TFF StackOverflow), or pass '
                       '--download, or --use_synthetic_data')
    if not os.path.isfile(os.path.join(cache_dir, SQLITE_NAME)):
      raise UsageError(f'--cache_dir={cache_dir} has no {SQLITE_NAME} (TFF '
                       'StackOverflow); pass --download to fetch it, or '
                       '--use_synthetic_data')
  database = os.path.join(cache_dir, SQLITE_NAME)
  # The splits TFF's loader reads.
  client_database.require_text_client_ids(database,
                                          ('train', 'heldout', 'test'))
  try:
    train, _, test = tff.simulation.datasets.stackoverflow.load_data(
        cache_dir=cache_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise load_error('StackOverflow', database, e) from e
  client_database.require_readable_client_ids(database, (train, test))
  client_database.require_examples(database, 'StackOverflow',
                                   {'train': 'train', 'test': 'test'})
  return train, test


# --- Wikipedia -------------------------------------------------------------

_SYNTHETIC_WIKI_WORDS = (
    'The', 'History', 'of', 'river', 'was', 'founded', 'in', 'century',
    'North', 'American', 'population', 'census', 'village', 'is', 'a',
    'located', 'district', 'Kingdom', 'during', 'war', 'known', 'as', 'and',
    'first', 'album', 'released', 'by', 'band', '1987', '2004', 'species',
    'family', 'genus', 'University', 'school', 'church', 'built')


def synthetic_wikipedia_articles() -> dict:
  """Articles with TFDS Wikipedia's features ({'text', 'title'} strings).

  Capitalized, punctuated prose with newlines, unlike StackOverflow's
  lowercased tokens, so the two sources have different character statistics.
  Titles are chosen so that some fall into the held-out evaluation bucket.
  """
  rng = np.random.default_rng(3)
  candidates = [f'Synthetic article {i}'
                for i in range(100 * SYNTHETIC_ARTICLES)]
  held_out = is_wikipedia_eval_title(tf.constant(candidates)).numpy()
  # A tenth of the synthetic articles are held out (the real rule holds out
  # 1%), so the synthetic evaluation set is not tiny.
  num_held_out = SYNTHETIC_ARTICLES // 10
  chosen = ([c for c, h in zip(candidates, held_out) if h][:num_held_out] +
            [c for c, h in zip(candidates, held_out) if not h][
                :SYNTHETIC_ARTICLES - num_held_out])
  titles, texts = [], []
  for title in sorted(chosen):
    paragraphs = []
    for _ in range(int(rng.integers(1, 4))):
      words = rng.choice(_SYNTHETIC_WIKI_WORDS, size=int(rng.integers(15, 60)))
      paragraphs.append(' '.join(words) + '.')
    titles.append(title.encode())
    texts.append('\n'.join(paragraphs).encode())
  return collections.OrderedDict(text=texts, title=titles)


class Wikipedia:
  """TFDS `wikipedia/20201201.en` (or its synthetic stand-in) as articles."""

  def __init__(self, config: base.DataConfig):
    self._synthetic = config.use_synthetic_data
    self._data_dir = config.data_dir
    if self._synthetic:
      self._articles = synthetic_wikipedia_articles()
      return
    if not config.data_dir:
      raise UsageError(f'--data_dir is required: the TFDS data directory '
                       f'holding {WIKIPEDIA} (central data), or pass '
                       '--use_synthetic_data')
    dataset_dir = os.path.join(config.data_dir, *WIKIPEDIA.split('/'))
    if not os.path.isdir(dataset_dir):
      raise UsageError(f'--data_dir={config.data_dir} has no prepared TFDS '
                       f'{WIKIPEDIA} (no {dataset_dir}); prepare it with '
                       'tfds build, or pass --use_synthetic_data')
    try:
      self._builder = base.tensorflow_datasets().builder(
          WIKIPEDIA, data_dir=config.data_dir)
      split = self._builder.info.splits['train']
    except Exception as e:  # pylint: disable=broad-except
      raise UsageError(f'cannot read TFDS {WIKIPEDIA} in --data_dir='
                       f'{config.data_dir}: {e}') from e
    self._files = [os.fspath(path) for path in split.filepaths]
    self._shard_lengths = [int(n) for n in split.shard_lengths]
    self._require_central_articles()

  def _require_central_articles(self) -> None:
    """UsageError unless every shard file is there and one article is not
    held out: the central stream repeats its articles without end, so with
    none it would wait forever for its first batch."""
    where = f'TFDS {WIKIPEDIA} in --data_dir={self._data_dir}'
    missing = [path for path in self._files if not os.path.isfile(path)]
    if missing:
      raise UsageError(f'{where} lacks its file {missing[0]}; restore it or '
                       'prepare the dataset again')
    # A damaged file fails here, as the binaries report it
    # (binaries.app.bad_data_message).
    central = self._articles_once().filter(_is_wikipedia_train_article)
    if not any(True for _ in central.take(1)):
      raise UsageError(
          f'{where} holds no article for the central data: all '
          f'{sum(self._shard_lengths)} are held out for evaluation (1 title '
          f'in {WIKIPEDIA_EVAL_BUCKETS}) or the split is empty')

  def train_stream(self, seed: tf.Tensor) -> tf.data.Dataset:
    """An endless, seeded stream of the central (not held-out) articles.

    Built from the split's shard files rather than `tfds.load` because the
    round's seed is a tensor inside a TFF computation and TFDS's file shuffling
    only takes Python seeds: shards come in a seeded order, each starting at
    a seeded offset, so rounds do not all begin with the same articles.
    """
    if self._synthetic:
      articles = tf.data.Dataset.from_tensor_slices(self._articles).shuffle(
          SYNTHETIC_ARTICLES, seed=seed, reshuffle_each_iteration=True
      ).repeat()
      return articles.filter(_is_wikipedia_train_article)
    features = self._builder.info.features
    shards = tf.data.Dataset.from_tensor_slices(
        (tf.constant(self._files), tf.constant(self._shard_lengths, tf.int64)))

    def read_shard(path, num_examples):
      offset_seed = tf.stack(
          [seed, tf.strings.to_hash_bucket_fast(path, 2**31 - 1)])
      offset = tf.random.stateless_uniform(
          [], offset_seed, minval=0, maxval=tf.maximum(num_examples, 1),
          dtype=tf.int64)
      return tf.data.TFRecordDataset(path).skip(offset)

    articles = shards.shuffle(len(self._files), seed=seed,
                              reshuffle_each_iteration=True).repeat(
                              ).interleave(
        read_shard, cycle_length=min(_WIKIPEDIA_CYCLE_LENGTH,
                                     len(self._files))).map(
                                         features.deserialize_example)
    return articles.filter(_is_wikipedia_train_article)

  def _articles_once(self) -> tf.data.Dataset:
    """Every article, once, in a fixed order."""
    if self._synthetic:
      return tf.data.Dataset.from_tensor_slices(self._articles)
    return base.tensorflow_datasets().load(
        WIKIPEDIA, split='train', data_dir=self._data_dir, download=False,
        shuffle_files=False)

  def eval_articles(self) -> tf.data.Dataset:
    return self._articles_once().filter(_is_wikipedia_eval_article)


# --- Model -----------------------------------------------------------------

def build_keras_model(embedding_dim: int = DEFAULT_EMBEDDING_DIM,
                      gru_units: int = DEFAULT_GRU_UNITS) -> tf.keras.Model:
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(None,), dtype=tf.int64),
      tf.keras.layers.Embedding(CHAR_VOCAB_SIZE, embedding_dim),
      # The GRU of tf.keras.layers.GRU (same math and weights, reset_after)
      # without its cuDNN/generic implementation selector: TFF's runtime is
      # CPU-only.
      tf.keras.layers.RNN(tf.keras.layers.GRUCell(gru_units),
                          return_sequences=True),
      tf.keras.layers.Dense(CHAR_VOCAB_SIZE),
  ])


def metrics() -> list[tf.keras.metrics.Metric]:
  return [tff_internals.MaskedCategoricalAccuracy(name='accuracy',
                                                   masked_tokens=[PAD])]


def _serving_preprocess(texts: tf.Tensor) -> tf.Tensor:
  """Strings -> [bos] + character ids, padded to the longest."""
  ids = tf.map_fn(
      lambda text: tf.concat([[BOS], char_ids(text)], 0), texts,
      fn_output_signature=tf.RaggedTensorSpec([None], tf.int64))
  return ids.to_tensor(PAD)


def positive_option(options, name, default) -> int:
  """A task option that must be >= 1 (None: the default)."""
  value = options.get(name)
  value = default if value is None else value
  if int(value) < 1:
    raise UsageError(f'--{name} must be >= 1, got {value}')
  return int(value)


def build_task(config: base.DataConfig) -> base.Task:
  options = config.options
  embedding_dim = positive_option(options, 'char_embedding_dim',
                                   DEFAULT_EMBEDDING_DIM)
  gru_units = positive_option(options, 'gru_units', DEFAULT_GRU_UNITS)
  max_eval_sequences = positive_option(options, 'max_eval_sequences',
                                        DEFAULT_MAX_EVAL_SEQUENCES)
  train, test = load_stackoverflow(config)
  wikipedia = Wikipedia(config)
  raw_examples = train.serializable_dataset_fn

  def client_dataset(client_id, seed):
    sequences = to_sequences(raw_examples(client_id).map(_stackoverflow_text))
    return base.client_batches(sequences, config, seed).map(
        split_input_target)

  def server_batches(seed):
    sequences = to_sequences(wikipedia.train_stream(seed).map(
        lambda article: article['text']))
    # Mixes sequences of several articles into a batch.
    buffer = min(_CENTRAL_SHUFFLE_SEQUENCES, 4 * config.central_batch_size)
    return sequences.shuffle(buffer, seed=seed).batch(
            config.central_batch_size).take(config.central_steps).map(
                split_input_target)

  def eval_datasets():
    # Fixed client and article order: the same sequences every evaluation,
    # read once.
    test_ids = sorted(test.client_ids)
    np.random.default_rng(0).shuffle(test_ids)
    stackoverflow = tf.data.Dataset.from_tensor_slices(test_ids).flat_map(
        lambda cid: to_sequences(
            test.serializable_dataset_fn(cid).map(_stackoverflow_text))
    ).take(max_eval_sequences).cache()
    wiki = to_sequences(wikipedia.eval_articles().map(
        lambda article: article['text'])).take(max_eval_sequences).cache()
    mixed = tf.data.Dataset.sample_from_datasets(
        [stackoverflow, wiki], seed=0, stop_on_empty_dataset=False)

    def batches(sequences):
      return sequences.batch(config.eval_batch_size).map(split_input_target)

    return {'': batches(mixed), 'stackoverflow': batches(stackoverflow),
            'wikipedia': batches(wiki)}

  sequence_spec = tf.TensorSpec([None, SEQUENCE_LENGTH], tf.int64)
  serving = base.ServingSpec(
      input_name='texts',
      input_spec=tf.TensorSpec([None], tf.string),
      preprocess=_serving_preprocess,
      # Position t holds the distribution of the character after input t
      # (position 0: after bos, i.e. the first character).
      postprocess=lambda logits: {
          'next_char_probabilities': tf.nn.softmax(logits)})
  return base.Task(
      name='stackoverflow_char',
      train_client_ids=tuple(train.client_ids),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=lambda: build_keras_model(embedding_dim, gru_units),
      loss_fn=lambda: tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True),
      metrics_fn=metrics,
      batch_spec=(sequence_spec, sequence_spec),
      eval_datasets_fn=eval_datasets,
      serving=serving,
      server_dataset_computation=base.server_dataset_computation(
          server_batches))
