"""Mixed FL (PT, 1-w GT, 2-w GT) against hand-computed rounds, its special
cases, data-free central losses, communication accounting and resume.

Expected values are computed here in float64 numpy from the algorithm
statements of [MixedFL] (Algs. 1-2, eq. 7, eq. 10), independently of
the TF code, on a linear model y = x.W + b with mean squared error.
"""

import collections
import dataclasses
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import round_testing
from pipeline import driver
from tasks import base
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import settings as settings_lib
from tff_algos.algorithms.baselines import definition as baselines
from tff_algos.algorithms.mixed import definition as mixed
from tff_algos.runtime import cohort

# --- A linear model and its numpy twin ---------------------------------------

BATCH_SPEC = (tf.TensorSpec([None, 2], tf.float32),
              tf.TensorSpec([None, 1], tf.float32))
INITIAL_THETA = np.array([0.3, -0.2, 0.1])  # W[0], W[1], b


def keras_linear_model():
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(2,)),
      tf.keras.layers.Dense(1)])


def linear_model_fn():
  return tff.learning.models.from_keras_model(
      keras_linear_model(), loss=tf.keras.losses.MeanSquaredError(),
      input_spec=BATCH_SPEC)


def to_weights(theta):
  theta = np.asarray(theta, np.float32)
  return tff.learning.models.ModelWeights(
      trainable=[theta[:2].reshape(2, 1), theta[2:]], non_trainable=[])


def to_theta(trainable):
  return np.concatenate([np.asarray(t, np.float64).ravel() for t in trainable])


def mse_gradient(theta, batch):
  """d/dtheta mean_j (x_j.W + b - y_j)^2."""
  x, y = batch
  features = np.hstack([x, np.ones((len(x), 1))])
  residual = features @ theta - y
  return 2.0 * features.T @ residual / len(x)


def batches(x, y, batch_size):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return [(x[i:i + batch_size], y[i:i + batch_size])
          for i in range(0, len(x), batch_size)]


def to_dataset(batch_list):
  xs = np.concatenate([b[0] for b in batch_list]).astype(np.float32)
  ys = np.concatenate([b[1] for b in batch_list]).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices(
      (xs, ys.reshape(-1, 1))).batch(max(1, len(batch_list[0][0])))


# Client A has 3 examples in batches of 2 (K_A = 2), client B one example
# (K_B = 1 < K): the formulas must use the actual K_i and p_i = examples.
CLIENT_BATCHES = [
    batches([[1, 2], [3, -1], [0, 1]], [1, 2, -1], 2),
    batches([[2, 1]], [0.5], 2),
]
CENTRAL_BATCHES = batches([[1, 1], [2, 0], [-1, 2], [1, 3], [0, 0], [1, -1]],
                          [0, 1, 1, -2, 0.5, 0.5], 2)


def client_datasets(client_batches=CLIENT_BATCHES):
  return [to_dataset(b) for b in client_batches]


# --- numpy reference of the algorithms -----------------------------------------


def sgd(learning_rate, momentum=0.0):
  """tff.learning's sgd / sgdm as a numpy step w, g -> w', its state kept
  (a <- momentum * a + g; w <- w - learning_rate * a)."""
  state = {'a': 0.0}

  def step(w, g):
    state['a'] = momentum * state['a'] + g
    return w - learning_rate * state['a']

  return step


def reference_client(theta, client_batches, lr, w_f, augmenting,
                     momentum=0.0):
  local = theta.copy()
  step = sgd(lr, momentum)  # ClientOpt starts fresh every round.
  for batch in client_batches:
    local = step(local, w_f * mse_gradient(local, batch) + augmenting)
  num_examples = sum(len(b[0]) for b in client_batches)
  return local - theta, num_examples, len(client_batches)


def reference_federated(theta, lr, w_f, augmenting, client_batches,
                        momentum=0.0):
  """(weighted mean delta, sum of deltas, sum of K_i)."""
  results = [reference_client(theta, b, lr, w_f, augmenting, momentum)
             for b in client_batches]
  weights = np.array([r[1] for r in results], np.float64)
  deltas = np.stack([r[0] for r in results])
  mean_delta = (weights[:, None] * deltas).sum(0) / weights.sum()
  return mean_delta, deltas.sum(0), sum(r[2] for r in results)


