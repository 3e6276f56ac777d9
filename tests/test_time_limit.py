"""The suite's per-test time limit (tests/conftest.py)."""

import threading
import time

import pytest

import conftest


@pytest.mark.time_limit(1)
def test_a_test_over_its_time_limit_is_interrupted():
  started = time.monotonic()
  with pytest.raises(conftest.TestTimeLimitExceeded, match='over 1 s'):
    time.sleep(30)
  assert time.monotonic() - started < 10


@pytest.mark.time_limit(1)
def test_a_wait_on_a_lock_is_interrupted_too():
  # As when the main thread waits on a TFF call that never returns.
  never_released = threading.Lock()
  never_released.acquire()
  with pytest.raises(conftest.TestTimeLimitExceeded):
    never_released.acquire()
