"""The experiments' command line, held to the binaries' standard
(binaries/app.py): bad input ends with one line `error: ...` and status 2,
an environment fault with status 3, Ctrl-C with 130, never a traceback.

The experiments parse their flags with argparse, whose own error is a usage
block and a `prog: error: ...` line; the binaries they run print their own
error line, which a CalledProcessError traceback used to follow.
"""

import argparse
import logging as logging_lib
import math
import os
import signal
import subprocess
import sys
from typing import Callable

from binaries import app
from pipeline import interrupts
from pipeline import private_temp
from pipeline import tff_runtime
from pipeline.errors import UsageError


ArgumentParser = app.ArgumentParser


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):
    raise ValueError(text)
  return value


def finite_number(text: str) -> float:
  """An argparse `type`: a finite float (a NaN margin or target was taken,
  and every comparison with it failed)."""
  try:
    return _finite_float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not a finite number') from None


def exact(value: float) -> str:
  """`value` for a flag or a run name: as short as `:g` writes it when that
  is the same number, else Python's exact repr (`:g` keeps 6 digits, so
  0.3000001 trained at 0.3, and as the same run as 0.3)."""
  short = f'{value:g}'
  return short if float(short) == value else repr(float(value))


def comma_list(kind: type) -> Callable[[str], list]:
  """An argparse `type` of comma-separated ints or (finite) floats (`kind`
  int, float, or positive_int); a bad item was a ValueError traceback after
  parsing."""
  parse_item, noun = {int: (int, 'integers'),
                      positive_int: (positive_int, 'integers >= 1'),
                      float: (_finite_float, 'finite numbers')}[kind]

  def parse(text: str) -> list:
    try:
      return [parse_item(item) for item in text.split(',')]
    except (ValueError, argparse.ArgumentTypeError):
      raise argparse.ArgumentTypeError(
          f'{text!r} is not a comma-separated list of {noun}') from None

  return parse


def seed(text: str) -> int:
  """An argparse `type`: a seed as the binaries' --seed takes it, 0 to
  2**32 - 1 (NumPy's and TF's seeds refused others with a traceback)."""
  try:
    value = int(text)
  except ValueError:
    value = -1
  if not 0 <= value <= 2**32 - 1:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not a seed: an integer from 0 to 2**32 - 1')
  return value


def positive_int(text: str) -> int:
  """An argparse `type`: an integer >= 1 (the in-process experiments passed
  0 on, to be refused under the driver's flag name, e.g. --total_rounds for
  --rounds)."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f'{text!r} is not an integer >= 1')
  return value


def run_binary(command: list[str], **kwargs) -> None:
  """Runs a binary of the project; when it fails, this process ends with
  its status, below the binary's own `error: ...` line (whose advice names
  the experiment's --root_output_dir, not the binary's run flags).

  The binary gets SIGTERM when this process dies: killed with SIGTERM, an
  experiment left its training running on, TFF worker and all. Ctrl-C
  reaches both (one process group), a SIGINT to this process alone is passed
  on: the binary stops cleanly and says so (subprocess.run SIGKILLed it, and
  a second line followed).
  """
  environment = dict(kwargs.pop('env', None) or os.environ)
  environment[app.RUN_BY_EXPERIMENT_ENV] = '1'
  process = subprocess.Popen(
      tff_runtime.die_with_parent(command, signal.SIGTERM), env=environment,
      **kwargs)
  try:
    status = process.wait()
  except KeyboardInterrupt:
    # A SIGINT sent to this process alone (`kill -INT`, not a Ctrl-C to the
    # group) did not reach the binary and was lost here: it trained on, and
    # the experiment's runs after it too (status 0). The binary takes a
    # second one as nothing. A SIGTERM (`run_main`) is passed on as one.
    process.send_signal(signal.SIGTERM if interrupts.cause() ==
                        interrupts.TERMINATED else signal.SIGINT)
    status = process.wait()
    if not status:  # It had finished: the experiment says it stopped.
      raise
  if status:
    sys.exit(status if status > 0 else 128 - status)  # -N: killed by N.


class _WithoutRetracingNotes(logging_lib.Filter):
  """An experiment trains many small runs in one process, so TF's notes
  that a function was traced again (a performance hint) are expected."""

  def filter(self, record):
    return 'triggered tf.function retracing' not in record.getMessage()


def run_main(main: Callable[[], int], runs_kept: bool = True) -> None:
  """sys.exit(main()), with the binaries' error lines and statuses.

  `runs_kept`: whether the experiment's runs are run directories a re-run
  goes on from (False: runs in a temporary directory, trained in this
  process). Those, and TF's temporary files, live in this process's private
  temp directory, removed at exit, on SIGTERM/SIGHUP, or (after a SIGKILL)
  by the next start of a binary or experiment.
  """
  tff_runtime.install_shutdown_hooks()
  private_temp.use_private_temp_dir()
  app.remove_temp_dir_on_fatal_signals()
  # A SIGTERM stops it as a Ctrl-C does, as it stops the binaries (it ended
  # the experiment at once: no line, killed by the signal); a second
  # Ctrl-C or SIGTERM changes nothing (it could cut the first one's line
  # short with a traceback).
  signal.signal(signal.SIGINT, app.interrupt_once)
  signal.signal(signal.SIGTERM, app.terminate_once)
  # One that lands in a finalizer or gc callback is lost there (the run
  # stops at its next interrupts.check()); Python's report of it is not
  # the one line.
  sys.unraisablehook = app.unraisable_unless_interrupt
  logging_lib.getLogger('tensorflow').addFilter(_WithoutRetracingNotes())
  try:
    status = main()
  except UsageError as e:
    # A run kept under --root_output_dir is named by it (in-process runs'
    # refusals said to pass a new --experiment_name).
    message = app.advice_for_experiments(str(e)) if runs_kept else str(e)
    print(f'error: {message}', file=sys.stderr)
    status = app.EXIT_USAGE
  except KeyboardInterrupt:
    cause = interrupts.cause()
    if runs_kept:
      print(f'error: {cause}; re-run the same command to go on (the runs '
            'trained so far are kept)', file=sys.stderr)
    else:
      print(f'error: {cause} (its runs were temporary: a re-run starts '
            'over)', file=sys.stderr)
    status = interrupts.exit_status()
  except Exception as e:  # pylint: disable=broad-except
    message = app.environment_fault_message(e)
    if message is not None:
      print(f'error: {message}', file=sys.stderr)
      status = app.EXIT_ENVIRONMENT
    elif _is_setting_error(e):
      # An experiment's flag of an algorithm setting (e.g. a negative
      # learning rate) was a traceback; the binaries say it this way.
      print(f'error: --{e}', file=sys.stderr)
      status = app.EXIT_USAGE
    else:
      raise
  sys.exit(status)


def _is_setting_error(error: Exception) -> bool:
  settings = sys.modules.get('tff_algos.algorithms.settings')
  return settings is not None and isinstance(error, settings.SettingError)


if __name__ == '__main__':
  from pipeline import errors as _errors  # pylint: disable=g-import-not-at-top
  _errors.refuse_to_run_library_module(__spec__)
