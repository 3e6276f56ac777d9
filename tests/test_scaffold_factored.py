"""SCAFFOLD with a Dense kernel's c_i kept as factors, against dense c_i.

The dense path is checked against hand computation (test_scaffold_math); the
factored one must compute the same rounds to float32 rounding: model, c, and
every stored c_i (A^T E). The task: multi-output linear regression, 4
clients of unequal sizes with --client_steps K = 3 batches of at most 2, so
a kernel of 12 x 16 is smaller as K * B = 6 rows of factors
(6 * 28 < 192). The clients take K_i = 2, 3, 1 and 3 batches; the client
of 1 example and the last batch of the client of 5 have one row (rows of
zeros fill the rest).
"""

import math
from typing import Optional

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import base
from tff_algos.aggregation import factories
from tff_algos.algorithms import registry
from tff_algos.algorithms.scaffold import definition as scaffold
from tff_algos.algorithms.scaffold import factored

from pipeline import driver

import scaffold_testlib as lib

INPUTS, UNITS = 12, 16
CLIENT_SIZES = (4, 6, 1, 5)
STEPS, BATCH = 3, 2


def _arrays():
  rng = np.random.default_rng(7)
  xs = [rng.normal(size=(n, INPUTS)).astype(np.float32)
        for n in CLIENT_SIZES]
  ys = [(x @ rng.normal(size=(INPUTS, UNITS)) + rng.normal(size=UNITS)
         ).astype(np.float32) for x in xs]
  return xs, ys


def build_task(hidden_twice: bool = False,
               diverging_client: Optional[int] = None,
               hidden_layer: bool = False, nested: bool = False
               ) -> base.Task:
  xs, ys = _arrays()
  if diverging_client is not None:  # A NaN target: its update is NaN.
    ys[diverging_client] = ys[diverging_client].copy()
    ys[diverging_client][0, 0] = np.nan
  offsets = np.cumsum((0,) + CLIENT_SIZES[:-1]).astype(np.int64)
  all_x, all_y = np.concatenate(xs), np.concatenate(ys)

  def client_dataset(client_id, seed):
    del seed
    k = tf.strings.to_number(client_id, tf.int64)
    start = tf.gather(tf.constant(offsets), k)
    size = tf.gather(tf.constant(CLIENT_SIZES, tf.int64), k)
    x = tf.slice(tf.constant(all_x), [start, 0], [size, INPUTS])
    y = tf.slice(tf.constant(all_y), [start, 0], [size, UNITS])
    # At most K batches; fewer, and a smaller last one, for small clients
    # (base.client_batches repeats the data to K full batches; a task may
    # not).
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).take(
        STEPS)

  def keras_model():
    initializer = tf.keras.initializers.GlorotUniform(seed=3)
    inputs = tf.keras.Input(shape=(INPUTS,))
    layer = tf.keras.layers.Dense(UNITS, kernel_initializer=initializer,
                                  bias_initializer='ones')
    outputs = layer(inputs)
    if hidden_layer:  # A second kernel, 16 x 16, factored too.
      outputs = tf.keras.layers.Dense(
          UNITS, kernel_initializer=initializer)(tf.nn.relu(outputs))
    if nested:  # The model above inside another one, then a second layer.
      outputs = tf.keras.layers.Dense(UNITS, kernel_initializer=initializer)(
          tf.keras.Model(inputs, outputs)(inputs))
    if hidden_twice:  # The kernel used twice: not a single product.
      outputs = layer(tf.keras.layers.Dense(INPUTS)(outputs))
    return tf.keras.Model(inputs, outputs)

  return base.Task(
      name='linear_multi',
      train_client_ids=tuple(str(k) for k in range(len(CLIENT_SIZES))),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=keras_model,
      loss_fn=tf.keras.losses.MeanSquaredError,
      metrics_fn=lambda: [],
      batch_spec=(tf.TensorSpec([None, INPUTS], tf.float32),
                  tf.TensorSpec([None, UNITS], tf.float32)),
      eval_datasets_fn=lambda: {'': tf.data.Dataset.from_tensor_slices(
          (all_x, all_y)).batch(100)},
      serving=base.ServingSpec(
          'x', tf.TensorSpec([None, INPUTS], tf.float32),
          lambda x: x, lambda y: {'y': y}),
      data_config=base.DataConfig(client_batch_size=BATCH,
                                  client_steps=STEPS))


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  return lib.make_runner(build_task(), str(tmp_path_factory.mktemp('factored')))


