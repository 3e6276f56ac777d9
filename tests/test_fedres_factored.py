"""FedResAvg Option II with a Dense kernel's c_i kept as factors, against
dense c_i.

The dense path is checked against the numpy reference
(test_fedres_algorithms); the factored one must compute the same rounds to
float32 rounding: w, c, every stored c_i (A^T E) and theta_i. The task:
multi-output linear regression, a global Dense 12 -> 16 on all features
plus a local Dense on the first 4, 4 clients of unequal sizes with
--client_steps K = 3 batches of at most 2, so the global kernel of 12 x 16
is smaller as K * B = 6 rows of factors (6 * 28 < 192). The clients take
K_i = 2, 3, 1 and 3 batches in each of Step 1 and Step 2; the client of 1
example and the last batch of the client of 5 have one row. alpha = 0.7
scales the server step that the kernel's update, sent as
-K_i eta (c_i+ - c_i + c), takes.
"""

import dataclasses
import math
from typing import Optional

import numpy as np
import pytest
import tensorflow as tf

from pipeline import driver
from tasks import base
from tasks import residual
from tff_algos.aggregation import factories
from tff_algos.algorithms import registry
from tff_algos.algorithms.fedres import definition as fedres
from tff_algos.algorithms.fedres import export as fedres_export
from tff_algos.algorithms.fedres import math as fedres_math
from tff_algos.algorithms.scaffold import factored

import scaffold_testlib

import test_scaffold_factored as scaffold_factored

INPUTS, UNITS = scaffold_factored.INPUTS, scaffold_factored.UNITS
CLIENT_SIZES = scaffold_factored.CLIENT_SIZES
STEPS, BATCH = scaffold_factored.STEPS, scaffold_factored.BATCH
LOCAL_INPUTS = 4
SEED = scaffold_testlib.SEED  # Consecutive rounds share a client.
CLIENTS_PER_ROUND = 2
SETTINGS = dict(client_learning_rate=0.05, local_learning_rate=0.05,
                fedres_alpha=0.7)


def _global_model(regularized: bool = False):
  inputs = tf.keras.Input(shape=(INPUTS,))
  outputs = tf.keras.layers.Dense(
      UNITS, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3),
      bias_initializer='ones',
      kernel_regularizer='l2' if regularized else None)(inputs)
  return tf.keras.Model(inputs, outputs)


def _local_model():
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(LOCAL_INPUTS,)),
      tf.keras.layers.Dense(
          UNITS, kernel_initializer=tf.keras.initializers.GlorotUniform(
              seed=5))])


def build_task(diverging_client: Optional[int] = None,
               steps: Optional[int] = STEPS,
               regularized: bool = False) -> base.Task:
  """SCAFFOLD's factored test task (its clients' data and batches) with a
  residual model."""
  task = scaffold_factored.build_task(diverging_client=diverging_client)
  spec = residual.ResidualModelSpec(
      global_model_fn=lambda: _global_model(regularized),
      local_model_fn=_local_model,
      split_inputs=lambda x: (x, x[:, :LOCAL_INPUTS]),
      input_spec=tf.TensorSpec([None, INPUTS], tf.float32),
      loss_fn=tf.keras.losses.MeanSquaredError,
      metrics_fn=lambda: [])
  return dataclasses.replace(
      task, name='residual_multi', residual_spec=spec,
      keras_model_fn=lambda: residual.global_only_model(spec),
      data_config=base.DataConfig(client_batch_size=BATCH,
                                  client_steps=steps))


@dataclasses.dataclass
class Run:
  result: driver.TrainResult
  # Every client's stored state, in id order (None: not read).
  states: Optional[list]

  @property
  def server_control(self):
    return self.result.server_state['control']


