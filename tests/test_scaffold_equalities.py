"""SCAFFOLD / FedPVR special cases, equal to float rounding.

On the linear task of scaffold_testlib (unequal clients, 2 of 4 sampled per
round, eta_s = 0.5), through `pipeline.driver.train`, comparing the final
model weights and metrics.csv's train/loss (1e-6 relative):
  fedpvr --pvr_last_layers=0 == fedavg. The fedavg baseline is tff.learning's
    build_weighted_fed_avg, which by default (as [FedAvg]) weights clients by
    examples processed; fedpvr and scaffold default to their papers' uniform
    mean, so they are run with `--client_weighting=num_examples` here, and
    the clients process different numbers of examples, so the weighting is
    compared.
  fedpvr with every variable masked == scaffold Option II.
  scaffold with c and every c_i forced to zero each round == fedavg.
"""

import collections
import dataclasses

import numpy as np
import pytest
import tensorflow as tf


import scaffold_testlib as lib


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  return lib.make_runner(lib.build_linear_task(),
                         str(tmp_path_factory.mktemp('scaffold_equalities')))


def test_fedpvr_without_mask_equals_fedavg(run):
  fedavg = run('fedavg', 'fedavg')
  fedpvr = run('fedpvr_L0', 'fedpvr', pvr_last_layers=0,
               client_weighting='num_examples')
  lib.assert_equal_runs(fedpvr, fedavg)
  assert fedpvr.result.server_state['control_variate'] == []
  lib.assert_close_to_reference(fedavg, lib.reference_run(
      (False, False), option=2, weighting='num_examples'))


def test_fedpvr_masking_everything_equals_scaffold_option2(run):
  scaffold = run('scaffold2', 'scaffold', scaffold_option=2)
  fedpvr = run('fedpvr_all', 'fedpvr', pvr_last_layers=99)
  lib.assert_equal_runs(fedpvr, scaffold)
  for x, y in zip(fedpvr.result.server_state['control_variate'],
                  scaffold.result.server_state['control_variate'],
                  strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def with_control_variates_zeroed(definition):
  """The same round, with c and every c_i set to zero before each round."""

  def zeroed(control_variates):
    return [tf.zeros_like(c) for c in control_variates]

  def broadcast(state, central):
    message = collections.OrderedDict(definition.broadcast(state, central))
    message['control_variate'] = zeroed(message['control_variate'])
    return message

  def with_zeroed_state(function):
    def call(context, message, client_state, *args):
      return function(context, message, collections.OrderedDict(
          control_variate=zeroed(client_state['control_variate'])), *args)
    return call

  work = definition.client_work
  return dataclasses.replace(
      definition, broadcast=broadcast,
      client_work=dataclasses.replace(
          work, start=with_zeroed_state(work.start),
          steps=tuple(with_zeroed_state(f) for f in work.steps),
          finish=with_zeroed_state(work.finish),
          end_pass=(None if work.end_pass is None else
                    tuple(with_zeroed_state(f) for f in work.end_pass))))


def test_scaffold_with_zero_control_variates_equals_fedavg(run):
  fedavg = run('fedavg', 'fedavg')
  zeroed = run('scaffold_zeroed', 'scaffold', client_weighting='num_examples',
               wrap=with_control_variates_zeroed)
  lib.assert_equal_runs(zeroed, fedavg)
  # Without forcing, SCAFFOLD departs from FedAvg after the first round.
  scaffold = run('scaffold2', 'scaffold', scaffold_option=2)
  assert not np.allclose(lib.weights(scaffold)[0], lib.weights(fedavg)[0],
                         rtol=1e-4)
