"""celeba_smile: smile classification on TFF's federated CelebA ([MixedFL] Sec. 5.1).

Modes (`--celeba_mode`):
  mixed (default): Mixed FL split of [MixedFL] Sec. 5.1. Federated data are
    the smiling images of the train clients, three raw clients grouped into one
    composite client; central (server) data are the non-smiling images of the
    same train clients; evaluation on every image of the test clients.
  fl_only: the federated data of `mixed` alone, no central data (Figure 1's
    "only FL" curve, e.g. with FedAvg).
  oracle: the composite clients of `mixed` with both labels, no central data
    (Figure 1's "oracle": all training data available to one FL process).
  federated: plain FL, raw train clients with both labels.
All modes evaluate on the same test images.
"""

import collections
import functools
import os
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from pipeline.errors import load_error
from pipeline.errors import not_a_directory
from tasks import base
from tasks import client_database

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('celeba_mode',)
# The data-location flags it reads (registry.data_locations).
DATA_LOCATIONS = ('cache_dir', 'download')

IMAGE_SHAPE = (84, 84, 3)
LABEL = 'smiling'
MODES = ('mixed', 'fl_only', 'oracle', 'federated')
COMPOSITE_SIZE = 3
COMPOSITE_SEPARATOR = '|'
SQLITE_NAME = 'celeba.sqlite'
# The splits of celeba.sqlite TFF's loader reads (train, test).
_SPLITS = ('split_by_clients_train', 'split_by_clients_test')

# Synthetic stand-in: same element structure as the real loader.
SYNTHETIC_TRAIN_CLIENTS = 60
SYNTHETIC_TEST_CLIENTS = 12


_PIXELS_PER_IMAGE = int(np.prod(IMAGE_SHAPE))
# The message of the check on read pixels (binaries.app turns it into one
# line).
PIXELS_OUT_OF_RANGE = 'CelebA image pixel outside 0..255'
LABEL_NOT_BINARY = 'CelebA smiling label other than 0 or 1'


def _synthetic_client_examples(client_id: tf.Tensor,
                               columns: Optional[Sequence[str]] = None
                               ) -> tf.data.Dataset:
  """Deterministic fake CelebA examples for one client id.

  Images are noise; smiling faces get a brighter band where the mouth is, so
  the label is learnable. Every attribute is an independent coin flip.
  `columns`: only these features (the same values), e.g. the model's.
  """
  key = tf.strings.to_hash_bucket_fast(client_id, 2**31 - 1)
  seed = tf.stack([key, tf.constant(7, tf.int64)])
  num_examples = tf.random.stateless_uniform(
      [], seed, minval=4, maxval=17, dtype=tf.int64)
  attributes = tf.random.stateless_uniform(
      [num_examples, len(tff.simulation.datasets.celeba.ATTRIBUTE_NAMES)],
      seed + 1) < 0.5
  image_shape = tf.concat([[num_examples], tf.constant(IMAGE_SHAPE, tf.int64)],
                          0)
  # Pixels in 0..199 from random bytes (four per 32-bit draw): drawing each
  # pixel as an int64 took a fifth of a benchmark round's CPU time.
  random_words = tf.random.stateless_uniform(
      [num_examples * _PIXELS_PER_IMAGE // 4], seed + 2, minval=None,
      maxval=None, dtype=tf.uint32)
  random_bytes = tf.reshape(tf.bitcast(random_words, tf.uint8), image_shape)
  images = tf.bitwise.right_shift(tf.cast(random_bytes, tf.int64) * 200, 8)
  mouth_rows = tf.reshape(
      tf.cast((tf.range(84) >= 52) & (tf.range(84) < 72), tf.int64),
      [1, 84, 1, 1])
  smiling_index = tff.simulation.datasets.celeba.ATTRIBUTE_NAMES.index(LABEL)
  smiling = tf.cast(attributes[:, smiling_index], tf.int64)
  images += 55 * mouth_rows * tf.reshape(smiling, [-1, 1, 1, 1])
  features = [('image', images)] + [
      (name, attributes[:, i]) for i, name in
      enumerate(tff.simulation.datasets.celeba.ATTRIBUTE_NAMES)]
  if columns is not None:
    features = [(name, value) for name, value in features if name in columns]
  return tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(sorted(features)))


