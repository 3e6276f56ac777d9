"""What a run directory guarantees around training: one trainer at a time,
no resume with different results-changing flags, nothing of a killed round
left behind.

- `RunLock`: an fcntl lock on `<run>/.lock`, held while a process trains in
  (or exports from) the run; the kernel drops it when the process dies, even
  by SIGKILL. A second process gets one UsageError.
- `check_resume`: before anything is written, metrics.csv and the
  TensorBoard events are checked (`run_logs.check_metrics`,
  `run_logs.check_tensorboard`: only what a kill leaves may differ from one
  row per round up to the checkpoint; `run_logs.check_columns`: each row's
  columns are the names its round logged), and the flags of a resumed run are
  compared with its hparams.json; a flag that changes results and differs is
  refused (one line naming each), unless the caller allows changes, which are
  then recorded in hparams.json under `flag_changes`. Flags that do not
  change results (RESULT_NEUTRAL_KEYS) may differ freely; hparams.json keeps
  the values the run started with.
- `finish_resume`: once the checkpoint has loaded, removes what a killed
  round left: temporary checkpoint directories, staging files, metrics rows
  and TensorBoard events after the checkpoint (logged), and writes
  hparams.json (new runs and allowed changes only).
"""

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import shutil
from typing import Any, Callable, Iterator, Mapping, Optional

from pipeline import run_logs
from pipeline.errors import ENVIRONMENT_ERRNOS
from pipeline.errors import EnvironmentFault
from pipeline.errors import UsageError

LOCK_FILE = '.lock'
HPARAMS_FILE = 'hparams.json'
TENSORBOARD_DIR = 'tensorboard'
CHECKPOINTS_DIR = 'checkpoints'
# hparams.json's record of changes allowed on resume.
FLAG_CHANGES_KEY = 'flag_changes'

# Flags that may differ when a run resumes: how long it trains, how often it
# evaluates and checkpoints, where outputs and input data live, and how the
# rounds are executed (runtime and worker settings compute the same rounds,
# up to floating-point rounding across runtimes). Every other flag changes
# the results, so a resumed run must repeat it. `task_defaults_applied`
# records which values came from task defaults, not a setting itself.
RESULT_NEUTRAL_KEYS = frozenset({
    'total_rounds', 'rounds_per_eval', 'rounds_per_checkpoint',
    'root_output_dir', 'experiment_name',
    'cache_dir', 'data_dir', 'download', 'movielens_dir',
    # Where the client states are: a moved store holds the same states (a
    # resume checks every file its checkpoint names).
    'client_state_dir',
    'runtime', 'num_workers', 'num_subrounds', 'worker_addresses',
    'max_concurrent_computation_calls', 'batched_cohorts',
    'task_defaults_applied', FLAG_CHANGES_KEY,
})

# Left by a write that was cut off, by place: TFF's checkpoint and CSV
# writes (`<name>_temp<digits>`), this pipeline's staging files and an
# export's staging directory (`<name>.<8 random characters>.staging`,
# `tempfile.mkdtemp`, and `run_logs.replace_file`'s files). Only these: a
# user's file of another name is kept.
_EXPORT_STAGING = re.compile(r'^(.+)\.[a-z0-9_]{8}\.staging$')
_CUT_OFF_WRITE = re.compile(
    r'^((hparams\.json|metrics\.csv)\.staging|metrics\.csv_temp\d+)$|'
    + _EXPORT_STAGING.pattern)
_CUT_OFF_CHECKPOINT = re.compile(r'^.+_temp\d+$')
_CUT_OFF_EVENTS = re.compile(r'^events\.out\.tfevents\..+\.staging$')


def nearest_existing_path(path: str) -> str:
  """`path` (absolute) or its closest ancestor that exists: what making
  `path` would start from."""
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  return existing


def enclosing_run_dir(path: str, own_run: str) -> Optional[str]:
  """The nearest directory above `path` (both real paths) that is a run
  directory (it holds hparams.json) other than `own_run`, else None."""
  ancestor = os.path.dirname(path)
  while True:
    if ancestor != own_run and os.path.isfile(
        os.path.join(ancestor, HPARAMS_FILE)):
      return ancestor
    parent = os.path.dirname(ancestor)
    if parent == ancestor:
      return None
    ancestor = parent


