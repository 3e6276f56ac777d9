"""pipeline.interrupts: Ctrl-C held back around a coroutine run."""

import asyncio
import os
import signal
import sys
import time

import pytest

from pipeline import interrupts


@pytest.fixture
def sigint_calls_interrupt(monkeypatch):
  # As binaries.app installs it (without its ignoring of a second SIGINT).
  # A Ctrl-C stays requested for the process: later tests run in it.
  monkeypatch.setattr(interrupts, '_requested', False)
  previous = signal.signal(signal.SIGINT,
                           lambda signum, frame: interrupts.interrupt())
  yield
  signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_a_coroutine_comes_after_it(sigint_calls_interrupt):
  # It was raised inside the coroutine's task: asyncio then logged "Task
  # exception was never retrieved" with a traceback, and the work (a
  # metrics row, a checkpoint) stopped halfway.
  finished = []

  async def work():
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.sleep(0.05)
    await asyncio.gather(asyncio.sleep(0.01), asyncio.sleep(0.01))
    finished.append(True)
    return 7

  with pytest.raises(KeyboardInterrupt):
    interrupts.run_coroutine(work())
  assert finished == [True]
  # Nothing is left pending: the next run is not interrupted.
  assert interrupts.run_coroutine(asyncio.sleep(0, result=3)) == 3


def test_outside_a_deferred_block_a_ctrl_c_is_immediate(sigint_calls_interrupt):
  with pytest.raises(KeyboardInterrupt):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # Interrupted.


def test_an_error_inside_is_not_replaced(sigint_calls_interrupt):
  async def failing():
    os.kill(os.getpid(), signal.SIGINT)
    raise ValueError('the work failed')

  with pytest.raises(ValueError, match='the work failed'):
    interrupts.run_coroutine(failing())
  # The held-back interrupt is not lost either: it comes at the next end.
  with pytest.raises(KeyboardInterrupt):
    with interrupts.deferred():
      pass


def test_a_ctrl_c_lost_in_a_finalizer_comes_at_the_next_check(
    sigint_calls_interrupt):
  # Python reports an exception raised in __del__ as "Exception ignored" and
  # goes on: the Ctrl-C was lost, and the benchmark ran to its end.
  class Finalized:

    def __del__(self):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.01)  # The handler runs here.

  lost = []
  previous_hook = sys.unraisablehook
  sys.unraisablehook = lost.append
  try:
    Finalized()  # Freed at once.
  finally:
    sys.unraisablehook = previous_hook
  assert [u.exc_type for u in lost] == [KeyboardInterrupt]
  assert interrupts.requested()
  with pytest.raises(KeyboardInterrupt):
    interrupts.check()


@pytest.mark.parametrize('program, resumes', [
    ('binaries.train', True), ('binaries.export', False),
    ('binaries.evaluate', False), ('benchmarks.rounds', False),
    # Stopped while importing (after that, cli.run_main says its own line).
    ('experiments.fedres_toy', False), (None, True)])
def test_only_a_training_program_speaks_of_going_on(monkeypatch, program,
                                                     resumes):
  # evaluate, export and the benchmarks said "re-run the same command to go
  # on (a training run from its last checkpoint)": they have nothing to go
  # on from.
  main = type(sys)('__main__')
  main.__spec__ = (None if program is None else
                   type('Spec', (), {'name': program})())
  monkeypatch.setitem(sys.modules, '__main__', main)
  assert (interrupts.message() == interrupts.INTERRUPTED) == resumes
  assert 'go on' not in interrupts.INTERRUPTED_WITHOUT_RESUME


def test_a_ctrl_c_while_the_package_imports_names_the_program(monkeypatch):
  # `python -m binaries.export` imports `binaries` (which installs the
  # handler of a Ctrl-C while starting) before __main__ is the module: its
  # line spoke of going on.
  monkeypatch.setitem(sys.modules, '__main__', type(sys)('__main__'))
  monkeypatch.setattr(sys, 'argv', ['-m', '--experiment_name=run'])
  monkeypatch.setattr(sys, 'orig_argv', [
      'python', '-X', 'utf8', '-m', 'binaries.export',
      '--experiment_name=run'])
  assert interrupts.message() == interrupts.INTERRUPTED_WITHOUT_RESUME


@pytest.mark.parametrize('script', [
    # A KeyboardInterrupt raised inside a C extension's Python callback
    # (e.g. SavedModel tracing in export) surfaced as a SystemError chained
    # to it: a traceback, about 1 in 15 Ctrl-Cs of an export.
    ('from absl import flags\n'
     'from binaries import app\n'
     'flags.DEFINE_integer("x", 0, "x")\n'
     'def main(argv):\n'
     '  try:\n'
     '    raise KeyboardInterrupt\n'
     '  except KeyboardInterrupt:\n'
     '    raise SystemError("<built-in function trace> returned a result '
     'with an exception set")\n'
     'app.run(main)\n'),
    # absl parses and validates the flags before the binary's main, outside
    # its handler: a traceback.
    ('from absl import flags\n'
     'from binaries import app\n'
     'flags.DEFINE_integer("x", 0, "x")\n'
     'def interrupted(value):\n'
     '  raise KeyboardInterrupt\n'
     'flags.register_validator("x", interrupted)\n'
     'app.run(print)\n'),
], ids=['reported_by_another_error', 'while_the_flags_are_parsed'])
def test_a_ctrl_c_is_one_line(tmp_path, script):
  result = _run_script(tmp_path, script)
  assert result.returncode == 130, result.stderr[-3000:]
  assert result.stderr.splitlines() == [
      f'error: {interrupts.INTERRUPTED}'], result.stderr[-3000:]