def _train(root, name, task, rounds=3, runtime='tff', clients_per_round=2,
           clients_per_group=0, rounds_per_checkpoint=None, export=False,
           aggregator=None, **settings):
  definition = registry.build('fedres_avg', task, fedres.FedResAvgSettings(
      **{**SETTINGS, **settings}))
  config = driver.RunConfig(
      root_output_dir=str(root), experiment_name=name, total_rounds=rounds,
      clients_per_round=clients_per_round, rounds_per_eval=rounds,
      rounds_per_checkpoint=rounds_per_checkpoint or rounds, seed=SEED,
      clients_per_group=clients_per_group, export=export, runtime=runtime)
  result = driver.train(
      definition, task, config, model_aggregator=(
          None if aggregator is None else
          factories.build(aggregator, clients_per_round)))
  if aggregator is not None:  # Its state is in the checkpoint too.
    return Run(result, None)
  states = driver.committed_client_states(definition, task, config.run_dir)
  return Run(result, list(states.read(list(task.train_client_ids))))


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """`run(name, **kwargs)` -> Run of the module's task, memoized by name."""
  root = tmp_path_factory.mktemp('fedres_factored')
  task = build_task()
  runs = {}

  def run_(name, **kwargs):
    if name not in runs:
      runs[name] = _train(root, name, task, **kwargs)
    return runs[name]

  return run_


_dense_cv = scaffold_factored._dense_cv  # pylint: disable=protected-access


def _assert_close(got, want):
  for value in tf.nest.flatten(got):
    assert np.all(np.isfinite(value))
  scaffold_factored._assert_close(got, want)  # pylint: disable=protected-access


def _assert_same_rounds(factors: Run, dense: Run):
  """w, c, every client's c_i (formed) and theta_i, to float32 rounding."""
  _assert_close(factors.result.model_weights.trainable,
                dense.result.model_weights.trainable)
  _assert_close(factors.server_control, dense.server_control)
  for got, want in zip(factors.states, dense.states, strict=True):
    _assert_close(_dense_cv(got['control']), want['control'])
    _assert_close(got['local_model'], want['local_model'])


def _plan(task, steps=STEPS, batch=BATCH):
  return factored.plan(lambda: fedres_math.ResidualModel(task.residual_spec),
                       (True, True), steps, batch,
                       parts=fedres_math.global_model_parts)


def test_the_plan_factors_the_global_kernel_that_is_smaller():
  task = build_task()
  assert _plan(task) == (
      factored.FactoredKernel(0, STEPS, BATCH, INPUTS, UNITS),)
  # Unbounded steps, too many rows, a regularized kernel: dense.
  assert _plan(task, steps=None) == ()
  assert _plan(task, steps=4) == ()
  assert _plan(build_task(regularized=True)) == ()


@pytest.mark.parametrize('settings,steps,factors', [
    ({}, STEPS, True),
    (dict(factored_control_variates=False), STEPS, False),
    (dict(fedres_option=1), STEPS, False),
    ({}, None, False)])
def test_only_option_2_with_client_steps_keeps_factors(settings, steps,
                                                       factors):
  task = build_task(steps=steps)
  definition = registry.build('fedres_avg', task, fedres.FedResAvgSettings(
      **settings))
  state = definition.initial_client_state()
  kernel = state['control'][0] if 'control' in state else None
  if factors:
    assert [tuple(t.shape) for t in kernel] == [(STEPS * BATCH, INPUTS),
                                                (STEPS * BATCH, UNITS)]
    assert set(definition.fixed_on_resume) == {
        'factored_control_variates', 'client_steps', 'client_batch_size'}
  else:
    assert kernel is None or tuple(kernel.shape) == (INPUTS, UNITS)
  # Runs that could keep factors fix the flag: their stored c_i's form.
  assert ('factored_control_variates' in definition.fixed_on_resume) == (
      'fedres_option' not in settings and steps is not None)


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_factored_control_variates_compute_the_dense_rounds(run, runtime):
  dense = run(f'dense_{runtime}', runtime=runtime,
              factored_control_variates=False)
  factors = run(f'factored_{runtime}', runtime=runtime)
  _assert_same_rounds(factors, dense)
  # Step 1's loss, at w read from the factored kernel's layer.
  assert factors.result.last_metrics['train/loss'] == pytest.approx(
      dense.result.last_metrics['train/loss'], rel=1e-6)
  # The kernel's c_i is stored as factors, the bias's dense.
  for state in factors.states:
    assert [np.shape(e) for e in state['control'][0]] == [
        (STEPS * BATCH, INPUTS), (STEPS * BATCH, UNITS)]
  # Control variates are in play, for more than one client.
  assert sum(bool(np.any(s['control'][0])) for s in dense.states) >= 2
  assert np.abs(dense.server_control[0]).max() > 0.05


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_clients_of_one_group_compute_the_dense_rounds(tmp_path, runtime):
  # Every client each round, in one group: each client's Step 1 reads w
  # from layer variables that the client before it left at its last step,
  # and its Step 2 finds that client's rows there.
  runs = [_train(tmp_path, f'{form}', build_task(), rounds=4,
                 runtime=runtime, clients_per_round=len(CLIENT_SIZES),
                 clients_per_group=len(CLIENT_SIZES),
                 factored_control_variates=form)
          for form in (True, False)]
  _assert_same_rounds(*runs)


