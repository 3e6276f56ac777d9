"""Shared by the SCAFFOLD / FedPVR tests: a tiny linear-regression task, an
independent float64 numpy reference of the algorithms, and runs through
`pipeline.driver.train` (the loop the CLI runs, which writes metrics.csv).

The task: 4 clients of unequal sizes (4, 6, 2, 5 examples; unshuffled batches
of 2, so K_i = 2, 3, 1, 3 and the last client ends on a batch of one), each with
its own true regression weights; 2 of the 4 clients are sampled per round by
the driver's seeded sampling, and the seed is chosen so that consecutive rounds
share a client (its stored c_i is then used).
"""

import collections
import csv
import dataclasses
import os

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline import driver
from tasks import base
from tff_algos.algorithms import registry

NUM_FEATURES = 2
# Batches of 2 give K_i = 2, 3, 1, 3 local steps (the last client ends on a
# batch of one).
CLIENT_SIZES = (4, 6, 2, 5)
BATCH_SIZE = 2
NUM_CLIENTS = len(CLIENT_SIZES)
CLIENTS_PER_ROUND = 2
ROUNDS = 2
CLIENT_LR = 0.1
SERVER_LR = 0.5
INITIAL_KERNEL = np.array([[0.3], [-0.2]])
INITIAL_BIAS = np.array([0.1])


def _client_arrays():
  """Heterogeneous clients: each has its own true regression weights."""
  rng = np.random.default_rng(1234)
  features, targets = [], []
  for size in CLIENT_SIZES:
    x = rng.normal(size=(size, NUM_FEATURES))
    true_w = rng.normal(scale=2.0, size=(NUM_FEATURES, 1))
    features.append(x)
    targets.append(x @ true_w + rng.normal(size=1) + 0.1 * rng.normal(
        size=(size, 1)))
  return ([f.astype(np.float32) for f in features],
          [t.astype(np.float32) for t in targets])


FEATURES, TARGETS = _client_arrays()


def _find_sampling_seed():
  """A seed whose rounds sample overlapping but different client sets.

  Then a client's stored c_i from one round is used in the next.
  """
  for seed in range(100):
    plans = [set(driver.plan_round(seed, r, NUM_CLIENTS,
                                   CLIENTS_PER_ROUND).client_indices)
             for r in range(1, ROUNDS + 1)]
    if all(a != b and a & b for a, b in zip(plans, plans[1:])):
      return seed
  raise AssertionError('no suitable seed')


SEED = _find_sampling_seed()


def build_linear_task() -> base.Task:
  offsets = np.cumsum((0,) + CLIENT_SIZES[:-1]).astype(np.int64)
  all_x = np.concatenate(FEATURES)
  all_y = np.concatenate(TARGETS)

  def client_dataset(client_id, seed):
    del seed  # Unshuffled: the numpy reference sees the same batches.
    k = tf.strings.to_number(client_id, tf.int64)
    start = tf.gather(tf.constant(offsets), k)
    size = tf.gather(tf.constant(CLIENT_SIZES, tf.int64), k)
    x = tf.slice(tf.constant(all_x), [start, 0], [size, NUM_FEATURES])
    y = tf.slice(tf.constant(all_y), [start, 0], [size, 1])
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE)

  def keras_model():
    return tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(NUM_FEATURES,)),
        tf.keras.layers.Dense(
            1, kernel_initializer=tf.keras.initializers.Constant(
                INITIAL_KERNEL),
            bias_initializer=tf.keras.initializers.Constant(INITIAL_BIAS)),
    ])

  return base.Task(
      name='linear',
      train_client_ids=tuple(str(k) for k in range(NUM_CLIENTS)),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=keras_model,
      loss_fn=tf.keras.losses.MeanSquaredError,
      metrics_fn=lambda: [],
      batch_spec=(tf.TensorSpec([None, NUM_FEATURES], tf.float32),
                  tf.TensorSpec([None, 1], tf.float32)),
      eval_datasets_fn=lambda: {'': tf.data.Dataset.from_tensor_slices(
          (all_x, all_y)).batch(100)},
      serving=base.ServingSpec(
          'x', tf.TensorSpec([None, NUM_FEATURES], tf.float32),
          lambda x: x, lambda y: {'y': y}))


