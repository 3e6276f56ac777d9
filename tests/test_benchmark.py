"""benchmarks/rounds.py runs its measurements and prints its contract.

Only that it runs: its figures are measurements of this machine, not
something a test can hold to a bound.
"""

import os
import re

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