def reference_central(theta, central_batches, steps, lr, w_c, augmenting,
                      momentum=0.0):
  local = theta.copy()
  step = sgd(lr, momentum)  # CentralOpt starts fresh every round.
  for batch in central_batches[:steps]:
    local = step(local, w_c * mse_gradient(local, batch) + augmenting)
  return local - theta


def reference_round(name, theta, hp, gtilde_c=None, gtilde_f=None,
                    client_batches=CLIENT_BATCHES,
                    central_batches=CENTRAL_BATCHES, central_steps=None,
                    server_step=None, merge_step=None, momentum=0.0):
  """Next (theta, gtilde_c, gtilde_f) of [MixedFL] Alg. 1 with plain SGD
  everywhere; the central model takes `central_steps` steps (default K).

  With `momentum`, ClientOpt and CentralOpt are sgdm; `server_step` and
  `merge_step` (w, g -> w', e.g. `sgd`) are ServerOpt and MergeOpt, whose
  state the caller keeps across rounds (default: plain SGD at eta_s, eta_m).
  """
  zeros = np.zeros_like(theta)
  central_steps = central_steps or hp['K']
  server_step = server_step or sgd(hp['eta_s'])
  merge_step = merge_step or sgd(hp['eta_m'])
  if name == 'mixed_1wgt':
    g_c = hp['w_c'] * mse_gradient(theta, central_batches[0])
    mean_delta, _, _ = reference_federated(theta, hp['eta'], hp['w_f'], g_c,
                                           client_batches, momentum)
    return server_step(theta, -mean_delta), None, None
  two_way = name == 'mixed_2wgt'
  gtilde_c = gtilde_c if two_way else zeros
  gtilde_f = gtilde_f if two_way else zeros
  delta_c = reference_central(theta, central_batches, central_steps,
                              hp['eta_c'], hp['w_c'], gtilde_f, momentum)
  mean_delta, delta_sum, steps_sum = reference_federated(
      theta, hp['eta'], hp['w_f'], gtilde_c, client_batches, momentum)
  x_f = server_step(theta, -mean_delta)
  new_theta = merge_step(theta, -(delta_c + (x_f - theta)))
  if not two_way:
    return new_theta, None, None
  new_gtilde_c = -delta_c / (hp['eta_c'] * central_steps) - gtilde_f
  new_gtilde_f = -delta_sum / (hp['eta'] * steps_sum) - gtilde_c
  return new_theta, new_gtilde_c, new_gtilde_f


# --- Algorithms under test, built once --------------------------------------------

HP = dict(eta=0.1, eta_c=0.05, eta_s=0.7, eta_m=0.9, w_f=0.6, w_c=0.4, K=2)
# 1-w GT and PT under the K=1 equivalence conditions of [MixedFL] App. A.3.
HP_EQUIVALENT = dict(eta=0.1, eta_c=0.1, eta_s=1.0, eta_m=1.0, w_f=0.6,
                     w_c=0.4, K=1)


def settings_from(name, hp, **kwargs):
  """`name`'s settings with the hyperparameters `hp` (those it has)."""
  return round_testing.settings_of(
      name, client_learning_rate=hp['eta'], central_learning_rate=hp['eta_c'],
      server_learning_rate=hp['eta_s'], merge_learning_rate=hp['eta_m'],
      federated_weight=hp['w_f'], central_weight=hp['w_c'], **kwargs)


def linear_task(client_steps, central_loss_fn=None) -> base.Task:
  """The linear model's task; its K (the central model's steps) is
  `client_steps`. Data: set per round by `run_round`."""
  return base.Task(
      name='linear', train_client_ids=('0',),
      client_dataset_computation=None, keras_model_fn=keras_linear_model,
      loss_fn=tf.keras.losses.MeanSquaredError, metrics_fn=list,
      batch_spec=BATCH_SPEC, eval_datasets_fn=dict, serving=None,
      central_loss_fn=central_loss_fn,
      data_config=base.DataConfig(client_steps=client_steps))


@dataclasses.dataclass
class Algorithm:
  """A definition and its TFF process, on data read from `data`."""
  definition: round_lib.RoundDefinition
  process: object
  data: round_testing.FileData


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  return round_testing.FileData(tmp_path_factory.mktemp('mixed_data'),
                                BATCH_SPEC)