def _load_client_data(config: base.DataConfig):
  """(train, test) ClientData with TFF's CelebA element structure."""
  if config.use_synthetic_data:
    make = tff.simulation.datasets.ClientData.from_clients_and_tf_fn
    # A larger population (e.g. to sample 1000 clients a round in the
    # benchmark) is a task option; the flags keep the small default.
    num_train = config.options.get('synthetic_train_clients',
                                   SYNTHETIC_TRAIN_CLIENTS)
    train = make([f'synthetic_train_{i:03d}' for i in range(num_train)],
                 _synthetic_client_examples)
    test = make([f'synthetic_test_{i:03d}'
                 for i in range(SYNTHETIC_TEST_CLIENTS)],
                _synthetic_client_examples)
    return train, test
  cache_dir = config.cache_dir or os.path.join(os.path.expanduser('~'), '.tff')
  database = os.path.join(cache_dir, SQLITE_NAME)
  if not config.download:
    if not os.path.isdir(cache_dir):
      raise UsageError(f'--cache_dir={cache_dir} {not_a_directory(cache_dir)}; it must hold '
                       f'{SQLITE_NAME} (TFF CelebA), or pass --download, or '
                       '--use_synthetic_data')
    if not os.path.isfile(database):
      raise UsageError(f'--cache_dir={cache_dir} has no {SQLITE_NAME} (TFF '
                       'CelebA); pass --download to fetch it, or '
                       '--use_synthetic_data')
  client_database.require_text_client_ids(database, _SPLITS)
  try:
    if not os.path.isfile(database):  # --download: TFF's loader fetches it.
      tff.simulation.datasets.celeba.load_data(split_by_clients=True,
                                               cache_dir=cache_dir)
    # A list, not a generator: TFF's bare StopIteration (a file of none of
    # the splits) would become a RuntimeError.
    train, test = [tff.simulation.datasets.SqlClientData(
        database, split).preprocess(_parse_examples) for split in _SPLITS]
  except Exception as e:  # pylint: disable=broad-except
    raise load_error('CelebA', database, e) from e
  client_database.require_readable_client_ids(database, (train, test),
                                              COMPOSITE_SEPARATOR)
  client_database.require_examples(database, 'CelebA',
                                   dict(zip(_SPLITS, ('train', 'test'))))
  return train, test


def _parse_examples(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """TFF's CelebA parsing (its loader's `_add_proto_parsing`: the same
  elements) with the label checked: TFF casts every attribute to bool, so a
  smiling value of 2 or -1 (a damaged file) trained silently as smiling."""
  attributes = tff.simulation.datasets.celeba.ATTRIBUTE_NAMES
  features = {'image': tf.io.FixedLenFeature(IMAGE_SHAPE, tf.int64),
              **{name: tf.io.FixedLenFeature((), tf.int64)
                 for name in attributes}}

  def parse(serialized):
    parsed = tf.io.parse_example(serialized, features)
    label = parsed[LABEL]
    binary = tf.debugging.Assert(
        tf.reduce_all(tf.logical_or(tf.equal(label, 0), tf.equal(label, 1))),
        [LABEL_NOT_BINARY])
    with tf.control_dependencies([binary]):
      return collections.OrderedDict(sorted(
          [('image', tf.identity(parsed['image']))] +
          [(name, tf.cast(parsed[name], tf.bool)) for name in attributes]))

  return dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def _to_model_input(image: tf.Tensor) -> tf.Tensor:
  return tf.cast(image, tf.float32) / 255.0


MODEL_COLUMNS = ('image', LABEL)


def _model_columns(example):
  return {name: example[name] for name in MODEL_COLUMNS}


def _model_examples_fn(train, config: base.DataConfig) -> Callable:
  """client id -> its examples with only the columns the model reads.

  Training never sees the other 39 columns, yet slicing them costs as much
  as generating a synthetic client's pixels (every example slices every
  column): the synthetic clients make only these; real clients are read
  whole, then projected before anything copies them.
  """
  if config.use_synthetic_data:
    return functools.partial(_synthetic_client_examples,
                             columns=MODEL_COLUMNS)
  # A pixel outside 0..255 (a damaged file) trained silently, exit 0.
  return lambda client_id: train.serializable_dataset_fn(client_id).map(
      _model_columns).map(_as_uint8_pixels)


def _as_uint8_pixels(example):
  """`example` with its image as uint8 (TFF's CelebA stores 0..255 as int64).

  Central batches hold a shuffle buffer of twice their size: with 8 bytes a
  pixel it was 1.7 GB at 5000 images a batch (making them peaked at 10 GB of
  RSS, 3 GB with uint8), and filling it with freshly allocated memory doubled
  the first round's time to make them. The model sees the same floats
  (`_to_model_input`); a pixel outside 0..255 is an error, not wrapped
  around.
  """
  image = example['image']
  narrow = tf.cast(image, tf.uint8)
  in_range = tf.debugging.assert_equal(
      tf.cast(narrow, image.dtype), image,
      message=PIXELS_OUT_OF_RANGE)
  with tf.control_dependencies([in_range]):
    return dict(example, image=tf.identity(narrow))


def _to_batch(batch):
  label = tf.cast(tf.expand_dims(batch[LABEL], -1), tf.float32)
  return _to_model_input(batch['image']), label


def build_keras_model() -> tf.keras.Model:
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=IMAGE_SHAPE),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(64, activation='relu'),
      tf.keras.layers.Dense(1),
  ])


