"""digits: scikit-learn's bundled 8x8 handwritten digits, split into clients
with SCAFFOLD's s% similarity partition ([SCAFFOLD] Sec. 7) or FedPVR's
Dirichlet(alpha) label partition ([FedPVR] Sec. 4).

Data: `sklearn.datasets.load_digits` (1797 images of 8x8 pixels in 0..16, 10
classes; shipped inside scikit-learn, so it is real data available offline). A
fixed stratified split (independent of `--seed`, so every run evaluates on the
same images) keeps 297 images for test and 1500 for training; the training
images are dealt to `--num_clients` clients (default 100, i.e. 15 images each)
with `--similarity` percent i.i.d. (default 0: label-sorted shards, equal
client sizes), or with `--dirichlet_alpha=alpha` by FedDF's Dirichlet
procedure (tasks.dirichlet: skewed label mixes, unequal client sizes; one of
the two options).

Models (`--model`): `logistic` (multinomial logistic regression, 64 -> 10) and
`mlp` (64 -> 100 ReLU -> 10), the convex and non-convex models of [SCAFFOLD];
`cnn`, a small convolutional network with four layers so that FedPVR's "last
layers" ([FedPVR]) are a small part of the model: the 8x8 image, conv 3x3
(16, ReLU), conv 3x3 (32, ReLU), 2x2 max pooling, dense 64 (ReLU), dense 10
(38,282 parameters, of which the output layer has 650).
`--l2_regularization=lam` adds (lam / 2) * ||kernel||^2 of every Dense and
conv layer to the training loss and to evaluation's (biases are not penalized;
`train/loss`, tff.learning's metric of the batches' loss, leaves it out), making
logistic regression
strongly convex with finite client optima: the regime of SCAFFOLD's client-drift
analysis (docs/scaffold.md shows why FedAvg's slow-down with K needs it here).
Evaluation: the test images (`eval/...`) and the whole training set
(`eval_train/...`, the objective f(x) the federated clients jointly minimize).

`--use_synthetic_data`: 600 generated images with the same element structure
(8x8 pixels in 0..16, 10 classes), for fast runs.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from pipeline.errors import UsageError
from tasks import base
from tasks import dirichlet
from tasks import partition

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('model', 'num_clients', 'similarity', 'dirichlet_alpha',
           'l2_regularization')

IMAGE_SIZE = 8
NUM_PIXELS = IMAGE_SIZE * IMAGE_SIZE
NUM_CLASSES = 10
MAX_PIXEL = 16.0
NUM_TEST_IMAGES = 297
SPLIT_SEED = 0
MODELS = ('logistic', 'mlp', 'cnn')
DEFAULT_MODEL = 'logistic'
DEFAULT_NUM_CLIENTS = 100
DEFAULT_SIMILARITY = 0.0
DEFAULT_L2_REGULARIZATION = 0.0
MLP_HIDDEN_UNITS = 100
CNN_FILTERS = (16, 32)
CNN_HIDDEN_UNITS = 64
SYNTHETIC_NUM_IMAGES = 600


@dataclasses.dataclass(frozen=True)
class DigitsArrays:
  images: np.ndarray  # [n, 8, 8] float, pixel values in 0..16.
  labels: np.ndarray  # [n] int64.


def load_arrays(use_synthetic_data: bool) -> DigitsArrays:
  if use_synthetic_data:
    return synthetic_arrays(SYNTHETIC_NUM_IMAGES, seed=0)
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()
  return DigitsArrays(digits.images.astype(np.float64),
                      digits.target.astype(np.int64))


def synthetic_arrays(num_images: int, seed: int) -> DigitsArrays:
  """Noisy copies of one random prototype per class, pixels in 0..16."""
  rng = np.random.default_rng(seed)
  prototypes = rng.integers(0, 17, size=(NUM_CLASSES, IMAGE_SIZE, IMAGE_SIZE))
  labels = np.arange(num_images, dtype=np.int64) % NUM_CLASSES
  rng.shuffle(labels)
  noise = rng.integers(-4, 5, size=(num_images, IMAGE_SIZE, IMAGE_SIZE))
  images = np.clip(prototypes[labels] + noise, 0, 16).astype(np.float64)
  return DigitsArrays(images, labels)


def train_test_split(arrays: DigitsArrays, num_test: int):
  """Fixed stratified split: the same test images for every run."""
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top
  train_idx, test_idx = model_selection.train_test_split(
      np.arange(len(arrays.labels)), test_size=num_test,
      stratify=arrays.labels, random_state=SPLIT_SEED)
  pick = lambda idx: DigitsArrays(arrays.images[idx], arrays.labels[idx])
  return pick(np.sort(train_idx)), pick(np.sort(test_idx))


def to_model_input(images: tf.Tensor) -> tf.Tensor:
  """[n, 8, 8] pixels in 0..16 -> [n, 64] features in [0, 1]."""
  return tf.reshape(tf.cast(images, tf.float32), [-1, NUM_PIXELS]) / MAX_PIXEL


def build_keras_model(model: str,
                      l2_regularization: float = 0.0) -> tf.keras.Model:
  # Keras' L2(l) adds l * sum(w^2); the penalty here is (lam / 2) * ||w||^2,
  # whose gradient is lam * w. Keras adds it to `model.losses`, which
  # tff.learning's forward pass and Keras' evaluate both add to the loss, so
  # training and `eval_train/loss` see the same objective.
  regularizer = (tf.keras.regularizers.L2(l2_regularization / 2.0)
                 if l2_regularization else None)
  dense = lambda units, **kwargs: tf.keras.layers.Dense(
      units, kernel_regularizer=regularizer, **kwargs)
  conv = lambda filters: tf.keras.layers.Conv2D(
      filters, 3, padding='same', activation='relu',
      kernel_regularizer=regularizer)
  if model == 'logistic':
    layers = [dense(NUM_CLASSES)]
  elif model == 'mlp':
    layers = [dense(MLP_HIDDEN_UNITS, activation='relu'), dense(NUM_CLASSES)]
  elif model == 'cnn':
    layers = [tf.keras.layers.Reshape((IMAGE_SIZE, IMAGE_SIZE, 1)),
              *(conv(filters) for filters in CNN_FILTERS),
              tf.keras.layers.MaxPool2D(2),
              tf.keras.layers.Flatten(),
              dense(CNN_HIDDEN_UNITS, activation='relu'),
              dense(NUM_CLASSES)]
  else:
    raise UsageError(f'--model={model!r} is unknown for --task=digits; '
                     f'allowed: {", ".join(MODELS)}')
  return tf.keras.Sequential(
      [tf.keras.layers.InputLayer(input_shape=(NUM_PIXELS,))] + layers)


def client_id(index: int) -> str:
  return f'{index:04d}'


def _options(config: base.DataConfig):
  options = config.options
  model = options.get('model', DEFAULT_MODEL)
  if model not in MODELS:
    raise UsageError(f'--model={model!r} is unknown for --task=digits; '
                     f'allowed: {", ".join(MODELS)}')
  l2_regularization = float(
      options.get('l2_regularization', DEFAULT_L2_REGULARIZATION))
  if not l2_regularization >= 0.0:
    raise UsageError(f'--l2_regularization={l2_regularization} must be >= 0')
  alpha = options.get('dirichlet_alpha')
  if alpha is not None:
    if 'similarity' in options:
      raise UsageError('--similarity and --dirichlet_alpha both choose the '
                       'partition of --task=digits; pass one of them')
    alpha = float(alpha)
    if not alpha > 0.0:
      raise UsageError(f'--dirichlet_alpha={alpha} must be > 0')
  return (model, int(options.get('num_clients', DEFAULT_NUM_CLIENTS)),
          float(options.get('similarity', DEFAULT_SIMILARITY)), alpha,
          l2_regularization)


def client_partition(labels: np.ndarray, num_clients: int, similarity: float,
                     alpha, seed: int) -> list[np.ndarray]:
  """Each client's indices into `labels`: Dirichlet(alpha) if alpha is set,
  else the s% similarity split."""
  if alpha is None:
    return partition.similarity_partition(labels, num_clients, similarity,
                                          seed)
  if not 1 <= num_clients <= len(labels):
    raise UsageError(f'--num_clients={num_clients} is impossible for '
                     f'{len(labels)} examples (allowed: 1..{len(labels)})')
  try:
    return dirichlet.dirichlet_partition(labels, num_clients, alpha, seed)
  except ValueError as e:
    raise UsageError(f'--num_clients={num_clients}, --dirichlet_alpha='
                     f'{alpha:g}: {e}') from e


def build_task(config: base.DataConfig) -> base.Task:
  model, num_clients, similarity, alpha, l2_regularization = _options(config)
  arrays = load_arrays(config.use_synthetic_data)
  num_test = (NUM_TEST_IMAGES if not config.use_synthetic_data else
              SYNTHETIC_NUM_IMAGES // 6)
  train, test = train_test_split(arrays, num_test)
  clients = client_partition(train.labels, num_clients, similarity, alpha,
                             config.seed)
  # Clients' index lists one after another; client k's are
  # client_rows[starts[k]:starts[k + 1]] (sizes differ under Dirichlet).
  client_rows = np.concatenate(clients)
  starts = np.cumsum([0] + [len(c) for c in clients]).astype(np.int64)

  def client_dataset(client_id_tensor, seed):
    # Client k's rows of the training set; the arrays become constants of
    # the TFF computation (the whole training set is 1500 x 64 floats).
    k = tf.strings.to_number(client_id_tensor, tf.int64)
    bounds = tf.constant(starts)
    rows = tf.constant(client_rows)[bounds[k]:bounds[k + 1]]
    examples = tf.data.Dataset.from_tensor_slices(
        (tf.gather(to_model_input(train.images), rows),
         tf.gather(tf.constant(train.labels), rows)))
    return base.client_batches(examples, config, seed)

  def eval_datasets():
    def batched(split):
      return tf.data.Dataset.from_tensor_slices(
          (to_model_input(split.images), split.labels)).batch(
              config.eval_batch_size)
    return {'': batched(test), 'train': batched(train)}

  serving = base.ServingSpec(
      input_name='images',
      input_spec=tf.TensorSpec([None, IMAGE_SIZE, IMAGE_SIZE], tf.float32),
      preprocess=to_model_input,
      postprocess=lambda logits: {
          'probabilities': tf.nn.softmax(logits),
          'classes': tf.argmax(logits, axis=-1)})
  return base.Task(
      name='digits',
      train_client_ids=tuple(client_id(k) for k in range(num_clients)),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=lambda: build_keras_model(model, l2_regularization),
      loss_fn=lambda: tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True),
      metrics_fn=lambda: [
          tf.keras.metrics.SparseCategoricalAccuracy(name='accuracy')],
      batch_spec=(tf.TensorSpec([None, NUM_PIXELS], tf.float32),
                  tf.TensorSpec([None], tf.int64)),
      eval_datasets_fn=eval_datasets,
      serving=serving)
