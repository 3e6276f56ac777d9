"""--aggregator: tff.aggregators for every algorithm's model update.

- robust with no clipping (inf) and no zeroing gives exactly the mean's
  results, and dp without noise and with a clip above every update gives
  them up to float rounding, for every algorithm (the mean run with groups of
  one client, as the aggregators run, so float sums add in the same order);
- dp's epsilon is dp_accounting's, and what the aggregator reports it added;
- a dp run with noise resumes bit-identically (noise included);
- compression's seeded quantization: tensor_encoding's uniform quantization
  within one step, unbiased, the same draws for the same (seed, round,
  tensor), exact sums of small tensors; a compression run repeats itself and
  resumes bit-identically;
- DP mixed FL runs end to end through binaries.train on celeba_smile
  synthetic data and logs epsilon every round;
- usage errors of the aggregator flags.
"""

import csv
import math
import os

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from absl import flags

from binaries import flags_lib
from pipeline import driver
from tasks import base
from tff_algos.aggregation import accounting
from tff_algos.aggregation import factories
from tff_algos.aggregation import seeded_quantization
from tff_algos.algorithms import registry
from tff_algos.algorithms import settings as settings_lib
import fault_testlib
import fedres_testing
import test_native_runtime

FLAGS = flags.FLAGS
CLIENTS_PER_ROUND = 3
# One round per run: the aggregators' equalities hold round by round (their
# state across rounds is the resume test's).
ROUNDS = 1

# One case per algorithm (the parity cases' variants, `<name>_option_...`,
# are left out).
SETTINGS = {name: settings
            for name, settings in test_native_runtime.CONFIGS.items()
            if '_option_' not in name}
SETTINGS.update(test_native_runtime.FEDRES_CONFIGS)


@pytest.fixture(scope='module')
def tasks():
  # K = 2 steps of 2 examples: every client processes 4 examples, so the
  # example-weighted mean equals the DP (uniform) mean.
  return {'tiny': test_native_runtime.tiny_task(client_steps=2),
          'fedres': fedres_testing.linear_task(
              fedres_testing.client_data(seed=1, sizes=(4, 6, 2, 5)),
              base.DataConfig(client_batch_size=2, client_steps=2))}


def _train(name, tasks, directory, aggregator=None, total_rounds=ROUNDS,
           rounds_per_checkpoint=ROUNDS, round_metrics=None):
  task = tasks['fedres' if name.startswith('fedres_') else 'tiny']
  definition = registry.build(name, task, SETTINGS[name])
  factory = None if aggregator is None else factories.build(
      aggregator, CLIENTS_PER_ROUND)
  config = driver.RunConfig(
      root_output_dir=str(directory), experiment_name='run',
      total_rounds=total_rounds, clients_per_round=CLIENTS_PER_ROUND,
      rounds_per_eval=total_rounds, rounds_per_checkpoint=rounds_per_checkpoint,
      seed=5, clients_per_group=1, export=False)
  return driver.train(definition, task, config, model_aggregator=factory,
                      round_metrics=round_metrics)


def _flat(structure):
  return [np.asarray(v) for v in tf.nest.flatten(structure)]


_MEAN_RUNS = {}


def _mean_run(name, tasks, tmp_path_factory):
  if name not in _MEAN_RUNS:
    _MEAN_RUNS[name] = _train(name, tasks, tmp_path_factory.mktemp('mean'))
  return _MEAN_RUNS[name]


def _assert_same_model_and_metrics(run, reference, **tolerance):
  exact = not tolerance
  for got, want in zip(_flat(run.model_weights), _flat(reference.model_weights)):
    if exact:
      np.testing.assert_array_equal(got, want)
    else:
      np.testing.assert_allclose(got, want, **tolerance)
  train_metrics = [k for k in reference.last_metrics if k.startswith('train/')]
  assert train_metrics
  for key in train_metrics:
    if exact:
      assert run.last_metrics[key] == reference.last_metrics[key], key
    else:
      assert run.last_metrics[key] == pytest.approx(
          reference.last_metrics[key], rel=1e-4, abs=1e-5), key


