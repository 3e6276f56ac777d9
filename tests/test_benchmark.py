"""benchmarks/rounds.py runs its measurements and prints its contract.

Only that it runs: its figures are measurements of this machine, not
something a test can hold to a bound.
"""

import os
import re

import numpy as np
import pytest

import fault_testlib
from test_cli import run_binary


# benchmarks.rounds imported once: each run a process of its own without
# TensorFlow's import. Its measurements still run as
# `python -m benchmarks.rounds --child=...` processes.
rounds = fault_testlib.preloaded_runs('benchmarks.rounds')

LAST_LINE = re.compile(r'ratio_tff_over_bound=(\S+) ratio_naive_over_tff=(\S+) '
                       r'peak_rss_mb=(\d+)$')


def test_quick_run_prints_the_ratios_line(rounds):
  # The modes of the ratio lines; the central-mode test below runs native.
  result = rounds('--quick', '--modes=tff,naive,bound', '--clients_per_round=3',
                  '--population=6')
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  match = LAST_LINE.match(lines[-1])
  assert match, lines[-1]
  tff_over_bound, naive_over_tff, peak_rss_mb = match.groups()
  assert float(tff_over_bound) > 0 and float(naive_over_tff) > 0
  assert int(peak_rss_mb) > 0
  assert lines[-2].startswith('ratio_naive_over_bound=')
  for mode in ('tff', 'naive', 'bound'):
    assert any(line.strip().startswith(f'{mode} ') and 's/round' in line
               for line in lines), mode
  # The (a) lines parse as the peer comparison reads them.
  from benchmarks.peers import compare  # pylint: disable=import-outside-toplevel
  records = compare.parse_project_output(result.stdout)
  assert [(r['algorithm'], r['clients']) for r in records] == [('fedavg', 3)]
  assert records[0]['seconds_per_round'] > 0 and records[0]['peak_rss_mb'] > 0
  # Every measurement's CPU time a round, its child's and workers'.
  cpu = re.findall(r'^\s*(?:tff|naive|bound)\s+fedavg\s+3 clients:.* CPU '
                   r'([\d.]+) s/round$', result.stdout, re.MULTILINE)
  assert len(cpu) == 3 and all(float(c) > 0 for c in cpu), result.stdout


def test_cpu_seconds_count_the_measured_process_descendants():
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import psutil  # pylint: disable=import-outside-toplevel
  from binaries import process_memory  # pylint: disable=import-outside-toplevel
  # A child (as a TFF worker) that spends 1 s of CPU, then waits: its CPU
  # counts while it lives.
  spin = ('import time\nstart = time.process_time()\n'
          'while time.process_time() - start < 1.0:\n  pass\n'
          'print("spent", flush=True)\ntime.sleep(60)\n')
  before = process_memory.cpu_seconds(psutil.Process())
  child = subprocess.Popen([sys.executable, '-c', spin],
                           stdout=subprocess.PIPE, text=True)
  try:
    assert child.stdout.readline().strip() == 'spent'
    spent = process_memory.cpu_seconds(psutil.Process()) - before
  finally:
    child.kill()
    child.wait()
    child.stdout.close()
  # /proc counts in clock ticks (10 ms).
  assert spent >= 0.95, spent


@pytest.mark.parametrize('flag, message', [
    ('--bound_threads=-1', '--bound_threads must be >= 0, got -1'),
    # A ValueError traceback.
    ('--sweep_clients=10,x', '--sweep_clients=10,x must be integers'),
    # K=0 timed empty rounds; K<0 never ended.
    ('--client_steps=0', '--client_steps must be >= 1, got 0'),
    ('--client_steps=-3', '--client_steps must be >= 1, got -3'),
    # Each was a RuntimeError traceback around the measuring child's error.
    ('--client_batch_size=0', '--client_batch_size must be >= 1, got 0'),
    ('--num_workers=0', '--num_workers must be >= 1, got 0'),
    ('--clients_per_group=-1', '--clients_per_group must be >= 0, got -1'),
    # Both were accepted (the naive baseline still ran).
    ('--clients_per_subround=-5', '--clients_per_subround must be >= 0, got '
     '-5'),
    ('--naive_max_clients=-1', '--naive_max_clients must be >= 0, got -1'),
    ('--repeats=0', '--repeats must be >= 1, got 0'),
])
def test_impossible_values_are_one_clear_error(rounds, flag, message):
  result = rounds('--quick', flag)
  assert (result.returncode, result.stderr) == (2, f'error: {message}\n')


def test_a_measuring_childs_refusal_is_its_one_line(rounds):
  # A RuntimeError traceback around the child's error line.
  result = rounds('--quick', '--modes=native', '--sweep_algorithms=fedavg',
                  '--client_batch_size=3000000000')
  assert result.returncode == 2, result.stderr[-3000:]
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith('error: --client_batch_size=3000000000 '), line


