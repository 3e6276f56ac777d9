"""emnist: TFF's federated EMNIST re-partitioned with s% similarity ([SCAFFOLD] Sec. 7).

SCAFFOLD ([SCAFFOLD], Sec. 7) pools the training examples of all writers and
deals them to N clients (`--num_clients`, default 100): s% of the data
(`--similarity`) i.i.d., the rest sorted by label in contiguous shards
(`tasks.partition.similarity_partition`). The paper does not name the EMNIST
split; the default is the 62-class one (`--emnist_only_digits` for 10 digits).
Evaluation is on the pooled test examples of all writers. Images are flattened
to 784 features (TFF's convention: 1.0 is background). Models
(`--model`): multinomial logistic regression (default) or a 2-layer MLP with
200 ReLU hidden units (the paper leaves the width open).

The pooled partition is written once to a client database in TFF's sqlite
format (tasks.client_database) under `<cache_dir>/partitions`; synthetic data
(`--use_synthetic_data`) goes through the same path in a temporary directory.
"""

import collections
import os
import sqlite3
from typing import Iterator

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from pipeline.errors import first_line
from pipeline.errors import load_error
from tasks import base
from tasks import client_database
from tasks import partition

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('num_clients', 'similarity', 'model', 'emnist_only_digits',
           'model_width')
# The data-location flags it reads (registry.data_locations).
DATA_LOCATIONS = ('cache_dir', 'download')

IMAGE_SHAPE = (28, 28)
NUM_PIXELS = 28 * 28
SQLITE_NAME = 'emnist_all.sqlite'
# Split names inside TFF's emnist_all.sqlite (see tff emnist.load_data).
TRAIN_SPLIT = {True: 'digits_only_train', False: 'all_train'}
TEST_SPLIT = {True: 'digits_only_test', False: 'all_test'}
NUM_CLASSES = {True: 10, False: 62}
MODELS = ('logistic', 'mlp')
MLP_HIDDEN_UNITS = 200
DEFAULT_NUM_CLIENTS = 100
# SCAFFOLD samples 20% of the clients per round.
DEFAULT_PARTICIPATION = 0.2
PARTITION_FORMAT_VERSION = 1
_LABEL_CHUNK = 10000

# Synthetic stand-in with the real element structure.
SYNTHETIC_EXAMPLES_PER_CLIENT = 20
SYNTHETIC_TEST_EXAMPLES = 400


# The message of the check on parsed pixels (binaries.app turns it into one
# line).
NON_FINITE_PIXELS = 'EMNIST pixels that are not finite'
# TFF's EMNIST pixels are in [0, 1]; a finite value far outside (1e38)
# trained to an infinite loss with exit 0.
PIXELS_OUT_OF_RANGE = 'EMNIST pixels outside [0, 1]'


def _parse_examples(serialized: tf.Tensor) -> collections.OrderedDict:
  """TFF EMNIST's parsing of a (batch of) serialized tf.train.Example."""
  features = tf.io.parse_example(serialized, {
      'pixels': tf.io.FixedLenFeature(IMAGE_SHAPE, tf.float32),
      'label': tf.io.FixedLenFeature([], tf.int64),
  })
  return _with_valid_pixels(collections.OrderedDict(
      label=tf.cast(features['label'], tf.int32), pixels=features['pixels']))


def _with_valid_pixels(example):
  # A NaN or infinite pixel (a damaged file) would train silently: every
  # client it reaches is dropped as non-finite, and the metrics are NaN (in
  # the test split: evaluation reported NaN and exited 0).
  pixels = tf.debugging.check_numerics(example['pixels'], NON_FINITE_PIXELS)
  in_range = tf.debugging.Assert(
      tf.logical_and(tf.reduce_min(pixels) >= 0.0,
                     tf.reduce_max(pixels) <= 1.0), [PIXELS_OUT_OF_RANGE])
  with tf.control_dependencies([in_range]):
    return collections.OrderedDict(example, pixels=tf.identity(pixels))


def _serialize(label: int, pixels: np.ndarray) -> bytes:
  return tf.train.Example(features=tf.train.Features(feature={
      'label': tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
      'pixels': tf.train.Feature(float_list=tf.train.FloatList(
          value=np.asarray(pixels, np.float32).ravel())),
  })).SerializeToString()


def _labels_of(serialized: list[bytes]) -> np.ndarray:
  labels = [tf.io.parse_example(
      serialized[i:i + _LABEL_CHUNK],
      {'label': tf.io.FixedLenFeature([], tf.int64)})['label'].numpy()
            for i in range(0, len(serialized), _LABEL_CHUNK)]
  return np.concatenate(labels) if labels else np.zeros([0], np.int64)


