"""Shared pieces of the fault tests: small runs, binaries as subprocesses,
tree digests, read-only and size-limited mounts."""

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from pipeline import run_logs
import preloaded_binary
from preloaded_binary import PreloadedBinary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Checkpoints 0, 2 and 3; a run of a few seconds once TF is loaded.
DIGITS_FLAGS = ['--task=digits', '--algorithm=fedavg', '--num_clients=20',
                '--clients_per_round=5', '--client_steps=2',
                '--rounds_per_checkpoint=2']
FEDRES_FLAGS = ['--task=fedres_logistic', '--algorithm=fedres_avg',
                '--clients_per_round=4']


def binary_command(module, *args):
  return [sys.executable, '-m', module, *args]


def run_binary(module, *args, timeout=600, env=None):
  """`python -m <module> *args`: forked from this test process's server of
  `module` (`shared_binary`), or, with `env` or an environment other than
  the server's, a process of its own."""
  if env is None and module in SHARED_MODULES:
    binary = shared_binary(module)
    if _comparable(binary.env) == _comparable(environment()):
      return binary.run(list(args), timeout=timeout)
  return subprocess.run(binary_command(module, *args), cwd=REPO,
                        capture_output=True, text=True, timeout=timeout,
                        stdin=subprocess.DEVNULL, check=False,
                        env=env or environment())


def _comparable(env: dict) -> dict:
  # pytest names the current test and phase in the environment.
  return {k: v for k, v in env.items() if k != 'PYTEST_CURRENT_TEST'}


def environment(**extra):
  return {**os.environ, 'PYTHONPATH': REPO, **extra}


# The programs whose runs tests fork from a server (`shared_binary`). A run
# is then a process of its own in every way a test checks (exit status,
# stdout/stderr, TFF workers, files) without TF's import: ~4.5 s of CPU a
# run. The tests of a user's first run (test_first_run) and those that
# signal a run start `python -m` processes as a user does.
SHARED_MODULES = frozenset((
    'binaries.train', 'binaries.evaluate', 'binaries.export',
    'binaries.serve_personalized', 'benchmarks.rounds',
    'benchmarks.state_files', 'benchmarks.weight_passes',
    'benchmarks.fused_floor'))


def shared_binary(module) -> PreloadedBinary:
  """This test process's server of `module` (see preloaded_binary), started
  on first use and closed when the process exits."""
  return preloaded_binary.shared(module, REPO, environment())


def preloaded(binary) -> PreloadedBinary:
  """The shared server of `binaries.<binary>` (`shared_binary`)."""
  return shared_binary(f'binaries.{binary}')


def preloaded_runs(module):
  """A fixture: `run(*args)` runs `python -m <module> *args` in a process of
  its own, forked from the shared server of `module` (`shared_binary`); it
  returns the CompletedProcess."""

  @pytest.fixture(scope='module')
  def fixture():
    binary = shared_binary(module)
    return lambda *args: binary.run(list(args))

  return fixture


def train(root, name, flags, *more, total_rounds=3, binary=None):
  """Trains a run to completion, with `binary` (a preloaded train binary)
  or in a new process."""
  args = [*flags, f'--total_rounds={total_rounds}', f'--experiment_name={name}',
          f'--root_output_dir={root}', *more]
  result = (binary.run(args) if binary else
            run_binary('binaries.train', *args))
  assert result.returncode == 0, result.stderr[-3000:]
  return os.path.join(root, name)


def tree_digest(path):
  """Digest of every directory and file (names and contents) under path."""
  digest = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    digest.update(root.encode())
    for name in sorted(files):
      full = os.path.join(root, name)
      digest.update(full.encode())
      if os.path.islink(full):  # Its target may not exist.
        digest.update(os.readlink(full).encode())
        continue
      with open(full, 'rb') as f:
        digest.update(f.read())
  return digest.hexdigest()


def error_lines(result):
  return [l for l in result.stderr.splitlines() if l.startswith('error: ')]


def metrics_rows(run_dir):
  return run_logs.comparable_rows(os.path.join(run_dir, 'metrics.csv'))


def copy_run(source, destination):
  shutil.copytree(source, destination, symlinks=True)
  return str(destination)


@contextlib.contextmanager
def lock_held_by_another_process(run_dir):
  """`run_dir` locked by a child process while the context lasts."""
  holder = subprocess.Popen(
      [sys.executable, '-c',
       'import sys, time\n'
       'from pipeline import run_directory\n'
       'run_directory.RunLock(sys.argv[1]).acquire()\n'
       'print("locked", flush=True)\n'
       'time.sleep(600)\n', str(run_dir)],
      cwd=REPO, stdout=subprocess.PIPE, text=True, env=environment())
  try:
    assert holder.stdout.readline() == 'locked\n'
    yield
  finally:
    holder.kill()
    holder.wait()


def _mount(*args):
  return subprocess.run(['mount', *args], capture_output=True, text=True,
                        check=False).returncode == 0


@contextlib.contextmanager
def read_only(path):
  """`path` read-only for this user: a read-only bind mount as root (who
  ignores permission bits), permission bits otherwise; skips the test if
  neither is possible."""
  path = str(path)
  if os.geteuid() != 0:
    modes = {}
    for root, dirs, files in os.walk(path):
      for name in [root] + [os.path.join(root, n) for n in dirs + files]:
        modes[name] = os.stat(name).st_mode
        os.chmod(name, modes[name] & ~0o222)
    try:
      yield
    finally:
      for name, mode in modes.items():
        os.chmod(name, mode)
    return
  if not (_mount('--bind', path, path) and
          _mount('-o', 'remount,bind,ro', path, path)):
    subprocess.run(['umount', path], capture_output=True, check=False)
    pytest.skip('cannot make a read-only mount here')
  try:
    yield
  finally:
    subprocess.run(['umount', path], check=True)


@contextlib.contextmanager
def small_filesystem(path, size_kb):
  """A tmpfs of `size_kb` at `path` (root only; skips otherwise). Yields a
  function that resizes it."""
  os.makedirs(path, exist_ok=True)
  if os.geteuid() != 0 or not _mount('-t', 'tmpfs', '-o', f'size={size_kb}k',
                                     'tmpfs', str(path)):
    pytest.skip('cannot mount a small tmpfs here (needs root)')

  def resize(new_size_kb):
    assert _mount('-o', f'remount,size={new_size_kb}k', str(path))

  try:
    yield resize
  finally:
    subprocess.run(['umount', str(path)], check=True)


def shared_runs(tmp_path_factory):
  """A digits run `base` (3 rounds, checkpoints 0, 2, 3) and a FedRes run
  `fedres` (2 rounds), trained once per test session (shared by the xdist
  workers). Tests copy them before changing anything."""
  directory = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    directory = directory.parent  # The session's, not this worker's.
  directory = directory / 'shared_fault_runs'
  directory.mkdir(exist_ok=True)
  with open(directory / '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (directory / 'done').exists():
      for name in ('base', 'fedres'):
        shutil.rmtree(directory / name, ignore_errors=True)
      binary = preloaded('train')
      train(directory, 'base', DIGITS_FLAGS, binary=binary)
      train(directory, 'fedres', FEDRES_FLAGS, total_rounds=2, binary=binary)
      (directory / 'done').write_text('')
  return directory
