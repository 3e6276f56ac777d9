"""Entry-point wrapper shared by the binaries.

Exit statuses:
  0  success.
  2  bad input: a flag value absl or the binary rejects, a positional
     argument, a damaged or mismatched file of the run, a run directory in
     use by another process (UsageError). One line `error: ...` on stderr.
  3  an environment fault: an output that cannot be written (disk full,
     read-only or not permitted), a TFF worker that cannot be started or
     reached (EnvironmentFault, or the OS's own error). One line
     `error: ...`; what was written before stays valid, so re-running the
     same command once the fault is fixed resumes.
  1  anything else (a bug): Python's traceback.
A fatal signal ends the process with that signal's status. TFF's worker
process is stopped on every exit path, and the process's temporary files
live in a private directory that is removed at exit (and, after a SIGKILL,
at the next start of any binary).
"""

import argparse
import atexit
import errno
import logging as logging_lib
import os
import re
import signal
import sqlite3
import sys
import warnings
from typing import Iterator, Optional

from absl import app
from absl import flags
from absl import logging

from pipeline import interrupts
from pipeline import private_temp
from pipeline import tff_runtime
from pipeline.errors import DAMAGED_CLIENT_STATE
from pipeline.errors import ENVIRONMENT_ERRNOS
from pipeline.errors import EnvironmentFault
from pipeline.errors import first_line
from pipeline.errors import UsageError

EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3
EXIT_INTERRUPTED = interrupts.EXIT_INTERRUPTED

# How TensorFlow (gfile, SavedModel) and SQLite report the same faults.
_ENVIRONMENT_MESSAGES = ('No space left on device', 'Read-only file system',
                         'Permission denied', 'Disk quota exceeded',
                         'database or disk is full',
                         'attempt to write a readonly database',
                         # Memory: e.g. a model too large for the machine.
                         'OOM when allocating')
_TF_PATH_SEPARATOR = re.compile('; (?=' + '|'.join(
    map(re.escape, _ENVIRONMENT_MESSAGES[:4])) + ')')
_RECOVERY = ('fix that and re-run the same command (what was written before '
             'is kept)')

# Set by an experiment for the binaries it runs: their users name runs by the
# experiment's --root_output_dir and cannot pass the binary's run flags, so
# advice naming those is rewritten (`advice_for_experiments`).
RUN_BY_EXPERIMENT_ENV = 'FL_PIPELINE_RUN_BY_EXPERIMENT'
_EXPERIMENT_ADVICE = (
    (re.compile(r', use a new --experiment_name, or pass '
                r'--allow_flag_changes to [^;)]*'),
     ', or use another --root_output_dir'),
    (re.compile(r',? (?:even )?with --allow_flag_changes'), ''),
    (re.compile(r',? or pass --allow_flag_changes to [^;)]*'), ''),
    (re.compile(r'(?:start|train) a new --experiment_name'),
     'use another --root_output_dir'),
    (re.compile(r'(?:a new|another) --experiment_name'),
     'another --root_output_dir'),
)


def advice_for_experiments(message: str) -> str:
  """`message` with the binary's advice on its run flags (a new
  --experiment_name, --allow_flag_changes) put as an experiment's user can
  follow it (another --root_output_dir)."""
  for pattern, replacement in _EXPERIMENT_ADVICE:
    message = pattern.sub(replacement, message)
  return message


