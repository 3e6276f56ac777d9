"""SCAFFOLD / FedPVR rounds against hand computation ([SCAFFOLD] Alg. 1, [FedPVR] Alg. I).

Two rounds on a linear-regression task with 2 of 4 clients sampled per round
(|S| < N, so the |S|/N rule for c and the stored c_i of a client sampled twice
matter), unequal client sizes (actual K_i and example weights matter) and
eta_s = 0.5. Expected model, server c, every stored c_i and train/loss come
from an independent float64 numpy implementation (scaffold_testlib).
"""

import numpy as np
import pytest
import tensorflow as tf

from pipeline import driver
from tff_algos.algorithms import registry
from tff_algos.algorithms import settings as settings_lib
from tff_algos.algorithms.scaffold import definition as scaffold
from tff_algos.algorithms.scaffold import math as scaffold_tf

import scaffold_testlib as lib


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  return lib.make_runner(lib.build_linear_task(),
                         str(tmp_path_factory.mktemp('scaffold_math')))


def test_reference_rounds_sample_overlapping_clients():
  plans = [set(driver.plan_round(lib.SEED, r, lib.NUM_CLIENTS,
                                 lib.CLIENTS_PER_ROUND).client_indices)
           for r in range(1, lib.ROUNDS + 1)]
  assert all(len(p) == lib.CLIENTS_PER_ROUND for p in plans)
  assert plans[0] & plans[1] and plans[0] != plans[1]


@pytest.mark.parametrize('weighting', [None, 'num_examples'])
def test_scaffold_option2_matches_hand_computation(run, weighting):
  # Default (None): the paper's uniform mean of the model deltas.
  result = run(f'scaffold2_{weighting}', 'scaffold', scaffold_option=2,
               **({'client_weighting': weighting} if weighting else {}))
  weighting = weighting or 'uniform'
  reference = lib.reference_run((True, True), option=2, weighting=weighting)
  lib.assert_close_to_reference(result, reference)
  # The control variates are really in play (else this would test FedAvg).
  assert max(np.abs(c).max() for c in reference.server_cv) > 0.05
  fedavg = lib.reference_run((False, False), option=2, weighting=weighting)
  assert not np.allclose(reference.weights[0], fedavg.weights[0], rtol=1e-3)
  # The clients' sizes differ, so the two weightings give different models.
  other = lib.reference_run(
      (True, True), option=2,
      weighting={'uniform': 'num_examples'}.get(weighting, 'uniform'))
  assert not np.allclose(reference.weights[0], other.weights[0], rtol=1e-3)


def test_scaffold_option1_uniform_matches_hand_computation(run):
  result = run('scaffold1_uniform', 'scaffold', scaffold_option=1,
               client_weighting='uniform')
  reference = lib.reference_run((True, True), option=1, weighting='uniform')
  lib.assert_close_to_reference(result, reference)
  option2 = lib.reference_run((True, True), option=2, weighting='uniform')
  assert not np.allclose(reference.weights[0], option2.weights[0], rtol=1e-3)


def test_fedpvr_partial_mask_matches_hand_computation(run):
  # Control variates on the bias only (trainable variable 1 of 2): the kernel
  # takes plain SGD steps, the bias SCAFFOLD's corrected steps.
  result = run('fedpvr_bias', 'fedpvr', pvr_start_variable=1,
               drift_diversity=True)
  reference = lib.reference_run((False, True), option=2, weighting='uniform')
  lib.assert_close_to_reference(result, reference)
  assert [np.shape(c) for c in result.result.server_state[
      'control_variate']] == [(1,)]
  for other_mask in ((True, True), (False, False)):
    other = lib.reference_run(other_mask, option=2, weighting='uniform')
    assert not np.allclose(reference.weights[0], other.weights[0], rtol=1e-4)


# Both options' c_i and both runtimes: 2 of the 4 unequal clients a round
# (K_i = 2, 3, 1, 3 steps of one epoch), clients weighted uniformly.
@pytest.mark.parametrize('algorithm,overrides', [
    ('scaffold', {}),
    ('scaffold', {'scaffold_option': 1}),
    ('fedpvr', {'pvr_start_variable': 1})],
                         ids=['scaffold_option2', 'scaffold_option1',
                              'fedpvr_bias'])
@pytest.mark.parametrize('runtime', ['tff', 'native'])
def test_server_control_variate_is_the_mean_of_all_client_control_variates(
    run, algorithm, overrides, runtime):
  rounds = 5
  name = f'invariant_{algorithm}_{runtime}_' + '_'.join(
      f'{k}{v}' for k, v in overrides.items())
  result = run(name, algorithm, rounds=rounds, runtime=runtime, **overrides)
  # Every client sampled at least once, one of them more often.
  sampled = [set(driver.plan_round(lib.SEED, r, lib.NUM_CLIENTS,
                                   lib.CLIENTS_PER_ROUND).client_indices)
             for r in range(1, rounds + 1)]
  assert set().union(*sampled) == set(range(lib.NUM_CLIENTS))
  server_cv = result.result.server_state['control_variate']
  assert max(np.abs(c).max() for c in server_cv) > 0.05
  for j, c in enumerate(server_cv):
    mean_of_clients = np.mean(
        [result.client_cvs[k][j] for k in range(lib.NUM_CLIENTS)], axis=0)
    np.testing.assert_allclose(c, mean_of_clients, rtol=1e-5, atol=1e-6)