class _SqliteSource:
  """The pooled training examples of TFF's EMNIST database, in a fixed order.

  Pool order is (writer id, row order), so a partition is reproducible from
  the seed. Streams rows; only the labels are held in memory.
  """

  def __init__(self, database: str, split: str, num_classes: int):
    self._database = database
    self._split = split
    self._num_classes = num_classes

  def _rows(self) -> Iterator[bytes]:
    connection = sqlite3.connect(f'file:{self._database}?mode=ro', uri=True)
    try:
      cursor = connection.execute(
          'SELECT serialized_example_proto FROM examples WHERE split_name = ? '
          'ORDER BY client_id, rowid', (self._split,))
      for (row,) in cursor:
        yield row
    finally:
      connection.close()

  def labels(self) -> np.ndarray:
    chunks, chunk = [], []
    try:
      for row in self._rows():
        if not isinstance(row, bytes):
          # A NULL or text record stopped the run with numpy's traceback.
          raise ValueError(f'a record is {type(row).__name__}, not the '
                           'bytes of a tf.train.Example')
        chunk.append(row)
        if len(chunk) == _LABEL_CHUNK:
          chunks.append(_labels_of(chunk))
          chunk = []
      chunks.append(_labels_of(chunk))
    except (ValueError, tf.errors.InvalidArgumentError) as e:
      # E.g. a label of two values: TF's parse error, as a traceback.
      raise UsageError(
          f'{self._database} holds {self._split} examples that are not '
          f'EMNIST examples ({first_line(e)}): it is damaged or not '
          'TFF\'s EMNIST') from e
    labels = np.concatenate(chunks)
    outside = labels[(labels < 0) | (labels >= self._num_classes)]
    if outside.size:
      # Found here, not as a worker's traceback when (if) a client's batch
      # holds one; a negative label trained silently.
      raise UsageError(
          f'{self._database} holds {self._split} label {outside[0]}, '
          f'outside the {self._num_classes} classes (0..'
          f'{self._num_classes - 1}): it is damaged or not TFF\'s EMNIST')
    return labels

  def serialized_examples(self) -> Iterator[bytes]:
    return self._rows()


def _synthetic_examples(num_examples: int, num_classes: int, seed: int):
  """Noisy class prototypes (learnable), TFF's value range and structure."""
  prototypes = np.random.default_rng(1234).uniform(
      0.0, 1.0, size=(num_classes, *IMAGE_SHAPE)).astype(np.float32)
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, num_classes, size=num_examples)
  pixels = prototypes[labels] + rng.normal(
      0.0, 0.3, size=(num_examples, *IMAGE_SHAPE))
  return labels.astype(np.int32), np.clip(pixels, 0.0, 1.0).astype(np.float32)


class _SyntheticSource:
  """Pooled examples generated in memory."""

  def __init__(self, num_examples: int, num_classes: int):
    self._labels, self._pixels = _synthetic_examples(
        num_examples, num_classes, seed=0)

  def labels(self) -> np.ndarray:
    return self._labels.astype(np.int64)

  def serialized_examples(self) -> Iterator[bytes]:
    for label, pixels in zip(self._labels, self._pixels):
      yield _serialize(int(label), pixels)


def _options(config: base.DataConfig):
  options = config.options
  # `or` would take an explicit 0 for unset.
  num_clients = options.get('num_clients', DEFAULT_NUM_CLIENTS)
  similarity = options.get('similarity', 0.0)
  model = options.get('model') or MODELS[0]
  only_digits = bool(options.get('emnist_only_digits', False))
  width = options.get('model_width', 1.0)
  if num_clients < 1:
    raise UsageError(f'--num_clients must be >= 1, got {num_clients}')
  if not 0.0 <= similarity <= 100.0:
    raise UsageError(f'--similarity must be a percentage in [0, 100], got '
                     f'{similarity}')
  if model not in MODELS:
    raise UsageError(f'--model={model!r} is not an emnist model; allowed: '
                     f'{", ".join(MODELS)}')
  if not width > 0:
    raise UsageError(f'--model_width must be > 0, got {width}')
  return num_clients, similarity, model, only_digits, width


