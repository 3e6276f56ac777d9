"""cifar10 / cifar100: TFDS CIFAR with a Dirichlet label partition ([FedPVR] Sec. 4).

The FedPVR setup ([FedPVR], Sec. 4): the 50k training images are dealt to N
clients (`--num_clients`, default 10) by FedDF's Dirichlet(alpha) procedure
(`--dirichlet_alpha`, tasks.dirichlet); all clients take part in every round
by default; the server model is evaluated on the 10k test images. Client
batches get the standard augmentation (random crop of the image padded by 4
pixels, random horizontal flip) drawn from the round's seed, so a resumed run
sees the same augmented batches; every image is then normalized with the
dataset's channel mean and std. Models (`--model`): VGG-11 (default) and
ResNet-8 (tasks.cifar_models; `--model_width` scales them down for tests).

Data come from `tfds.builder(name, data_dir=--data_dir)`; without
`--download` the prepared dataset must already be there. The partition is
written to a client database in TFF's sqlite format (tasks.client_database):
cached under `<--cache_dir>/partitions` when `--cache_dir` is given (built
again when a file of the prepared dataset changes), else rebuilt in a
temporary directory per process.
"""

import collections
import dataclasses
import os
from typing import Callable

import numpy as np
import tensorflow as tf

from pipeline.errors import UsageError
from pipeline.errors import check_host_resolves
from pipeline.errors import download_failure
from pipeline.errors import load_error
from tasks import base
from tasks import cifar_models
from tasks import client_database
from tasks import dirichlet

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('num_clients', 'dirichlet_alpha', 'model', 'model_width')
# The data-location flags it reads (registry.data_locations).
DATA_LOCATIONS = ('cache_dir', 'data_dir', 'download')

IMAGE_SHAPE = cifar_models.IMAGE_SHAPE
CROP_PADDING = 4
DEFAULT_NUM_CLIENTS = 10
PARTITION_FORMAT_VERSION = 1

# Synthetic stand-in with the real element structure.
SYNTHETIC_EXAMPLES_PER_CLIENT = 40
SYNTHETIC_TEST_EXAMPLES = 200


@dataclasses.dataclass(frozen=True)
class CifarSpec:
  name: str
  num_classes: int
  # Where TFDS downloads it from (its builder's URL).
  url: str
  # Per-channel normalization of images in [0, 1] (FedDF's constants).
  mean: tuple[float, float, float]
  std: tuple[float, float, float]


CIFAR10 = CifarSpec(
    'cifar10', 10, 'https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz',
    (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
CIFAR100 = CifarSpec(
    'cifar100', 100, 'https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz',
    (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))


def normalize(images: tf.Tensor, spec: CifarSpec) -> tf.Tensor:
  """uint8 images -> float model input."""
  images = tf.cast(images, tf.float32) / 255.0
  return (images - tf.constant(spec.mean)) / tf.constant(spec.std)


def augment(images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  """Random 4-pixel-padded crop and horizontal flip of a batch, per image.

  Stateless in `seed` (shape [2]): the same seed gives the same batch. Padding
  is with zeros (black) before normalization, as torchvision's RandomCrop.
  """
  crop_seed, flip_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, num=2))
  batch_size = tf.shape(images)[0]
  height, width = IMAGE_SHAPE[0], IMAGE_SHAPE[1]
  padded = tf.pad(images, [[0, 0], [CROP_PADDING, CROP_PADDING],
                           [CROP_PADDING, CROP_PADDING], [0, 0]])
  offsets = tf.random.stateless_uniform(
      [batch_size, 2], crop_seed, minval=0, maxval=2 * CROP_PADDING + 1,
      dtype=tf.int32)
  rows = offsets[:, :1] + tf.range(height)[tf.newaxis]
  cols = offsets[:, 1:] + tf.range(width)[tf.newaxis]
  cropped = tf.gather(padded, rows, axis=1, batch_dims=1)
  cropped = tf.gather(cropped, cols, axis=2, batch_dims=1)
  flip = tf.random.stateless_uniform([batch_size], flip_seed) < 0.5
  return tf.where(flip[:, tf.newaxis, tf.newaxis, tf.newaxis],
                  tf.reverse(cropped, axis=[2]), cropped)


def _parse_examples(serialized: tf.Tensor) -> collections.OrderedDict:
  features = tf.io.parse_example(serialized, {
      'image': tf.io.FixedLenFeature([], tf.string),
      'label': tf.io.FixedLenFeature([], tf.int64),
  })
  images = tf.reshape(tf.io.decode_raw(features['image'], tf.uint8),
                      IMAGE_SHAPE)
  return collections.OrderedDict(image=images, label=features['label'])


def _serialize(image: np.ndarray, label: int) -> bytes:
  return tf.train.Example(features=tf.train.Features(feature={
      'image': tf.train.Feature(bytes_list=tf.train.BytesList(
          value=[np.ascontiguousarray(image, np.uint8).tobytes()])),
      'label': tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
  })).SerializeToString()


def _synthetic_examples(num_examples: int, num_classes: int, seed: int):
  """Noisy per-class colour patterns (learnable), uint8 like TFDS."""
  prototypes = np.random.default_rng(4321).uniform(
      0, 255, size=(num_classes, *IMAGE_SHAPE))
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, num_classes, size=num_examples)
  images = prototypes[labels] + rng.normal(0, 40, size=(num_examples,
                                                        *IMAGE_SHAPE))
  return (np.clip(np.rint(images), 0, 255).astype(np.uint8),
          labels.astype(np.int64))


