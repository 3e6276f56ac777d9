"""benchmarks/peers: the pure parts of the peer comparison (no peer venv).

The comparison itself installs pfl and torch in a venv of its own, so it is
not run here; these check what its figures go through: the lines it parses
from benchmarks.rounds and pfl_benchmark.py, the table it makes, and the
pfl side's sampling and client data.
"""

import json

import numpy as np
import pytest

from benchmarks.peers import compare
from benchmarks.peers import pfl_benchmark

# benchmarks.rounds's lines (benchmark.format_measurement; not imported
# here, its absl flags would clash with other test modules' in the same
# process). test_benchmark.py parses a real run's.
PROJECT_OUTPUT = '''\
benchmark: K=2, B=5, 4 timed + 1 warm-up rounds, population 2000, 2 CPUs
  tff   fedavg       100 clients:    1.310 s/round (rounds: 1.31, 1.41), \
peak RSS   2900 MB (Python 1200, workers 1700), 80 s wall
  bound fedavg       100 clients:    1.100 s/round (rounds: 1.10), \
peak RSS    800 MB (Python 800, workers 0), 40 s wall
  tff   scaffold     100 clients:   12.500 s/round (rounds: 12.50), \
peak RSS   3100 MB (Python 1500, workers 1600), 90 s wall
  native fedavg       100 clients:    0.900 s/round (rounds: 0.90, 0.95), \
peak RSS    700 MB (Python 700, workers 0), 30 s wall
| 100 | 0.763 (2900) |
'''


def test_project_lines_are_parsed():
  records = compare.parse_project_output(PROJECT_OUTPUT)
  assert [(r['algorithm'], r['clients']) for r in records] == [
      ('fedavg', 100), ('scaffold', 100)]  # (c) is not the project's (a).
  assert records[0]['seconds_per_round'] == pytest.approx(1.310)
  assert records[0]['round_seconds'] == [1.31, 1.41]
  assert records[0]['peak_rss_mb'] == 2900
  assert records[1]['seconds_per_round'] == 12.5
  native = compare.parse_project_output(PROJECT_OUTPUT, 'native')
  assert [(r['algorithm'], r['seconds_per_round']) for r in native] == [
      ('fedavg', 0.9)]


def test_pfl_result_line_is_parsed():
  result = dict(algorithm='scaffold', state_store='disk', clients=100,
                processes=2, threads=1, seconds_per_round=0.5,
                round_seconds=[0.9, 0.5], peak_rss_mb=1200)
  record = compare.parse_pfl_output(
      'Metrics at iteration 1\n' + pfl_benchmark.RESULT_PREFIX +
      json.dumps(result))
  assert record['config'] == '2x1'
  assert compare.row_name(record) == 'scaffold, pfl c_i disk'
  with pytest.raises(ValueError):
    compare.parse_pfl_output('no result here')


def _pfl(algorithm, config, seconds, rss, store=None):
  return dict(side='pfl', algorithm=algorithm, state_store=store,
              config=config, clients=100, seconds_per_round=seconds,
              round_seconds=[seconds], peak_rss_mb=rss)


def _project(algorithm, seconds, rss):
  return dict(side='project', algorithm=algorithm, clients=100,
              seconds_per_round=seconds, round_seconds=[seconds],
              peak_rss_mb=rss)


def test_summary_takes_the_fastest_config_and_per_pair_ratios():
  pairs = [
      dict(project=[_project('fedavg', 1.0, 3000),
                    _project('scaffold', 10.0, 3500)],
           pfl=[_pfl('fedavg', '1x2', 0.6, 500), _pfl('fedavg', '2x1', 0.4, 1100),
                _pfl('scaffold', '2x1', 2.0, 1300, 'disk')]),
      dict(project=[_project('fedavg', 2.0, 3100),
                    _project('scaffold', 12.0, 3400)],
           pfl=[_pfl('fedavg', '1x2', 0.7, 520), _pfl('fedavg', '2x1', 0.6, 1150),
                _pfl('scaffold', '2x1', 3.0, 1250, 'disk')]),
  ]
  rows = {row['name']: row for row in compare.summarize(pairs)}
  fedavg = rows['fedavg']
  assert fedavg['best_config'] == '2x1'
  assert fedavg['pfl_seconds'] == pytest.approx(0.5)
  assert fedavg['project_seconds'] == pytest.approx(1.5)
  # Median of 0.4/1.0 and 0.6/2.0, not 0.5/1.5.
  assert fedavg['ratio'] == pytest.approx(0.35)
  assert fedavg['pfl_peak_rss_mb'] == 1150
  assert fedavg['project_peak_rss_mb'] == 3100
  scaffold = rows['scaffold, pfl c_i disk']
  assert scaffold['project_seconds'] == pytest.approx(11.0)
  assert scaffold['ratio'] == pytest.approx((0.2 + 0.25) / 2)
  table = compare.format_table(compare.summarize(pairs), 100)
  assert '| fedavg | 1.500 | 0.500 (2x1) | 0.35 | 3100 MB | 1150 MB |' in table
  assert '| 1x2 | 0.650 s (520 MB) | - |' in table


def test_pfl_configs_are_processes_by_threads():
  assert compare.parse_configs('1x2, 2x1,1x1+1') == [(1, 2, 0), (2, 1, 0),
                                                     (1, 1, 1)]
  assert compare.config_name(1, 1, 1) == '1x1+1'
  for bad in ('2', '0x1', 'ax1', '1x1+'):
    with pytest.raises(ValueError):
      compare.parse_configs(bad)


def test_pfl_sampler_draws_distinct_users_per_round_alike_in_every_process():
  first = pfl_benchmark.WithoutReplacementSampler(50, 10, seed=3)
  second = pfl_benchmark.WithoutReplacementSampler(50, 10, seed=3)
  rounds = [[first() for _ in range(10)] for _ in range(5)]
  assert all(len(set(users)) == 10 for users in rounds)
  assert len({tuple(users) for users in rounds}) == 5
  assert rounds == [[second() for _ in range(10)] for _ in range(5)]


def test_pfl_clients_have_4_to_16_examples_and_take_k_batches():
  args = pfl_benchmark.parse_args(['--client_steps=2', '--client_batch_size=5'])
  clients = pfl_benchmark.ClientData(args, np.random.default_rng(0))
  sizes = [len(clients.examples(user)[0]) for user in range(200)]
  assert min(sizes) == 4 and max(sizes) == 16
  images, smiling = clients.examples(7)
  x, y = clients.training_stream(7)
  assert x.shape == (10, 84, 84, 3) and y.shape == (10, 1)
  assert x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
  # Every stream example is one of the client's, label with its image.
  for image, label in zip(x, y):
    matches = [i for i in range(len(images))
               if np.array_equal(images[i] / np.float32(255), image)]
    assert matches and all(smiling[i] == label[0] for i in matches)


def test_pfl_benchmark_rejects_what_pfl_cannot_run():
  for argv in (['--clients_per_round=5', '--processes=2'],
               ['--algorithm=scaffold', '--state_store=memory',
                '--processes=2'],
               ['--warmup_rounds=0']):
    with pytest.raises(SystemExit) as error:
      pfl_benchmark.parse_args(argv)
    assert error.value.code == 2