@pytest.fixture(scope='module')
def build(data):
  """(name, hp, central_loss_fn=None, **settings) -> Algorithm."""

  def algorithm(name, hp, central_loss_fn=None, **settings):
    task = data.task(linear_task(hp['K'], central_loss_fn),
                     central=central_loss_fn is None)
    definition = mixed.definition(name, task,
                                  settings_from(name, hp, **settings))
    return Algorithm(definition, driver.compose_process(definition, task),
                     data)

  return algorithm


# PT and 1-w GT are built under the K=1 equivalence conditions (and checked by
# hand there); 2-w GT, whose first round is PT with K=2, under general ones.


@pytest.fixture(scope='module')
def pt(build):
  return build(mixed.PARALLEL_TRAINING, HP_EQUIVALENT, mixed_diagnostics=True)


@pytest.fixture(scope='module')
def one_way_gt(build):
  return build(mixed.ONE_WAY_GT, HP_EQUIVALENT, mixed_diagnostics=True)


@pytest.fixture(scope='module')
def two_way_gt(build):
  return build(mixed.TWO_WAY_GT, HP)


def initial_state(algorithm, theta=INITIAL_THETA):
  return round_lib.set_model_weights(algorithm.process.initialize(),
                                     to_weights(theta))


def run_round(algorithm, state, client_batches=CLIENT_BATCHES,
              central_batches=CENTRAL_BATCHES):
  """(state, metrics) of a round on these clients' and central batches
  (None: no central data is written, for a data-free central loss)."""
  client_ids = [algorithm.data.set_client(f'client_{i}', dataset)
                for i, dataset in enumerate(client_datasets(client_batches))]
  if central_batches is not None:
    algorithm.data.set_central(0, to_dataset(central_batches))
  return round_testing.run_round(algorithm.process, state, client_ids,
                                 server_seed=0)


def model_theta(algorithm, state):
  del algorithm
  return to_theta(round_lib.get_model_weights(state).trainable)


# --- Hand-computed rounds -----------------------------------------------------------


def test_parallel_training_one_round(pt):
  state, metrics = run_round(pt, initial_state(pt))
  expected, _, _ = reference_round('mixed_pt', INITIAL_THETA, HP_EQUIVALENT)
  np.testing.assert_allclose(model_theta(pt, state), expected, rtol=1e-5)
  # Clients keep no state.
  assert not pt.definition.has_client_state
  assert metrics['train']['num_examples'] == 4
  assert metrics['train']['num_batches'] == 3
  assert metrics['central']['num_steps'] == 1
  x, y = CENTRAL_BATCHES[0]
  expected_central_loss = np.mean(
      (np.hstack([x, np.ones((len(x), 1))]) @ INITIAL_THETA - y)**2)
  np.testing.assert_allclose(metrics['central']['loss'],
                             expected_central_loss, rtol=1e-5)


def test_one_way_gradient_transfer_one_round(one_way_gt):
  state, metrics = run_round(one_way_gt, initial_state(one_way_gt))
  expected, _, _ = reference_round('mixed_1wgt', INITIAL_THETA, HP_EQUIVALENT)
  np.testing.assert_allclose(model_theta(one_way_gt, state), expected,
                             rtol=1e-5)
  assert metrics['central']['num_steps'] == 1


@pytest.mark.parametrize('name', ['pt', 'one_way_gt', 'two_way_gt'])
def test_the_process_is_a_tff_iterative_process(request, name):
  algorithm = request.getfixturevalue(name)
  process = algorithm.process
  iterative = process.iterative_process
  assert isinstance(iterative, tff.templates.IterativeProcess)
  state = initial_state(algorithm)
  expected_state, expected_metrics = run_round(algorithm, state)
  round_info = collections.OrderedDict(round_num=np.int64(1),
                                       server_seed=np.int64(0))
  if process.broadcast_needs_central:
    round_info['central'] = process.central_computation(state, round_info)
  ids = np.asarray(['client_0', 'client_1'], dtype=object)
  [group] = cohort.groups(ids, np.zeros(2, np.int64), None, 2)
  state, metrics = iterative.next(state, [group], round_info)
  for ours, theirs in zip(tf.nest.flatten(state),
                          tf.nest.flatten(expected_state)):
    np.testing.assert_array_equal(ours, theirs)
  assert float(metrics['train']['loss']) == float(
      expected_metrics['train']['loss'])


