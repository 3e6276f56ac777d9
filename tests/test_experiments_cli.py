"""The experiments' (and the peer benchmark's) bad flags end with one
`error: ...` line and status 2, as the binaries' do (experiments/cli.py);
each command here fails before it trains, most before they import
TensorFlow (a fraction of a second)."""

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

import fault_testlib as lib


def run(module, *args):
  return subprocess.run([sys.executable, '-m', module, *args], cwd=lib.REPO,
                        capture_output=True, text=True, timeout=120,
                        env=lib.environment(), check=False)


@pytest.mark.parametrize('module, args, message', [
    # Each was a ValueError traceback.
    ('experiments.scaffold_digits', ['--client_steps=5,x'],
     "argument --client_steps: '5,x' is not a comma-separated list of "
     'integers'),
    ('experiments.fedpvr_digits', ['--alphas=abc'],
     "argument --alphas: 'abc' is not a comma-separated list of finite "
     'numbers'),
    ('experiments.fedres_toy', ['--ks=abc'],
     "argument --ks: 'abc' is not a comma-separated list of integers >= 1"),
    # Refused by the driver as --total_rounds / --client_steps.
    ('experiments.fedres_toy', ['--rounds=0'],
     "argument --rounds: '0' is not an integer >= 1"),
    ('experiments.fedres_toy', ['--ks=5,0'],
     "argument --ks: '5,0' is not a comma-separated list of integers >= 1"),
    # A traceback from NumPy's seed, after the table's header.
    ('experiments.fedres_toy', ['--seed=-5'],
     "argument --seed: '-5' is not a seed: an integer from 0 to 2**32 - 1"),
    ('experiments.celeba_mixed', ['--seed=4294967296'],
     "argument --seed: '4294967296' is not a seed: an integer from 0 to "
     '2**32 - 1'),
    ('experiments.fedres_logistic', ['--heterogeneities=nan'],
     "argument --heterogeneities: 'nan' is not a comma-separated list of "
     'finite numbers'),
    # Every mixed run "FAILED" the check against a NaN margin (exit 1,
    # after training all five runs); a NaN target loss was never reached.
    ('experiments.celeba_mixed', ['--check_margin=nan'],
     "argument --check_margin: 'nan' is not a finite number"),
    ('experiments.scaffold_digits', ['--target_loss=inf'],
     "argument --target_loss: 'inf' is not a finite number"),
    # argparse's usage block and `prog: error:` line.
    ('experiments.celeba_mixed', ['--bogus'],
     'unrecognized arguments: --bogus'),
    # It indexed the accuracy curves from their end.
    ('experiments.fedpvr_digits', ['--at_round=-1'],
     'argument --at_round: -1 is not a round of 1..30 (--total_rounds)'),
    # Unknown runs were skipped: an empty table, or a KeyError with
    # --check_margin.
    ('experiments.celeba_mixed', ['--runs=foo'],
     "argument --runs: 'foo' is not one of fl_only, oracle, mixed_pt, "
     'mixed_1wgt, mixed_2wgt'),
    ('experiments.celeba_mixed', ['--runs=mixed_pt', '--check_margin=0.1'],
     'argument --check_margin: compares with fl_only, which --runs leaves '
     'out'),
    # Nothing trained, then an IndexError traceback in the summary.
    ('experiments.movielens_mixed', ['--use_synthetic_data',
                                     '--total_rounds=0'],
     "argument --total_rounds: '0' is not an integer >= 1"),
    # 0 was taken as "not given": the task's 100 clients a round.
    ('experiments.movielens_mixed', ['--use_synthetic_data',
                                     '--clients_per_round=0'],
     "argument --clients_per_round: '0' is not an integer >= 1"),
    # Each was ignored: synthetic data trained, the FedProx runs left out.
    ('experiments.movielens_mixed', ['--use_synthetic_data',
                                     '--movielens_dir=ml'],
     'argument --movielens_dir does not apply with --use_synthetic_data '
     '(synthetic data reads no files); pass one of them'),
    ('experiments.fedpvr_digits', ['--fast', '--fedprox_mu=0.5'],
     'argument --fedprox_mu does not apply with --fast (its runs leave out '
     'FedProx)'),
    # No run can reach it: every method ">30 rounds" to the target.
    ('experiments.fedpvr_digits', ['--target_accuracy=2'],
     'argument --target_accuracy: 2.0 is not an accuracy in (0, 1]'),
    # Refused by the binary only when their run came, after the runs
    # before it had trained.
    ('experiments.fedpvr_digits', ['--pvr_starts=6,9'],
     'argument --pvr_starts: 9 is not a variable index of the CNN (0..8)'),
    ('experiments.fedpvr_digits', ['--fedprox_mu=-1'],
     'argument --fedprox_mu: -1.0 is not a number >= 0'),
    # Each was refused under the binary's flag name (--dirichlet_alpha,
    # --seed, --client_learning_rate, --heterogeneity), a list's only when
    # its run came.
    ('experiments.fedpvr_digits', ['--alphas=0.1,-1'],
     'argument --alphas: -1 is not > 0'),
    ('experiments.fedpvr_digits', ['--seeds=0,-1'],
     "argument --seeds: '-1' is not a seed: an integer from 0 to 2**32 - 1"),
    ('experiments.fedpvr_digits', ['--learning_rate=nan'],
     'argument --learning_rate: nan is not a finite number > 0'),
    ('experiments.fedres_logistic', ['--heterogeneities=0,2'],
     'argument --heterogeneities: 2 is not in [0, 1]'),
    # Imports TensorFlow for the optimizers' names (a few seconds).
    ('experiments.fedpvr_digits', ['--pvr_client_optimizer=bogus'],
     "argument --pvr_client_optimizer: 'bogus' is not one of sgd, sgdm, "
     'adam, yogi, adagrad, rmsprop'),
    ('experiments.fedpvr_digits', ['--client_epochs=0'],
     "argument --client_epochs: '0' is not an integer >= 1"),
    # argparse's usage block and `compare.py: error:` line.
    ('benchmarks.peers.compare', ['--pairs=0'],
     '--pairs, --rounds and --warmup_rounds must be >= 1'),
], ids=lambda value: value if isinstance(value, str) else None)
def test_bad_flags_are_one_error_line(tmp_path, module, args, message):
  if module.startswith(('experiments.scaffold', 'experiments.fedpvr',
                        'experiments.celeba', 'experiments.movielens')):
    args = [f'--root_output_dir={tmp_path}/runs', *args]
  result = run(module, *args)
  assert (result.returncode, result.stderr) == (2, f'error: {message}\n')
  assert not (tmp_path / 'runs').exists()