# One algorithm of each family (its round definition's own aggregation
# inputs); every algorithm goes through an aggregator below (DP).
ROBUST_NAMES = ('fedavg', 'scaffold', 'mixed_2wgt', 'fedres_avg')


@pytest.mark.parametrize('name', ROBUST_NAMES)
def test_robust_without_clipping_or_zeroing_is_the_mean(name, tasks,
                                                        tmp_path_factory):
  robust = factories.AggregatorSettings(aggregator=factories.ROBUST,
                                        clip_norm=math.inf, zeroing=False)
  run = _train(name, tasks, tmp_path_factory.mktemp('robust'), robust)
  _assert_same_model_and_metrics(run, _mean_run(name, tasks, tmp_path_factory))
  assert 'aggregator/mean_value' not in run.last_metrics  # Empty ones.
  assert 'global_model_weights' in run.server_state
  assert 'aggregator' in run.server_state


@pytest.mark.parametrize('name', sorted(SETTINGS))
def test_dp_without_noise_is_the_mean_up_to_rounding(name, tasks,
                                                     tmp_path_factory):
  dp = factories.AggregatorSettings(aggregator=factories.DP, clip_norm=1e6,
                                    dp_noise_multiplier=0.0)
  run = _train(name, tasks, tmp_path_factory.mktemp('dp'), dp)
  reference = _mean_run(name, tasks, tmp_path_factory)
  _assert_same_model_and_metrics(run, reference, rtol=1e-5, atol=1e-6)
  # The training moved the model, so the comparison says something.
  initial = _flat(driver.initial_model_weights(
      tasks['fedres' if name.startswith('fedres_') else 'tiny'], 5))
  assert any(not np.allclose(a, b)
             for a, b in zip(_flat(run.model_weights), initial))
  assert run.last_metrics['aggregator/dp_query_metrics/clip_norm'] == 1e6


def _direct_epsilon(noise_multiplier, population, sample, rounds, delta):
  # Round by round, as the driver samples: a fixed-size sample without
  # replacement; replacing one client moves the clipped sum by 2 * clip.
  accountant = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  for _ in range(rounds):
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        population, sample, dp_accounting.GaussianDpEvent(
            noise_multiplier / 2)))
  return accountant.get_epsilon(delta)


def test_epsilon_is_dp_accountings():
  spent = accounting.accounting(1.1, population=500, clients_per_round=20)
  assert spent.target_delta == 1 / 500
  for rounds in (1, 3):
    assert spent.epsilon(rounds) == pytest.approx(
        _direct_epsilon(1.1, 500, 20, rounds, 1 / 500), rel=1e-12)
  assert spent.epsilon(30) > spent.epsilon(3) > spent.epsilon(1) > 0
  assert math.isinf(accounting.accounting(0.0, 500, 20).epsilon(3))


def test_an_epsilon_past_float32_is_inf():
  # With noise near 0 epsilon exceeds float32 after a few rounds; logged as
  # such it failed TensorBoard's write (a crash at every re-run).
  spent = accounting.accounting(2e-19, population=10, clients_per_round=2)
  assert math.isfinite(spent.epsilon(1))
  assert math.isinf(spent.epsilon(4))
  assert math.isinf(spent.epsilon(40))