def _chain(error: Optional[BaseException]) -> Iterator[BaseException]:
  """`error`, its cause (else its context), theirs, ... each once."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def environment_fault_message(error: BaseException) -> Optional[str]:
  """The one-line message of an environment fault in `error`'s chain (the
  error, its cause and context), else None."""
  for link in _chain(error):
    if isinstance(link, EnvironmentFault):
      return str(link)
    if isinstance(link, OSError) and link.errno in ENVIRONMENT_ERRNOS:
      where = f'{link.filename}: ' if link.filename else ''
      return f'{where}{link.strerror}; {_RECOVERY}'
    if isinstance(link, (sqlite3.OperationalError, OSError)) or (
        type(link).__module__.startswith(('tensorflow', 'grpc'))):
      line = _line_naming_the_fault(str(link))
      if line is not None:
        return f'{line}; {_RECOVERY}'
  return None


def _line_naming_the_fault(text: str) -> Optional[str]:
  """The line of an error text that reports an environment fault, without
  the wrapping of TF (`Graph execution error:` first, the failing path on a
  later line) and of a TFF worker's gRPC status (`details = "Failed to run
  computation: ...`), else None."""
  for line in str(text).splitlines():
    if any(marker in line for marker in _ENVIRONMENT_MESSAGES):
      line = re.sub(r'^\s*details = "', '', line)
      line = re.sub(r'^Failed to run computation: ', '', line)
      # TF writes `path; No space left on device`; the OS's errors read
      # `path: ...` (OSError above), and both now do.
      line = _TF_PATH_SEPARATOR.sub(': ', line)
      return first_line(line).rstrip('"')
  return None


class _UnusedAssertionFilter(logging_lib.Filter):
  """Drops TF's `Object was never used` reports of assertion ops.

  TFF 0.87's secure-sum aggregator (`--aggregator=secure`) builds range
  assertions it never runs; when they are garbage-collected TF logs each as
  an ERROR with a stack (216 lines a run), though nothing failed and nothing
  can be done about it here.
  """

  def filter(self, record):
    message = record.getMessage()
    return not ('Object was never used' in message and
                'Assert/AssertGuard' in message)


# How TF reports a dataset record that is not what the task's parser expects
# (e.g. a damaged sqlite file of TFF's CelebA or StackOverflow): found while
# training, in the worker, and passed up through gRPC. Not a proto at all;
# a feature of another size or type; a feature missing.
_UNPARSABLE_DATA = re.compile(
    r"Could not parse example input|"
    r"Key: [\w/.-]+\.\s+(?:Can't parse serialized Example|"
    r"Data types don't match)|"
    r'Feature: [\w/.-]+ \(data type: \w+\) is required but could not be '
    r'found')


# How TF reports a TFRecord file of the task's data (e.g. a TFDS shard of
# Wikipedia) that is cut short or not a TFRecord file: a traceback, from
# this process or from the worker.
_DAMAGED_RECORD = re.compile(r'(truncated|corrupted) record at \d+')


# How TF reports a file it was told to read that is not there (e.g. a TFDS
# shard of the task's data deleted): a traceback.
_MISSING_FILE = re.compile(r'(/[^\s;]+); No such file or directory')


# How TF's SQL dataset (TFF's SqlClientData: TFF's CelebA, StackOverflow,
# EMNIST files and this project's partitions of EMNIST and CIFAR) reports a
# damaged SQLite file.
_DAMAGED_SQLITE = re.compile(r'database disk image is malformed|'
                             r'file is not a database')


# How TFDS reports a split with fewer records than its metadata (a shard
# emptied or cut short at a record boundary).
_SHORT_DATASET = re.compile(r'Input dataset was expected to contain \d+ '
                            r'elements but contained only \d+ elements')


# How TF's sparse cross-entropy reports a label beyond the model's classes
# (e.g. 99 in a file of TFF's 62-class EMNIST): a traceback, from this
# process or from the worker.
_LABEL_OUT_OF_RANGE = re.compile(
    r'Received a label value of -?\d+ which is outside the valid range of '
    r'\[0, \d+\)')


# How a task's check of its parsed values reports a NaN or infinite one
# (`tf.debugging.check_numerics`'s message: ours, then what it found).
_NON_FINITE_DATA = re.compile(
    r'(EMNIST pixels that are not finite) : Tensor had (NaN|Inf) values')
_DATA_OUT_OF_RANGE = re.compile(r'EMNIST pixels outside \[0, 1\]|'
                                r'CelebA image pixel outside 0\.\.255|'
                                r'CelebA smiling label other than 0 or 1')


# How a client's state file whose values do not match its checksum is
# reported (tf.debugging.Assert's message: the marker, then the path), from
# this process or from the worker.
_DAMAGED_STATE = re.compile(
    r'\[' + re.escape(DAMAGED_CLIENT_STATE) + r'\] \[([^\]]+)\]')


_NOT_THIS_TASKS = ('they are damaged or not the files of this task '
                   '(--cache_dir, --data_dir)')

# (how TF reports it, its one line from the match), in the order tried.
_BAD_DATA = (
    (_UNPARSABLE_DATA, lambda m: 'the task\'s data files hold records that '
     f'cannot be parsed ({m.group(0)}): {_NOT_THIS_TASKS}'),
    (_DAMAGED_STATE, lambda m: f'{m.group(1)} is damaged, or another '
     'client\'s or round\'s state: its values do not match its checksum; '
     'restore the client state directory, or train a new --experiment_name'),
    (_DAMAGED_RECORD, lambda m: 'the task\'s data files hold a damaged '
     f'TFRecord file ({m.group(0)}): restore them, or use the files of this '
     'task (--cache_dir, --data_dir)'),
    (_MISSING_FILE, lambda m: f'a file the run reads is missing: {m.group(1)} '
     '(No such file or directory); restore it, or use the files of this task '
     '(--cache_dir, --data_dir)'),
    (_DAMAGED_SQLITE, lambda m: 'the task\'s data files hold a damaged SQLite '
     f'file ({m.group(0)}): restore it; a partition this project made '
     '(<--cache_dir>/partitions/*.sqlite) is made again once deleted'),
    (_SHORT_DATASET, lambda m: 'the task\'s data files hold fewer records '
     f'than their metadata says ({m.group(0)}): restore them, or prepare the '
     'dataset again (--data_dir)'),
    (_NON_FINITE_DATA, lambda m: f'the task\'s data files hold {m.group(1)} '
     f'({m.group(2)}): {_NOT_THIS_TASKS}'),
    (_DATA_OUT_OF_RANGE, lambda m: f'the task\'s data files hold {m.group(0)}'
     f': {_NOT_THIS_TASKS}'),
    (_LABEL_OUT_OF_RANGE, lambda m: 'the task\'s data files hold a label the '
     f'model has no class for ({m.group(0)}): {_NOT_THIS_TASKS}'),
)


def bad_data_message(error: BaseException) -> Optional[str]:
  """The one-line message for a task's data that is damaged or missing, or a
  damaged client state file, if `error`'s chain (the error, its cause and
  context) reports it."""
  for link in _chain(error):
    for pattern, message in _BAD_DATA:
      match = pattern.search(str(link))
      if match:
        return message(match)
  return None


def remove_temp_dir_on_fatal_signals() -> None:
  # tff_runtime's handlers re-raise the signal with its default action, which
  # skips atexit hooks; the private temp directory goes first.
  for signum in (signal.SIGTERM, signal.SIGHUP):
    previous = signal.getsignal(signum)
    if previous == signal.SIG_IGN:  # SIGHUP under `nohup`: it stays so.
      continue

    def handler(number, frame, previous=previous):
      private_temp.remove_private_temp_dir()
      if callable(previous):
        previous(number, frame)
      else:
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)

    signal.signal(signum, handler)


def interrupt_once(signum, frame):
  """SIGINT: KeyboardInterrupt the first time, then ignored. A second one (a
  second Ctrl-C, or GNU `timeout -s INT`, which signals the process and then
  its process group) interrupted the clean-up with a traceback. Inside
  `interrupts.deferred()` (a metrics row, a checkpoint) it comes at its end;
  one lost in a finalizer comes at the next `interrupts.check()`."""
  del signum, frame
  if not interrupts.requested():
    interrupts.interrupt()


def terminate_once(signum, frame):
  """SIGTERM (or SIGHUP): the first one stops the binary as a Ctrl-C does
  (`interrupts.terminate`: its newest finished round checkpointed, one line,
  status 143, or 129), then ignored, as `interrupt_once` ignores a second
  SIGINT: GNU `timeout` sends it to the process and then to its process
  group, and a cluster's scheduler sends SIGKILL when its grace period
  ends."""
  del frame
  if not interrupts.requested():
    interrupts.terminate(signum)


def _ignore_stop_signals() -> None:
  """Ctrl-C, SIGTERM and SIGHUP from now on change nothing (the error line
  is said, the workers are being shut down)."""
  for signum in (signal.SIGINT, *interrupts.STOP_SIGNALS):
    signal.signal(signum, signal.SIG_IGN)


def unraisable_unless_interrupt(unraisable) -> None:
  # A KeyboardInterrupt raised in a finalizer or a gc callback is lost
  # there (interrupts.check raises it again); Python's report of it, an
  # "Exception ignored in ..." block, is not the binary's one line.
  if not issubclass(unraisable.exc_type, KeyboardInterrupt):
    sys.__unraisablehook__(unraisable)


def exit_without_finalizing(status: int) -> None:
  """Exits as `sys.exit` would (atexit hooks, flushed output), without the
  interpreter's finalization. A thread the error or Ctrl-C left inside a
  TF/TFF call (the computation of a round cut short) takes the GIL back
  while Python finalizes; Python then ends it with a forced unwind, which
  TF's C++ catches without rethrowing, and the process aborted (status 134,
  "FATAL: exception not rethrown", a thread dump) after the error line."""
  try:
    atexit._run_exitfuncs()  # pylint: disable=protected-access
  finally:
    _flush_what_is_still_open()
    os._exit(status)  # pylint: disable=protected-access


def _flush_what_is_still_open() -> None:
  """Flushes stdout and stderr, unless closed (`>&-`: None) or nobody reads
  them (`_nobody_reads`): there is nobody to tell then. Other faults (a full
  disk) still raise."""
  for stream in (sys.stdout, sys.stderr):
    if stream is None:
      continue
    try:
      stream.flush()
    except OSError as e:
      if not _nobody_reads(e):
        raise


def _nobody_reads(error: OSError) -> bool:
  """Whether `error` of a write to stdout or stderr says nobody reads it:
  its reader left (a broken pipe) or its terminal closed (EIO, after the
  SIGHUP that stopped the run)."""
  return isinstance(error, BrokenPipeError) or error.errno == errno.EIO


_HELP_FLAGS = frozenset(
    ('--help', '-help', '-h', '-?', '--helpshort', '-helpshort', '--helpfull',
     '-helpfull', '--helpxml', '-helpxml'))


def run(main, allow_positional_args: bool = False) -> None:
  tff_runtime.install_shutdown_hooks()
  private_temp.use_private_temp_dir()
  remove_temp_dir_on_fatal_signals()
  signal.signal(signal.SIGINT, interrupt_once)
  for signum in interrupts.STOP_SIGNALS:
    signal.signal(signum, terminate_once)
  sys.unraisablehook = unraisable_unless_interrupt

  def fail(message: str, status: int):
    # Said once: a Ctrl-C now would cut the workers' shutdown short with a
    # second line.
    _ignore_stop_signals()
    if os.environ.get(RUN_BY_EXPERIMENT_ENV):
      message = advice_for_experiments(message)
    try:
      print(f'error: {message}', file=sys.stderr)
    except OSError as e:
      if not _nobody_reads(e):
        raise
    tff_runtime.shutdown_workers()
    exit_without_finalizing(status)

  def output_closed():
    # `train ... | head`: the run stops as for a Ctrl-C (the driver
    # checkpointed its newest finished round), the rest of its output to
    # nowhere.
    if sys.stdout is not None:
      try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
      except (OSError, ValueError):
        pass
    fail(interrupts.message(interrupts.OUTPUT_CLOSED),
         interrupts.EXIT_OUTPUT_CLOSED)

  def interrupted():
    # Ctrl-C is a way to stop, not a fault: no traceback. A run's writes
    # are atomic, so the same command goes on from the last one.
    # What it cut short (e.g. an event loop of a checkpoint write, half
    # made, and its coroutine) is reported by Python at collection as
    # "Exception ignored ..." and "never awaited"; nothing to act on.
    sys.unraisablehook = lambda unraisable: None
    warnings.simplefilter('ignore')
    fail(interrupts.message(), interrupts.exit_status())

  def guarded_main(argv):
    # Notes read `WARNING: <message>`, not absl's `W1127 03:40:39.567080
    # 140476141452160 run_logs.py:191] <message>`, which reads as an
    # internal fault (absl installs its handler in app.run).
    logging.get_absl_handler().setFormatter(
        logging_lib.Formatter('%(levelname)s: %(message)s'))
    logging_lib.getLogger('tensorflow').addFilter(_UnusedAssertionFilter())
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)
      # Only binaries that use TF have imported it; others (plot) stay light.
      tf = sys.modules.get('tensorflow')
      if tf is not None:
        tf.get_logger().setLevel('WARNING')
    try:
      if len(argv) > 1 and not allow_positional_args:
        raise UsageError(f'unexpected positional arguments: '
                         f'{" ".join(argv[1:])} (every option is a --flag)')
      return main(argv)
    except UsageError as e:
      fail(str(e), EXIT_USAGE)
    except KeyboardInterrupt:
      interrupted()
    except (NotADirectoryError, IsADirectoryError) as e:
      # A path given through a file, or a file path that is a directory.
      fail(f'{e.filename}: {e.strerror}', EXIT_USAGE)
    except Exception as e:  # pylint: disable=broad-except
      if interrupts.requested() or any(
          isinstance(link, KeyboardInterrupt) for link in _chain(e)):
        # The KeyboardInterrupt came inside a C extension's callback (e.g.
        # SavedModel tracing), which reported it as its own error, such as
        # "SystemError: ... returned a result with an exception set".
        interrupted()
      if any(isinstance(link, BrokenPipeError) for link in _chain(e)):
        output_closed()
      message = environment_fault_message(e)
      if message is not None:
        fail(message, EXIT_ENVIRONMENT)
      message = bad_data_message(e)
      if message is None:
        raise
      fail(message, EXIT_USAGE)

  def parse_flags(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      # absl puts each bad flag on a line of its own: one line, all named.
      print('error: ' + '; '.join(
          line.strip() for line in str(e).splitlines() if line.strip()),
            file=sys.stderr)
      sys.exit(EXIT_USAGE)

  status = 1
  try:
    app.run(guarded_main, flags_parser=parse_flags)
  except KeyboardInterrupt:
    # Outside guarded_main: while absl parses and validates the flags.
    interrupted()
  except SystemExit as e:
    if isinstance(e.code, str):
      print(e.code, file=sys.stderr)
    status = e.code if isinstance(e.code, int) else int(e.code is not None)
    if status == 1 and _HELP_FLAGS.intersection(sys.argv[1:]):
      status = 0  # absl's help flags exit 1, which here means a bug.
  finally:
    # The work is done (or failed, and said so): a Ctrl-C now would cut the
    # workers' shutdown short with a traceback, or end Python's
    # finalization without a line.
    _ignore_stop_signals()
    tff_runtime.shutdown_workers()
  exit_without_finalizing(status)


class ArgumentParser(argparse.ArgumentParser):
  """argparse, for the commands that use it (experiments, peer benchmarks),
  with the binaries' one line `error: ...` and status 2 instead of its usage
  block and `prog: error: ...` line, and flag names taken as written, as
  absl takes them: argparse's prefixes ran `--total_round=3` as
  `--total_rounds=3`, and reported a misspelt required flag as missing."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault('allow_abbrev', False)
    super().__init__(*args, **kwargs)

  def parse_known_args(self, args=None, namespace=None):
    args = sys.argv[1:] if args is None else list(args)
    options = args[:args.index('--')] if '--' in args else args
    unknown = [arg for arg in options if arg.startswith('--') and
               arg.split('=', 1)[0] not in self._option_string_actions]
    if unknown:
      self.error(f'unrecognized arguments: {" ".join(unknown)}')
    return super().parse_known_args(args, namespace)

  def error(self, message):
    print(f'error: {message}', file=sys.stderr)
    sys.exit(EXIT_USAGE)


def require_flags(*names: str) -> None:
  missing = [name for name in names if flags.FLAGS[name].value is None]
  if missing:
    raise UsageError('missing required flag(s): ' +
                     ', '.join(f'--{name}' for name in missing))


def check_flags_apply(owner: str, accepted: tuple[str, ...],
                      candidates: tuple[str, ...]) -> None:
  """Each of `candidates` set on the command line must be one `owner` (e.g.
  'algorithm=fedavg', 'task=digits') uses: a flag it would ignore is an error,
  not a silent no-op."""
  for name in candidates:
    if flags.FLAGS[name].present and name not in accepted:
      allowed = ', '.join(f'--{n}' for n in accepted) or 'none'
      raise UsageError(f'--{name} does not apply to --{owner} '
                       f'(its flags: {allowed})')


if __name__ == '__main__':
  from pipeline import errors as _errors  # pylint: disable=g-import-not-at-top
  _errors.refuse_to_run_library_module(__spec__)