def test_summarize_only_without_runs_is_one_error_line(tmp_path):
  # A FileNotFoundError (scaffold_digits), an IndexError (fedpvr_digits).
  result = run('experiments.scaffold_digits', f'--root_output_dir={tmp_path}',
               '--summarize_only')
  assert (result.returncode, result.stderr) == (
      2, f'error: {tmp_path}/fedavg_K5_lr0.3/metrics.csv is missing: train '
      'the run first (leave out --summarize_only)\n')
  result = run('experiments.fedpvr_digits', f'--root_output_dir={tmp_path}',
               '--summarize_only')
  assert (result.returncode, result.stderr) == (
      2, f'error: {tmp_path}/fedavg_a0.1_s0 has 0 rounds, fewer than the 30 '
      'summarized (--at_round, --total_rounds); train it first (leave out '
      '--summarize_only)\n')


def test_an_in_process_runs_refusal_names_the_root_output_dir(
    monkeypatch, capsys):
  # The driver's advice (a new --experiment_name, --allow_flag_changes)
  # names flags an experiment does not take.
  from experiments import cli  # pylint: disable=g-import-not-at-top
  from pipeline.errors import UsageError  # pylint: disable=g-import-not-at-top
  for module, name in ((cli.tff_runtime, 'install_shutdown_hooks'),
                       (cli.private_temp, 'use_private_temp_dir'),
                       (cli.app, 'remove_temp_dir_on_fatal_signals')):
    monkeypatch.setattr(module, name, lambda: None)

  def main():
    raise UsageError('runs/a was trained with other values of flags that '
                     'change results: --seed (run: 0, now: 1); repeat the '
                     'run\'s values, use a new --experiment_name, or pass '
                     '--allow_flag_changes to continue with the new ones')

  with pytest.raises(SystemExit) as raised:
    cli.run_main(main)
  assert raised.value.code == 2
  assert capsys.readouterr().err == (
      'error: runs/a was trained with other values of flags that change '
      'results: --seed (run: 0, now: 1); repeat the run\'s values, or use '
      'another --root_output_dir\n')