def test_unknown_mode_is_one_clear_error(rounds):
  result = rounds('--modes=tff,fast')
  assert result.returncode == 2
  assert 'error: --modes=tff,fast must name some of tff, native, naive, bound' in (
      result.stdout + result.stderr)


def test_stateful_bounds_run_revisited_clients_and_print_their_ratios(rounds):
  # 3 of 6 clients over 3 rounds: some clients read the state they wrote.
  # Both stateful bounds in one run (each its own measuring child, as with
  # one algorithm a run), sharing the parent and FedAvg's bound.
  algorithms = ('scaffold', 'fedres_avg')
  result = rounds('--quick', '--modes=bound', '--clients_per_round=3',
                  '--population=6', '--sweep_clients=3',
                  f'--sweep_algorithms={",".join(algorithms)}', '--rounds=2')
  assert result.returncode == 0, result.stderr[-3000:]
  for algorithm in algorithms:
    assert re.search(rf'^\s*bound\s+{algorithm}\s+3 clients:', result.stdout,
                     re.MULTILINE), (algorithm, result.stdout)
    assert re.search(rf'{algorithm} / fedavg, bound, 3 clients: round time '
                     r'x[\d.]+, CPU time x[\d.]+, peak RSS x[\d.]+',
                     result.stdout), (
                         algorithm, result.stdout)


def test_unknown_algorithm_is_one_clear_error(rounds):
  result = rounds('--sweep_algorithms=fedavg,scafold')
  assert result.returncode == 2
  assert "error: --sweep_algorithms: 'scafold' is unknown" in (
      result.stdout + result.stderr)


@pytest.mark.parametrize('make_root, problem', [
    # A missing directory was called "not a writable directory".
    (lambda tmp: str(tmp / 'missing'), 'does not exist (make it first)'),
    (lambda tmp: str((tmp / 'file').write_text('x') and tmp / 'file'),
     'is not a directory'),
])
def test_unusable_run_root_is_one_clear_error(rounds, tmp_path, make_root,
                                              problem):
  root = make_root(tmp_path)
  result = rounds('--quick', f'--run_root={root}')
  assert result.returncode == 2
  assert result.stderr.strip() == (
      f'error: --run_root={root} {problem}'), result.stderr


@pytest.mark.skipif(not os.access('/proc', os.W_OK | os.X_OK),
                    reason='/proc is writable by its mode only for root')
def test_a_run_root_that_holds_no_directory_is_an_environment_fault(
    rounds):
  # Writable by its mode, but the kernel makes nothing in /proc: the first
  # measurement's mkdtemp was a FileNotFoundError traceback.
  result = rounds('--quick', '--run_root=/proc')
  assert (result.returncode, result.stderr) == (
      3, "error: --run_root=/proc cannot hold the runs' directories (No such "
      'file or directory); use another --run_root\n')


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


def test_repeats_alternate_and_report_the_median_ratio(rounds):
  result = rounds('--quick', '--modes=native', '--clients_per_round=3',
                  '--population=6', '--sweep_clients=3',
                  '--sweep_algorithms=fedavg,fedprox', '--repeats=2')
  assert result.returncode == 0, result.stderr[-3000:]
  measured = re.findall(r'^\s*native\s+(\w+)\s+3 clients:\s+([\d.]+) s/round',
                        result.stdout, re.MULTILINE)
  # The second repeat runs the first's measurements in reverse order.
  assert [a for a, _ in measured] == ['fedavg', 'fedprox', 'fedprox',
                                      'fedavg'], result.stdout
  seconds = {a: [float(t) for b, t in measured if b == a]
             for a in ('fedavg', 'fedprox')}
  ratio = re.search(r'fedprox / fedavg, native, 3 clients: round time '
                    r'x([\d.]+) \(median of x([\d.]+), x([\d.]+)\)',
                    result.stdout)
  assert ratio, result.stdout
  want = [seconds['fedprox'][0] / seconds['fedavg'][0],
          seconds['fedprox'][1] / seconds['fedavg'][1]]
  # The printed seconds are rounded to 1 ms.
  for got, expected in zip(map(float, ratio.groups()[1:]), want):
    assert abs(got - expected) < 0.05 * expected + 0.01
  assert 'medians over 2 repeats' in result.stdout


def test_central_mode_times_mixed_fl_central_work_alone(rounds):
  result = rounds('--quick', '--modes=native,central',
                  '--clients_per_round=3', '--population=6',
                  '--sweep_clients=3', '--sweep_algorithms=mixed_2wgt')
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'^\s*central\s+mixed_2wgt\s+3 clients:\s+[\d.]+ s/round',
                   result.stdout, re.MULTILINE), result.stdout
  assert not re.search(r'^\s*central\s+fedavg', result.stdout, re.MULTILINE)
  # Only the modes asked for run.
  assert not any(line.strip().startswith(('tff ', 'naive ', 'bound ', 'ratio_'))
                 for line in result.stdout.splitlines()), result.stdout
  # The base of the mixed round's comparison: FedAvg on the same clients.
  assert re.search(r'^\s*native\s+fedavg_on_mixed_clients\s+3 clients:',
                   result.stdout, re.MULTILINE), result.stdout
  # x is negative when the round, whose central work runs alongside its
  # clients, took less than the central work alone (seen under load).
  assert re.search(r'^  mixed_2wgt, native, 3 clients: round [\d.]+ s = '
                   r'x-?[\d.]+ FedAvg\'s [\d.]+ s \+ its central work alone',
                   result.stdout, re.MULTILINE), result.stdout


