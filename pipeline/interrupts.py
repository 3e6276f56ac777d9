"""Ctrl-C held back until a short piece of work that must not stop halfway
is done.

TFF's release managers and checkpoint manager are coroutines run with
`asyncio.run`. A KeyboardInterrupt raised inside one ends its task with that
exception, which asyncio (Python 3.11) never marks as retrieved: it logs
"Task exception was never retrieved" and a traceback on the way out, and a
checkpoint save stopped between TFF's write and its deletion of the oldest
leaves one checkpoint too many. The binaries' SIGINT handler calls
`interrupt()`, which raises at once outside `deferred()` and at its end
inside it. Their first SIGTERM does the same (`terminate()`): a cluster's
scheduler sends it before it kills a job, and the run then stops as for a
Ctrl-C, its newest finished round checkpointed, with SIGTERM's status. So
does a SIGHUP (the terminal of a run not started with nohup closed), with
its status.
"""

import asyncio
import contextlib
import os
import signal
import sys
from typing import Optional

# What an interrupted binary prints (after "error: ") and its status, as a
# shell reports a SIGINT.
# A training run checkpoints its newest finished round first where it can
# (pipeline.driver); rounds after its last checkpoint are trained again.
_GOES_ON = ('; re-run the same command to go on (a training run from its '
            'last checkpoint)')
# The other programs' (evaluate, export, plot, benchmarks...): they write
# their outputs whole or not at all, and have nothing to go on from.
_STARTS_OVER = ('; what it had not finished was not written: re-run the same '
                'command')
INTERRUPTED = 'interrupted' + _GOES_ON
INTERRUPTED_WITHOUT_RESUME = 'interrupted' + _STARTS_OVER
EXIT_INTERRUPTED = 130
# A first SIGTERM stops a binary as a Ctrl-C does, with the status a shell
# reports for the signal.
TERMINATED = 'terminated (SIGTERM)'
EXIT_TERMINATED = 143
HUNG_UP = 'hung up (SIGHUP: its terminal closed)'
EXIT_HUNG_UP = 129
# Started by `nohup` (SIGHUP ignored, as this module's import finds it, before
# any handler of this project): a SIGHUP must go on changing nothing.
SIGHUP_IGNORED = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
# The signals that stop a binary as a Ctrl-C does: (cause, status).
STOP_SIGNALS = {signal.SIGTERM: (TERMINATED, EXIT_TERMINATED),
                **({} if SIGHUP_IGNORED else
                   {signal.SIGHUP: (HUNG_UP, EXIT_HUNG_UP)})}
# Its output closed (e.g. `train ... | head`): as a shell reports a SIGPIPE.
OUTPUT_CLOSED = 'its output was closed (broken pipe)'
EXIT_OUTPUT_CLOSED = 141
# Programs that go on from a checkpoint when re-run.
_RESUMING_PROGRAMS = ('binaries.train',)

_depth = 0
_pending = False
_starting_handlers = False  # exit_at_once_while_starting's, installed.
_requested = False
# What stopped this process first: its line's cause and its exit status.
_cause = ('interrupted', EXIT_INTERRUPTED)


def interrupt() -> None:
  """KeyboardInterrupt now, or at the end of the current `deferred()`."""
  global _pending, _requested
  _requested = True
  if _depth:
    _pending = True
    return
  raise KeyboardInterrupt


def terminate(signum: int = signal.SIGTERM) -> None:
  """`interrupt()` for a SIGTERM (or another of `STOP_SIGNALS`): the same
  stop, said and exited as one."""
  global _cause
  if not _requested:
    _cause = STOP_SIGNALS[signum]
  interrupt()


def cause() -> str:
  """What stopped this process: 'interrupted' or `TERMINATED`."""
  return _cause[0]


def exit_status() -> int:
  """The status of a process that `interrupt()` or `terminate()` stopped."""
  return _cause[1]


@contextlib.contextmanager
def deferred():
  """Holds back `interrupt()` until the block is done (seconds at most: a
  metrics row, a checkpoint)."""
  global _depth, _pending
  _depth += 1
  try:
    yield
  finally:
    _depth -= 1
  if not _depth and _pending:
    _pending = False
    raise KeyboardInterrupt


def requested() -> bool:
  """Whether `interrupt()` was called in this process."""
  return _requested


def check() -> None:
  """KeyboardInterrupt if `interrupt()` was called: its exception can be
  lost when the signal lands in a finalizer or a garbage-collector callback
  (Python reports it as "Exception ignored" and goes on). Called at safe
  points of long loops (each round), so such a Ctrl-C still stops the run
  there."""
  if _requested and not _depth:
    raise KeyboardInterrupt


def run_coroutine(coroutine):
  """`asyncio.run(coroutine)` with Ctrl-C held back until it is done."""
  with deferred():
    return asyncio.run(coroutine)


# Programs (`python -m <package>.<name>`) that run through `app.run`.
_APP_PACKAGES = ('binaries.', 'benchmarks.')
# The scripted experiments, which run through `experiments.cli.run_main`
# (its own lines once it runs; stopped while importing, as the binaries).
_EXPERIMENTS_PACKAGE = 'experiments.'


def _main_program() -> str:
  """The module `python -m` runs, else ''."""
  spec = getattr(sys.modules.get('__main__'), '__spec__', None)
  if spec:
    return spec.name
  # While `python -m binaries.x` imports its package, __main__ is not yet
  # the module: the command line names it.
  argv = getattr(sys, 'orig_argv', [])
  if sys.argv[:1] == ['-m'] and '-m' in argv[:-1]:
    return argv[argv.index('-m') + 1]
  return ''


def message(cause: Optional[str] = None) -> str:
  """The line (after "error: ") this program prints when `cause` (e.g. its
  output closed; by default the Ctrl-C or SIGTERM that stopped it) stopped
  it."""
  if cause is None:
    cause = _cause[0]
  program = _main_program()
  if ((program.startswith(_APP_PACKAGES)
       and program not in _RESUMING_PROGRAMS)
      or program.startswith(_EXPERIMENTS_PACKAGE)):
    return cause + _STARTS_OVER
  return cause + _GOES_ON


def _runs_as_app_program() -> bool:
  if sys.argv[:1] == ['-m']:  # `python -m binaries.x`: its package imports.
    return True
  return _main_program().startswith((*_APP_PACKAGES, _EXPERIMENTS_PACKAGE))


def exit_at_once_while_starting() -> None:
  """Ctrl-C (or SIGTERM) while a binary imports TensorFlow and TFF (seconds;
  nothing is written yet) ends it with the binary's one error line and
  status 130 (143), not an import traceback (a SIGTERM: no line, killed by
  the signal), until its `app.run` (an experiment's `run_main`) installs
  its own handlers. Only for the programs that run through those: one that
  imports the package, e.g. pytest, keeps its own."""
  global _starting_handlers
  # `python -m experiments.x` comes here twice: from `experiments` and from
  # `binaries`, which its cli imports.
  if _starting_handlers or not _runs_as_app_program():
    return
  _starting_handlers = True
  # The import of TensorFlow captures file descriptor 2 for a while
  # (tf_logs.stderr_without); the line goes to the real stderr.
  stderr = os.dup(2)

  def exit_now(signum, frame):
    del frame
    cause, status = STOP_SIGNALS.get(signum, (_cause[0], EXIT_INTERRUPTED))
    os.write(stderr, f'error: {message(cause)}\n'.encode())
    os._exit(status)  # pylint: disable=protected-access

  for signum in (signal.SIGINT, *STOP_SIGNALS):
    signal.signal(signum, exit_now)
