"""Faults a run must survive: kills and signals, a second trainer, a round
cut off inside its checkpoint write, a full disk, a TFF worker that cannot
start or be reached; and exports that keep a FedRes run's personal models."""

import csv
import errno
import glob
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from binaries import app
import fault_testlib as lib
from pipeline import run_logs
from pipeline import tff_runtime
from pipeline.errors import EnvironmentFault
from pipeline.errors import UsageError

RECOVERY = ('; fix that and re-run the same command (what was written before '
            'is kept)')


@pytest.fixture(scope='module')
def base(tmp_path_factory):
  """An uninterrupted digits run of 3 rounds (checkpoints 0, 2, 3)."""
  return str(lib.shared_runs(tmp_path_factory) / 'base')


@pytest.fixture(scope='module')
def train_binary():
  return lib.preloaded('train')


def train_base(binary, root):
  return binary.run([*lib.DIGITS_FLAGS, '--total_rounds=3',
                     '--experiment_name=base', f'--root_output_dir={root}'])


def export_weights(run_dir, name='export'):
  loaded = tf.saved_model.load(os.path.join(run_dir, name))
  return [v.numpy() for v in loaded.trainable_weights]


def assert_same_run(run_dir, reference):
  assert lib.metrics_rows(run_dir) == lib.metrics_rows(reference)
  for a, b in zip(export_weights(run_dir), export_weights(reference),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def tensorboard_steps(run_dir):
  """{(tag, step): count} over all event files of the run."""
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  counts = {}
  for path in run_logs.event_files(os.path.join(run_dir, 'tensorboard')):
    for record in run_logs.read_events(path)[0]:
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        key = (value.tag, event.step)
        counts[key] = counts.get(key, 0) + 1
  return counts


def wait_for_rows(run_dir, rows, process, timeout=600):
  deadline = time.monotonic() + timeout
  path = os.path.join(run_dir, 'metrics.csv')
  while time.monotonic() < deadline:
    assert process.poll() is None, f'{run_dir}: trainer exited early'
    if os.path.exists(path):
      with open(path) as f:
        if len(f.read().splitlines()) > rows:
          return
    time.sleep(0.5)
  raise AssertionError(f'{run_dir}: no {rows} rows within {timeout} s')


def workers_of(process):
  return [p for p in psutil.Process(process.pid).children()
          if 'worker_binary' in ' '.join(p.cmdline()[:1])]


def alive(process):
  try:
    return process.status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def wait_for_autograph_file(temp, process, timeout=600):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert process.poll() is None, 'the binary exited early'
    if glob.glob(str(temp / 'tff-algos-*' / '__autograph_generated_file*')):
      return
    time.sleep(0.2)
  raise AssertionError(f'no autograph file within {timeout} s')


@pytest.mark.time_limit(900)
def test_killed_runs_leave_no_worker_no_temp_files_and_resume(tmp_path):
  root, temp = tmp_path / 'runs', tmp_path / 'tmp'
  temp.mkdir()
  env = lib.environment(TMPDIR=str(temp))

  def start(name, stderr=subprocess.DEVNULL):
    return subprocess.Popen(
        lib.binary_command('binaries.train', *lib.DIGITS_FLAGS,
                           '--total_rounds=100000', f'--experiment_name={name}',
                           f'--root_output_dir={root}'),
        cwd=lib.REPO, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=stderr, text=True)

  def stop_mid_run(name, signum, wait):
    """Its status and its stderr's lines."""
    process = start(name, stderr=subprocess.PIPE)
    try:
      wait(process)
      process.send_signal(signum)
      _, stderr = process.communicate(timeout=120)
    finally:
      process.kill()
    assert not os.listdir(temp)
    return process.returncode, stderr.strip().splitlines()

  # SIGTERM (a scheduler's, before its SIGKILL) once rows are written: as a
  # Ctrl-C, the newest finished round checkpointed, one line, status 143.
  assert stop_mid_run('terminated', signal.SIGTERM, lambda process: (
      wait_for_rows(root / 'terminated', 3, process))) == (143, [
          'error: terminated (SIGTERM); re-run the same command to go on (a '
          'training run from its last checkpoint)'])
  with open(root / 'terminated' / 'metrics.csv') as f:
    newest = int(f.read().strip().splitlines()[-1].split(',')[0])
  assert max(int(name[len('round_'):]) for name in os.listdir(
      root / 'terminated' / 'checkpoints')) == newest

  # SIGHUP (its terminal closed) once autograph has written files: as a
  # SIGTERM, and the private temp directory holding them goes with the
  # process. It ended the process at once (status -1), losing the rounds
  # since the last checkpoint.
  assert stop_mid_run('hung_up', signal.SIGHUP, lambda process: (
      wait_for_autograph_file(temp, process))) == (129, [
          'error: hung up (SIGHUP: its terminal closed); re-run the same '
          'command to go on (a training run from its last checkpoint)'])

  # Ctrl-C (SIGINT) mid-run: one line, no traceback, status 130.
  assert stop_mid_run('interrupted', signal.SIGINT, lambda process: (
      wait_for_autograph_file(temp, process))) == (130, [
          'error: interrupted; re-run the same command to go on (a training '
          'run from its last checkpoint)'])

  # SIGKILL while training; meanwhile a second trainer is refused.
  process = start('killed')
  try:
    wait_for_rows(root / 'killed', 2, process)
    (worker,) = workers_of(process)
    process.send_signal(signal.SIGSTOP)  # Keeps its lock, not the CPU.
    second = lib.run_binary('binaries.train', *lib.DIGITS_FLAGS,
                            '--total_rounds=100000', '--experiment_name=killed',
                            f'--root_output_dir={root}', env=env)
    assert second.returncode == 2, second.stderr[-3000:]
    assert lib.error_lines(second) == [
        f'error: {root}/killed is in use by another process (it holds '
        f'{root}/killed/.lock); wait for it to finish, or use another '
        '--experiment_name']
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=120) == -signal.SIGKILL
  finally:
    process.kill()
  time.sleep(1)
  # The kernel killed its worker (the parent-death signal).
  assert not alive(worker)
  # SIGKILL left its private temp dir (autograph files inside, none
  # outside) until the next start of a binary.
  (left,) = os.listdir(temp)
  assert left.startswith('tff-algos-')
  assert glob.glob(str(temp / left / '__autograph_generated_file*'))

  # The killed run resumes: rows after its checkpoint are re-run, the kept
  # rows stay byte for byte, and a re-run round equals the killed one.
  killed = root / 'killed'
  with open(killed / 'metrics.csv') as f:
    lines_before = f.read().splitlines(keepends=True)
  rows_before = lib.metrics_rows(killed)
  checkpoint = max(int(n[len('round_'):]) for n in os.listdir(
      killed / 'checkpoints') if n[len('round_'):].isdigit())
  resumed = lib.run_binary('binaries.train', *lib.DIGITS_FLAGS,
                           f'--total_rounds={checkpoint + 1}',
                           '--experiment_name=killed',
                           f'--root_output_dir={root}', env=env)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  if len(rows_before) > checkpoint:
    assert re.search(r'metrics.csv: removed (a partial last row .* and )?the '
                     r'rows of rounds \d+', resumed.stderr)
  with open(killed / 'metrics.csv') as f:
    lines_after = f.read().splitlines(keepends=True)
  assert lines_after[:checkpoint + 1] == lines_before[:checkpoint + 1]
  rows_after = lib.metrics_rows(killed)
  assert [int(r['round_num']) for r in rows_after] == list(
      range(1, checkpoint + 2))
  if len(rows_before) > checkpoint and all(
      rows_before[checkpoint].values()):
    assert rows_after[checkpoint] == rows_before[checkpoint]
  assert set(tensorboard_steps(killed).values()) == {1}
  assert not os.listdir(temp)  # The stale temp dir went at the start.


