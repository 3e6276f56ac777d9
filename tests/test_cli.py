"""The binaries as a user runs them: outputs, resume, errors, no leaked workers."""

import ast
import csv
import json
import os
import subprocess
import sys

import numpy as np
import psutil
import pytest
import tensorflow as tf

import fault_testlib
from fault_testlib import tree_digest


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_FLAGS = ['--task=celeba_smile', '--celeba_mode=federated',
               '--algorithm=fedavg', '--use_synthetic_data',
               '--clients_per_round=5', '--client_steps=1',
               '--rounds_per_eval=2']


def run_binary(module, *args, timeout=600):
  return fault_testlib.run_binary(module, *args, timeout=timeout)


def _orphaned_worker_pids():
  # A worker whose Python parent is gone is re-parented to init (pid 1).
  orphans = set()
  for proc in psutil.process_iter(['pid', 'ppid', 'cmdline']):
    cmdline = ' '.join(proc.info['cmdline'] or [])
    if 'worker_binary' in cmdline and proc.info['ppid'] == 1:
      orphans.add(proc.info['pid'])
  return orphans


_ORPHANS_BEFORE_TESTS = _orphaned_worker_pids()


def orphan_workers():
  """TFF workers left running by a binary that has exited."""
  return sorted(_orphaned_worker_pids() - _ORPHANS_BEFORE_TESTS)


def read_rows(path):
  with open(path) as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    row.pop('round_seconds'), row.pop('eval_seconds', None)
  return rows


def assert_one_error_line(result, *fragments):
  assert result.returncode == 2, result.stderr[-3000:]
  error_lines = [l for l in result.stderr.splitlines()
                 if l.startswith('error: ')]
  assert len(error_lines) == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  for fragment in fragments:
    assert fragment in error_lines[0], error_lines[0]
  assert not orphan_workers()


# binaries.train imported once (each run still a process of its own: exit
# status, stderr, TFF workers; see fault_testlib.SHARED_MODULES). A user's
# cold `python -m binaries.train` is test_first_run's.
train_with_an_error = fault_testlib.preloaded_runs('binaries.train')


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('runs'))
  first = run_binary('binaries.train', *TRAIN_FLAGS, '--total_rounds=3',
                     '--experiment_name=e', f'--root_output_dir={root}')
  assert first.returncode == 0, first.stderr[-3000:]
  with open(os.path.join(root, 'e', 'metrics.csv')) as f:
    after_three = f.read()
  resumed = run_binary('binaries.train', *TRAIN_FLAGS, '--total_rounds=5',
                       '--experiment_name=e', f'--root_output_dir={root}')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  straight = run_binary('binaries.train', *TRAIN_FLAGS, '--total_rounds=5',
                        '--experiment_name=straight',
                        f'--root_output_dir={root}')
  assert straight.returncode == 0, straight.stderr[-3000:]
  return root, after_three


def test_first_run_writes_every_output(runs):
  root, after_three = runs
  rows = list(csv.DictReader(after_three.splitlines()))
  assert [r['round_num'] for r in rows] == ['1', '2', '3']
  assert all(np.isfinite(float(r['train/loss'])) for r in rows)
  assert os.path.isfile(os.path.join(root, 'e', 'hparams.json'))
  assert os.listdir(os.path.join(root, 'e', 'tensorboard'))


def test_export_serves_predictions(runs):
  root, _ = runs
  loaded = tf.saved_model.load(os.path.join(root, 'e', 'export'))
  serve = loaded.signatures['serving_default']
  out = serve(images=tf.zeros([3, 84, 84, 3]))['smiling_probability']
  assert out.shape == (3, 1)
  assert np.all((out.numpy() >= 0) & (out.numpy() <= 1))


def test_rerun_resumes_and_matches_uninterrupted_run(runs):
  root, after_three = runs
  resumed = read_rows(os.path.join(root, 'e', 'metrics.csv'))
  assert [r['round_num'] for r in resumed] == ['1', '2', '3', '4', '5']
  # Rounds 1-3 were not rerun (their rows are the first run's).
  first = list(csv.DictReader(after_three.splitlines()))
  assert [r['train/loss'] for r in resumed[:3]] == [
      r['train/loss'] for r in first]
  straight = read_rows(os.path.join(root, 'straight', 'metrics.csv'))
  assert [r['train/loss'] for r in resumed] == [
      r['train/loss'] for r in straight]
  assert resumed[-1] == straight[-1]
  a = tf.saved_model.load(os.path.join(root, 'e', 'export'))
  b = tf.saved_model.load(os.path.join(root, 'straight', 'export'))
  for x, y in zip(a.trainable_weights, b.trainable_weights):
    np.testing.assert_array_equal(x.numpy(), y.numpy())