def test_fedpvr_drift_diversity_and_communication_metrics(run):
  result = run('fedpvr_bias', 'fedpvr', pvr_start_variable=1,
               drift_diversity=True)
  reference = lib.reference_run((False, True), option=2, weighting='uniform')
  # The linear model is one layer (kernel and bias).
  np.testing.assert_allclose(result.columns['drift_diversity/layer_0'],
                             reference.drift_diversity, rtol=1e-5)
  # d = 3 model floats, v = 1 masked, 4 bytes each: each client receives x
  # and c, and sends y - x, c_i+ - c_i, its weight and metric sums: FedAvg's
  # upload plus c_i+ - c_i.
  np.testing.assert_array_equal(
      result.columns['communication/bytes_down_per_client'], 4 * (3 + 1))
  fedavg = run('fedavg', 'fedavg')
  np.testing.assert_array_equal(
      result.columns['communication/bytes_up_per_client'],
      np.asarray(fedavg.columns['communication/bytes_up_per_client']) + 4)


# Masks and drift diversity (no TFF).


def test_variable_layers_group_by_owning_layer():
  names = ['dense/kernel:0', 'dense/bias:0', 'bn/gamma:0', 'bn/beta:0',
           'block/conv/kernel:0', 'block/dense_2/kernel:0',
           'block/dense_2/bias:0', 'free_variable:0', 'out/kernel:0']
  assert scaffold_tf.variable_layers(names) == (0, 0, 1, 1, 2, 3, 3, 4, 5)


@pytest.mark.parametrize('last_layers,expected', [
    (0, (False,) * 5),
    (1, (False, False, False, True, True)),
    (2, (False, False, True, True, True)),
    (3, (True,) * 5),
    (10, (True,) * 5)])
def test_mask_of_last_layers(last_layers, expected):
  names = ['d/kernel:0', 'd/bias:0', 'e/kernel:0', 'f/kernel:0', 'f/bias:0']
  assert scaffold_tf.control_variate_mask(
      names, last_layers=last_layers) == expected


def test_mask_from_start_variable_and_bad_values():
  names = ['d/kernel:0', 'd/bias:0', 'e/kernel:0']
  assert scaffold_tf.control_variate_mask(names, start_variable=1) == (
      False, True, True)
  assert scaffold_tf.control_variate_mask(names, start_variable=3) == (
      False, False, False)
  with pytest.raises(ValueError, match='start_variable=4 is out of range'):
    scaffold_tf.control_variate_mask(names, start_variable=4)
  with pytest.raises(ValueError, match='last_layers must be >= 0'):
    scaffold_tf.control_variate_mask(names, last_layers=-1)
  # The settings name the flag the binaries report.
  with pytest.raises(settings_lib.SettingError, match='pvr_start_variable'):
    registry.build('fedpvr', lib.build_linear_task(),
                   scaffold.FedPvrSettings(pvr_start_variable=3))
  with pytest.raises(settings_lib.SettingError, match='pvr_last_layers'):
    scaffold.FedPvrSettings(pvr_last_layers=-1)


def test_drift_diversity_per_layer():
  rng = np.random.default_rng(0)
  layer_of_variable = (0, 0, 1)
  deltas = [[rng.normal(size=(3, 2)), rng.normal(size=2), rng.normal(size=4)]
            for _ in range(5)]
  sq_norms = sum(scaffold_tf.layer_squared_norms(
      [tf.constant(t, tf.float32) for t in d], layer_of_variable).numpy()
                 for d in deltas)
  sums = [tf.constant(sum(d[j] for d in deltas), tf.float32)
          for j in range(3)]
  xi = scaffold_tf.drift_diversity(tf.constant(sq_norms), sums,
                                   layer_of_variable).numpy()
  for layer, parts in ((0, (0, 1)), (1, (2,))):
    numerator = sum(sum(np.sum(d[j]**2) for j in parts) for d in deltas)
    denominator = sum(np.sum(sum(d[j] for d in deltas)**2) for j in parts)
    np.testing.assert_allclose(xi[layer], numerator / denominator, rtol=1e-5)
  # Five identical updates: xi = 1/5, its minimum.
  one = tf.ones([3])
  xi_same = scaffold_tf.drift_diversity(tf.constant([5 * 3.0]), [5 * one],
                                        (0,)).numpy()
  np.testing.assert_allclose(xi_same, [1 / 5], rtol=1e-6)
