"""The other benchmarks run and print their contract: benchmarks/state_files.py,
benchmarks/weight_passes.py and the fused floors (benchmarks/floors.py,
benchmarks/fused_floor.py), whose rounds must compute the algorithms' math.

Split from test_benchmark.py (benchmarks/rounds.py), so that `--dist
loadfile` can run the two files on different workers.
"""

import os
import re

import numpy as np
import pytest

from test_cli import run_binary


@pytest.mark.parametrize('state, megabytes', [('scaffold', '5.4'),
                                              ('fedres_avg', '6.1'),
                                              ('scaffold_factored', '0.8')])
def test_state_files_times_first_visits_and_revisits(state, megabytes):
  result = run_binary('benchmarks.state_files', '--clients_per_round=4',
                      '--rounds=2', f'--state={state}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'state files ({state}): 4 clients a round, {megabytes} MB' in (
      result.stdout), result.stdout
  for case in ('first visits', 'revisits', r'truncate and write \(write_file\)',
               'new file, renamed over the old', r'in place \(pwrite\)',
               'read'):
    assert re.search(rf'^  {case} +[0-9.]+ s/round', result.stdout,
                     re.MULTILINE), result.stdout
  assert f'4 files of {megabytes} MB a round' in result.stdout


def test_state_files_bad_clients_per_round_is_one_clear_error():
  # Once, not once per --state above: the same command either way.
  bad = run_binary('benchmarks.state_files', '--clients_per_round=0')
  assert bad.returncode == 2
  assert 'error: --clients_per_round must be >= 1, got 0' in bad.stderr


def test_weight_passes_times_each_op_over_the_model():
  result = run_binary('benchmarks.weight_passes', '--repeats=2', '--trials=1')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'one op over the benchmark model (5.4 MB)' in result.stdout
  for op in ('difference a - b', 'scaling a / s', 'in-place SGD step',
             'concat (state write)', 'serialize_tensor (state write)',
             'parse_tensor (state read)', 'new c_i + delta (TF ops)',
             'new c_i + delta (XLA-fused)'):
    assert re.search(rf'^  {re.escape(op)} +[0-9.]+ ms', result.stdout,
                     re.MULTILINE), result.stdout
  assert "the first layer's forward product" in result.stdout
  for rows in (5, 10, 20, 50, 100, 500):
    assert re.search(rf'^ +{rows} rows +[0-9.]+ ms +\( *[0-9.]+ ms per 5 '
                     r'rows\)', result.stdout, re.MULTILINE), result.stdout
  bad = run_binary('benchmarks.weight_passes', '--repeats=0')
  assert bad.returncode == 2
  assert 'error: --repeats must be >= 1, got 0' in bad.stderr


@pytest.fixture(scope='module')
def c_floor(tmp_path_factory):
  """The C floor, built once; skipped, with the reason, on a machine whose
  cc cannot build it (none, or without OpenMP)."""
  from benchmarks import floors  # pylint: disable=import-outside-toplevel
  from pipeline.errors import UsageError  # pylint: disable=import-outside-toplevel
  builds = {}

  def build(batch):
    if batch not in builds:
      try:
        builds[batch] = floors.CFloor(
            str(tmp_path_factory.mktemp(f'c_floor_{batch}')), batch)
      except UsageError as e:
        pytest.skip(str(e))
    return builds[batch]

  return build


@pytest.mark.parametrize('steps, batch', [(1, 2), (3, 5)])
@pytest.mark.parametrize('states', ['memory', 'file', 'mapped'])
def test_the_c_floor_computes_fedavg_and_scaffold(c_floor, steps, batch,
                                                  states):
  # The floors time the algorithms only if they compute them: a round of
  # the C code against a float64 NumPy reference of the math.
  from benchmarks import floors  # pylint: disable=import-outside-toplevel
  workload = floors.Workload(3, steps, batch, seed=2)
  want = floors.reference(workload)
  got = c_floor(batch).run(workload, states, 1, 2, check_only=True)
  floors.check('c', got, want)
  # SCAFFOLD's corrections change the sum, and the check sees a wrong one.
  assert not np.allclose(got[0], got[1])
  with pytest.raises(floors.MismatchError, match='new c_i of client 0'):
    floors.check('c', got[:3] + (got[3] * 1.01,), want)