# A file name's limit in bytes on Linux's file systems (ext4, xfs, tmpfs).
NAME_MAX_BYTES = 255


def check_output_root(root: str, flag: str = 'root_output_dir') -> None:
  """UsageError, naming `--<flag>`, unless `root` is a directory or can be
  made one."""
  if not root:
    raise UsageError(f'--{flag} is empty; name the directory that holds the '
                     'runs')
  if os.path.exists(root) and not os.path.isdir(root):
    raise UsageError(f'--{flag}={root} is a file, not a directory')
  existing = nearest_existing_path(root)
  if not os.path.isdir(existing):
    raise UsageError(f'--{flag}={root} cannot be made: {existing} is a file, '
                     'not a directory')


def run_dir_path(root_output_dir: str, experiment_name: str) -> str:
  """`<root>/<name>`; UsageError if the name would leave the root."""
  name = experiment_name or ''
  if (not name or name in ('.', '..') or '/' in name or '\0' in name or
      (os.altsep and os.altsep in name)):
    raise UsageError(f'--experiment_name={experiment_name!r} must be a '
                     'non-empty name without path separators, other than '
                     '"." and ".."')
  if any(ord(c) < 32 or c == '\x7f' for c in name):
    raise UsageError(f'--experiment_name={experiment_name!r} holds a control '
                     'character (e.g. a newline); name the run without one')
  if len(os.fsencode(name)) > NAME_MAX_BYTES:
    raise UsageError(f'--experiment_name is {len(os.fsencode(name))} bytes '
                     f'long; a file name has at most {NAME_MAX_BYTES}')
  check_output_root(root_output_dir)
  path = os.path.join(root_output_dir, name)
  if os.path.islink(path) and not os.path.exists(path):
    # Making it failed with EEXIST: status 3, "use another
    # --root_output_dir".
    raise UsageError(f'{path} is a symbolic link to {os.readlink(path)}, '
                     'which does not exist (or is a loop of links); make its '
                     'target a directory, or use another --experiment_name')
  if os.path.exists(path) and not os.path.isdir(path):
    # Making the run directory failed with a traceback.
    raise UsageError(f'{path} is a file, not a run directory; use another '
                     '--experiment_name')
  return path


# What a refused second process on a run is told to do instead of waiting.
_RUN_IN_USE_ADVICE = 'use another --experiment_name'


class RunLock:
  """Exclusive use of a run directory by this process (see module doc)."""

  def __init__(self, run_dir: str, writable: bool = True,
               lock_file: str = LOCK_FILE,
               when_busy: str = _RUN_IN_USE_ADVICE):
    """`writable`: open the lock file for writing, so that a run directory
    this process cannot write is an error at once (training); otherwise a
    read-only run can be locked (exporting elsewhere). `lock_file` and
    `when_busy` (the advice when another process holds it) let the same
    lock guard another directory a run uses alone (its client-state
    store)."""
    self._run_dir = run_dir
    self._writable = writable
    self._lock_file = lock_file
    self._when_busy = when_busy
    self._fd: Optional[int] = None

  def acquire(self) -> 'RunLock':
    """Creates the run directory if needed and locks it."""
    try:
      os.makedirs(self._run_dir, exist_ok=True)
    except OSError as e:
      if e.errno in ENVIRONMENT_ERRNOS:
        raise  # The binaries name these faults with the path.
      # E.g. a place the kernel will not make directories in (/proc).
      raise EnvironmentFault(
          f'{self._run_dir} cannot be made ({e.strerror}); use another '
          '--root_output_dir') from None
    path = os.path.join(self._run_dir, self._lock_file)
    if self._writable:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    else:
      try:
        fd = os.open(path, os.O_RDONLY)
      except FileNotFoundError:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise UsageError(
            f'{self._run_dir} is in use by another process (it holds '
            f'{path}); wait for it to finish, or {self._when_busy}'
        ) from None
      raise
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # Closing the descriptor drops the lock.
      self._fd = None

  def __enter__(self) -> 'RunLock':
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()