def test_a_mixed_round_is_compared_with_fedavg_on_its_clients_plus_central():
  from benchmarks import report  # pylint: disable=import-outside-toplevel

  def record(seconds):
    return {'seconds_per_round': seconds}

  by_key = {('fedavg', 'native', 100): record(0.4),  # Other clients: unused.
            ('fedavg_on_mixed_clients', 'native', 100): record(0.5),
            ('mixed_2wgt', 'native', 100): record(1.7),
            ('mixed_2wgt', 'central', 100): record(0.6),
            ('mixed_2wgt', 'tff', 100): record(2.0),  # No FedAvg under tff.
            ('scaffold', 'native', 100): record(1.5)}
  assert report.central_work_lines(by_key, 'fedavg_on_mixed_clients') == [
      '  mixed_2wgt, native, 100 clients: round 1.700 s = x2.20 FedAvg\'s '
      '0.500 s + its central work alone 0.600 s']


def test_a_stateful_round_is_compared_with_fedavg_plus_its_bound_extra_work():
  from benchmarks import report  # pylint: disable=import-outside-toplevel

  def record(seconds):
    return {'seconds_per_round': seconds}

  by_key = {('fedavg', 'tff', 100): record(0.5),
            ('fedavg', 'bound', 100): record(0.4),
            ('fedres_avg', 'tff', 100): record(2.0),
            ('fedres_avg', 'bound', 100): record(1.6),
            ('scaffold', 'native', 100): record(1.5),  # No native FedAvg.
            ('scaffold', 'bound', 100): record(1.2),
            ('mixed_2wgt', 'tff', 100): record(1.0)}  # No bound.
  assert report.bound_extra_work_lines(by_key) == [
      '  fedres_avg, tff, 100 clients: round 2.000 s = x1.60 FedAvg\'s '
      '0.500 s + its extra work in plain TF ((c) minus FedAvg\'s) 1.200 s']


def test_binaries_benchmark_is_the_round_benchmark():
  # The binaries' name for it (`python -m binaries.benchmark`), with the
  # binaries' contract: a bad flag value is one error line, status 2.
  result = run_binary('binaries.benchmark', '--sweep_algorithms=fedavg,nope',
                      '--modes=tff')
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip().splitlines() == [
      "error: --sweep_algorithms: 'nope' is unknown; allowed: fedavg, "
      'fedprox, fedsgd, scaffold, fedpvr, mixed_pt, mixed_1wgt, mixed_2wgt, '
      'fedres_naive, fedres_sgd, fedres_avg']


@pytest.mark.parametrize('flags, message', [
    # A TypeError traceback (None * an int).
    ([], '--child=native needs --child_clients >= 1, got None'),
    (['--child_clients=0'], '--child=native needs --child_clients >= 1, got '
     '0'),
    (['--child_clients=5'], '--child=native needs --child_output_dir (the '
     'directory of its run)'),
    # A ValueError traceback from the algorithm registry.
    (['--child_clients=5', '--child_output_dir={tmp}',
      '--child_algorithm=bogus'],
     "--child_algorithm='bogus' is unknown to --child=native; allowed: "
     'fedavg, fedprox, fedsgd, scaffold, fedpvr, mixed_pt, mixed_1wgt, '
     'mixed_2wgt, fedres_naive, fedres_sgd, fedres_avg, '
     'fedavg_on_mixed_clients'),
    (['--child_clients=5', '--child_output_dir={tmp}',
      '--child_algorithm=scaffold'],
     "--child_algorithm='scaffold' is unknown to --child=naive; allowed: "
     'fedavg'),
    # Named --root_output_dir, which the benchmark has not.
    (['--child_clients=5', '--child_output_dir={tmp}/file'],
     '--child_output_dir={tmp}/file is a file, not a directory'),
])
def test_a_measuring_childs_bad_flags_are_one_clear_error(rounds, tmp_path,
                                                           flags, message):
  (tmp_path / 'file').write_text('not a directory')
  mode = 'naive' if '--child=naive' in message else 'native'
  result = rounds('--quick', f'--child={mode}',
                  *[f.format(tmp=tmp_path) for f in flags])
  assert (result.returncode, result.stderr) == (
      2, f'error: {message.format(tmp=tmp_path)}\n')