def test_evaluate_and_export_binaries(runs, tmp_path):
  root, _ = runs
  evaluated = run_binary('binaries.evaluate', '--experiment_name=e',
                         f'--root_output_dir={root}', '--checkpoint_round=5')
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  assert '"eval/auc"' in evaluated.stdout
  exported = run_binary('binaries.export', '--experiment_name=e',
                        f'--root_output_dir={root}',
                        f'--export_dir={tmp_path / "x"}')
  assert exported.returncode == 0, exported.stderr[-3000:]
  assert (tmp_path / 'x' / 'saved_model.pb').is_file()
  assert not orphan_workers()


def test_unknown_algorithm_and_task(train_with_an_error, tmp_path):
  result = train_with_an_error('--task=celeba_smile', '--algorithm=fedmagic',
                               '--experiment_name=x',
                               f'--root_output_dir={tmp_path}')
  assert_one_error_line(result, '--algorithm', 'fedmagic', 'fedavg')
  assert not os.listdir(tmp_path)


def test_bad_values_leave_existing_run_untouched(train_with_an_error, runs):
  root, _ = runs
  before = tree_digest(os.path.join(root, 'e'))
  too_many = train_with_an_error(
      *TRAIN_FLAGS, '--clients_per_round=10000', '--total_rounds=6',
      '--experiment_name=e', f'--root_output_dir={root}')
  assert_one_error_line(too_many, '--clients_per_round=10000', '60')
  negative = train_with_an_error(
      *TRAIN_FLAGS, '--total_rounds=6', '--client_learning_rate=-1',
      '--experiment_name=e', f'--root_output_dir={root}')
  assert_one_error_line(negative, 'client_optimizer', '> 0')
  assert tree_digest(os.path.join(root, 'e')) == before


def test_missing_cache_dir(train_with_an_error, tmp_path):
  result = train_with_an_error('--task=celeba_smile', '--algorithm=fedavg',
                               '--experiment_name=x',
                               f'--cache_dir={tmp_path / "nowhere"}',
                               f'--root_output_dir={tmp_path}')
  assert_one_error_line(result, '--cache_dir', 'nowhere')


def test_truncated_checkpoint(train_with_an_error, runs, tmp_path):
  root, _ = runs
  run_dir = tmp_path / 'copy'
  subprocess.run(['cp', '-r', os.path.join(root, 'straight'), str(run_dir)],
                 check=True)
  variables = run_dir / 'checkpoints' / 'round_5' / 'variables'
  data = next(p for p in variables.iterdir() if 'data' in p.name)
  data.write_bytes(data.read_bytes()[:100])
  before = tree_digest(run_dir)
  result = train_with_an_error(*TRAIN_FLAGS, '--total_rounds=6',
                               '--experiment_name=copy',
                               f'--root_output_dir={tmp_path}')
  assert_one_error_line(result, 'checkpoint', 'round_5', 'corrupted')
  assert tree_digest(run_dir) == before