def _assert_equal(got, want):
  for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_shared_products_are_each_batchs_own_product(tmp_path, runtime,
                                                      monkeypatch):
  # A group's clients take the kernel's products with w and w - k eta c
  # together (factored.shared_products). One round of every client, from
  # the same w: each client's new theta_i and c_i must not depend on the
  # clients it shared them with, and must be bit for bit what the batches'
  # own products give wherever a batch has two rows or more (a one-row
  # product rounds otherwise: clients 2 and 3, to float32 rounding).
  task = build_task()
  assert factored.shareable(
      lambda: fedres_math.ResidualModel(task.residual_spec), _plan(task),
      parts=fedres_math.global_model_parts)

  def states(name, group):
    return _train(tmp_path, name, task, rounds=1, runtime=runtime,
                  clients_per_round=len(CLIENT_SIZES),
                  clients_per_group=group).states

  together, alone = states('together', len(CLIENT_SIZES)), states('alone', 1)
  monkeypatch.setattr(factored, 'shareable', lambda *args, **kwargs: False)
  own = states('own', len(CLIENT_SIZES))
  for k, size in enumerate(CLIENT_SIZES):
    _assert_equal(together[k], alone[k])
    if size % BATCH == 0:
      _assert_equal(together[k], own[k])
    else:
      _assert_close(together[k], own[k])
    # Trained: theta_i left its start.
    assert not np.array_equal(together[k]['local_model'][0],
                              own[0]['local_model'][0]) or k == 0


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_a_diverging_client_keeps_its_state_and_adds_nothing(tmp_path,
                                                             runtime):
  diverging, rounds = 2, 3
  sampled = [driver.plan_round(SEED, r, len(CLIENT_SIZES),
                               CLIENTS_PER_ROUND).client_indices
             for r in range(1, rounds + 1)]
  assert any(diverging in s for s in sampled)
  task = build_task(diverging_client=diverging)
  factors, dense = [
      _train(tmp_path, f'{form}', task, rounds=rounds, runtime=runtime,
             factored_control_variates=form) for form in (True, False)]
  _assert_close(factors.result.model_weights.trainable,
                dense.result.model_weights.trainable)
  _assert_close(factors.server_control, dense.server_control)
  for k, (got, want) in enumerate(zip(factors.states, dense.states)):
    if k == diverging:
      continue
    _assert_close(_dense_cv(got['control']), want['control'])
    _assert_close(got['local_model'], want['local_model'])
  # Never updated: the initial theta and zero factors.
  initial = fedres.initial_weights(task.residual_spec)[1]
  kept = factors.states[diverging]
  for entry in tf.nest.flatten(kept['control']):
    np.testing.assert_array_equal(entry, np.zeros_like(entry))
  for got, want in zip(kept['local_model'], initial, strict=True):
    np.testing.assert_array_equal(got, want)