def test_two_way_gradient_transfer_two_rounds(two_way_gt):
  """Round 1 (gtilde = 0) is PT with K=2 and eta_c, eta_s, eta_m != eta, 1."""
  state = initial_state(two_way_gt)
  np.testing.assert_array_equal(to_theta(state['gtilde_c']), 0.0)
  np.testing.assert_array_equal(to_theta(state['gtilde_f']), 0.0)
  theta, gtilde_c, gtilde_f = INITIAL_THETA, np.zeros(3), np.zeros(3)
  # Round 2 uses other client and central batches than round 1.
  round_data = [(CLIENT_BATCHES, CENTRAL_BATCHES),
                ([CLIENT_BATCHES[1], CLIENT_BATCHES[0]], CENTRAL_BATCHES[2:] +
                 CENTRAL_BATCHES[:2])]
  for clients, central in round_data:
    state, _ = run_round(two_way_gt, state, clients, central)
    theta, gtilde_c, gtilde_f = reference_round(
        'mixed_2wgt', theta, HP, gtilde_c, gtilde_f, clients, central)
    np.testing.assert_allclose(model_theta(two_way_gt, state), theta,
                               rtol=1e-5)
    # -Delta/(eta K) cancels digits of the float32 weights: atol.
    np.testing.assert_allclose(to_theta(state['gtilde_c']), gtilde_c,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_theta(state['gtilde_f']), gtilde_f,
                               rtol=1e-5, atol=1e-6)
  # After round 1, gtilde_c is the mean central gradient and gtilde_f the mean
  # client gradient (no augmentation yet): both non-trivial.
  assert np.linalg.norm(gtilde_c) > 0.01 and np.linalg.norm(gtilde_f) > 0.01


@pytest.mark.parametrize('name', [mixed.PARALLEL_TRAINING, mixed.ONE_WAY_GT])
def test_momentum_optimizers_over_three_rounds(build, name):
  """ClientOpt, CentralOpt, ServerOpt and MergeOpt all sgdm (momentum 0.9)
  at eta, eta_c, eta_s, eta_m != 1: ClientOpt and CentralOpt restart every
  round, ServerOpt's and MergeOpt's momenta carry over, each its own."""
  algorithm = build(name, HP, client_optimizer='sgdm',
                    central_optimizer='sgdm', server_optimizer='sgdm',
                    merge_optimizer='sgdm')
  state = initial_state(algorithm)
  theta = INITIAL_THETA
  server_step, merge_step = sgd(HP['eta_s'], 0.9), sgd(HP['eta_m'], 0.9)
  round_data = [(CLIENT_BATCHES, CENTRAL_BATCHES),
                ([CLIENT_BATCHES[1], CLIENT_BATCHES[0]],
                 CENTRAL_BATCHES[2:] + CENTRAL_BATCHES[:2]),
                (CLIENT_BATCHES[:1], CENTRAL_BATCHES[4:] + CENTRAL_BATCHES[:4])]
  for clients, central in round_data:
    state, _ = run_round(algorithm, state, clients, central)
    theta, _, _ = reference_round(name, theta, HP, client_batches=clients,
                                  central_batches=central,
                                  server_step=server_step,
                                  merge_step=merge_step, momentum=0.9)
    np.testing.assert_allclose(model_theta(algorithm, state), theta,
                               rtol=1e-5, atol=1e-6)