def _fake_binaries(monkeypatch, tmp_path, module):
  """Each binary `module` runs writes a one-round metrics.csv where its
  --root_output_dir is from the directory it runs in (the repository root,
  here tmp_path/repo); returns the commands run."""
  commands = []

  def run_binary(command, cwd, **_):
    commands.append(command)
    flags = dict(a[2:].split('=', 1) for a in command if a.startswith('--'))
    run_dir = os.path.join(cwd, flags['root_output_dir'],
                           flags['experiment_name'])
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, 'metrics.csv'), 'w') as f:
      f.write('round_num,eval/recall_at_10,train/client_flops,'
              'train/client_comm_floats,eval/auc,eval/loss\n'
              '1,0.5,10.0,10.0,0.5,0.7\n')

  (tmp_path / 'repo').mkdir()
  monkeypatch.setattr(module, 'REPO', str(tmp_path / 'repo'))
  monkeypatch.setattr(module.cli, 'run_binary', run_binary)
  monkeypatch.chdir(tmp_path)
  return commands


@pytest.mark.parametrize('name', ['movielens_mixed', 'celeba_mixed'])
def test_relative_directories_are_the_callers_not_the_binaries(
    tmp_path, monkeypatch, capsys, name):
  # The binaries run from the repository root: movielens_mixed's runs went
  # there and its summary read them here (an IndexError traceback);
  # celeba_mixed's --cache_dir was looked for there.
  import importlib  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(f'experiments.{name}')
  commands = _fake_binaries(monkeypatch, tmp_path, module)
  monkeypatch.setattr(sys, 'argv', [
      name, '--root_output_dir=runs', '--total_rounds=1',
      '--movielens_dir=ml' if name == 'movielens_mixed' else '--cache_dir=tff'])
  module.main()
  table = {'movielens_mixed': 'recall@10', 'celeba_mixed': 'best auc'}[name]
  assert table in capsys.readouterr().out
  for command in commands:
    assert f'--root_output_dir={tmp_path}/runs' in command
    assert any(flag in command for flag in (
        f'--movielens_dir={tmp_path}/ml', f'--cache_dir={tmp_path}/tff'))
  assert not (tmp_path / 'repo' / 'runs').exists()


def test_a_failing_training_ends_the_experiment_with_its_status(tmp_path):
  # train's own error line was followed by a CalledProcessError traceback.
  result = run('experiments.scaffold_digits', f'--root_output_dir={tmp_path}',
               '--client_steps=5', '--learning_rates=1',
               '--client_batch_size=0')
  assert (result.returncode, result.stderr) == (
      2, 'error: --client_batch_size must be >= 1, got 0\n')