def test_dp_resume_is_bit_identical(tasks, tmp_path, tmp_path_factory):
  # SCAFFOLD: client states too; noise large enough to matter.
  dp = factories.AggregatorSettings(aggregator=factories.DP, clip_norm=0.5,
                                    dp_noise_multiplier=1.0, noise_seed=3)
  spent = accounting.accounting(1.0, 6, CLIENTS_PER_ROUND)

  def epsilon(round_num):
    return {accounting.EPSILON_METRIC: spent.epsilon(round_num)}

  whole = _train('scaffold', tasks, tmp_path / 'whole', dp, total_rounds=2,
                 round_metrics=epsilon)
  first = _train('scaffold', tasks, tmp_path / 'parts', dp, total_rounds=1,
                 rounds_per_checkpoint=1, round_metrics=epsilon)
  resumed = _train('scaffold', tasks, tmp_path / 'parts', dp, total_rounds=2,
                   round_metrics=epsilon)
  for got, want in zip(_flat(resumed.server_state), _flat(whole.server_state)):
    np.testing.assert_array_equal(got, want)
  for key, value in whole.last_metrics.items():
    if not key.endswith('_seconds'):
      assert resumed.last_metrics[key] == value, key
  assert whole.last_metrics[accounting.EPSILON_METRIC] == spent.epsilon(2)
  # Two rounds released noise twice, each with the flags' z.
  numerator = resumed.server_state['aggregator'].query_state.numerator_state
  assert int(numerator.releases) == 2
  assert float(resumed.server_state['aggregator'].dp_event.noise_multiplier
               ) == pytest.approx(1.0)
  # The aggregator (clip, noise) acted: the first round is not the mean's.
  mean = _mean_run('scaffold', tasks, tmp_path_factory)
  assert any(not np.allclose(a, b) for a, b in zip(
      _flat(first.model_weights), _flat(mean.model_weights)))


def test_quantized_is_within_one_step_unbiased_and_seeded():
  x = tf.constant(np.random.default_rng(0).normal(size=200), tf.float32)
  step = (float(tf.reduce_max(x)) - float(tf.reduce_min(x))) / 15
  draws = np.stack([seeded_quantization.quantized(
      x, 4, tf.constant([7, r], tf.int64)).numpy() for r in range(400)])
  assert np.all(np.abs(draws - x.numpy()) <= step * (1 + 1e-5))
  # Unbiased: the mean of 400 draws is within a tenth of a step of x (a
  # rounding that always went down or to the nearest would be off by up to a
  # half step on average: this checks the draws are random in the right way).
  assert np.mean(np.abs(draws.mean(axis=0) - x.numpy())) < 0.1 * step
  assert np.mean(np.abs(draws[0] - x.numpy())) > 0.1 * step
  again = seeded_quantization.quantized(x, 4, tf.constant([7, 0], tf.int64))
  np.testing.assert_array_equal(again.numpy(), draws[0])
  assert not np.array_equal(draws[0], draws[1])
  # Another tensor (another client's) draws its own uniforms with the same
  # key: 1 bit, halves rounded to 0 or 1 by the draws.
  halves = np.full(1000, 0.5, np.float32)
  halves[:2] = 0.0, 1.0
  other = halves.copy()
  other[2] = 0.25
  key = tf.constant([7, 0], tf.int64)
  rounded = seeded_quantization.quantized(tf.constant(halves), 1, key).numpy()
  rounded_other = seeded_quantization.quantized(tf.constant(other), 1,
                                                key).numpy()
  assert 300 < np.sum(rounded[3:]) < 700
  assert not np.array_equal(rounded[3:], rounded_other[3:])
  constant = tf.fill([30], 2.5)
  np.testing.assert_array_equal(
      seeded_quantization.quantized(constant, 8, tf.constant([1, 1], tf.int64)
                                    ).numpy(), constant.numpy())


def test_seeded_quantized_sum_repeats_per_round_and_sums_small_tensors():
  value_type = tff.types.tensorflow_to_type(
      [tf.TensorSpec([64], tf.float32), tf.TensorSpec([3], tf.float32)])
  process = seeded_quantization.SeededQuantizedSumFactory(
      bits=2, threshold=10, seed=5).create(value_type)
  rng = np.random.default_rng(1)
  clients = [[rng.normal(size=64).astype(np.float32),
              rng.normal(size=3).astype(np.float32)] for _ in range(3)]
  state = process.initialize()
  first = process.next(state, clients)
  again = process.next(state, clients)
  np.testing.assert_array_equal(first.result[0], again.result[0])
  np.testing.assert_allclose(first.result[1], sum(c[1] for c in clients),
                             rtol=1e-6)
  exact = sum(c[0] for c in clients)
  steps = sum((c[0].max() - c[0].min()) / 3 for c in clients)
  assert np.all(np.abs(first.result[0] - exact) <= steps * (1 + 1e-5))
  assert not np.allclose(first.result[0], exact)  # It quantized.
  assert int(first.state['round']) == 1
  second = process.next(first.state, clients)
  assert not np.array_equal(second.result[0], first.result[0])