# ----------------------------------------------------------------------------
# Independent float64 reference.


def _loss_and_gradient(weights, x, y):
  """MSE (mean over the batch) of x @ w + b, and its gradient (w, b)."""
  kernel, bias = weights
  residual = x @ kernel + bias - y
  n = len(x)
  return (np.mean(residual**2),
          [2.0 / n * x.T @ residual, 2.0 / n * residual.sum(axis=0)])


@dataclasses.dataclass
class Reference:
  weights: list
  server_cv: list
  client_cvs: dict
  train_losses: list
  # Per round: sum_i ||m_i||^2 / ||sum_i m_i||^2, m_i = y_i - x (one layer).
  drift_diversity: list


def reference_run(mask, option, weighting, rounds=ROUNDS,
                  zero_control_variates=False) -> Reference:
  """SCAFFOLD / FedPVR with mask p over (kernel, bias), in numpy float64.

  mask all False is FedAvg; `zero_control_variates` resets c and every c_i to
  zero at the start of each round.
  """
  x = [INITIAL_KERNEL.astype(np.float64), INITIAL_BIAS.astype(np.float64)]
  masked = [j for j, m in enumerate(mask) if m]
  zeros = lambda: [np.zeros_like(x[j]) for j in masked]
  c = zeros()
  client_cvs = {}
  train_losses = []
  drift_diversity = []
  for round_num in range(1, rounds + 1):
    if zero_control_variates:
      c, client_cvs = zeros(), {}
    plan = driver.plan_round(SEED, round_num, NUM_CLIENTS, CLIENTS_PER_ROUND)
    updates, cv_updates, client_weights = [], [], []
    loss_sum, examples = 0.0, 0
    new_cvs = {}
    for k in plan.client_indices:
      xs, ys = FEATURES[k].astype(np.float64), TARGETS[k].astype(np.float64)
      c_i = client_cvs.get(k, zeros())
      y = [w.copy() for w in x]
      steps = 0
      for start in range(0, len(xs), BATCH_SIZE):
        xb, yb = xs[start:start + BATCH_SIZE], ys[start:start + BATCH_SIZE]
        loss, grads = _loss_and_gradient(y, xb, yb)
        loss_sum += loss * len(xb)
        examples += len(xb)
        for j in range(2):
          step = grads[j]
          if mask[j]:
            m = masked.index(j)
            step = step - c_i[m] + c[m]
          y[j] = y[j] - CLIENT_LR * step
        steps += 1
      if option == 1:
        _, full_grads = _loss_and_gradient(x, xs, ys)
        new_ci = [full_grads[j] for j in masked]
      else:
        new_ci = [c_i[m] - c[m] + (x[j] - y[j]) / (steps * CLIENT_LR)
                  for m, j in enumerate(masked)]
      updates.append([y[j] - x[j] for j in range(2)])
      cv_updates.append([n - o for n, o in zip(new_ci, c_i)])
      client_weights.append(len(xs) if weighting == 'num_examples' else 1.0)
      new_cvs[k] = new_ci
    flat_updates = [np.concatenate([u.ravel() for u in update])
                    for update in updates]
    drift_diversity.append(sum(np.sum(m**2) for m in flat_updates) /
                           np.sum(sum(flat_updates)**2))
    p = np.array(client_weights) / np.sum(client_weights)
    x = [x[j] + SERVER_LR * sum(pi * u[j] for pi, u in zip(p, updates))
         for j in range(2)]
    # c += (|S|/N) * the uniform mean of (c_i+ - c_i), whatever weights x.
    c = [c[m] + CLIENTS_PER_ROUND / NUM_CLIENTS *
         np.mean([u[m] for u in cv_updates], axis=0)
         for m in range(len(masked))]
    client_cvs.update(new_cvs)
    train_losses.append(loss_sum / examples)
  return Reference(x, c, client_cvs, train_losses, drift_diversity)