def test_a_killed_experiment_takes_its_binary_along(tmp_path):
  # SIGTERM to an experiment left its train process (and that one's TFF
  # worker) running on.
  experiment = subprocess.Popen(
      [sys.executable, '-c',
       'import sys\n'
       'from experiments import cli\n'
       'cli.run_binary([sys.executable, "-c", "import os, time; '
       'print(os.getpid(), flush=True); time.sleep(60)"])\n'],
      cwd=lib.REPO, env=lib.environment(), stdout=subprocess.PIPE, text=True)
  child = int(experiment.stdout.readline())
  experiment.terminate()
  experiment.wait(timeout=30)
  experiment.stdout.close()
  deadline = time.monotonic() + 10
  while os.path.exists(f'/proc/{child}') and time.monotonic() < deadline:
    time.sleep(0.05)
  gone = not os.path.exists(f'/proc/{child}')
  if not gone:
    os.kill(child, signal.SIGKILL)
  assert gone


@pytest.mark.parametrize('signum, status', [(signal.SIGINT, 130),
                                            (signal.SIGTERM, 143)])
def test_a_signal_to_the_experiment_alone_stops_its_binary_and_it(
    tmp_path, signum, status):
  # A Ctrl-C reaches the whole process group; a SIGINT to the experiment
  # alone (kill -INT) was lost while it waited for a binary: the binary and
  # every run after it trained on, and the experiment ended with status 0.
  # A SIGTERM ended the experiment at once (no line, status -15), its
  # binary still writing.
  binary = ('import os, signal, sys, time\n'
            'def stop(signum, _):\n'
            '  print(f"error: {signum}", file=sys.stderr, flush=True)\n'
            '  os._exit(128 + signum)\n'
            'signal.signal(signal.SIGINT, stop)\n'
            'signal.signal(signal.SIGTERM, stop)\n'
            'print(os.getpid(), flush=True)\n'
            'time.sleep(60)\n')
  assert _run_experiment(
      'import sys\n'
      'from experiments import cli\n'
      'def main():\n'
      '  for _ in range(2):\n'
      f'    cli.run_binary([sys.executable, "-c", {binary!r}])\n'
      '  print("finished", flush=True)\n'
      '  return 0\n'
      'cli.run_main(main)\n', signum) == (status, '', f'error: {int(signum)}\n')


def test_a_sigterm_stops_an_in_process_experiment_with_one_line():
  # It ended at once: no line, killed by the signal. One that lands in a
  # finalizer (a gc callback of JAX's) is lost there, and Python reported it
  # ("Exception ignored in ..." and a traceback) before the line.
  assert _run_experiment(
      'import os, signal, time\n'
      'from experiments import cli\n'
      'from pipeline import interrupts\n'
      'class Finalized:\n'
      '  def __del__(self):\n'
      '    os.kill(os.getpid(), signal.SIGTERM)\n'
      'def main():\n'
      '  Finalized()\n'
      '  for _ in range(6000):\n'
      '    interrupts.check()  # As the driver does every round.\n'
      '    time.sleep(0.01)\n'
      'cli.run_main(main, runs_kept=False)\n') == (
          143, '', 'error: terminated (SIGTERM) (its runs were temporary: a '
          're-run starts over)\n')


