"""A temporary directory of this process that a killed process cannot leak.

TensorFlow's autograph writes a `__autograph_generated_file*.py` per converted
function into the temp directory and removes them from an atexit hook, which
SIGKILL (and a re-raised SIGTERM/SIGHUP) never runs: each killed run left ~20
files. `use_private_temp_dir` points Python's `tempfile` (and so autograph)
at a directory of this process, locked while it lives; every start removes
the directories of processes that are gone (their lock is free), and a
normal exit removes its own.
"""

import atexit
import fcntl
import logging
import os
import shutil
import tempfile
import time
from typing import Optional

PREFIX = 'tff-algos-'
_OWNER_LOCK = '.owner.lock'
# A directory without an owner lock yet may be one a process is creating.
_UNLOCKED_GRACE_SECONDS = 60

_directory: Optional[str] = None
_lock_fd: Optional[int] = None
# Where `_directory` was made (`tempfile` keeps naming a removed directory).
_parent: Optional[str] = None


def lock_as_owner(directory: str) -> int:
  """Marks `directory` as this process's while the returned descriptor is
  open (an exclusive lock on a file in it; the kernel frees it when the
  process ends, however it ends)."""
  # Locked before it takes its name: another process's `owner_is_gone`
  # could otherwise lock the new, not yet locked file, and remove the
  # directory of a live process (seen in the test suite).
  unnamed = os.path.join(directory, _OWNER_LOCK + '.new')
  fd = os.open(unnamed, os.O_RDWR | os.O_CREAT, 0o600)
  fcntl.flock(fd, fcntl.LOCK_EX)
  os.rename(unnamed, os.path.join(directory, _OWNER_LOCK))
  return fd


def owner_is_gone(path: str) -> bool:
  """Whether the process that made `path` (`lock_as_owner`) has ended."""
  lock = os.path.join(path, _OWNER_LOCK)
  try:
    fd = os.open(lock, os.O_RDONLY)
  except FileNotFoundError:
    try:
      return time.time() - os.stat(path).st_mtime > _UNLOCKED_GRACE_SECONDS
    except OSError:
      return False
  except OSError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    return False  # Its owner still runs.
  finally:
    os.close(fd)
  return True


def remove_stale(parent: str) -> int:
  """Removes the private temp directories in `parent` of processes that are
  gone; returns how many."""
  removed = 0
  try:
    names = os.listdir(parent)
  except OSError:
    return 0
  for name in names:
    path = os.path.join(parent, name)
    if (name.startswith(PREFIX) and path != _directory and
        os.path.isdir(path) and not os.path.islink(path) and
        owner_is_gone(path)):
      shutil.rmtree(path, ignore_errors=True)
      removed += 1
  return removed


def use_private_temp_dir() -> Optional[str]:
  """Makes `tempfile` use a new directory of this process. Idempotent.

  Returns the directory, or None when the temp directory is not writable
  (then nothing changes and the error, if any, comes from the first use).
  """
  global _directory, _lock_fd, _parent
  if _directory is not None:
    return _directory
  parent = _parent or tempfile.gettempdir()
  removed = remove_stale(parent)
  if removed:
    logging.info('Removed %d temp directories of ended processes from %s',
                 removed, parent)
  try:
    directory = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    lock_fd = lock_as_owner(directory)
  except OSError:
    return None
  _directory, _lock_fd, _parent = directory, lock_fd, parent
  tempfile.tempdir = directory
  atexit.register(remove_private_temp_dir)
  return directory


def remove_private_temp_dir() -> None:
  """Removes this process's directory (at exit, or on a fatal signal).

  `tempfile` keeps naming the removed directory, so that a file made after
  this fails instead of going to the shared temp directory: on a fatal
  signal the process's other threads run until the re-raised signal ends it
  (e.g. TFF's checkpoint writer, whose tf.function autograph converts into a
  temp file), and the atexit hook that would remove such a file never runs.
  """
  global _directory, _lock_fd
  if _directory is None:
    return
  directory, _directory = _directory, None
  shutil.rmtree(directory, ignore_errors=True)
  if _lock_fd is not None:
    os.close(_lock_fd)
    _lock_fd = None