class _TfdsSource:
  """A prepared TFDS CIFAR dataset under --data_dir."""

  def __init__(self, spec: CifarSpec, config: base.DataConfig):
    self._spec = spec
    try:
      self._builder = base.tensorflow_datasets().builder(
          spec.name, data_dir=config.data_dir)
      if config.download and not self._builder.is_prepared():
        check_host_resolves(spec.url)
        self._builder.download_and_prepare()
    except Exception as e:  # pylint: disable=broad-except
      location = config.data_dir or 'TFDS\'s default data directory'
      if config.download and download_failure(e) is not None:
        # Also what TFDS raises after its retries (a name that resolves but
        # does not answer).
        raise load_error(f'TFDS {spec.name}', location, e) from e
      raise UsageError(f'cannot prepare TFDS {spec.name} in {location}: '
                       f'{e}') from e
    self.location = str(self._builder.data_dir)

  def split(self, split: str) -> tf.data.Dataset:
    try:
      return self._builder.as_dataset(split=split, shuffle_files=False)
    except Exception as e:  # pylint: disable=broad-except
      name = self._spec.name
      if not self._builder.is_prepared():
        # It said "(test split) ... (AssertionError)".
        raise UsageError(
            f'no prepared TFDS {name} in --data_dir: {self.location} does not '
            f'hold it; prepare it (`tfds build {name} --data_dir=DIR`), pass '
            '--download to fetch it, or --use_synthetic_data') from e
      raise UsageError(
          f'TFDS {name} in {self.location} cannot be read ({split} split: '
          f'{type(e).__name__}); prepare it again, or pass '
          '--use_synthetic_data') from e

  def train_arrays(self):
    images, labels = [], []
    for example in self.split('train').batch(1000).as_numpy_iterator():
      images.append(example['image'])
      labels.append(example['label'])
    return np.concatenate(images), np.concatenate(labels)


def _options(config: base.DataConfig):
  options = config.options
  # `or` would take an explicit 0 for unset.
  num_clients = options.get('num_clients', DEFAULT_NUM_CLIENTS)
  alpha = options.get('dirichlet_alpha', 0.1)
  model = options.get('model') or next(iter(cifar_models.MODELS))
  width = options.get('model_width', 1.0)
  if num_clients < 1:
    raise UsageError(f'--num_clients must be >= 1, got {num_clients}')
  if not alpha > 0:
    raise UsageError(f'--dirichlet_alpha must be > 0, got {alpha}')
  if model not in cifar_models.MODELS:
    raise UsageError(f'--model={model!r} is not a CIFAR model; allowed: '
                     f'{", ".join(cifar_models.MODELS)}')
  if not width > 0:
    raise UsageError(f'--model_width must be > 0, got {width}')
  return num_clients, alpha, model, width