def test_a_ctrl_c_after_the_error_line_adds_nothing(tmp_path):
  # It cut the workers' shutdown short: a second line (or a traceback), and
  # status 130 for a run that had failed on its input.
  result = _run_script(
      tmp_path,
      'import os, signal\n'
      'from absl import flags\n'
      'from binaries import app\n'
      'from pipeline import tff_runtime\n'
      'from pipeline.errors import UsageError\n'
      'flags.DEFINE_integer("x", 0, "x")\n'
      'tff_runtime.shutdown_workers = lambda: os.kill(os.getpid(), '
      'signal.SIGINT)\n'
      'def main(argv):\n'
      '  raise UsageError("bad input")\n'
      'app.run(main)\n')
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.splitlines() == ['error: bad input'], result.stderr


@pytest.mark.parametrize('signal_name, status, cause', [
    ('SIGTERM', 143, 'terminated (SIGTERM)'),
    ('SIGHUP', 129, 'hung up (SIGHUP: its terminal closed)')])
def test_a_sigterm_stops_a_binary_as_a_ctrl_c_does(tmp_path, signal_name,
                                                   status, cause):
  # It ended the process at once (status -15 or -1, no line): a scheduler's
  # SIGTERM before its SIGKILL, or a closed terminal, lost every round since
  # the last checkpoint. A second one (GNU timeout signals the process,
  # then its group) is ignored, as a second Ctrl-C is; a Ctrl-C after it
  # changes nothing.
  result = _run_script(
      tmp_path,
      'import os, signal, time\n'
      'from absl import flags\n'
      'from binaries import app\n'
      'flags.DEFINE_integer("x", 0, "x")\n'
      'def main(argv):\n'
      '  try:\n'
      f'    os.kill(os.getpid(), signal.{signal_name})\n'
      '    time.sleep(60)\n'
      '  finally:\n'
      f'    os.kill(os.getpid(), signal.{signal_name})\n'
      '    os.kill(os.getpid(), signal.SIGINT)\n'
      '    print("cleaned up", flush=True)\n'
      'app.run(main)\n')
  assert result.returncode == status, result.stderr[-3000:]
  assert result.stdout == 'cleaned up\n'
  assert result.stderr.splitlines() == [
      f'error: {cause}; re-run the same command to go on (a training run '
      'from its last checkpoint)'], result.stderr[-3000:]


def test_a_closed_terminal_takes_no_traceback_after_its_sighup(tmp_path):
  # After the SIGHUP of a closed terminal, writes to it fail with EIO: the
  # error line's write raised, and the run ended with status 1.
  import pty  # pylint: disable=g-import-not-at-top
  script = tmp_path / 'script.py'
  script.write_text(
      'import os, signal, time\n'
      'from absl import flags\n'
      'from binaries import app\n'
      'flags.DEFINE_integer("x", 0, "x")\n'
      'def main(argv):\n'
      '  print("ready", flush=True)\n'
      '  time.sleep(60)\n'
      'app.run(main)\n')
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  pid, terminal = pty.fork()
  if pid == 0:  # The child: a session whose terminal is the pty.
    try:
      os.chdir(repo)
      os.execve(sys.executable, [sys.executable, str(script), '--x=1'],
                dict(os.environ, PYTHONPATH=repo))
    finally:
      os._exit(127)  # pylint: disable=protected-access
  try:
    seen = b''
    while b'ready' not in seen:
      seen += os.read(terminal, 1024)
  finally:
    os.close(terminal)  # The hang-up: the kernel sends SIGHUP.
  _, wait_status = os.waitpid(pid, 0)
  assert os.waitstatus_to_exitcode(wait_status) == 129


def test_a_sighup_under_nohup_changes_nothing(tmp_path):
  # nohup starts a program with SIGHUP ignored; the handlers of this
  # project's binaries must keep it so (TFF's worker shutdown hook made a
  # SIGHUP end such a run at once).
  result = _run_script(
      tmp_path,
      'import os, signal, time\n'
      'from absl import flags\n'
      'from binaries import app\n'
      'from pipeline import tff_runtime\n'
      'flags.DEFINE_integer("x", 0, "x")\n'
      'def main(argv):\n'
      '  tff_runtime.install_shutdown_hooks()\n'
      '  os.kill(os.getpid(), signal.SIGHUP)\n'
      '  time.sleep(0.5)\n'
      '  print("still running", flush=True)\n'
      'app.run(main)\n',
      preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
  assert (result.returncode, result.stdout, result.stderr) == (
      0, 'still running\n', '')


def _run_script(tmp_path, text, **kwargs):
  """`text` (which calls binaries.app.run) run with --x=1 as a process of
  its own (`kwargs`: subprocess.run's)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  (tmp_path / 'script.py').write_text(text)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.run([sys.executable, str(tmp_path / 'script.py'),
                         '--x=1'], cwd=repo, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, PYTHONPATH=repo),
                        **kwargs)