def entries(run_dir: str) -> Optional[frozenset]:
  """The names in `run_dir`, None if it does not exist: what
  `remove_unwritten` compares against."""
  return frozenset(os.listdir(run_dir)) if os.path.isdir(run_dir) else None


def _holds_files(path: str) -> bool:
  if not os.path.isdir(path):
    return True
  return any(files for _, _, files in os.walk(path))


def remove_unwritten(run_dir: str, before: Optional[frozenset],
                     lock_file: str = LOCK_FILE) -> None:
  """After a refused or failed start: if nothing was written but the lock
  file and empty directories, removes those (the run directory too if it
  was new, `before` being None), so that a refused attempt leaves the
  directory as it was. Call it holding the lock."""
  if not os.path.isdir(run_dir):
    return
  new = [name for name in os.listdir(run_dir)
         if before is None or name not in before]
  if any(name != lock_file and _holds_files(os.path.join(run_dir, name))
         for name in new):
    return
  if before is None:
    shutil.rmtree(run_dir, ignore_errors=True)
    return
  for name in new:
    path = os.path.join(run_dir, name)
    if name == lock_file:
      os.unlink(path)
    else:
      shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def locked(run_dir: str, writable: bool = True, lock_file: str = LOCK_FILE,
           when_busy: str = _RUN_IN_USE_ADVICE
           ) -> Iterator[None]:
  """`RunLock(run_dir, ...)` held for the block; a block that fails having
  written nothing but the lock file and empty directories leaves the
  directory as it was (`remove_unwritten`)."""
  before = entries(run_dir)
  with RunLock(run_dir, writable, lock_file, when_busy):
    try:
      yield
    except BaseException:
      # Under the lock: no other process can have started in it meanwhile.
      remove_unwritten(run_dir, before, lock_file)
      raise


def read_hparams(run_dir: str) -> dict:
  """The run's hparams.json as a dict; UsageError if it is not one."""
  path = os.path.join(run_dir, HPARAMS_FILE)
  if os.path.isdir(path):
    # Reported as missing, with --allow_flag_changes as a way out that then
    # failed to write it.
    raise UsageError(f'{path} is a directory, not the file of the run\'s '
                     'flags: move it away')
  if not os.path.isfile(path):
    raise UsageError(f'{path} not found: the flags of the run are unknown '
                     '(restore the file, or pass --allow_flag_changes to '
                     'record this command\'s)')
  try:
    with open(path, 'rb') as f:
      hparams = json.loads(f.read().decode('utf-8'))
  except UnicodeDecodeError as e:
    raise UsageError(f'{path} is not UTF-8 text (byte {e.start})') from e
  except json.JSONDecodeError as e:
    raise UsageError(f'{path} is not valid JSON: {e}') from e
  if not isinstance(hparams, dict):
    raise UsageError(f'{path} must hold a JSON object of flag values, not a '
                     f'{type(hparams).__name__}')
  history = hparams.get(FLAG_CHANGES_KEY, [])
  if not isinstance(history, list):
    raise UsageError(f'{path}: {FLAG_CHANGES_KEY} must be a list of the '
                     'changes made on earlier resumes, not '
                     f'{json.dumps(history)}: the file is damaged')
  return hparams


def _as_json(values: dict) -> dict:
  """`values` as hparams.json would store them (tuples become lists, ...)."""
  return json.loads(json.dumps(values, default=str, sort_keys=True))


class _NotRecorded:
  """The stored side of a change whose key hparams.json lacks."""

  def __repr__(self):
    return 'NOT_RECORDED'


NOT_RECORDED = _NotRecorded()