def _build(spec: CifarSpec, config: base.DataConfig) -> base.Task:
  num_clients, alpha, model, width = _options(config)
  if config.use_synthetic_data:
    train_images, train_labels = _synthetic_examples(
        SYNTHETIC_EXAMPLES_PER_CLIENT * num_clients, spec.num_classes, seed=0)
    test_images, test_labels = _synthetic_examples(
        SYNTHETIC_TEST_EXAMPLES, spec.num_classes, seed=1)
    test_examples = lambda: tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(image=test_images, label=test_labels))
    load_train = lambda: (train_images, train_labels)
    source_name = 'synthetic'
  else:
    source = _TfdsSource(spec, config)
    test_examples = lambda: source.split('test')
    source.split('test')  # A missing dataset fails here, before any work.
    load_train = source.train_arrays
    source_name = client_database.source_fingerprint(source.location)
  if config.cache_dir and not config.use_synthetic_data:
    partition_dir = os.path.join(config.cache_dir, 'partitions')
  else:
    partition_dir = client_database.scratch_dir()
  file_name = (f'{spec.name}_dirichlet{alpha:g}_clients{num_clients}_'
               f'seed{config.seed}.sqlite')
  fingerprint = (f'v{PARTITION_FORMAT_VERSION} {source_name} alpha={alpha!r} '
                 f'clients={num_clients} seed={config.seed}')

  def make_partition():
    images, labels = load_train()
    try:
      clients = dirichlet.dirichlet_partition(labels, num_clients, alpha,
                                              config.seed)
    except ValueError as e:
      raise UsageError(f'--num_clients={num_clients}, --dirichlet_alpha='
                       f'{alpha}: {e}') from e
    return clients, (_serialize(image, int(label))
                     for image, label in zip(images, labels))

  clients = client_database.materialize(
      os.path.join(partition_dir, file_name), fingerprint, make_partition)
  client_examples = clients.serializable_dataset_fn

  def client_dataset(client_id, seed):
    examples = client_examples(client_id).map(_parse_examples)
    batches = base.client_batches(examples, config, seed)

    def augmented(batch_index, batch):
      images = augment(batch['image'], tf.stack([seed, batch_index]))
      return normalize(images, spec), batch['label']

    return batches.enumerate().map(augmented)

  def eval_datasets():
    return {'': test_examples().batch(config.eval_batch_size).map(
        lambda batch: (normalize(batch['image'], spec), batch['label']))}

  def predictions(logits):
    return {'logits': logits, 'probabilities': tf.nn.softmax(logits),
            'class': tf.argmax(logits, axis=-1)}

  model_fn: Callable[[], tf.keras.Model] = lambda: cifar_models.MODELS[model](
      spec.num_classes, width=width)
  return base.Task(
      name=spec.name,
      train_client_ids=tuple(clients.client_ids),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=model_fn,
      loss_fn=lambda: tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True),
      metrics_fn=lambda: [
          tf.keras.metrics.SparseCategoricalAccuracy(name='accuracy')],
      batch_spec=(tf.TensorSpec([None, *IMAGE_SHAPE], tf.float32),
                  tf.TensorSpec([None], tf.int64)),
      eval_datasets_fn=eval_datasets,
      serving=base.ServingSpec(
          input_name='images',
          input_spec=tf.TensorSpec([None, *IMAGE_SHAPE], tf.uint8),
          preprocess=lambda images: normalize(images, spec),
          postprocess=predictions),
      default_clients_per_round=num_clients)


def build_cifar10(config: base.DataConfig) -> base.Task:
  return _build(CIFAR10, config)


def build_cifar100(config: base.DataConfig) -> base.Task:
  return _build(CIFAR100, config)
