"""Ctrl-C held back until a short piece of work that must not stop halfway
is done.

TFF's release managers and checkpoint manager are coroutines run with
`asyncio.run`. A KeyboardInterrupt raised inside one ends its task with that
exception, which asyncio (Python 3.11) never marks as retrieved: it logs
"Task exception was never retrieved" and a traceback on the way out, and a
checkpoint save stopped between TFF's write and its deletion of the oldest
leaves one checkpoint too many. The binaries' SIGINT handler calls
`interrupt()`, which raises at once outside `deferred()` and at its end
inside it.
"""

import asyncio
import contextlib

_depth = 0
_pending = False


def interrupt() -> None:
  """KeyboardInterrupt now, or at the end of the current `deferred()`."""
  global _pending
  if _depth:
    _pending = True
    return
  raise KeyboardInterrupt


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


def run_coroutine(coroutine):
  """`asyncio.run(coroutine)` with Ctrl-C held back until it is done."""
  with deferred():
    return asyncio.run(coroutine)