def test_compression_run_repeats_itself_and_resumes_bit_identically(
    tasks, tmp_path, tmp_path_factory, monkeypatch):
  # Every tensor of the tiny model quantized (threshold 0), to 2 bits.
  monkeypatch.setattr(factories, 'COMPRESSION_THRESHOLD', 0)
  compression = factories.AggregatorSettings(
      aggregator=factories.COMPRESSION, clip_norm=math.inf, zeroing=False,
      compression_bits=2, noise_seed=3)
  whole = _train('fedavg', tasks, tmp_path / 'whole', compression,
                 total_rounds=2)
  repeated = _train('fedavg', tasks, tmp_path / 'repeated', compression,
                    total_rounds=2)
  first = _train('fedavg', tasks, tmp_path / 'parts', compression,
                 total_rounds=1, rounds_per_checkpoint=1)
  resumed = _train('fedavg', tasks, tmp_path / 'parts', compression,
                   total_rounds=2)
  for run in (repeated, resumed):
    for got, want in zip(_flat(run.server_state), _flat(whole.server_state)):
      np.testing.assert_array_equal(got, want)
  # The quantization acted: the first round is not the mean's (the
  # threshold patched above applies to the compression factory alone).
  mean = _mean_run('fedavg', tasks, tmp_path_factory)
  assert any(not np.allclose(a, b) for a, b in zip(
      _flat(first.model_weights), _flat(mean.model_weights)))


def _train_cli(*args):
  return fault_testlib.run_binary('binaries.train', *args)


def test_dp_mixed_fl_on_celeba_logs_epsilon_every_round(tmp_path):
  result = _train_cli(
      '--task=celeba_smile', '--algorithm=mixed_pt', '--use_synthetic_data',
      '--experiment_name=dp', f'--root_output_dir={tmp_path}',
      '--total_rounds=2', '--clients_per_round=4', '--aggregator=dp',
      '--dp_noise_multiplier=0.8', '--clip_norm=0.3')
  assert result.returncode == 0, result.stderr
  with open(tmp_path / 'dp' / 'metrics.csv') as f:
    rows = list(csv.DictReader(f))
  assert [int(r['round_num']) for r in rows] == [1, 2]
  population = 20  # celeba_smile's synthetic train clients.
  for row in rows:
    assert float(row[accounting.EPSILON_METRIC]) == pytest.approx(
        _direct_epsilon(0.8, population, 4, int(row['round_num']),
                        1 / population), rel=1e-9)
    assert float(row['aggregator/dp_query_metrics/noise_stddev']
                 ) == pytest.approx(0.8 * 0.3)
    assert math.isfinite(float(row['train/loss']))
  assert 'privacy/epsilon=' in result.stderr + result.stdout

  # The checkpoints hold the DP state (clip, noise), and epsilon covers every
  # round with one noise multiplier and sampling rate: a resume that changes
  # them would log a wrong epsilon, so it is refused even when flag changes
  # are allowed, and the run is left as it was.
  before = fault_testlib.tree_digest(tmp_path / 'dp')
  for change in ('--dp_noise_multiplier=5', '--clip_norm=1',
                 '--clients_per_round=5', '--aggregator=robust'):
    args = ['--dp_noise_multiplier=0.8', '--clip_norm=0.3',
            '--clients_per_round=4', '--aggregator=dp']
    args = [a for a in args if a.split('=')[0] != change.split('=')[0]]
    if change == '--aggregator=robust':
      args = ['--clients_per_round=4']
    refused = _train_cli(
        '--task=celeba_smile', '--algorithm=mixed_pt', '--use_synthetic_data',
        '--experiment_name=dp', f'--root_output_dir={tmp_path}',
        '--total_rounds=3', '--allow_flag_changes', change, *args)
    assert refused.returncode == 2, refused.stderr
    error = refused.stderr.strip().splitlines()
    assert len(error) == 1 and 'cannot change in a run' in error[0], error
    assert change.split('=')[0] in error[0]
    assert fault_testlib.tree_digest(tmp_path / 'dp') == before


