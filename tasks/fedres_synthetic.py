"""Synthetic FedRes problems of [FedRes] App. E.

fedres_toy (E.1): two clients, scalar w and theta, deterministic losses
    L_1(w, theta_1) = 0.1 (w + theta_1)^2 + 10 w
    L_2(w, theta_2) = 0.1 theta_2^2 - 10 w
  optimum w + theta_1 = 0, theta_2 = 0, average loss 0. Written as a residual
  model: yhat = w x_g + theta x_l with two output coordinates, and the loss
  l = sum_j a_j yhat_j^2 + b_j yhat_j whose coefficients (a, b) are the
  label. Client 1 has x_g = (1, 1), x_l = (1, 0), a = (0.1, 0), b = (0, 10):
  yhat = (w + theta, w), l = L_1; client 2 has x_g = (0, 1), x_l = (1, 0),
  b = (0, -10): yhat = (theta, w), l = L_2. Each client holds that one
  example, so every mini-batch loss is exactly L_i. Parameters start
  N(0, 0.1) (variance 0.1); the initial theta is one seeded draw that every
  client starts from (the store's initial state is client-independent).

fedres_logistic (E.2): N = 10 clients, M = 2 classes, d = 10 features,
  x_g = x_l = x ~ N(0, I), y = argmax((1 - alpha) W* x + alpha Theta_i* x + n)
  with W*, Theta_i* entries N(0, 1) and n ~ N(0, I_M); alpha is the
  heterogeneity knob (`--heterogeneity`, 0 = identical clients). Linear
  softmax models without bias, W x + Theta_i x, logistic loss. Each client
  has TRAIN_EXAMPLES train and TEST_EXAMPLES test examples; every draw comes
  from the seed, and the draws do not depend on alpha (only the labels do).
"""

import numpy as np
import tensorflow as tf

from pipeline.errors import UsageError
from tasks import base
from tasks import client_arrays
from tasks import residual

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('heterogeneity',)

# fedres_toy.
TOY_INIT_STDDEV = float(np.sqrt(0.1))
_TOY_X = np.array([[1, 1, 1, 0],   # client 1: x_g = (1, 1), x_l = (1, 0)
                   [0, 1, 1, 0]],  # client 2: x_g = (0, 1), x_l = (1, 0)
                  np.float32)
_TOY_COEFFICIENTS = np.array([[0.1, 0, 0, 10],    # a = (0.1, 0), b = (0, 10)
                              [0.1, 0, 0, -10]],  # a = (0.1, 0), b = (0, -10)
                             np.float32)
TOY_CLIENT_IDS = ('1', '2')

# fedres_logistic.
LOGISTIC_NUM_CLIENTS = 10
LOGISTIC_NUM_CLASSES = 2
LOGISTIC_DIM = 10
TRAIN_EXAMPLES = 200
TEST_EXAMPLES = 500


class QuadraticLinearLoss(tf.keras.losses.Loss):
  """sum_j a_j yhat_j^2 + b_j yhat_j, with y_true = (a, b)."""

  def call(self, y_true, y_pred):
    a, b = tf.split(y_true, 2, axis=-1)
    return tf.reduce_sum(a * tf.square(y_pred) + b * y_pred, axis=-1)


def _scalar_times_vector(initializer, name):
  """x (2 coordinates) -> s x with one scalar parameter s."""
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(2,)),
      tf.keras.layers.Reshape((2, 1)),
      tf.keras.layers.Dense(1, use_bias=False, kernel_initializer=initializer),
      tf.keras.layers.Reshape((2,)),
  ], name=name)


def toy_spec(seed: int) -> residual.ResidualModelSpec:
  return residual.ResidualModelSpec(
      global_model_fn=lambda: _scalar_times_vector(
          tf.keras.initializers.RandomNormal(stddev=TOY_INIT_STDDEV), 'w'),
      local_model_fn=lambda: _scalar_times_vector(
          tf.keras.initializers.RandomNormal(stddev=TOY_INIT_STDDEV,
                                             seed=seed), 'theta'),
      split_inputs=lambda x: (x[:, :2], x[:, 2:]),
      input_spec=tf.TensorSpec([None, 4], tf.float32),
      loss_fn=QuadraticLinearLoss,
      metrics_fn=list)