def start_endless_run(root, name, stdout):
  """A digits run of rounds without end, each evaluated, checkpointed only
  when stopped; its stderr piped."""
  return subprocess.Popen(
      lib.binary_command('binaries.train', *lib.DIGITS_FLAGS,
                         '--total_rounds=100000', '--rounds_per_eval=1',
                         '--rounds_per_checkpoint=100000',
                         f'--experiment_name={name}',
                         f'--root_output_dir={root}'),
      cwd=lib.REPO, env=lib.environment(), stdin=subprocess.DEVNULL,
      stdout=stdout, stderr=subprocess.PIPE, text=True)


@pytest.mark.time_limit(300)
def test_a_second_ctrl_c_during_the_clean_up_is_ignored(tmp_path):
  # As `timeout -s INT` sends it (to the process, then to its group): the
  # second one interrupted the clean-up with a traceback.
  process = start_endless_run(tmp_path, 'twice', stdout=subprocess.DEVNULL)
  try:
    wait_for_rows(tmp_path / 'twice', 2, process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
  finally:
    process.kill()
  assert process.returncode == 130, stderr[-3000:]
  assert [l for l in stderr.splitlines() if not l.startswith('round ')] == [
      'error: interrupted; re-run the same command to go on (a training '
      'run from its last checkpoint)'], stderr[-3000:]


INTERRUPTED_LINE = ('error: interrupted; re-run the same command to go on '
                    '(a training run from its last checkpoint)')


@pytest.mark.time_limit(300)
def test_a_closed_output_pipe_stops_the_run_as_a_ctrl_c_does(tmp_path):
  # `train ... | head -n 1`: tqdm's next line raised BrokenPipeError, a
  # traceback with status 1, and the rounds after the last periodic
  # checkpoint were lost.
  process = start_endless_run(tmp_path, 'piped', stdout=subprocess.PIPE)
  try:
    first = process.stdout.readline()
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
  finally:
    process.kill()
  assert first.startswith('round 1:'), first
  assert process.returncode == 141, stderr[-3000:]
  assert [l for l in stderr.splitlines() if not l.startswith('round ')] == [
      'error: its output was closed (broken pipe); re-run the same command '
      'to go on (a training run from its last checkpoint)'], stderr[-3000:]
  run_dir = tmp_path / 'piped'
  rows = len(run_logs.read_metrics(str(run_dir / 'metrics.csv')).rows)
  checkpoints = sorted(int(name.split('_')[1]) for name in
                       os.listdir(run_dir / 'checkpoints'))
  assert rows >= 1 and checkpoints[-1] == rows, (rows, checkpoints)


@pytest.mark.time_limit(600)
def test_ctrl_c_while_importing_or_in_the_first_round_is_one_line(tmp_path):
  """Ctrl-C during the imports printed an import traceback (the handler came
  with app.run); during the first round's TFF computation the process
  aborted after the error line (status 134, "FATAL: exception not
  rethrown": the computation's thread was ended while Python finalized)."""
  root = tmp_path / 'runs'
  command = lib.binary_command(
      'binaries.train', '--task=celeba_smile', '--use_synthetic_data',
      '--celeba_mode=federated', '--algorithm=fedavg', '--client_steps=2',
      '--clients_per_round=4', '--total_rounds=8', '--experiment_name=run',
      f'--root_output_dir={root}')
  for when in ('importing', 'first round'):
    process = subprocess.Popen(
        command, cwd=lib.REPO, env=lib.environment(),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
      if when == 'importing':
        time.sleep(1.0)  # TensorFlow and TFF take seconds to import.
        assert not root.exists()
      else:
        deadline = time.monotonic() + 300
        while not (root / 'run' / 'checkpoints' / 'round_0').exists():
          assert process.poll() is None and time.monotonic() < deadline
          time.sleep(0.02)
        time.sleep(0.2)
        workers = workers_of(process)
        assert workers
      process.send_signal(signal.SIGINT)
      _, stderr = process.communicate(timeout=120)
    finally:
      process.kill()
    assert process.returncode == 130, (when, stderr[-3000:])
    assert stderr.splitlines() == [INTERRUPTED_LINE], (when, stderr[-3000:])
  assert not any(alive(worker) for worker in workers)


def test_a_sigterm_while_importing_is_one_line(tmp_path):
  """A SIGTERM before app.run installed its handler (TensorFlow's and TFF's
  imports, seconds) ended the binary at once: killed by the signal, no
  line."""
  command = lib.binary_command(
      'binaries.evaluate', '--experiment_name=run',
      f'--root_output_dir={tmp_path}')
  process = subprocess.Popen(
      command, cwd=lib.REPO, env=lib.environment(), stdin=subprocess.DEVNULL,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    time.sleep(1.0)  # TensorFlow and TFF take seconds to import.
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
  finally:
    process.kill()
  assert process.returncode == 143, stderr[-3000:]
  assert stderr.splitlines() == [
      'error: terminated (SIGTERM); what it had not finished was not '
      'written: re-run the same command'], stderr[-3000:]


def test_ctrl_c_prints_nothing_about_what_it_cut_short(tmp_path):
  # Ctrl-C in a checkpoint write's asyncio.run left a half-made event loop
  # and an unawaited coroutine; Python reported both after the error line.
  script = tmp_path / 'interrupted.py'
  script.write_text(
      'from binaries import app\n'
      'class HalfMade:\n'
      '  def __del__(self):\n'
      '    raise AttributeError("_ssock")\n'
      'async def save():\n'
      '  pass\n'
      'def main(argv):\n'
      '  left = [HalfMade(), save()]\n'
      '  left.append(left)  # Freed by the collector, after the line.\n'
      '  raise KeyboardInterrupt\n'
      'app.run(main)\n')
  result = subprocess.run([sys.executable, str(script)], cwd=lib.REPO,
                          capture_output=True, text=True, timeout=300,
                          env=lib.environment())
  assert result.returncode == 130, result.stderr[-3000:]
  assert result.stderr.splitlines() == [
      'error: interrupted; re-run the same command to go on (a training '
      'run from its last checkpoint)'], result.stderr[-3000:]


def test_resume_removes_what_a_cut_off_checkpoint_write_left(
    base, train_binary, tmp_path):
  # Killed inside round 3's checkpoint write, after its row and events:
  # round_3 is a temp directory, metrics.csv has row 3 and a partial row.
  run = lib.copy_run(base, tmp_path / 'base')
  os.rename(os.path.join(run, 'checkpoints', 'round_3'),
            os.path.join(run, 'checkpoints', 'round_3_temp1234'))
  with open(os.path.join(run, 'metrics.csv'), 'a') as f:
    f.write('4,3.1')
  with open(os.path.join(run, 'metrics.csv_temp5678'), 'w') as f:
    f.write('round_num\n')
  result = train_base(train_binary, tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  events_of_round_3 = sum(count for (_, step), count in
                          tensorboard_steps(base).items() if step == 3)
  for message in ('round_3_temp1234, left by a write that was cut off',
                  'metrics.csv_temp5678, left by a write that was cut off',
                  'metrics.csv: removed a partial last row (a write that was '
                  'cut off) and the rows of rounds 3, after checkpoint round 2',
                  f'removed {events_of_round_3} events of rounds after '
                  'checkpoint round 2'):
    assert message in result.stderr, result.stderr[-3000:]
  assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == [
      'round_0', 'round_2', 'round_3']
  assert not glob.glob(os.path.join(run, '*_temp*'))
  assert_same_run(run, base)
  assert tensorboard_steps(run) == tensorboard_steps(base)
  assert set(tensorboard_steps(run).values()) == {1}


def test_full_disk_is_one_error_and_the_run_resumes(base, train_binary,
                                                    tmp_path):
  # 64 kB fill up in round 2's checkpoint write.
  disk = tmp_path / 'disk'
  with lib.small_filesystem(disk, 64) as resize:
    full = train_base(train_binary, disk)
    assert full.returncode == 3, full.stderr[-3000:]
    assert 'Traceback' not in full.stderr
    (line,) = lib.error_lines(full)
    assert re.fullmatch(rf'error: {disk}/base/\S+: No space left on device'
                        + re.escape(RECOVERY), line), line
    resize(4096)
    resumed = train_base(train_binary, disk)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(disk / 'base', base)
    assert set(tensorboard_steps(disk / 'base').values()) == {1}
    assert not glob.glob(str(disk / 'base' / '**' / '*temp*'),
                         recursive=True)
    assert not glob.glob(str(disk / 'base' / '*.staging'))


def without_file_permission_override(command):
  """`command` run so that file modes bind this process: as root, without
  the capabilities that let root read any file."""
  if os.geteuid() != 0:
    return command
  if shutil.which('setpriv') is None:
    pytest.skip('setpriv is needed to drop root\'s file-read capabilities')
  capabilities = '-dac_override,-dac_read_search'
  return ['setpriv', f'--bounding-set={capabilities}',
          f'--inh-caps={capabilities}', *command]


@pytest.mark.parametrize('binary, unreadable', [
    ('evaluate', 'checkpoints/round_3'), ('train', 'checkpoints/round_3'),
    ('evaluate', 'export')])
def test_an_unreadable_checkpoint_or_export_is_an_environment_fault(
    base, tmp_path, binary, unreadable):
  # It read "is corrupted or incompatible with these flags (OpError); ...
  # or delete it", status 2: advice to delete a sound checkpoint (an export:
  # "is not a readable export of this pipeline").
  run = tmp_path / 'base'
  lib.copy_run(base, run)
  (data,) = glob.glob(str(run / unreadable / 'variables/*.data-*'))
  os.chmod(data, 0)
  before = lib.tree_digest(run)
  args = [f'--root_output_dir={tmp_path}', '--experiment_name=base']
  if binary == 'train':
    args += [*lib.DIGITS_FLAGS, '--total_rounds=4']
  if unreadable == 'export':
    args.append(f'--export_dir={run / unreadable}')
  result = subprocess.run(
      without_file_permission_override(
          lib.binary_command(f'binaries.{binary}', *args)),
      cwd=lib.REPO, capture_output=True, text=True, timeout=600,
      stdin=subprocess.DEVNULL, env=lib.environment(), check=False)
  assert result.returncode == 3, result.stderr[-3000:]
  assert lib.error_lines(result) == [
      f'error: {data}: Permission denied{RECOVERY}'], result.stderr[-3000:]
  assert lib.tree_digest(run) == before


@pytest.fixture(scope='module')
def fedres(tmp_path_factory):
  return str(lib.shared_runs(tmp_path_factory) / 'fedres')


def local_models(export_dir):
  connection = sqlite3.connect(
      f'file:{export_dir}/local_models.sqlite?mode=ro', uri=True)
  try:
    return connection.execute('SELECT * FROM local_models ORDER BY '
                              'client_id').fetchall()
  finally:
    connection.close()


def test_export_of_a_fedres_run_keeps_its_personal_models(fedres, tmp_path):
  run = lib.copy_run(fedres, tmp_path / 'fedres')
  trained = local_models(os.path.join(run, 'export'))
  assert trained
  export = lib.preloaded('export')
  outcomes = [(export_dir, export.run(
      ['--experiment_name=fedres', f'--root_output_dir={tmp_path}',
       *([f'--export_dir={export_dir}'] if export_dir else [])]))
              for export_dir in (None, tmp_path / 'elsewhere')]
  for export_dir, exported in outcomes:
    assert exported.returncode == 0, exported.stderr[-3000:]
    target = str(export_dir or os.path.join(run, 'export'))
    assert local_models(target) == trained
    assert os.path.isfile(os.path.join(target, 'personalized',
                                       'saved_model.pb'))
    for a, b in zip(export_weights(target, ''), export_weights(fedres),
                    strict=True):
      np.testing.assert_array_equal(a, b)
  np.save(tmp_path / 'inputs.npy', np.zeros([3, 10], np.float32))
  served = lib.run_binary(
      'binaries.serve_personalized', f'--export_dir={run}/export',
      f'--client_id={trained[0][0]}', f'--inputs_npy={tmp_path}/inputs.npy')
  assert served.returncode == 0, served.stderr[-3000:]
  predictions = json.loads(served.stdout)
  assert np.shape(next(iter(predictions.values())))[0] == 3
  assert 'note:' not in served.stderr
  # A client without a local model: the initial one's predictions, said so.
  unknown = lib.run_binary(
      'binaries.serve_personalized', f'--export_dir={run}/export',
      '--client_id=no such client', f'--inputs_npy={tmp_path}/inputs.npy')
  assert unknown.returncode == 0, unknown.stderr[-3000:]
  assert json.loads(unknown.stdout).keys() == predictions.keys()
  assert ("has no local model of client 'no such client'"
          in unknown.stderr), unknown.stderr[-3000:]


def test_evaluate_of_a_fedres_run_reports_its_personalized_metrics(
    fedres, tmp_path):
  """binaries.evaluate on a FedRes checkpoint adds eval_personalized/* (each
  client's global model plus its own theta_i of that round): the values
  training logged for that round. It reported the global model only."""
  run = lib.copy_run(fedres, tmp_path / 'fedres')
  with open(os.path.join(run, 'metrics.csv')) as f:
    logged = list(csv.DictReader(f))[-1]
  evaluated = lib.preloaded('evaluate').run(['--experiment_name=fedres',
                                             f'--root_output_dir={tmp_path}'])
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  report = json.loads(evaluated.stdout)
  assert report['checkpoint_round'] == int(logged['round_num']) == 2
  personalized = {k: v for k, v in report.items()
                  if k.startswith('eval_personalized/')}
  assert {'eval_personalized/loss',
          'eval_personalized/num_clients'} <= set(personalized)
  for name, value in {**personalized, 'eval/loss': report['eval/loss']}.items():
    assert value == pytest.approx(float(logged[name]), rel=1e-6), name
  assert report['eval_personalized/loss'] != pytest.approx(report['eval/loss'])


@pytest.fixture
def restore_default_context():
  yield
  tff_runtime.configure_execution()


def add_one():
  return tff.tensorflow.computation(lambda x: x + 1, np.int32)


@pytest.mark.parametrize('script, message', [
    ('echo "worker: cannot bind" >&2; exit 3',
     r'the TFF worker .* exited at start-up with status 3'),
    ('exec sleep 600', r'the TFF worker .* did not answer on port \d+ within 2 s'),
])
def test_worker_that_does_not_start_is_an_error_within_seconds(
    tmp_path, monkeypatch, restore_default_context, script, message):
  del restore_default_context
  monkeypatch.setattr(tff_runtime, 'WORKER_START_SECONDS', 2)
  binary = tmp_path / 'worker_binary'
  binary.write_text(f'#!/bin/sh\n{script}\n')
  binary.chmod(0o755)
  tff.framework.set_default_context(
      tff_runtime.local_worker_context(binary_path=str(binary)))
  started = time.monotonic()
  with pytest.raises(EnvironmentFault, match=message):
    add_one()(1)
  assert time.monotonic() - started < 15
  assert not [p for p in psutil.Process().children(recursive=True)
              if str(binary) in ' '.join(p.cmdline()) and alive(p)]


def test_a_cap_on_calls_beyond_the_workers_32_bits(restore_default_context):
  """worker_binary's --max_concurrent_computation_calls is 32-bit: a larger
  cap stopped it at start-up (status 3, with its own ERROR line); a cap
  below -2**31 did too, though any value <= 0 means no cap."""
  del restore_default_context
  with pytest.raises(UsageError, match=r'at most 2147483647 \(<= 0: no cap\), '
                     r'got 2147483648'):
    tff_runtime.check_execution_settings(2**31)
  tff.framework.set_default_context(tff_runtime.local_worker_context(
      max_concurrent_computation_calls=-10**11))
  assert add_one()(1) == 2


def test_a_worker_that_keeps_dying_ends_the_run(monkeypatch,
                                                restore_default_context):
  """TFF retries a call on a restarted worker without end: a worker that
  crashed on every retry (a TF kernel's fault) looped for good. One death is
  survived; more than WORKER_DEATHS_ALLOWED in the window end the run."""
  del restore_default_context
  monkeypatch.setattr(tff_runtime, 'WORKER_DEATHS_ALLOWED', 2)
  tff.framework.set_default_context(tff_runtime.local_worker_context())
  add = add_one()
  assert add(1) == 2

  def crash_worker():
    (worker,) = [p for p in psutil.Process().children(recursive=True)
                 if 'worker_binary' in ' '.join(p.cmdline())]
    worker.send_signal(signal.SIGSEGV)
    deadline = time.monotonic() + 30
    # Dead but not reaped: its status is the runtime's to read.
    while worker.status() != psutil.STATUS_ZOMBIE:
      assert time.monotonic() < deadline
      time.sleep(0.05)

  for _ in range(2):
    crash_worker()
    assert add(1) == 2  # Restarted.
  crash_worker()
  with pytest.raises(EnvironmentFault, match=(
      r'the TFF worker .*worker_binary died 3 times within 600 s, the last '
      r'with signal SIGSEGV \(see its messages above\); re-run the same '
      'command to resume')):
    add(1)


class _GrpcError(Exception):
  """Stands for grpc's `_InactiveRpcError` (a module's class, by name)."""


_GrpcError.__module__ = 'grpc._channel'


@pytest.mark.parametrize('error, expected', [
    (OSError(errno.ENOSPC, 'No space left on device', '/r/metrics.csv'),
     '/r/metrics.csv: No space left on device'),
    (PermissionError(errno.EACCES, 'Permission denied', '/r'),
     '/r: Permission denied'),
    (sqlite3.OperationalError('database or disk is full'),
     'database or disk is full'),
    (tf.errors.ResourceExhaustedError(
        None, None, '{{function_node x}} /r/v.data; No space left on device '
        '[Op:SaveV2]'), '/r/v.data: No space left on device'),
    # The native runtime: TF names the failing path on a later line.
    (tf.errors.ResourceExhaustedError(
        None, None, 'Graph execution error:\n\nDetected at node WriteFile\n'
        '/r/s/round_2/AA.state; No space left on device\n\t [[{{node '
        'WriteFile}}]]\nHint: ...\n [Op:__inference_f_10]'),
     '/r/s/round_2/AA.state: No space left on device'),
    # TFF's runtime: a worker's failed computation, as gRPC passes it on.
    (_GrpcError('<_InactiveRpcError of RPC that terminated with:\n\tstatus = '
                'StatusCode.INTERNAL\n\tdetails = "Failed to run computation: '
                '/r/s/round_2/AA.state; No space left on device\n\t [[{{'
                'function_node cond}}{{node WriteFile}}]]\nHint: ..."\n>'),
     '/r/s/round_2/AA.state: No space left on device'),
    (EnvironmentFault('the TFF worker w exited'), 'the TFF worker w exited'),
    # A model too large for memory (--movielens_embedding_dim=2**40) was a
    # traceback.
    (tf.errors.ResourceExhaustedError(
        None, None, '{{function_node x}} OOM when allocating tensor with '
        'shape[41,1099511627776] and type float on /job:localhost/replica:0/'
        'task:0/device:CPU:0 by allocator mklcpu [Op:StatelessRandomNormalV2] '
        'name: '),
     'OOM when allocating tensor with shape[41,1099511627776] and type float '
     'on /job:localhost/replica:0/task:0/device:CPU:0 by allocator mklcpu'),
])
def test_environment_faults_are_recognized(error, expected):
  try:
    try:
      raise error
    except Exception as e:  # pylint: disable=broad-except
      raise RuntimeError('wrapped') from e
  except RuntimeError as wrapped:
    message = app.environment_fault_message(wrapped)
  if isinstance(error, EnvironmentFault):
    assert message == expected
  else:
    assert message == expected + RECOVERY
  assert app.environment_fault_message(ValueError('x')) is None
  assert app.environment_fault_message(
      OSError(errno.ENOENT, 'No such file')) is None


@pytest.mark.parametrize('error', [
    # TFF's runtime: the worker's failed client update, as gRPC passes it on
    # (a label of 99 in a file of 62-class EMNIST was a traceback).
    _GrpcError('<_InactiveRpcError of RPC that terminated with:\n\tstatus = '
               'StatusCode.INTERNAL\n\tdetails = "Failed to run computation: '
               'Received a label value of 99 which is outside the valid range '
               'of [0, 62).  Label values: 99 55 60\n\t [[{{function_node '
               'x}}]]"\n>'),
    # The native runtime, or evaluation in this process.
    tf.errors.InvalidArgumentError(
        None, None, 'Graph execution error:\n\nDetected at node x\nReceived '
        'a label value of 99 which is outside the valid range of [0, 62).  '
        'Label values: 99\n\t [[{{node x}}]] [Op:__inference_f_1]'),
])
def test_labels_beyond_the_models_classes_are_bad_data(error):
  try:
    raise RuntimeError('wrapped') from error
  except RuntimeError as wrapped:
    assert app.bad_data_message(wrapped) == (
        "the task's data files hold a label the model has no class for "
        '(Received a label value of 99 which is outside the valid range of '
        '[0, 62)): they are damaged or not the files of this task '
        '(--cache_dir, --data_dir)')


def test_a_script_using_the_modules_leaves_no_worker_behind(tmp_path):
  """A script (or notebook) that runs a TFF computation through this
  project's modules, without its binaries: TFF's own local context starts a
  worker that outlived the script and held its output pipes open (a caller
  reading them waited for good), and TFF printed an AttributeError at
  teardown."""
  script = tmp_path / 'script.py'
  script.write_text(
      'import os\n'
      'import tensorflow as tf\n'
      'import tensorflow_federated as tff\n'
      'import tff_algos.algorithms.registry  # noqa: F401\n'
      '@tff.tensorflow.computation(tf.float32)\n'
      'def add_one(x):\n'
      '  return x + 1\n'
      'print(add_one(1.0), os.getpid())\n')
  try:
    done = subprocess.run([sys.executable, str(script)], cwd=lib.REPO,
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, 'PYTHONPATH': lib.REPO})
  finally:
    leaked = [p for p in psutil.process_iter(['cmdline', 'ppid'])
              if 'worker_binary' in ' '.join(p.info['cmdline'] or ())
              and p.info['ppid'] == 1 and p.create_time() > script.stat().st_mtime]
    for process in leaked:
      process.kill()
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split()[0] == '2.0'
  assert not leaked
  assert 'Exception ignored' not in done.stderr, done.stderr[-3000:]