@pytest.fixture
def parse_flags():
  def parse(*args):
    FLAGS.unparse_flags()
    FLAGS(['train', '--task=fedres_toy', '--algorithm=fedavg', *args])

  yield parse
  FLAGS.unparse_flags()


class _Task:
  num_train_clients = 40


@pytest.mark.parametrize('args, error', [
    (('--aggregator=dp', '--runtime=native', '--dp_noise_multiplier=1',
      '--clip_norm=1'), '--aggregator=dp runs only under --runtime=tff'),
    (('--dp_noise_multiplier=1',),
     '--dp_noise_multiplier does not apply to --aggregator=mean'),
    (('--aggregator=robust', '--dp_target_delta=0.1'),
     '--dp_target_delta does not apply to --aggregator=robust'),
    (('--aggregator=dp', '--clip_norm=1'),
     '--dp_noise_multiplier is needed by --aggregator=dp'),
    (('--aggregator=dp', '--dp_noise_multiplier=1'),
     '--clip_norm must be a finite number > 0 with --aggregator=dp'),
    (('--aggregator=robust', '--clip_norm=0'), '--clip_norm must be > 0'),
    (('--aggregator=secure', '--clients_per_group=4'),
     '--clients_per_group=4 does not apply to --aggregator=secure'),
    # Its threshold is estimated without noise: epsilon would not hold.
    (('--aggregator=dp', '--dp_noise_multiplier=1', '--clip_norm=1',
      '--zeroing'), '--zeroing does not apply to --aggregator=dp'),
    # The DP mean is unweighted: the weighting would be recorded, not used.
    (('--aggregator=dp', '--dp_noise_multiplier=1', '--clip_norm=1',
      '--client_weighting=num_examples'),
     '--client_weighting=num_examples does not apply to --aggregator=dp'),
])
def test_aggregator_flag_errors(parse_flags, args, error):
  parse_flags(*args)
  with pytest.raises(flags_lib.UsageError, match=error):
    flags_lib.aggregator_settings(_Task())


def test_dp_defaults_are_recorded(parse_flags):
  parse_flags('--aggregator=dp', '--dp_noise_multiplier=1.5',
              '--clip_norm=0.2', '--clients_per_round=8', '--seed=4')
  settings = flags_lib.aggregator_settings(_Task())
  assert (settings.dp_clients_per_round, settings.dp_target_delta,
          settings.noise_seed, settings.uses_zeroing) == (8, 1 / 40, 4, False)
  values = flags_lib.all_values()
  assert (values['aggregator'], values['dp_clients_per_round'],
          values['dp_target_delta']) == ('dp', 8, 1 / 40)


def test_dp_takes_uniform_weighting_and_no_zeroing(parse_flags):
  parse_flags('--aggregator=dp', '--dp_noise_multiplier=1', '--clip_norm=1',
              '--client_weighting=uniform')
  assert not flags_lib.aggregator_settings(_Task()).uses_zeroing
  with pytest.raises(settings_lib.SettingError,
                     match='zeroing does not apply to --aggregator=dp'):
    factories.AggregatorSettings(aggregator=factories.DP, clip_norm=1.0,
                                 dp_noise_multiplier=1.0, zeroing=True)


def test_mean_is_the_runtimes_own():
  assert factories.build(factories.AggregatorSettings(), 10) is None