def _metrics():
  return [tf.keras.metrics.BinaryAccuracy(name='accuracy', threshold=0.0),
          tf.keras.metrics.AUC(name='auc', from_logits=True)]


def _composite_ids(raw_ids, seed):
  raw_ids = sorted(raw_ids)
  np.random.default_rng(seed).shuffle(raw_ids)
  usable = len(raw_ids) - len(raw_ids) % COMPOSITE_SIZE
  return tuple(
      COMPOSITE_SEPARATOR.join(raw_ids[i:i + COMPOSITE_SIZE])
      for i in range(0, usable, COMPOSITE_SIZE))


def build_task(config: base.DataConfig) -> base.Task:
  mode = config.options.get('celeba_mode', 'mixed')
  if mode not in MODES:
    raise UsageError(f'--celeba_mode={mode!r} is unknown; allowed: '
                     f'{", ".join(MODES)}')
  train, test = _load_client_data(config)
  model_examples = _model_examples_fn(train, config)
  raw_train_ids = tuple(train.client_ids)
  smiling_clients = mode in ('mixed', 'fl_only')
  if mode == 'federated':
    train_ids = raw_train_ids
  else:
    train_ids = _composite_ids(raw_train_ids, config.seed)

  def client_examples(client_id):
    if mode == 'federated':
      # Not through flat_map, whose function each client's iterator would
      # instantiate again.
      return model_examples(client_id)
    # A composite client is its raw clients' data in sequence.
    raw_ids = tf.strings.split(client_id, COMPOSITE_SEPARATOR)
    examples = tf.data.Dataset.from_tensor_slices(raw_ids).flat_map(
        model_examples)
    if smiling_clients:
      examples = examples.filter(lambda e: e[LABEL])
    return examples

  def client_dataset(client_id, seed):
    return base.client_batches(client_examples(client_id), config,
                               seed).map(_to_batch)

  server_dataset = None
  if mode == 'mixed':

    def server_batches(seed):
      # Fresh central batches each round: a seeded pass over the train
      # clients' non-smiling images.
      examples = tf.data.Dataset.from_tensor_slices(
          tf.constant(raw_train_ids)).shuffle(
          len(raw_train_ids), seed=seed).flat_map(model_examples).filter(
              lambda e: tf.logical_not(e[LABEL])).map(_as_uint8_pixels)
      return examples.shuffle(
          2 * config.central_batch_size, seed=seed).repeat().batch(
              config.central_batch_size).take(
                  config.central_steps).map(_to_batch)

    server_dataset = base.server_dataset_computation(server_batches)

  def eval_datasets():
    # A fixed client order: eval batches (and so float sums) never change.
    return {'': test.create_tf_dataset_from_all_clients(seed=0).map(
        _as_uint8_pixels).batch(config.eval_batch_size).map(_to_batch)}

  batch_spec = (tf.TensorSpec([None, *IMAGE_SHAPE], tf.float32),
                tf.TensorSpec([None, 1], tf.float32))
  serving = base.ServingSpec(
      input_name='images',
      input_spec=tf.TensorSpec([None, *IMAGE_SHAPE], tf.float32),
      preprocess=_to_model_input,
      postprocess=lambda logits: {'smiling_probability': tf.sigmoid(logits)})
  return base.Task(
      name='celeba_smile',
      train_client_ids=train_ids,
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=build_keras_model,
      loss_fn=lambda: tf.keras.losses.BinaryCrossentropy(from_logits=True),
      metrics_fn=_metrics,
      batch_spec=batch_spec,
      eval_datasets_fn=eval_datasets,
      serving=serving,
      server_dataset_computation=server_dataset)