def test_the_check_sees_an_error_in_the_first_layer_alone():
  # W1's values are 100x smaller than the small tensors': a bound on the
  # whole vector's largest value let a 1% error in W1 through.
  from benchmarks import floors  # pylint: disable=import-outside-toplevel
  workload = floors.Workload(2, 2, 3, seed=4)
  want = floors.reference(workload)
  floors.check('reference', want, want)
  wrong = [w.copy() for w in want]
  w1_size = floors.SHAPES[0][0] * floors.SHAPES[0][1]
  wrong[1][:w1_size] *= 1.01
  with pytest.raises(floors.MismatchError,
                     match=r'SCAFFOLD sum, tensor 0 \(21168, 64\)'):
    floors.check('wrong', wrong, want)


@pytest.mark.parametrize('states', ['memory', 'file'])
def test_the_xla_floor_computes_fedavg_and_scaffold(tmp_path, states):
  from benchmarks import floors  # pylint: disable=import-outside-toplevel
  workload = floors.Workload(3, 2, 3, seed=3)
  floor = floors.XlaFloor(2, states, str(tmp_path), threads=2)
  got = floor.run(workload, 0, check_only=True)
  floors.check('xla', got, floors.reference(workload))
  if states == 'file':  # c_i+ is what the files hold after the round.
    assert sorted(os.listdir(tmp_path)) == ['state_0', 'state_1', 'state_2']


@pytest.mark.parametrize('steps, batch', [(1, 2), (3, 5)])
def test_the_factored_floor_computes_fedavg_and_scaffold(steps, batch):
  # W1's c_i kept as factors (A^T D / K) must give the dense math's sums and
  # c_i+, clients' previous c_i with factors of their own included.
  from benchmarks import floors  # pylint: disable=import-outside-toplevel
  floor = floors.FactoredFloor(steps, batch)
  workload = floors.Workload(3, steps, batch, seed=5)
  factors = floor.factor_states(workload, seed=6)
  want = floors.reference(workload)
  got = floor.run(workload, factors, 0, check_only=True)
  floors.check('tf_factored', got, want)
  assert not np.allclose(got[0], got[1])


def test_fused_floor_prints_each_floors_ratio(c_floor):
  from benchmarks import floors as floors_lib  # pylint: disable=import-outside-toplevel
  c_floor(5)  # Skips where cc cannot build the C floors.
  result = run_binary('benchmarks.fused_floor', '--clients_per_round=3',
                      '--rounds=1')
  assert result.returncode == 0, result.stderr[-3000:]
  for floor in floors_lib.FLOORS:
    assert re.search(rf'^  {floor} +\S+ +[0-9.]+ +[0-9.]+ +-?[0-9.]+ +'
                     r'[0-9.]+x$', result.stdout, re.MULTILINE), result.stdout
  bad = run_binary('benchmarks.fused_floor', '--floors=c_memory,gpu')
  assert bad.returncode == 2
  assert ('error: --floors takes some of c_memory,c_file,c_mapped,xla,xla_file,'
          'tf_factored, got '
          'c_memory,gpu') in bad.stderr
  # 1.2 TB of inputs: refused before anything is made.
  too_large = run_binary('benchmarks.fused_floor', '--clients_per_round=100000')
  assert too_large.returncode == 2
  assert re.search(r'error: --clients_per_round=100000 .* needs about '
                   r'1253\.3 GB of RAM, [0-9.]+ GB is available',
                   too_large.stderr), too_large.stderr
