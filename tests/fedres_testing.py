"""A tiny linear residual task and a numpy FedRes reference, for the tests.

Model: yhat = [x0, x1, 1] . p + [x1, x2] . theta (global part with bias on
features 0-1, local part on the overlapping features 1-2), squared loss.
The numpy reference re-derives every algorithm from [FedRes] on its own;
it shares no code with the implementation.
"""

import collections

import numpy as np
import tensorflow as tf

from tasks import base
from tasks import client_arrays
from tasks import residual

BATCH_SIZE = 2


def linear_spec() -> residual.ResidualModelSpec:
  return residual.ResidualModelSpec(
      global_model_fn=lambda: residual.linear_model((2,), 1, use_bias=True),
      local_model_fn=lambda: residual.linear_model((2,), 1),
      split_inputs=lambda x: (x[:, :2], x[:, 1:]),
      input_spec=tf.TensorSpec([None, 3], tf.float32),
      loss_fn=tf.keras.losses.MeanSquaredError,
      metrics_fn=lambda: [tf.keras.metrics.RootMeanSquaredError(name='rmse')])


def client_data(seed: int = 0, sizes=(4, 6, 2)):
  """{client id: (x [n, 3], y [n])}; clients have different sizes."""
  rng = np.random.default_rng(seed)
  return {str(i): (rng.normal(size=(n, 3)).astype(np.float32),
                   rng.normal(size=n).astype(np.float32))
          for i, n in enumerate(sizes)}


def _to_batch(rows):
  return rows['x'], tf.expand_dims(rows['y'], -1)


def linear_task(data, config: base.DataConfig = None) -> base.Task:
  config = config or base.DataConfig(client_batch_size=BATCH_SIZE)
  keys = np.concatenate([np.full(len(y), int(c)) for c, (_, y) in data.items()])
  arrays = client_arrays.ClientArrays(keys, {
      'x': np.concatenate([x for x, _ in data.values()]),
      'y': np.concatenate([y for _, y in data.values()])})
  serving = base.ServingSpec(
      input_name='x', input_spec=tf.TensorSpec([None, 3], tf.float32),
      preprocess=lambda x: x, postprocess=lambda y: {'y': y})
  return client_arrays.build_task(
      'linear_test', config, arrays, arrays, _to_batch,
      tf.TensorSpec([None, 1], tf.float32), linear_spec(), serving)


def unshuffled_batches(x, y, batch_size=BATCH_SIZE) -> tf.data.Dataset:
  """The same batches on every pass, so the reference can follow them."""
  return tf.data.Dataset.from_tensor_slices((x, y[:, None])).batch(batch_size)


def model_weights(p, theta=None):
  """Global p -> Keras [kernel, bias]; local theta -> [kernel]."""
  global_weights = [np.asarray(p[:2], np.float32).reshape(2, 1),
                    np.asarray(p[2:], np.float32).reshape(1)]
  if theta is None:
    return global_weights
  return global_weights, [np.asarray(theta, np.float32).reshape(2, 1)]


def flat_global(weights) -> np.ndarray:
  return np.concatenate([np.reshape(w, -1) for w in weights]).astype(np.float64)


# ---------------------------------------------------------------- reference


def gradients(p, theta, x, y):
  """(grad_p, grad_theta, loss) of mean_b (y - [x0,x1,1].p - [x1,x2].theta)^2."""
  x = x.astype(np.float64)
  x_global = np.c_[x[:, :2], np.ones(len(x))]
  x_local = x[:, 1:]
  residual_ = y - x_global @ p - x_local @ theta
  n = len(y)
  return (-2 * x_global.T @ residual_ / n, -2 * x_local.T @ residual_ / n,
          float(np.mean(residual_**2)))


def batches(x, y, batch_size=BATCH_SIZE):
  return [(x[i:i + batch_size], y[i:i + batch_size])
          for i in range(0, len(y), batch_size)]


def reference_client(variant, p, theta, x, y, eta, lam, c=None, c_i=None,
                     batch_fn=batches):
  """One client's round: {delta, theta, loss_sum, num_examples, c_i}.

  `batch_fn(x, y)` is the list of batches every pass draws (default: one
  unshuffled epoch in batches of BATCH_SIZE)."""
  p = np.asarray(p, np.float64)
  theta = np.asarray(theta, np.float64).copy()
  round_batches = batch_fn(x, y)
  loss_sum, out = 0.0, {}
  if variant == 'naive':
    p_i = p.copy()
    for xb, yb in round_batches:
      g_p, g_theta, loss = gradients(p_i, theta, xb, yb)
      p_i -= eta * g_p
      theta -= lam * g_theta
      loss_sum += loss * len(yb)
    delta = p_i - p
  else:
    for xb, yb in round_batches:  # Step 1: theta, p fixed.
      _, g_theta, loss = gradients(p, theta, xb, yb)
      theta -= lam * g_theta
      loss_sum += loss * len(yb)
    num_steps = len(round_batches)
    if variant == 'sgd':  # Step 2: one step on the K batches as one.
      g_p, _, _ = gradients(p, theta,
                            np.concatenate([b[0] for b in round_batches]),
                            np.concatenate([b[1] for b in round_batches]))
      delta = -eta * num_steps * g_p
    else:  # Step 2: K corrected steps, theta fixed.
      correction = 0.0 if c is None else np.asarray(c) - np.asarray(c_i)
      p_i, gradient_sum = p.copy(), np.zeros_like(p)
      for xb, yb in round_batches:
        g_p, _, _ = gradients(p_i, theta, xb, yb)
        p_i -= eta * (g_p + correction)
        gradient_sum += g_p
      delta = p_i - p
      out['c_i'] = gradient_sum / num_steps
  out.update(delta=delta, theta=theta, loss_sum=loss_sum,
             num_examples=sum(len(b[1]) for b in round_batches))
  return out


def reference_round(variant, p, thetas, data_by_client, eta, lam, alpha=1.0,
                    c=None, c_is=None, num_train_clients=None,
                    batch_fn=batches):
  """Server view of one round over the given clients (dict order)."""
  results = {}
  for client_id, (x, y) in data_by_client.items():
    results[client_id] = reference_client(
        variant, p, thetas[client_id], x, y, eta, lam, c,
        None if c_is is None else c_is[client_id], batch_fn)
  mean_delta = np.mean([r['delta'] for r in results.values()], axis=0)
  new = collections.OrderedDict(p=np.asarray(p) + alpha * mean_delta,
                                clients=results)
  if c is not None:
    new['c'] = np.asarray(c) + sum(
        r['c_i'] - np.asarray(c_is[k]) for k, r in results.items()
    ) / num_train_clients
  total = sum(r['num_examples'] for r in results.values())
  new['loss'] = sum(r['loss_sum'] for r in results.values()) / total
  return new