# ----------------------------------------------------------------------------
# Runs through the driver.


@dataclasses.dataclass
class Run:
  result: driver.TrainResult
  # metrics.csv: column name -> values of the rounds that have it.
  columns: dict
  client_cvs: dict

  @property
  def train_losses(self):
    return self.columns['train/loss']


def _read_columns(run_dir):
  with open(os.path.join(run_dir, 'metrics.csv')) as f:
    rows = list(csv.DictReader(f))
  return {name: [float(r[name]) for r in rows if r.get(name)]
          for name in rows[0]}


def make_runner(task: base.Task, root: str):
  """`run(name, algorithm_name, wrap=None, rounds=ROUNDS, runtime='tff',
  **settings)` -> Run, memoized by name.

  Each run builds its algorithm from its settings class (this module's
  learning rates, overridden by `settings`), optionally wraps its round
  definition, and trains `rounds` rounds on `runtime`.
  """
  runs = {}

  def run(name, algorithm_name, wrap=None, rounds=ROUNDS, runtime='tff',
          **overrides) -> Run:
    if name in runs:
      return runs[name]
    settings_class = registry.settings_class(algorithm_name)
    defaults = {'client_learning_rate': CLIENT_LR,
                'server_learning_rate': SERVER_LR}
    settings = settings_class(**{
        **{k: v for k, v in defaults.items()
           if k in {f.name for f in dataclasses.fields(settings_class)}},
        **overrides})
    definition = registry.build(algorithm_name, task, settings)
    if wrap:
      definition = wrap(definition)
    run_config = driver.RunConfig(
        root_output_dir=root, experiment_name=name,
        total_rounds=rounds, clients_per_round=CLIENTS_PER_ROUND,
        rounds_per_eval=rounds, rounds_per_checkpoint=rounds, seed=SEED,
        export=False, runtime=runtime)
    result = driver.train(definition, task, run_config)
    client_cvs = {}
    if definition.has_client_state:
      states = driver.committed_client_states(definition, task,
                                              run_config.run_dir)
      ids = [str(k) for k in range(NUM_CLIENTS)]
      client_cvs = dict(zip(range(NUM_CLIENTS), (
          s['control_variate'] for s in states.read(ids))))
    runs[name] = Run(result, _read_columns(run_config.run_dir), client_cvs)
    return runs[name]

  return run


def weights(run: Run):
  return [np.asarray(w) for w in run.result.model_weights.trainable]


def assert_close_to_reference(run: Run, reference: Reference):
  """Model, c, every stored c_i and train/loss per round, to float32 rounding."""
  tolerance = dict(rtol=2e-5, atol=1e-6)
  for actual, expected in zip(weights(run), reference.weights, strict=True):
    np.testing.assert_allclose(actual, expected, **tolerance)
  np.testing.assert_allclose(run.train_losses, reference.train_losses,
                             **tolerance)
  if not reference.server_cv:
    return
  server_cv = run.result.server_state['control_variate']
  for actual, expected in zip(server_cv, reference.server_cv, strict=True):
    np.testing.assert_allclose(actual, expected, **tolerance)
  for k in range(NUM_CLIENTS):
    expected = reference.client_cvs.get(
        k, [np.zeros_like(c) for c in reference.server_cv])
    for actual, want in zip(run.client_cvs[k], expected, strict=True):
      np.testing.assert_allclose(actual, want, **tolerance)


def assert_equal_runs(a: Run, b: Run):
  """Equal to 1e-6 relative: model weights and metrics.csv train/loss."""
  for x, y in zip(weights(a), weights(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(a.train_losses, b.train_losses, rtol=1e-6)


