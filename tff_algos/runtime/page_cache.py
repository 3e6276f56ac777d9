"""Keeps written client-state files out of RAM unless they are read soon.

Every round writes a new state file per sampled client (5.4 MB per SCAFFOLD
client of the benchmark's model). Left alone, the kernel keeps each file's
pages in the page cache until memory runs short, so a run's RAM use grows by
every state it writes, and each write lands in fresh memory. Fresh memory is
what a write costs most where a hypervisor takes free memory back (free-page
reporting, as on Firecracker microVMs): measured on such a VM, 100 new
5.4 MB files took 1.0-1.1 s of kernel CPU when their pages stayed cached,
and 0.10-0.17 s when each file was written back and dropped from the cache as
soon as it was closed, so that the next files reused its pages.

`ClosedFileEvictor` does the latter: it watches a directory with Linux's
inotify and, in a background thread, writes back (`fdatasync`) and drops
(`POSIX_FADV_DONTNEED`) every file closed after writing, except those it is
told to keep. A dropped state read again comes from disk (measured: 4 ms
per 5.4 MB against 0.7 ms from the cache), so the driver keeps the states
of the clients the next round samples: with a small population sampled
every round nothing is dropped, and the writes reuse the pages that the
replaced states free. Eviction never changes a file's content, so a run's
results are the same with it or without it. Only files closed on this
machine are seen: a store on a shared file system written by remote
workers is left to the kernel. Elsewhere than Linux, it does nothing.
"""

import ctypes
import ctypes.util
import logging
import os
import select
import struct
import threading
from typing import Iterable, Optional

_IN_CLOSE_WRITE = 0x00000008
_IN_IGNORED = 0x00008000  # The watched directory is gone.
# inotify_init1 flags (Linux's values; elsewhere there is no inotify).
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct('iIII')  # wd, mask, cookie, len; then the name.


def drop_from_page_cache(path: str) -> None:
  """Writes `path`'s dirty pages to disk and drops its pages from the cache.

  A file that is gone, or a file system without the calls, is left alone.
  """
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  except OSError:
    pass
  finally:
    os.close(fd)


def _inotify():
  """libc's inotify calls, or None where there are none."""
  if not hasattr(os, 'posix_fadvise'):
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c'), use_errno=True)
    init, add_watch = libc.inotify_init1, libc.inotify_add_watch
  except (OSError, AttributeError):
    return None
  add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
  return init, add_watch, libc.inotify_rm_watch


class ClosedFileEvictor:
  """Drops files ending in `suffix` from the page cache once written.

  It follows one directory at a time (`follow`: the round being written, not
  its subdirectories); `close()` stops the thread, which the caller does on
  every exit path. Files closed while their directory is not followed are
  not seen.
  """

  def __init__(self, suffix: str):
    self._suffix = suffix.encode()
    # watch descriptor -> (directory, names to keep), as bytes.
    self._directories = {}
    self._lock = threading.Lock()
    self._thread: Optional[threading.Thread] = None
    self._calls = _inotify()
    self._followed = -1

  def _start(self) -> bool:
    """Starts the thread (at the first `follow`); False where it cannot."""
    if self._thread is not None:
      return True
    if self._calls is None:
      return False
    init, self._add_watch, self._rm_watch = self._calls
    fd = init(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
      logging.debug('inotify unavailable (errno %d): written client states '
                    'stay in the page cache', ctypes.get_errno())
      self._calls = None
      return False
    self._fd = fd
    self._wake_read, self._wake_write = os.pipe()
    self._thread = threading.Thread(target=self._run, name='page-cache',
                                    daemon=True)
    self._thread.start()
    return True

  def follow(self, directory: str, keep: Iterable[str] = ()) -> None:
    """Watches `directory` instead of the one followed before; files named
    in `keep` stay cached (a state read again soon)."""
    if not self._start():
      return
    if self._followed >= 0:
      # Its events already queued are still handled: the directory is
      # forgotten at its IN_IGNORED event, which comes after them.
      self._rm_watch(self._fd, self._followed)
      self._followed = -1
    path = os.fsencode(os.path.abspath(directory))
    wd = self._add_watch(self._fd, path, _IN_CLOSE_WRITE)
    if wd < 0:
      logging.debug('cannot watch %s (errno %d)', directory,
                    ctypes.get_errno())
      return
    with self._lock:
      self._directories[wd] = (path, frozenset(os.fsencode(n) for n in keep))
    self._followed = wd

  def close(self) -> None:
    if self._thread is None:
      return
    os.write(self._wake_write, b'x')
    self._thread.join()
    self._thread = None
    for fd in (self._fd, self._wake_read, self._wake_write):
      os.close(fd)
    self._directories.clear()
    self._followed = -1

  def _run(self) -> None:
    # poll, not select: select fails on descriptors above 1023.
    poller = select.poll()
    for fd in (self._fd, self._wake_read):
      poller.register(fd, select.POLLIN)
    while True:
      ready = {fd for fd, _ in poller.poll()}
      if self._wake_read in ready:
        return
      try:
        events = os.read(self._fd, 1 << 16)
      except BlockingIOError:
        continue
      except OSError as error:  # Eviction is an optimization: stop quietly.
        logging.debug('inotify read failed: %s', error)
        return
      for path in self._closed_files(events):
        drop_from_page_cache(path)

  def _closed_files(self, events: bytes) -> list[bytes]:
    paths = []
    offset = 0
    while offset + _EVENT.size <= len(events):
      wd, mask, _, length = _EVENT.unpack_from(events, offset)
      name = events[offset + _EVENT.size:offset + _EVENT.size + length]
      offset += _EVENT.size + length
      name = name.rstrip(b'\0')
      with self._lock:
        followed = (self._directories.pop(wd, None) if mask & _IN_IGNORED
                    else self._directories.get(wd))
      if mask & _IN_CLOSE_WRITE and followed is not None:
        directory, keep = followed
        if name.endswith(self._suffix) and name not in keep:
          paths.append(os.path.join(directory, name))
    return paths
