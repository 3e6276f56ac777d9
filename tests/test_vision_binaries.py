"""End to end through the binaries: emnist and cifar10 with fedavg, then
`binaries.evaluate --conformal` (tiny synthetic data and models).

Each run is a process of its own, forked from one that imported the binary
(fault_testlib.SHARED_MODULES): a TFF process build, compilation and export
per run.
"""

import csv
import json
import os

import pytest
import fault_testlib

TIMEOUT_SECONDS = 900


def _run(module, *args):
  return fault_testlib.run_binary(module, *args, timeout=TIMEOUT_SECONDS)


def _metrics(run_dir):
  with open(os.path.join(run_dir, 'metrics.csv')) as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope='module')
def emnist_run(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('runs'))
  result = _run('binaries.train', '--task=emnist', '--algorithm=fedavg',
                '--experiment_name=emnist', f'--root_output_dir={root}',
                '--use_synthetic_data', '--num_clients=5', '--similarity=10',
                '--total_rounds=2', '--client_steps=2',
                '--client_batch_size=8', '--client_learning_rate=0.1')
  assert result.returncode == 0, result.stderr[-3000:]
  return root


def test_emnist_trains_with_task_default_participation(emnist_run):
  run_dir = os.path.join(emnist_run, 'emnist')
  rows = _metrics(run_dir)
  assert [row['round_num'] for row in rows] == ['1', '2']
  assert all(float(row['train/loss']) > 0 for row in rows)
  assert 'eval/accuracy' in rows[-1]
  with open(os.path.join(run_dir, 'hparams.json')) as f:
    hparams = json.load(f)
  # 20% of 5 clients (SCAFFOLD's sampling rate), recorded for resumption.
  assert hparams['clients_per_round'] == 1
  assert hparams['num_clients'] == 5 and hparams['similarity'] == 10
  assert os.path.isfile(os.path.join(run_dir, 'export', 'saved_model.pb'))


def test_evaluate_conformal(emnist_run):
  result = _run('binaries.evaluate', '--experiment_name=emnist',
                f'--root_output_dir={emnist_run}', '--conformal',
                '--conformal_alphas=0.1,0.5')
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  rows = report['conformal']['rows']
  assert [row['alpha'] for row in rows] == [0.1, 0.5]
  # The synthetic eval set has 400 examples, split half and half.
  assert all(row['calibration_examples'] == 200 and
             row['test_examples'] == 200 for row in rows)
  assert rows[0]['mean_set_size'] >= rows[1]['mean_set_size']
  assert rows[0]['coverage'] >= rows[1]['coverage']
  csv_path = os.path.join(emnist_run, 'emnist',
                          'evaluation_round_2.conformal.csv')
  with open(csv_path) as f:
    assert len(list(csv.DictReader(f))) == 2
  assert 'coverage' in result.stderr


def test_evaluate_rejects_bad_alphas(emnist_run):
  result = _run('binaries.evaluate', '--experiment_name=emnist',
                f'--root_output_dir={emnist_run}', '--conformal',
                '--conformal_alphas=0.1,1.5')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith(
      'error: --conformal_alphas must be numbers in (0, 1)')


def test_cifar10_trains_with_full_participation(tmp_path):
  result = _run('binaries.train', '--task=cifar10', '--algorithm=fedavg',
                '--experiment_name=cifar', f'--root_output_dir={tmp_path}',
                '--use_synthetic_data', '--num_clients=2', '--model=vgg11',
                '--model_width=0.0625', '--total_rounds=1',
                '--client_steps=1', '--client_batch_size=4')
  assert result.returncode == 0, result.stderr[-3000:]
  run_dir = os.path.join(tmp_path, 'cifar')
  (row,) = _metrics(run_dir)
  # Both clients took their one step of 4 examples.
  assert float(row['train/num_examples']) == 8
  assert float(row['eval/loss']) > 0


def test_wrong_model_for_task_is_one_error_line(tmp_path):
  result = _run('binaries.train', '--task=cifar100', '--algorithm=fedavg',
                '--experiment_name=bad', f'--root_output_dir={tmp_path}',
                '--use_synthetic_data', '--model=logistic')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      "error: --model='logistic' is not a CIFAR model; allowed: vgg11, "
      'resnet8')
  assert not os.path.exists(os.path.join(tmp_path, 'bad'))
