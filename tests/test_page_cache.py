"""The client-state evictor drops written state files from the page cache."""

import ctypes
import mmap
import os
import threading
import time

import pytest

from tff_algos.runtime import page_cache

_LIBC = ctypes.CDLL(None, use_errno=True)


def resident_pages(path: str) -> int:
  """How many of the file's pages are in the page cache (mincore)."""
  size = os.path.getsize(path)
  _LIBC.mmap.restype = ctypes.c_void_p
  _LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_int, ctypes.c_int, ctypes.c_long)
  _LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
  _LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.POINTER(ctypes.c_ubyte))
  fd = os.open(path, os.O_RDONLY)
  try:
    address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
      raise OSError(ctypes.get_errno(), 'mmap failed')
    try:
      vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
      if _LIBC.mincore(address, size, vector) != 0:
        raise OSError(ctypes.get_errno(), 'mincore failed')
      return sum(v & 1 for v in vector)
    finally:
      _LIBC.munmap(address, size)
  finally:
    os.close(fd)


def write(path: str, data: bytes) -> None:
  with open(path, 'wb') as f:
    f.write(data)


def wait_until(condition, seconds: float = 10.0) -> bool:
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    if condition():
      return True
    time.sleep(0.02)
  return condition()


pytestmark = pytest.mark.skipif(
    page_cache._inotify() is None, reason='needs Linux inotify')  # pylint: disable=protected-access


def test_a_closed_state_file_leaves_the_cache_unless_kept(tmp_path):
  data = os.urandom(1 << 20)
  evictor = page_cache.ClosedFileEvictor('.state')
  try:
    evictor.follow(str(tmp_path), keep=['kept.state'])
    state, other = str(tmp_path / 'a.state'), str(tmp_path / 'a.tmp')
    kept = str(tmp_path / 'kept.state')
    write(other, data)
    write(kept, data)
    write(state, data)
    assert wait_until(lambda: resident_pages(state) == 0)
    # Not its suffix, or kept: left to the kernel.
    assert resident_pages(other) > 0
    assert resident_pages(kept) > 0
  finally:
    evictor.close()
  with open(state, 'rb') as f:
    assert f.read() == data


def test_only_the_followed_directory_is_watched(tmp_path):
  first, second = tmp_path / 'round_1', tmp_path / 'round_2'
  first.mkdir()
  second.mkdir()
  data = os.urandom(1 << 20)
  evictor = page_cache.ClosedFileEvictor('.state')
  try:
    evictor.follow(str(first))
    write(str(first / 'x.state'), data)
    assert wait_until(lambda: resident_pages(str(first / 'x.state')) == 0)
    evictor.follow(str(second))
    write(str(first / 'y.state'), data)
    write(str(second / 'y.state'), data)
    assert wait_until(lambda: resident_pages(str(second / 'y.state')) == 0)
    assert resident_pages(str(first / 'y.state')) > 0
  finally:
    evictor.close()


def test_close_stops_the_thread_and_deleted_files_are_no_error(tmp_path):
  before = threading.active_count()
  evictor = page_cache.ClosedFileEvictor('.state')
  evictor.follow(str(tmp_path))
  assert threading.active_count() == before + 1
  for i in range(50):  # Deleted before the thread gets to them.
    path = str(tmp_path / f'{i}.state')
    write(path, b'x' * 4096)
    os.remove(path)
  evictor.close()
  evictor.close()
  assert threading.active_count() == before
  evictor.follow(str(tmp_path))  # A closed evictor can follow again.
  write(str(tmp_path / 'again.state'), os.urandom(1 << 20))
  assert wait_until(
      lambda: resident_pages(str(tmp_path / 'again.state')) == 0)
  evictor.close()


def test_a_missing_directory_or_no_inotify_does_nothing(tmp_path, monkeypatch):
  evictor = page_cache.ClosedFileEvictor('.state')
  evictor.follow(str(tmp_path / 'missing'))  # add_watch fails: no error.
  evictor.close()
  monkeypatch.setattr(page_cache, '_inotify', lambda: None)
  before = threading.active_count()
  evictor = page_cache.ClosedFileEvictor('.state')
  evictor.follow(str(tmp_path))
  assert threading.active_count() == before
  evictor.close()


def test_a_run_keeps_cached_only_the_states_its_next_round_reads(tmp_path):
  # pylint: disable=import-outside-toplevel
  from pipeline import driver
  from tasks import base
  from tasks import registry as task_registry
  from tff_algos.algorithms import registry as algorithm_registry
  from tff_algos.runtime import client_states
  task = task_registry.build_task('celeba_smile', base.DataConfig(
      use_synthetic_data=True, client_batch_size=4, client_steps=2,
      options={'celeba_mode': 'federated', 'synthetic_train_clients': 6}))
  scaffold = algorithm_registry.build(
      'scaffold', task, algorithm_registry.settings_class('scaffold')())
  config = driver.RunConfig(
      root_output_dir=str(tmp_path), experiment_name='scaffold',
      total_rounds=4, clients_per_round=3, runtime='native')
  ids = task.train_client_ids
  seen = []

  def check(round_num):
    directory = client_states.round_directory(config.state_dir, round_num)
    written = sorted(os.listdir(directory))
    next_ids = ([] if round_num == config.total_rounds else
                [ids[i] for i in driver.plan_round(
                    config.seed, round_num + 1, len(ids), 3).client_indices])
    kept = sorted(client_states.file_name(c) for c in next_ids)
    assert len(written) == 3
    for name in written:
      path = os.path.join(directory, name)
      if name in kept:
        assert resident_pages(path) > 0, (round_num, name)
      else:
        assert wait_until(lambda p=path: resident_pages(p) == 0), (
            round_num, name)
    seen.append((round_num, len(set(written) & set(kept))))
    return {}

  driver.train(scaffold, task, config, round_metrics=check)
  assert 'page-cache' not in [t.name for t in threading.enumerate()]
  # 3 of 6 clients a round: some states were kept, some dropped.
  assert [r for r, _ in seen] == [1, 2, 3, 4]
  assert 0 < sum(k for _, k in seen) < 9, seen