def result_changes(stored: dict, current: dict,
                   neutral=RESULT_NEUTRAL_KEYS,
                   defaults: Optional[dict] = None
                   ) -> dict[str, tuple[Any, Any]]:
  """{key: (stored, current)} of keys both have that differ, except
  `neutral` ones. A key hparams.json lacks (a flag added by a code change
  since the run started, or a hand-edited file) is compared with its entry
  in `defaults`, the value the flag has when a command does not give it: a
  current value other than that is a change (stored side NOT_RECORDED). A
  key only hparams.json has (a flag removed by a code change) is not
  compared."""
  current = _as_json(current)
  defaults = _as_json(defaults or {})
  keys = (stored.keys() & current.keys()) | (
      (current.keys() & defaults.keys()) - stored.keys())
  changes = {}
  for key in sorted(keys - neutral):
    old = stored[key] if key in stored else defaults[key]
    if old != current[key]:
      changes[key] = (stored.get(key, NOT_RECORDED), current[key])
  return changes


def _describe(changes: dict[str, tuple[Any, Any]]) -> str:
  def run_value(old):
    return 'not in hparams.json' if old is NOT_RECORDED else json.dumps(old)
  return ', '.join(f'--{key} (run: {run_value(old)}, now: {json.dumps(new)})'
                   for key, (old, new) in changes.items())


@dataclasses.dataclass(frozen=True)
class ResumePlan:
  """What `finish_resume` does; made by `check_resume` (which writes
  nothing)."""
  # The checkpoint round the run continues from; None: a new run.
  start_round: Optional[int]
  # hparams.json to write, or None to leave it as it is.
  hparams_to_write: Optional[dict]
  # Logged once hparams.json records the changes (not before: a later
  # check may still refuse the resume).
  note: Optional[str] = None
  # The flags changed with `allow_flag_changes`, described (`--seed (run:
  # 0, now: 1)`): a checkpoint that cannot take them is no damage.
  changed: Optional[str] = None


def check_resume(run_dir: str, start_round: Optional[int],
                 hparams: Optional[dict],
                 allow_flag_changes: bool = False,
                 defaults: Optional[dict] = None,
                 unused: frozenset = frozenset(),
                 fixed: Optional[Mapping[str, str]] = None,
                 check_stored: Optional[Callable[[dict, str], None]] = None
                 ) -> ResumePlan:
  """Checks that the run may continue from `start_round` with `hparams`
  (see module doc); writes nothing. `hparams` None: not checked (library
  use). `defaults`: what keys hparams.json lacks are compared with
  (`result_changes`). `unused`: keys of flags the run's algorithm does not
  read (their values, e.g. one derived from a used flag, change nothing).
  `fixed`: {key: why} of flags that may not change even with
  `allow_flag_changes` (a change would make the run's record wrong).
  `check_stored(stored, path)`: raises UsageError for keys or values of
  hparams.json no command writes (a damaged file, not a changed flag)."""
  metrics_path = os.path.join(run_dir, run_logs.METRICS_FILE)
  # UsageError if damaged, or not one row per round up to the checkpoint.
  metrics = run_logs.check_metrics(metrics_path, start_round or 0)
  tensorboard_dir = os.path.join(run_dir, TENSORBOARD_DIR)
  logged = run_logs.check_tensorboard(tensorboard_dir)
  if metrics is not None and start_round:
    # A renamed column would split its metric in two.
    run_logs.check_columns(metrics_path, metrics, logged, start_round,
                           tensorboard_dir)
  current = _as_json(hparams or {})
  if start_round is None:
    if metrics is not None and metrics.rows:
      raise UsageError(
          f'{metrics_path} has rows but {run_dir} has no checkpoint to resume'
          ' them from: use a new --experiment_name, or move the run\'s files '
          'away')
    return ResumePlan(None, current)
  if hparams is None:
    return ResumePlan(start_round, None)
  path = os.path.join(run_dir, HPARAMS_FILE)
  if not os.path.lexists(path) and allow_flag_changes:
    logging.warning('%s was missing; it now records this command\'s flags',
                    path)
    return ResumePlan(start_round, current)
  stored = read_hparams(run_dir)
  if check_stored is not None:
    check_stored(stored, path)
  changes = result_changes(stored, current, RESULT_NEUTRAL_KEYS | unused,
                           defaults)
  if not changes:
    return ResumePlan(start_round, None)
  fixed_changes = {k: v for k, v in changes.items() if k in (fixed or {})}
  if fixed_changes:
    reasons = '; '.join(dict.fromkeys(fixed[k] for k in fixed_changes))
    raise UsageError(
        f'{run_dir} was trained with other values of flags that cannot '
        f'change in a run, even with --allow_flag_changes: '
        f'{_describe(fixed_changes)} ({reasons}); repeat the run\'s values '
        'or use a new --experiment_name')
  if not allow_flag_changes:
    raise UsageError(
        f'{run_dir} was trained with other values of flags that change '
        f'results: {_describe(changes)}; repeat the run\'s values, use a new '
        '--experiment_name, or pass --allow_flag_changes to continue with '
        'the new ones')
  changed = _describe(changes)
  note = (f'{run_dir} continues from round {start_round} with changed '
          f'flags: {changed} (recorded in {HPARAMS_FILE})')
  history = list(stored.get(FLAG_CHANGES_KEY) or [])
  # A key hparams.json lacked has no 'run' value.
  history.append({'from_round': start_round, 'changes': {
      key: ({'now': new} if old is NOT_RECORDED else {'run': old, 'now': new})
      for key, (old, new) in changes.items()}})
  # Neutral values stay the run's; changed ones take this command's.
  updated = {**current, **{k: stored[k] for k in stored.keys() &
                           RESULT_NEUTRAL_KEYS}}
  updated[FLAG_CHANGES_KEY] = history
  return ResumePlan(start_round, updated, note, changed)