def test_a_diverged_client_is_dropped_as_fedavg_drops_it(two_way_gt):
  """A client whose Delta_i is NaN adds nothing: x, both gtilde and the
  metrics are those of the round without it, bit for bit (before, x and
  gtilde_f became NaN for good)."""
  diverged = CLIENT_BATCHES + [batches([[1, 0], [2, 1]], [np.nan, 1.0], 2)]
  state = initial_state(two_way_gt)
  with_it, metrics_with = run_round(two_way_gt, state, diverged)
  without, metrics_without = run_round(two_way_gt, state)
  for a, b in zip(tf.nest.flatten(with_it), tf.nest.flatten(without)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(np.all(np.isfinite(np.asarray(v)))
             for v in tf.nest.flatten(with_it))
  for group in ('train', 'central'):
    assert metrics_with[group].keys() == metrics_without[group].keys()
    for key, value in metrics_with[group].items():
      np.testing.assert_array_equal(value, metrics_without[group][key])
  assert metrics_with['train']['num_examples'] == 4


def test_a_diverged_central_model_is_dropped_for_the_round(
    pt, one_way_gt, two_way_gt):
  """A NaN in the central batch: the round equals the one without central
  data, bit for bit (PT and 2-w GT merge Delta_c = 0 and keep gtilde_c, 1-w
  GT sends no central gradient); before, x became NaN for good."""
  nan_label = [(CENTRAL_BATCHES[0][0], np.array([np.nan, 1.0]))]
  no_central_data = [(np.zeros((0, 2)), np.zeros(0))]
  for algorithm in (pt, one_way_gt, two_way_gt):
    # From a state after one round: 2-w GT's gtilde_c is then not 0.
    state, _ = run_round(algorithm, initial_state(algorithm))
    dropped, metrics_dropped = run_round(algorithm, state,
                                         central_batches=nan_label +
                                         CENTRAL_BATCHES[1:])
    without, metrics_without = run_round(algorithm, state,
                                         central_batches=no_central_data)
    for a, b in zip(tf.nest.flatten(dropped), tf.nest.flatten(without)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(np.all(np.isfinite(np.asarray(v)))
               for v in tf.nest.flatten(dropped))
    assert metrics_dropped['central']['num_steps'] == 0
    assert np.isnan(metrics_dropped['central']['loss'])
    for key, value in metrics_dropped['train'].items():
      np.testing.assert_array_equal(value, metrics_without['train'][key])
  assert np.linalg.norm(to_theta(state['gtilde_c'])) > 0.01


def test_central_steps_setting_sets_the_central_models_steps(build):
  """--central_steps=3 with K=2: three central steps, gtilde_c over three."""
  algorithm = build(mixed.TWO_WAY_GT, HP, central_steps=3)
  state, metrics = run_round(algorithm, initial_state(algorithm))
  assert metrics['central']['num_steps'] == 3
  theta, gtilde_c, _ = reference_round('mixed_2wgt', INITIAL_THETA, HP,
                                       np.zeros(3), np.zeros(3),
                                       central_steps=3)
  np.testing.assert_allclose(model_theta(algorithm, state), theta, rtol=1e-5)
  np.testing.assert_allclose(to_theta(state['gtilde_c']), gtilde_c,
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match='central_steps must be >= 1, got 0'):
    settings_from(mixed.TWO_WAY_GT, HP, central_steps=0)


def test_diagnostics_follow_eq_7(pt, one_way_gt):
  for algorithm, hp in ((pt, HP), (one_way_gt, HP_EQUIVALENT)):
    # Uniform cohort mean of the clients' first gradients, at x(t).
    g_f = np.mean([hp['w_f'] * mse_gradient(INITIAL_THETA, b[0])
                   for b in CLIENT_BATCHES], axis=0)
    g_c = hp['w_c'] * mse_gradient(INITIAL_THETA, CENTRAL_BATCHES[0])
    weighted = g_f @ g_f / hp['w_f'] + g_c @ g_c / hp['w_c']
    total = (g_f + g_c) @ (g_f + g_c)
    _, metrics = run_round(algorithm, initial_state(algorithm))
    np.testing.assert_allclose(metrics['diagnostics']['gtilde_squared'],
                               weighted - total, rtol=1e-4)
    np.testing.assert_allclose(metrics['diagnostics']['btilde_squared'],
                               weighted / total, rtol=1e-4)


def test_diagnostics_average_over_clients_that_measured_a_gradient(pt):
  # eq. 7's federated gradient is the cohort mean of the clients' g_i(x); a
  # sampled client without data has no g_i and must not pull it to zero.
  empty = tf.data.Dataset.from_tensor_slices(
      (np.zeros((0, 2), np.float32), np.zeros((0, 1), np.float32))).batch(2)
  client_ids = [pt.data.set_client(f'client_{i}', dataset)
                for i, dataset in enumerate(client_datasets())]
  client_ids.append(pt.data.set_client('client_without_data', empty))
  pt.data.set_central(0, to_dataset(CENTRAL_BATCHES))
  _, metrics = round_testing.run_round(pt.process, initial_state(pt),
                                       client_ids, server_seed=0)
  hp = HP_EQUIVALENT
  g_f = np.mean([hp['w_f'] * mse_gradient(INITIAL_THETA, b[0])
                 for b in CLIENT_BATCHES], axis=0)
  g_c = hp['w_c'] * mse_gradient(INITIAL_THETA, CENTRAL_BATCHES[0])
  weighted = g_f @ g_f / hp['w_f'] + g_c @ g_c / hp['w_c']
  total = (g_f + g_c) @ (g_f + g_c)
  np.testing.assert_allclose(metrics['diagnostics']['gtilde_squared'],
                             weighted - total, rtol=1e-4)
  np.testing.assert_allclose(metrics['diagnostics']['btilde_squared'],
                             weighted / total, rtol=1e-4)


# --- Special cases ------------------------------------------------------------------


@pytest.mark.parametrize('name', [mixed.PARALLEL_TRAINING, mixed.ONE_WAY_GT,
                                  mixed.TWO_WAY_GT])
def test_a_round_without_client_data_keeps_the_server_optimizer(build, name):
  # As FedAvg's finalizer keeps x and its state (a 0/0 mean, rejected):
  # ServerOpt(x, 0) moved x by sgdm's momentum (0.9 x round 1's step).
  algorithm = build(name, HP, server_optimizer='sgdm')
  state, _ = run_round(algorithm, initial_state(algorithm))
  empty = tf.data.Dataset.from_tensor_slices(
      (np.zeros((0, 2), np.float32), np.zeros((0, 1), np.float32))).batch(2)
  client = algorithm.data.set_client('client_without_data', empty)
  algorithm.data.set_central(0, to_dataset(CENTRAL_BATCHES))
  after, metrics = round_testing.run_round(algorithm.process, state, [client],
                                           round_num=2, server_seed=0)
  assert int(metrics['train']['num_examples']) == 0
  for before, kept in zip(tf.nest.flatten(state['server_optimizer']),
                          tf.nest.flatten(after['server_optimizer'])):
    np.testing.assert_array_equal(before, kept)
  if name == mixed.ONE_WAY_GT:  # x_f is the new x: it stays.
    np.testing.assert_array_equal(model_theta(algorithm, after),
                                  model_theta(algorithm, state))


def test_pt_equals_1wgt_with_one_step(pt, one_way_gt):
  """K=1, eta_c=eta, eta_s=eta_m=1, same central batch: same next model."""
  rng = np.random.default_rng(0)
  pt_state = initial_state(pt)
  gt_state = initial_state(one_way_gt)
  for _ in range(3):
    # One batch per client (K_i = 1), of different sizes (p_i).
    clients = [batches(rng.normal(size=(n, 2)), rng.normal(size=n), n)
               for n in (1, 2, 3)]
    central = batches(rng.normal(size=(4, 2)), rng.normal(size=4), 4)
    pt_state, _ = run_round(pt, pt_state, clients, central)
    gt_state, _ = run_round(one_way_gt, gt_state, clients, central)
    np.testing.assert_allclose(model_theta(pt, pt_state),
                               model_theta(one_way_gt, gt_state),
                               rtol=1e-6, atol=1e-7)


def test_data_free_central_loss(build):
  """A central loss of the weights alone (L2): no server data is taken."""

  def l2_regularizer(weights):
    return 0.5 * tf.add_n([tf.reduce_sum(tf.square(w))
                           for w in weights.trainable])

  algorithm = build(mixed.PARALLEL_TRAINING, HP,
                    central_loss_fn=l2_regularizer)
  assert not algorithm.definition.uses_server_data
  state = initial_state(algorithm)
  state, metrics = run_round(algorithm, state, central_batches=None)
  # grad of 0.5 |theta|^2 is theta: K steps of x <- x - eta_c * w_c * x.
  delta_c = INITIAL_THETA * ((1 - HP['eta_c'] * HP['w_c'])**HP['K'] - 1)
  mean_delta, _, _ = reference_federated(INITIAL_THETA, HP['eta'], HP['w_f'],
                                         0.0, CLIENT_BATCHES)
  expected = INITIAL_THETA + HP['eta_m'] * (delta_c + HP['eta_s'] * mean_delta)
  np.testing.assert_allclose(model_theta(algorithm, state), expected,
                             rtol=1e-5)
  assert metrics['central']['num_steps'] == HP['K']


# --- Mixed FL vs FL only, in miniature ---------------------------------------
# Federated clients hold one label, the central data the other (the
# celeba_smile story; experiments/celeba_mixed.py checks it on CelebA-format
# data). FL only = the same process with no central data, i.e. FedAvg.

POSITIVE_CENTER, NEGATIVE_CENTER = np.zeros(2), np.array([2.0, 2.0])


def label_split_round(round_num):
  rng = np.random.default_rng(100 + round_num)
  clients = [[(rng.normal(size=(4, 2)) + POSITIVE_CENTER, np.ones(4))]
             for _ in range(4)]
  central = [(rng.normal(size=(8, 2)) + NEGATIVE_CENTER, np.zeros(8))]
  return clients, central


def accuracy_on_both_labels(theta):
  rng = np.random.default_rng(7)
  x = np.vstack([rng.normal(size=(100, 2)) + POSITIVE_CENTER,
                 rng.normal(size=(100, 2)) + NEGATIVE_CENTER])
  labels = np.r_[np.ones(100), np.zeros(100)]
  scores = np.hstack([x, np.ones((200, 1))]) @ theta
  return np.mean((scores > 0.5) == (labels == 1))


def test_central_data_teaches_the_label_clients_lack(one_way_gt):
  no_central_data = [(np.zeros((0, 2)), np.zeros(0))]
  accuracy = {}
  for name, with_central in (('fl_only', False), ('mixed', True)):
    state = initial_state(one_way_gt)
    for round_num in range(5):
      clients, central = label_split_round(round_num)
      state, _ = run_round(one_way_gt, state, clients,
                           central if with_central else no_central_data)
    accuracy[name] = accuracy_on_both_labels(model_theta(one_way_gt, state))
  # FL only never sees a negative (it drifts towards "always positive",
  # accuracy 0.5); mixed FL separates the labels (float64 replay of these
  # rounds: 0.275 vs 0.695).
  assert accuracy['fl_only'] <= 0.55
  assert accuracy['mixed'] >= accuracy['fl_only'] + 0.3, accuracy


# --- Communication -----------------------------------------------------------------

# The linear model: 3 float32 weights. A client uploads its delta (12 bytes),
# its weight p_i (4) and the model's metric sums: loss total and count
# (8), num_examples and num_batches (int64, 16).
MODEL_BYTES = 12
UPLOAD_BYTES = MODEL_BYTES + 4 + 8 + 16


def test_communication_metrics(pt, one_way_gt, two_way_gt):
  expected = {  # name: (down, up, augmenting gradient's part of down)
      'pt': (pt, MODEL_BYTES, UPLOAD_BYTES, 0),
      # Gradient transfer doubles the download.
      '1wgt': (one_way_gt, 2 * MODEL_BYTES, UPLOAD_BYTES, MODEL_BYTES),
      # 2-w GT adds only K_i (a float32) to the upload, no gradient.
      '2wgt': (two_way_gt, 2 * MODEL_BYTES, UPLOAD_BYTES + 4, MODEL_BYTES),
  }
  for name, (algorithm, down, up, augmenting) in expected.items():
    _, metrics = run_round(algorithm, initial_state(algorithm))
    assert metrics['communication'] == collections.OrderedDict(
        bytes_down_per_client=down, bytes_up_per_client=up,
        augmenting_bytes_down_per_client=augmenting), name


def test_baseline_communication_bytes(data):
  # FedAvg broadcasts the model alone (tff.learning's FedAvg also sends its
  # client optimizer's learning rate); a client uploads what a mixed FL
  # client does.
  fedavg = baselines.fedavg(linear_model_fn, baselines.FedAvgSettings(
      client_learning_rate=0.1))
  algorithm = Algorithm(fedavg, driver.compose_process(
      fedavg, data.task(linear_task(None)), 'native'), data)
  _, metrics = run_round(algorithm, initial_state(algorithm),
                         central_batches=None)
  assert metrics['communication'] == collections.OrderedDict(
      bytes_down_per_client=MODEL_BYTES, bytes_up_per_client=UPLOAD_BYTES)


# --- Bad configurations ------------------------------------------------------------


@pytest.mark.parametrize('client_steps, settings, name', [
    (None, dict(), 'algorithm'),
    (2, dict(central_weight=-1.0), 'central_weight'),
    (2, dict(central_optimizer='nope'), 'central_optimizer'),
    (2, dict(merge_learning_rate=0.0), 'merge_learning_rate'),
    (2, dict(mixed_diagnostics=True, federated_weight=0.0),
     'mixed_diagnostics'),
    (2, dict(federated_weight=0.0, central_weight=0.0), 'federated_weight'),
    # [MixedFL] Def. 4.2: proportions; eq. 7's G^2 came out negative.
    (2, dict(federated_weight=1.0, central_weight=1.0), 'federated_weight'),
    (2, dict(federated_weight=0.5, central_weight=0.0), 'federated_weight'),
])
def test_bad_configuration_is_a_usage_error(client_steps, settings, name):
  # A SettingError names the flag; the binaries print `error: --<name> ...`.
  with pytest.raises(settings_lib.SettingError, match=name) as raised:
    mixed.definition(mixed.PARALLEL_TRAINING, linear_task(client_steps),
                     mixed.ParallelTrainingSettings(**settings))
  assert raised.value.name == name


# --- Resume through the driver ----------------------------------------------------


def tiny_linear_task() -> base.Task:
  """12 clients and a central stream of a noisy linear problem."""
  true_theta = np.array([[1.5], [-2.0]], np.float32)

  def examples(seed, n):
    x = tf.random.stateless_normal([n, 2], seed)
    y = x @ true_theta + 0.1 * tf.random.stateless_normal([n, 1], seed + 1)
    return tf.data.Dataset.from_tensor_slices((x, y))

  def client_dataset(client_id, seed):
    key = tf.strings.to_hash_bucket_fast(client_id, 2**31 - 1)
    data = examples(tf.stack([key, tf.constant(0, tf.int64)]), 5)
    return data.shuffle(5, seed=seed).batch(2)

  def server_dataset(seed):
    data = examples(tf.stack([seed, tf.constant(1, tf.int64)]), 40)
    return data.repeat().batch(4)

  def eval_datasets():
    return {'': examples(tf.constant([7, 7], tf.int64), 20).batch(20)}

  return base.Task(
      name='tiny_linear',
      train_client_ids=tuple(f'client_{i}' for i in range(12)),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=keras_linear_model,
      loss_fn=tf.keras.losses.MeanSquaredError,
      metrics_fn=list,
      batch_spec=BATCH_SPEC,
      eval_datasets_fn=eval_datasets,
      serving=None,
      server_dataset_computation=base.server_dataset_computation(
          server_dataset))


def test_resumed_2wgt_run_equals_uninterrupted_run(two_way_gt):
  task = tiny_linear_task()
  with tempfile.TemporaryDirectory() as root:

    def run(name, rounds):
      config = driver.RunConfig(
          root_output_dir=root, experiment_name=name, total_rounds=rounds,
          clients_per_round=4, rounds_per_eval=10, rounds_per_checkpoint=1,
          export=False)
      return driver.train(two_way_gt.definition, task, config)

    run('interrupted', 2)
    resumed = run('interrupted', 4)
    uninterrupted = run('uninterrupted', 4)
    assert resumed.round_num == uninterrupted.round_num == 4
    # The whole server state: model, optimizer states, gtilde_c, gtilde_f.
    tf.nest.map_structure(np.testing.assert_array_equal,
                          resumed.server_state, uninterrupted.server_state)
    assert np.linalg.norm(to_theta(resumed.server_state['gtilde_f'])) > 0
    # The checkpoint holds the augmenting gradients.
    checkpoints = driver.CheckpointManager(
        f'{root}/interrupted/checkpoints', keep=0)
    loaded = checkpoints.load(
        4, driver.program_state_structure(two_way_gt.process, 4,
                                          task.num_train_clients, False))
    tf.nest.map_structure(np.testing.assert_array_equal,
                          loaded['server_state']['gtilde_c'],
                          uninterrupted.server_state['gtilde_c'])