def _dense_cv(entries):
  return [np.asarray(factored.dense(e)) if isinstance(e, (tuple, list))
          else np.asarray(e) for e in entries]


# The factored and the dense forms round differently.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _assert_close(got, want):
  for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
    np.testing.assert_allclose(a, b, **TOLERANCE)


def _assert_same_model_and_c(got, want):
  """Two driver results' models and server c, to float32 rounding."""
  _assert_close(got.model_weights.trainable, want.model_weights.trainable)
  _assert_close(got.server_state['control_variate'],
                want.server_state['control_variate'])


def test_the_plan_factors_only_the_kernel_that_is_smaller():
  task = build_task()
  kernels = factored.plan(task.model_fn, (True, True), STEPS, BATCH)
  assert kernels == (factored.FactoredKernel(0, STEPS, BATCH, INPUTS, UNITS),)
  # Unbounded steps, a masked-out kernel, too many rows: dense.
  assert factored.plan(task.model_fn, (True, True), None, BATCH) == ()
  assert factored.plan(task.model_fn, (False, True), STEPS, BATCH) == ()
  assert factored.plan(task.model_fn, (True, True), 4, BATCH) == ()


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_factored_control_variates_compute_the_dense_rounds(run, runtime):
  rounds = 3
  dense = run(f'dense_{runtime}', 'scaffold', rounds=rounds, runtime=runtime,
              factored_control_variates=False)
  factors = run(f'factored_{runtime}', 'scaffold', rounds=rounds,
                runtime=runtime)
  _assert_same_model_and_c(factors.result, dense.result)
  np.testing.assert_allclose(factors.train_losses, dense.train_losses,
                             **TOLERANCE)
  sampled = 0
  for k in range(len(CLIENT_SIZES)):
    stored = factors.client_cvs[k]
    # The kernel's c_i is stored as factors, the bias's dense.
    assert [np.shape(e[0]) for e in stored[:1]] == [(STEPS * BATCH, INPUTS)]
    want = dense.client_cvs[k]
    for a, b in zip(_dense_cv(stored), want, strict=True):
      np.testing.assert_allclose(a, b, **TOLERANCE)
    sampled += bool(np.any(want[0]))
  # Control variates are in play, for more than one client.
  assert sampled >= 2
  assert np.abs(dense.result.server_state['control_variate'][0]).max() > 0.05