def remove_cut_off_writes(run_dir: str) -> None:
  """Removes temporary files and directories of writes that were cut off
  (killed checkpoint writes, staging files) in the run's own directories."""
  places = [(run_dir, _CUT_OFF_WRITE),
            (os.path.join(run_dir, CHECKPOINTS_DIR), _CUT_OFF_CHECKPOINT)]
  tensorboard = os.path.join(run_dir, TENSORBOARD_DIR)
  places += [(root, _CUT_OFF_EVENTS) for root, _, _ in os.walk(tensorboard)]
  for place, cut_off in places:
    try:
      names = sorted(os.listdir(place))
    except (FileNotFoundError, NotADirectoryError):
      continue
    for name in names:
      path = os.path.join(place, name)
      if not cut_off.match(name) or os.path.islink(path):
        continue
      if os.path.isdir(path):
        export_target = _EXPORT_STAGING.match(name)
        if export_target:
          put_back_retired_export(path, os.path.join(place,
                                                     export_target.group(1)))
        shutil.rmtree(path)
      else:
        os.remove(path)
      logging.warning('Removed %s, left by a write that was cut off', path)


def put_back_retired_export(staging: str, export_dir: str) -> None:
  """An export killed between moving the previous export aside (into its
  staging directory's `old/`) and the new one in left `export_dir` missing:
  the previous export goes back."""
  retired = os.path.join(staging, 'old')
  if os.path.isdir(retired) and not os.path.lexists(export_dir):
    os.rename(retired, export_dir)
    logging.warning('Put back the previous export %s, which an export cut off '
                    'had moved aside', export_dir)


def write_hparams(run_dir: str, hparams: dict) -> None:
  path = os.path.join(run_dir, HPARAMS_FILE)
  staging = path + '.staging'
  with open(staging, 'w', encoding='utf-8') as f:
    json.dump(hparams, f, indent=2, sort_keys=True, default=str)
    f.flush()
    os.fsync(f.fileno())
  os.replace(staging, path)


def finish_resume(run_dir: str, plan: ResumePlan) -> None:
  """Cuts the run back to its checkpoint (see module doc)."""
  remove_cut_off_writes(run_dir)
  last_round = plan.start_round or 0
  run_logs.trim_metrics(os.path.join(run_dir, run_logs.METRICS_FILE),
                        last_round)
  run_logs.trim_tensorboard(os.path.join(run_dir, TENSORBOARD_DIR),
                            last_round)
  if plan.hparams_to_write is not None:
    write_hparams(run_dir, plan.hparams_to_write)
  if plan.note:
    logging.warning('%s', plan.note)