def _toy_batch(rows):
  return rows['x'], rows['coefficients']


def build_toy_task(config: base.DataConfig) -> base.Task:
  keys = np.array([int(i) for i in TOY_CLIENT_IDS])
  arrays = client_arrays.ClientArrays(
      keys, {'x': _TOY_X, 'coefficients': _TOY_COEFFICIENTS})
  serving = base.ServingSpec(
      input_name='inputs', input_spec=tf.TensorSpec([None, 4], tf.float32),
      preprocess=lambda x: x, postprocess=lambda y: {'outputs': y})
  return client_arrays.build_task(
      'fedres_toy', config, arrays, arrays, _toy_batch,
      tf.TensorSpec([None, 4], tf.float32), toy_spec(config.seed), serving)


def logistic_data(heterogeneity: float, seed: int,
                  num_clients: int = LOGISTIC_NUM_CLIENTS,
                  num_examples: int = TRAIN_EXAMPLES + TEST_EXAMPLES):
  """(x [N, n, d], labels [N, n]) of [FedRes] eq. 13."""
  rng = np.random.default_rng([seed, 13])
  w_star = rng.normal(size=(LOGISTIC_NUM_CLASSES, LOGISTIC_DIM))
  theta_star = rng.normal(
      size=(num_clients, LOGISTIC_NUM_CLASSES, LOGISTIC_DIM))
  x = rng.normal(size=(num_clients, num_examples, LOGISTIC_DIM))
  noise = rng.normal(size=(num_clients, num_examples, LOGISTIC_NUM_CLASSES))
  scores = ((1 - heterogeneity) * np.einsum('mj,inj->inm', w_star, x) +
            heterogeneity * np.einsum('imj,inj->inm', theta_star, x) + noise)
  return x.astype(np.float32), np.argmax(scores, axis=-1).astype(np.int32)


def logistic_spec() -> residual.ResidualModelSpec:
  return residual.ResidualModelSpec(
      global_model_fn=lambda: residual.linear_model(
          (LOGISTIC_DIM,), LOGISTIC_NUM_CLASSES, name='W'),
      local_model_fn=lambda: residual.linear_model(
          (LOGISTIC_DIM,), LOGISTIC_NUM_CLASSES, name='Theta'),
      split_inputs=lambda x: (x, x),
      input_spec=tf.TensorSpec([None, LOGISTIC_DIM], tf.float32),
      loss_fn=lambda: tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True),
      metrics_fn=lambda: [
          tf.keras.metrics.SparseCategoricalAccuracy(name='accuracy')])


def _logistic_batch(rows):
  return rows['x'], rows['label']


def build_logistic_task(config: base.DataConfig) -> base.Task:
  heterogeneity = config.options.get('heterogeneity', 1.0)
  if heterogeneity is None or not 0.0 <= heterogeneity <= 1.0:
    raise UsageError(
        f'--heterogeneity={heterogeneity} is impossible; allowed: [0, 1]')
  x, labels = logistic_data(heterogeneity, config.seed)
  keys = np.repeat(np.arange(LOGISTIC_NUM_CLIENTS), TRAIN_EXAMPLES)
  train = client_arrays.ClientArrays(keys, {
      'x': x[:, :TRAIN_EXAMPLES].reshape(-1, LOGISTIC_DIM),
      'label': labels[:, :TRAIN_EXAMPLES].reshape(-1)})
  keys = np.repeat(np.arange(LOGISTIC_NUM_CLIENTS), TEST_EXAMPLES)
  test = client_arrays.ClientArrays(keys, {
      'x': x[:, TRAIN_EXAMPLES:].reshape(-1, LOGISTIC_DIM),
      'label': labels[:, TRAIN_EXAMPLES:].reshape(-1)})
  serving = base.ServingSpec(
      input_name='features',
      input_spec=tf.TensorSpec([None, LOGISTIC_DIM], tf.float32),
      preprocess=lambda x: x,
      postprocess=lambda logits: {'probabilities': tf.nn.softmax(logits)})
  return client_arrays.build_task(
      'fedres_logistic', config, train, test, _logistic_batch,
      tf.TensorSpec([None], tf.int32), logistic_spec(), serving)