def _load_real(config: base.DataConfig, only_digits: bool):
  """(pooled train source, test ClientData, cache dir) of the real data."""
  cache_dir = config.cache_dir or os.path.join(os.path.expanduser('~'), '.tff')
  database = os.path.join(cache_dir, SQLITE_NAME)
  if not config.download and not os.path.isfile(database):
    raise UsageError(
        f'--cache_dir={cache_dir} has no {SQLITE_NAME} (TFF EMNIST); pass '
        '--download to fetch it, or --use_synthetic_data')
  client_database.require_text_client_ids(
      database, (TRAIN_SPLIT[only_digits], TEST_SPLIT[only_digits]))
  try:
    _, test = tff.simulation.datasets.emnist.load_data(
        only_digits=only_digits, cache_dir=cache_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise load_error('EMNIST', database, e) from e
  # Test clients are read by TFF's reader (an id with ' was a SQL syntax
  # error at the first evaluation, after a round had trained); the train
  # split is read here, by a query that takes any id.
  client_database.require_readable_client_ids(database, (test,))
  client_database.require_examples(database, 'EMNIST', {
      TRAIN_SPLIT[only_digits]: 'train', TEST_SPLIT[only_digits]: 'test'})
  return (_SqliteSource(database, TRAIN_SPLIT[only_digits],
                        NUM_CLASSES[only_digits]), test, cache_dir)


def build_keras_model(model: str = 'logistic', num_classes: int = 62,
                      width: float = 1.0) -> tf.keras.Model:
  layers = [tf.keras.layers.InputLayer(input_shape=(NUM_PIXELS,))]
  if model == 'mlp':
    layers.append(tf.keras.layers.Dense(
        max(1, round(MLP_HIDDEN_UNITS * width)), activation='relu'))
  layers.append(tf.keras.layers.Dense(num_classes))
  return tf.keras.Sequential(layers)


def _to_batch(batch):
  pixels = tf.reshape(batch['pixels'], [-1, NUM_PIXELS])
  return pixels, batch['label']


def build_task(config: base.DataConfig) -> base.Task:
  num_clients, similarity, model, only_digits, width = _options(config)
  num_classes = NUM_CLASSES[only_digits]
  split = TRAIN_SPLIT[only_digits]
  if config.use_synthetic_data:
    source = _SyntheticSource(
        SYNTHETIC_EXAMPLES_PER_CLIENT * num_clients, num_classes)
    test_labels, test_pixels = _synthetic_examples(
        SYNTHETIC_TEST_EXAMPLES, num_classes, seed=1)
    test_examples = lambda: tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(label=test_labels, pixels=test_pixels))
    partition_dir = client_database.scratch_dir()
    fingerprint_source = 'synthetic'
  else:
    source, test, cache_dir = _load_real(config, only_digits)
    test_examples = lambda: test.create_tf_dataset_from_all_clients(seed=0)
    partition_dir = os.path.join(cache_dir, 'partitions')
    fingerprint_source = client_database.source_fingerprint(
        os.path.join(cache_dir, SQLITE_NAME))
  name = (f'emnist_{split}_similarity{similarity:g}_clients{num_clients}_'
          f'seed{config.seed}{"_synthetic" if config.use_synthetic_data else ""}'
          '.sqlite')
  fingerprint = (f'v{PARTITION_FORMAT_VERSION} {fingerprint_source} '
                 f'split={split} similarity={similarity!r} '
                 f'clients={num_clients} seed={config.seed}')

  def make_partition():
    clients = partition.similarity_partition(source.labels(), num_clients,
                                             similarity, config.seed)
    return clients, source.serialized_examples()

  clients = client_database.materialize(
      os.path.join(partition_dir, name), fingerprint, make_partition)
  client_examples = clients.serializable_dataset_fn

  def client_dataset(client_id, seed):
    examples = client_examples(client_id).map(_parse_examples)
    return base.client_batches(examples, config, seed).map(_to_batch)

  def eval_datasets():
    return {'': test_examples().map(_with_valid_pixels).batch(
        config.eval_batch_size).map(_to_batch)}

  def probabilities(logits):
    return {'logits': logits, 'probabilities': tf.nn.softmax(logits),
            'class': tf.argmax(logits, axis=-1)}

  serving = base.ServingSpec(
      input_name='pixels',
      input_spec=tf.TensorSpec([None, *IMAGE_SHAPE], tf.float32),
      preprocess=lambda pixels: tf.reshape(pixels, [-1, NUM_PIXELS]),
      postprocess=probabilities)
  return base.Task(
      name='emnist',
      train_client_ids=tuple(clients.client_ids),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=lambda: build_keras_model(model, num_classes, width),
      loss_fn=lambda: tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True),
      metrics_fn=lambda: [
          tf.keras.metrics.SparseCategoricalAccuracy(name='accuracy')],
      batch_spec=(tf.TensorSpec([None, NUM_PIXELS], tf.float32),
                  tf.TensorSpec([None], tf.int32)),
      eval_datasets_fn=eval_datasets,
      serving=serving,
      default_clients_per_round=max(
          1, round(DEFAULT_PARTICIPATION * num_clients)))