def test_a_per_client_aggregator_gets_each_factored_clients_update(
    run, tmp_path):
  # The kernel's w_i - w travels as -K_i eta (c_i+ - c_i + c), c from the
  # message's `control`; a per-client aggregator gets each client's update
  # formed: robust aggregation without clipping or zeroing is the mean, and
  # the rounds equal the dense ones. (TFF's runtime: the native one runs
  # the mean only.)
  robust = factories.AggregatorSettings(
      aggregator=factories.ROBUST, clip_norm=math.inf, zeroing=False)
  robust_run = _train(tmp_path, 'robust', build_task(), aggregator=robust)
  dense = run('dense_tff', runtime='tff', factored_control_variates=False)
  _assert_close(robust_run.result.model_weights.trainable,
                dense.result.model_weights.trainable)
  _assert_close(robust_run.server_control, dense.server_control)


def test_c_stays_the_mean_of_the_stored_factored_c_i(run):
  # With every c_i starting at 0 and c += sum_S (c_i+ - c_i) / N, c is the
  # mean of all N clients' c_i, however many rounds: the sum is formed
  # from the stored factors.
  factors = run('invariant', rounds=30, client_learning_rate=0.005)
  stored = [_dense_cv(s['control']) for s in factors.states]
  for p, c in enumerate(factors.server_control):
    want = np.mean([s[p] for s in stored], axis=0)
    scale = np.abs(want).max()
    assert scale > 0
    np.testing.assert_allclose(c, want, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_a_resumed_factored_run_is_bit_identical(tmp_path, runtime):
  # The native runtime keeps the client models' variables from round to
  # round, where a resumed run starts afresh: no client may read what
  # another client left in them.
  task = build_task()
  train = lambda name, rounds: _train(tmp_path, name, task, rounds=rounds,
                                      runtime=runtime,
                                      rounds_per_checkpoint=2)
  train('resumed', 2)
  resumed = train('resumed', 4)
  straight = train('straight', 4)
  for a, b in zip(tf.nest.flatten(resumed.result.server_state),
                  tf.nest.flatten(straight.result.server_state), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(tf.nest.flatten(resumed.states),
                  tf.nest.flatten(straight.states), strict=True):
    np.testing.assert_array_equal(a, b)


def test_personalized_evaluation_and_export_read_theta_beside_factors(
    tmp_path):
  # Both read theta_i from the stored states, which hold the factored c_i
  # beside it: what they report and write equals the dense run's.
  xs, ys = scaffold_factored._arrays()  # pylint: disable=protected-access
  client = lambda client_id: int(client_id)
  batches = lambda client_id: tf.data.Dataset.from_tensor_slices(
      (xs[client(client_id)], ys[client(client_id)])).batch(BATCH)
  task = build_task()
  task = dataclasses.replace(task, personal_eval_data=base.PersonalEvalData(
      client_ids=task.train_client_ids, test_dataset_fn=batches,
      train_dataset_fn=lambda client_id, seed: batches(client_id)))
  factors, dense = [_train(tmp_path, f'{form}', task, export=True,
                           factored_control_variates=form)
                    for form in (True, False)]
  metrics = [k for k in dense.result.last_metrics
             if k.startswith('eval_personalized/')]
  assert 'eval_personalized/loss' in metrics
  for key in metrics:
    assert factors.result.last_metrics[key] == pytest.approx(
        dense.result.last_metrics[key], rel=1e-5), key
  initial = np.concatenate([np.ravel(w) for w in fedres.initial_weights(
      task.residual_spec)[1]])
  trained = 0
  for client_id, state in zip(task.train_client_ids, factors.states):
    theta, stored = fedres_export.local_weights_for(
        str(tmp_path / 'True' / 'export'), client_id)
    if not stored:
      continue
    want = np.concatenate([np.ravel(w) for w in state['local_model']])
    np.testing.assert_array_equal(theta, want)
    trained += not np.array_equal(theta, initial)
  assert trained >= 2