@pytest.mark.parametrize('shifts', [0, 1])
def test_steps_past_the_shifted_kernels_compute_the_dense_rounds(
    run, monkeypatch, shifts):
  # Room for `shifts` of the K - 1 = 2 kernels x - k eta c: the later steps
  # take the product of their batch with c instead.
  monkeypatch.setattr(factored, 'SHIFTED_KERNELS_BYTES',
                      shifts * 4 * INPUTS * UNITS)
  dense = run('dense_native', 'scaffold', rounds=3, runtime='native',
              factored_control_variates=False)
  factors = run(f'factored_shifts_{shifts}', 'scaffold', rounds=3,
                runtime='native')
  _assert_same_model_and_c(factors.result, dense.result)


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_a_stored_factor_holds_the_clients_own_rows(run, runtime):
  # A = the inputs of the client's steps, batch by batch at the step's
  # place, zero rows past a smaller batch and past its last step: nothing
  # of the clients before it in its group.
  factors = run(f'factored_{runtime}', 'scaffold', rounds=3, runtime=runtime)
  xs, _ = _arrays()
  for k, x in enumerate(xs):
    want = np.zeros((STEPS * BATCH, INPUTS), np.float32)
    for step in range(min(STEPS, -(-len(x) // BATCH))):
      rows = x[step * BATCH:(step + 1) * BATCH]
      want[step * BATCH:step * BATCH + len(rows)] = rows
    np.testing.assert_array_equal(factors.client_cvs[k][0][0], want)


def test_c_stays_the_mean_of_the_stored_factored_c_i(run):
  # [SCAFFOLD] eq. 21 with every c_i starting at 0 and the |S|/N rule: c is
  # the mean of all N clients' c_i, however many rounds. The sum of
  # c_i+ - c_i is formed from the stored factors; line 12's
  # (x - y) / (K eta) - c, with its rounding of eps |w| / (K eta) a client,
  # drifted from them by 1e-4 (relative) in these 30 rounds.
  factors = run('invariant', 'scaffold', rounds=30,
                client_learning_rate=0.001)
  mean = [np.mean([_dense_cv(factors.client_cvs[k])[p]
                   for k in range(len(CLIENT_SIZES))], axis=0)
          for p in range(2)]
  for c, want in zip(factors.result.server_state['control_variate'], mean,
                     strict=True):
    scale = np.abs(want).max()
    assert scale > 0
    np.testing.assert_allclose(c, want, rtol=0, atol=1e-5 * scale)


def test_factored_runs_on_both_runtimes_agree(run):
  # As every algorithm's runtimes (test_native_runtime): to the last bits
  # their graph optimizations may round differently.
  tff_run = run('factored_tff', 'scaffold', rounds=3, runtime='tff')
  native = run('factored_native', 'scaffold', rounds=3, runtime='native')
  _assert_close(lib.weights(tff_run), lib.weights(native))
  for k in range(len(CLIENT_SIZES)):
    _assert_close(tff_run.client_cvs[k], native.client_cvs[k])


def test_a_kernel_used_twice_stays_dense():
  task = build_task(hidden_twice=True)
  kernels = factored.plan(task.model_fn, (True,) * 4, STEPS, BATCH)
  assert all(k.variable_index != 0 for k in kernels)


class _ReadsKernel(tf.keras.layers.Layer):
  """Another use of a Dense layer's kernel (tied weights)."""

  def __init__(self, dense, **kwargs):
    super().__init__(**kwargs)
    self.dense = dense

  def call(self, inputs):
    return tf.matmul(inputs, self.dense.kernel, transpose_b=True)


def _model_fn(build, input_dtype=tf.float32):
  return lambda: tff.learning.models.from_keras_model(
      build(), loss=tf.keras.losses.MeanSquaredError(),
      input_spec=(tf.TensorSpec([None, INPUTS], input_dtype),
                  tf.TensorSpec([None, INPUTS], tf.float32)))


def _tied():
  inputs = tf.keras.Input((INPUTS,))
  dense = tf.keras.layers.Dense(UNITS)
  return tf.keras.Model(inputs, _ReadsKernel(dense)(dense(inputs)))


def _int_inputs():
  inputs = tf.keras.Input((INPUTS,), dtype=tf.int32)
  return tf.keras.Model(inputs, tf.keras.layers.Dense(INPUTS)(inputs))


def _more_rows():  # The Dense sees 4 rows per example.
  inputs = tf.keras.Input((INPUTS,))
  rows = tf.keras.layers.Reshape((4, INPUTS // 4))(inputs)
  rows = tf.keras.layers.Lambda(lambda t: tf.reshape(t, [-1, INPUTS // 4]))(
      rows)
  outputs = tf.keras.layers.Dense(UNITS)(rows)
  return tf.keras.Model(inputs, tf.keras.layers.Lambda(
      lambda t: tf.reshape(t, [-1, INPUTS]))(outputs[:, :3]))


@pytest.mark.parametrize('build,dtype', [(_tied, tf.float32),
                                         (_int_inputs, tf.int32),
                                         (_more_rows, tf.float32)])
def test_kernels_whose_gradient_is_not_one_product_stay_dense(build, dtype):
  # Each is smaller as factors; none has A^T D as its gradient.
  assert factored.plan(_model_fn(build, dtype), (True,) * 2, 1, 1) == ()


def test_a_diverging_client_keeps_its_factors_and_adds_nothing(tmp_path):
  diverging, rounds = 2, 3
  sampled = [driver.plan_round(lib.SEED, r, len(CLIENT_SIZES),
                               lib.CLIENTS_PER_ROUND).client_indices
             for r in range(1, rounds + 1)]
  assert any(diverging in s for s in sampled)
  run = lib.make_runner(build_task(diverging_client=diverging),
                        str(tmp_path))
  dense = run('dense', 'scaffold', rounds=rounds,
              factored_control_variates=False)
  factors = run('factored', 'scaffold', rounds=rounds)
  for a, b in zip(lib.weights(factors), lib.weights(dense), strict=True):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for a, b in zip(factors.result.server_state['control_variate'],
                  dense.result.server_state['control_variate'], strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Never updated: the initial zero factors.
  for entry in tf.nest.flatten(factors.client_cvs[diverging]):
    np.testing.assert_array_equal(entry, np.zeros_like(entry))


def _train(directory, name, task, runtime='tff', aggregator=None,
           clients_per_round=lib.CLIENTS_PER_ROUND, clients_per_group=0,
           rounds=3, **settings):
  definition = registry.build('scaffold', task, scaffold.ScaffoldSettings(
      client_learning_rate=lib.CLIENT_LR, server_learning_rate=lib.SERVER_LR,
      **settings))
  config = driver.RunConfig(
      root_output_dir=str(directory), experiment_name=name,
      total_rounds=rounds, clients_per_round=clients_per_round,
      rounds_per_eval=rounds, rounds_per_checkpoint=rounds, seed=lib.SEED,
      clients_per_group=clients_per_group, export=False, runtime=runtime)
  return driver.train(
      definition, task, config, model_aggregator=(
          None if aggregator is None else
          factories.build(aggregator, clients_per_round)))


def test_a_dropped_client_adds_nothing_to_its_formed_update(tmp_path):
  # A diverging client's update is zero where it is formed: drift
  # diversity's per-client measurements, and a per-client aggregator's
  # input (DP's unweighted mean), as in the dense run; its zeroed
  # c_i+ - c_i with the scale -K_i eta would leave -K_i eta c.
  diverging, rounds = 2, 3
  last = driver.plan_round(lib.SEED, rounds, len(CLIENT_SIZES),
                           lib.CLIENTS_PER_ROUND).client_indices
  assert diverging in last
  task = build_task(diverging_client=diverging)
  dp = factories.AggregatorSettings(aggregator=factories.DP, clip_norm=1e6,
                                    dp_noise_multiplier=0.0)
  for aggregator, settings in ((None, dict(drift_diversity=True)),
                               (dp, {})):
    runs = [_train(tmp_path / f'{form}_{aggregator is None}', 'run', task,
                   aggregator=aggregator, factored_control_variates=form,
                   **settings)
            for form in (True, False)]
    factors, dense = runs
    _assert_close(factors.model_weights.trainable,
                  dense.model_weights.trainable)
    diversity = [k for k in dense.last_metrics if 'drift_diversity' in k]
    assert bool(diversity) == (aggregator is None)
    for key in diversity:
      assert factors.last_metrics[key] == pytest.approx(
          dense.last_metrics[key], rel=1e-4), key


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_clients_of_one_group_compute_the_dense_rounds(tmp_path, runtime):
  # Every client each round, in one group: the clients share the group's
  # x - k eta c, and each finds the rows of the one before it (which took
  # other steps) in the layer's variables.
  runs = [_train(tmp_path / str(form), 'run', build_task(), runtime=runtime,
                 clients_per_round=len(CLIENT_SIZES),
                 clients_per_group=len(CLIENT_SIZES), rounds=4,
                 factored_control_variates=form)
          for form in (True, False)]
  factors, dense = runs
  _assert_same_model_and_c(factors, dense)


def test_a_resumed_factored_run_is_bit_identical(tmp_path):
  task = build_task()
  definition = registry.build('scaffold', task, scaffold.ScaffoldSettings(
      client_learning_rate=lib.CLIENT_LR))

  def train(name, rounds):
    config = driver.RunConfig(
        root_output_dir=str(tmp_path), experiment_name=name,
        total_rounds=rounds, clients_per_round=lib.CLIENTS_PER_ROUND,
        rounds_per_eval=4, rounds_per_checkpoint=2, seed=lib.SEED,
        export=False, runtime='tff')
    result = driver.train(definition, task, config)
    states = driver.committed_client_states(definition, task,
                                            config.run_dir)
    return result, list(states.read(list(task.train_client_ids)))

  train('resumed', 2)
  resumed, resumed_states = train('resumed', 4)
  straight, straight_states = train('straight', 4)
  for a, b in zip(tf.nest.flatten(resumed.server_state),
                  tf.nest.flatten(straight.server_state), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(tf.nest.flatten(resumed_states),
                  tf.nest.flatten(straight_states), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_per_client_aggregator_gets_each_factored_clients_update(
    run, tmp_path):
  # The kernel's y - x travels as -K_i eta (c_i+ - c_i + c), which a group
  # sums as sum_i w_i K_i eta (c_i+ - c_i) plus one multiple of c
  # (round.AffineUpdate). A per-client aggregator gets each client's update
  # formed: robust aggregation without clipping or zeroing is the mean, and
  # the rounds equal the dense ones. (TFF's runtime: the native one runs
  # the mean only.)
  runtime = 'tff'
  task = build_task()
  definition = registry.build('scaffold', task, scaffold.ScaffoldSettings(
      client_learning_rate=lib.CLIENT_LR,
      server_learning_rate=lib.SERVER_LR))
  robust = factories.AggregatorSettings(
      aggregator=factories.ROBUST, clip_norm=math.inf, zeroing=False)
  config = driver.RunConfig(
      root_output_dir=str(tmp_path), experiment_name='robust',
      total_rounds=3, clients_per_round=lib.CLIENTS_PER_ROUND,
      rounds_per_eval=3, rounds_per_checkpoint=3, seed=lib.SEED,
      export=False, runtime=runtime)
  robust_run = driver.train(
      definition, task, config,
      model_aggregator=factories.build(robust, lib.CLIENTS_PER_ROUND))
  dense = run(f'dense_{runtime}', 'scaffold', rounds=3, runtime=runtime,
              factored_control_variates=False)
  _assert_same_model_and_c(robust_run, dense.result)


@pytest.mark.parametrize('model', ['hidden_layer', 'nested'])
def test_two_factored_kernels_compute_the_dense_rounds(tmp_path, model):
  task = build_task(**{model: True})
  kernels = factored.plan(task.model_fn, (True,) * 4, STEPS, BATCH)
  assert [k.variable_index for k in kernels] == [0, 2]
  run = lib.make_runner(task, str(tmp_path))
  dense = run('dense', 'scaffold', rounds=3, factored_control_variates=False)
  factors = run('factored', 'scaffold', rounds=3)
  _assert_same_model_and_c(factors.result, dense.result)
  for k in range(len(CLIENT_SIZES)):
    _assert_close(_dense_cv(factors.client_cvs[k]), dense.client_cvs[k])


@pytest.mark.parametrize('learning_rate', [1.0, 0.3, 1 / 3, 0.07])
@pytest.mark.parametrize('steps', [1, 2, 5, 25])
def test_a_client_of_k_steps_sends_the_common_scale_bit_for_bit(
    learning_rate, steps):
  # The runtime skips a client's share of the update (round.AffineUpdate)
  # only when its weight x scale equals the common one exactly; a client
  # of fewer steps, or of another weight, takes the general sum.
  def weighted_scale(num_steps, weight=1.0):
    update = factored.model_update(
        tf.zeros([2, 3]), tf.constant(num_steps, tf.int64), learning_rate,
        0, summed_as=('control_variate_delta', 0), common=(1.0, steps))
    return (tf.constant(weight) * update.scale).numpy(), update.common_scale(
        ).numpy()

  client, common = weighted_scale(steps)
  assert client == common
  assert common == np.float32(-steps * np.float32(learning_rate))
  assert weighted_scale(steps - 1)[0] != common
  assert weighted_scale(steps, weight=0.0)[0] != common