def test_no_worker_survives_an_exception(tmp_path):
  script = tmp_path / 'crash.py'
  script.write_text(
      'import numpy as np\n'
      'from pipeline import tff_runtime\n'
      'tff_runtime.configure_execution()\n'
      'import tensorflow_federated as tff\n'
      '@tff.tensorflow.computation(np.int32)\n'
      'def add_one(x):\n'
      '  return x + 1\n'
      'assert add_one(1) == 2\n'
      'raise RuntimeError("crash after the worker started")\n')
  # Output is a pipe: a surviving worker would keep it open and hang here.
  result = subprocess.run([sys.executable, str(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, 'PYTHONPATH': REPO})
  assert result.returncode != 0
  assert 'crash after the worker started' in result.stderr
  assert 'Exception ignored' not in result.stderr
  assert not orphan_workers()


def test_native_runtime_run_matches_tff_run(runs):
  # The same command on --runtime=native: the same rounds, and
  # evaluate rebuilds the run (runtime from hparams.json) from a checkpoint.
  root, after_three = runs
  native = run_binary('binaries.train', *TRAIN_FLAGS, '--total_rounds=3',
                      '--runtime=native', '--experiment_name=native',
                      f'--root_output_dir={root}')
  assert native.returncode == 0, native.stderr[-3000:]
  with open(os.path.join(root, 'native', 'hparams.json')) as f:
    assert json.load(f)['runtime'] == 'native'
  tff_rows = list(csv.DictReader(after_three.splitlines()))
  native_rows = read_rows(os.path.join(root, 'native', 'metrics.csv'))
  for tff_row, native_row in zip(tff_rows, native_rows, strict=True):
    for column in ('train/loss', 'train/num_examples', 'eval/auc'):
      if tff_row[column]:
        np.testing.assert_allclose(float(native_row[column]),
                                   float(tff_row[column]), rtol=1e-5)
  evaluated = run_binary('binaries.evaluate', '--experiment_name=native',
                         f'--root_output_dir={root}')
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  assert '"eval/auc"' in evaluated.stdout
  assert not orphan_workers()


def _docstring_joins_lines(path):
  """Whether a module docstring has a backslash-newline that Python joins.

  In a non-raw string a trailing backslash removes the line break, so a
  usage example written over several lines prints as one line in --help.
  """
  with open(path, encoding='utf-8') as f:
    source = f.read()
  body = ast.parse(source).body
  if not (body and isinstance(body[0], ast.Expr)
          and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
    return False
  literal = ast.get_source_segment(source, body[0])
  return body[0].value.value.count('\n') < literal.count('\n')


def test_usage_examples_keep_their_line_breaks():
  modules = []
  for package in ('binaries', 'experiments', 'benchmarks', 'scripts'):
    for root, _, files in os.walk(os.path.join(REPO, package)):
      modules += [os.path.join(root, f) for f in files if f.endswith('.py')]
  assert len(modules) > 10
  joined = [os.path.relpath(m, REPO) for m in modules
            if _docstring_joins_lines(m)]
  assert not joined, f'docstrings whose line breaks Python removes: {joined}'


@pytest.mark.parametrize('module, listed', [
    ('binaries.train', ('--task', '--algorithm', '--client_learning_rate',
                        '--pvr_last_layers', '--[no]allow_flag_changes')),
    # benchmark's flags are those of the module it runs: it listed none.
    ('binaries.benchmark', ('--sweep_algorithms', '--clients_per_round',
                            '--modes')),
])
def test_help_lists_the_run_flags_and_exits_0(module, listed):
  # absl's --help exited 1 (a bug, by the binaries' statuses) and listed only
  # --allow_flag_changes; the other flags were under --helpfull.
  result = subprocess.run(
      [sys.executable, '-m', module, '--help'], cwd=REPO,
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  for flag in listed:
    assert flag in result.stdout + result.stderr, flag


PROGRAM_PACKAGES = ('binaries', 'benchmarks', 'benchmarks/peers',
                    'experiments')


def test_every_module_of_the_program_packages_has_a_main():
  # `python -m` on a module without one did nothing and exited 0.
  for package in PROGRAM_PACKAGES:
    directory = os.path.join(REPO, package)
    for name in os.listdir(directory):
      if name.endswith('.py') and name != '__init__.py':
        with open(os.path.join(directory, name), encoding='utf-8') as f:
          assert "if __name__ == '__main__':" in f.read(), f'{package}/{name}'


@pytest.mark.parametrize('module, programs', [
    ('binaries.restore', 'binaries.benchmark, binaries.evaluate, '
     'binaries.export, binaries.plot, binaries.serve_personalized, '
     'binaries.train'),
    ('experiments.cli', 'experiments.celeba_mixed, experiments.fedpvr_digits, '
     'experiments.fedres_logistic, experiments.fedres_movielens, '
     'experiments.fedres_toy, experiments.movielens_mixed, '
     'experiments.scaffold_digits'),
])
def test_a_library_module_run_as_a_program_is_one_error_line(module, programs):
  result = run_binary(module)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip() == (
      f'error: {module} is a library module, not a program (run one of: '
      f'{programs})'), result.stderr
  assert not result.stdout


@pytest.mark.parametrize('closed', [1, 2])
def test_a_closed_stdout_or_stderr_is_no_failure(closed):
  # `train ... >&-`: the work was done, then the final flush of the missing
  # stream (None) raised AttributeError, status 1.
  result = subprocess.run(
      [sys.executable, '-m', 'binaries.train', '--help'], cwd=REPO,
      stdout=subprocess.DEVNULL if closed == 2 else None,
      stderr=subprocess.DEVNULL if closed == 1 else subprocess.PIPE,
      preexec_fn=lambda: os.close(closed), timeout=120, check=False)
  assert result.returncode == 0, (result.stderr or b'')[-2000:]


def test_every_bad_flag_is_named_on_one_line():
  result = run_binary('binaries.train', '--task=digits', '--algorithm=fedavg',
                      '--experiment_name=x', '--client_learning_rate=nan',
                      '--server_learning_rate=inf')
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), lines
  assert '--client_learning_rate=nan' in lines[0], lines
  assert '--server_learning_rate=inf' in lines[0], lines
