"""benchmarks/rounds.py's repeats and its central mode (test_benchmark.py
has the rest of its contract; split from it, so that `--dist loadfile` can
run the two files' measuring children on different workers)."""

import re

import fault_testlib

# As in test_benchmark.py: benchmarks.rounds imported once.
rounds = fault_testlib.preloaded_runs('benchmarks.rounds')


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
