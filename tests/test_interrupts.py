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
