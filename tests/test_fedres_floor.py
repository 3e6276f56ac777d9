"""benchmarks.fedres_floor times the algorithms it says it times: each
compiled round agrees with the float64 reference, and the check sees a 1%
change of any rate the round uses."""

import os

import pytest

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from benchmarks import fedres_floor  # pylint: disable=g-import-not-at-top


@pytest.mark.parametrize('algorithm', fedres_floor.ALGORITHMS)
def test_each_compiled_round_matches_the_reference(algorithm):
  fedres_floor.check(algorithm, steps=2, batch=3)


@pytest.mark.parametrize('algorithm, rate', [
    ('fedavg', 'LEARNING_RATE'),
    ('fedres_avg_1', 'LOCAL_LEARNING_RATE'),
    ('fedres_avg_1_stacked', 'LEARNING_RATE'),
    ('fedres_avg_2', 'POPULATION')])
def test_the_check_sees_a_round_that_computes_something_else(
    monkeypatch, algorithm, rate):
  reference = fedres_floor.reference

  def off_by_one_percent(name, workload):
    with monkeypatch.context() as patch:
      patch.setattr(fedres_floor, rate, getattr(fedres_floor, rate) * 1.01)
      return reference(name, workload)

  monkeypatch.setattr(fedres_floor, 'reference', off_by_one_percent)
  with pytest.raises(fedres_floor.MismatchError):
    fedres_floor.check(algorithm, steps=2, batch=3)