def _run_experiment(script, signum=None):
  """(status, stdout, stderr) of `script`; `signum` is sent to it once it
  printed a line (its binary's pid)."""
  experiment = subprocess.Popen(
      [sys.executable, '-c', script], cwd=lib.REPO, env=lib.environment(),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    if signum is not None:
      int(experiment.stdout.readline())  # The binary is running.
      experiment.send_signal(signum)
    stdout, stderr = experiment.communicate(timeout=60)
  finally:
    experiment.kill()
  return experiment.returncode, stdout, stderr


def test_a_refused_rerun_names_the_experiments_flag(tmp_path):
  # The binary's advice named its own run flags (a new --experiment_name,
  # --allow_flag_changes), which an experiment does not take.
  flags = [f'--root_output_dir={tmp_path}', '--total_rounds=1',
           '--client_steps=1', '--learning_rates=0.3', '--runtime=native',
           '--num_clients=4', '--clients_per_round=2']
  first = run('experiments.scaffold_digits', *flags)
  assert first.returncode in (0, 1), first.stderr  # 1: a claim failed
  result = run('experiments.scaffold_digits', *flags, '--seed=1')
  assert (result.returncode, result.stderr) == (
      2, f'error: {tmp_path}/fedavg_K1_lr0.3 was trained with other values '
      'of flags that change results: --seed (run: 0, now: 1); repeat the '
      "run's values, or use another --root_output_dir\n")


@pytest.mark.parametrize('binary_line, experiment_line', [
    ("d was trained with other values of flags that cannot change in a run, "
     "even with --allow_flag_changes: --a (b); repeat the run's values or use "
     'a new --experiment_name',
     "d was trained with other values of flags that cannot change in a run: "
     "--a (b); repeat the run's values or use another --root_output_dir"),
    ('d/hparams.json not found: the flags of the run are unknown (restore the '
     "file, or pass --allow_flag_changes to record this command's)",
     'd/hparams.json not found: the flags of the run are unknown (restore the '
     'file)'),
    ('2 client state file(s) of checkpoint round 2 are missing or damaged '
     '(e.g. f); the run cannot resume exactly. Restore the directory or start '
     'a new --experiment_name',
     '2 client state file(s) of checkpoint round 2 are missing or damaged '
     '(e.g. f); the run cannot resume exactly. Restore the directory or use '
     'another --root_output_dir'),
    ('d is a file, not a run directory; use another --experiment_name',
     'd is a file, not a run directory; use another --root_output_dir'),
])
def test_advice_on_run_flags_is_put_for_experiments(binary_line,
                                                    experiment_line):
  from binaries import app  # pylint: disable=g-import-not-at-top
  assert app.advice_for_experiments(binary_line) == experiment_line


@pytest.mark.parametrize('args, message', [
    # argparse's prefix matching ran it as --total_rounds=3.
    (['--total_round=3'], 'unrecognized arguments: --total_round=3'),
    # Reported as "the following arguments are required: --root_output_dir".
    (['--root_output_dirr=x'], 'unrecognized arguments: --root_output_dirr=x'),
])
def test_flag_names_are_taken_as_written(tmp_path, args, message):
  if not any(a.startswith('--root_output_dir') for a in args):
    args = [f'--root_output_dir={tmp_path}/runs', *args]
  result = run('experiments.scaffold_digits', *args)
  assert (result.returncode, result.stderr) == (2, f'error: {message}\n')
  assert not (tmp_path / 'runs').exists()


def test_values_reach_the_binaries_and_run_names_exactly():
  # pylint: disable=g-import-not-at-top
  from experiments import cli
  from experiments import fedpvr_digits
  from experiments import scaffold_digits
  # pylint: enable=g-import-not-at-top
  # `:g` trained 0.3000001 at 0.3, as the same run as 0.3.
  assert [cli.exact(v) for v in (0.3, 1.0, 1e-5, 0.3000001, 0.1234567)] == [
      '0.3', '1', '1e-05', '0.3000001', '0.1234567']
  assert (scaffold_digits.run_name('fedavg', 2, 0.3000001) !=
          scaffold_digits.run_name('fedavg', 2, 0.3))
  assert fedpvr_digits.run_name('fedavg', 0.1234567, 0) == (
      'fedavg_a0.1234567_s0')
  argv = fedpvr_digits.train_argv('fedavg', 0.1234567, 0, argparse.Namespace(
      client_epochs=1, client_batch_size=4, learning_rate=0.0123456789,
      fedprox_mu=0.0, pvr_client_optimizer='sgd', total_rounds=1,
      root_output_dir='runs'))
  assert '--dirichlet_alpha=0.1234567' in argv
  assert '--client_learning_rate=0.0123456789' in argv
