"""Persistent per-client state (SCAFFOLD/FedPVR c_i, FedRes theta_i) keyed by id.

One SQLite table holds versioned rows `(client_id, round_num, blob)`: a round's
writes are one transaction, a read takes the newest version, and a resumed run
rolls the table back to its checkpoint round. The `sqlite` backend keeps the
table in a file beside the run (memory independent of the population: rows
are read only for sampled clients); the `memory` backend keeps it in an
in-memory database and, at a checkpoint, copies it into a file beside the
checkpoint (`sqlite3.Connection.backup`: no size limit, unlike
`Connection.serialize`, which fails above 2 GB). Clients never sampled have
no row: their state is created lazily by the initializer.
"""

import io
import os
import sqlite3
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import tree

from pipeline.errors import UsageError

BACKENDS = ('memory', 'sqlite')
# 'auto' picks sqlite above this many train clients: per-client states of a
# large population (StackOverflow: 342,477 clients) must not live in RAM.
AUTO_SQLITE_MIN_CLIENTS = 10_000


# A memory store's checkpoint file, `<prefix><round>.sqlite` in the directory
# given to `checkpoint`; what `checkpoint` returns names it after FILE_MARKER.
CHECKPOINT_FILE_PREFIX = 'client_store_round_'
FILE_MARKER = b'file:'


def checkpoint_file_round(name: str) -> Optional[int]:
  """The round of a checkpoint file name of this module, else None."""
  stem, suffix = os.path.splitext(name)
  number = stem[len(CHECKPOINT_FILE_PREFIX):]
  if (stem.startswith(CHECKPOINT_FILE_PREFIX) and suffix == '.sqlite' and
      number.isdigit()):
    return int(number)
  return None


def resolve_backend(backend: str, num_clients: int) -> str:
  if backend == 'auto':
    return 'sqlite' if num_clients >= AUTO_SQLITE_MIN_CLIENTS else 'memory'
  return backend

_SCHEMA = """
CREATE TABLE IF NOT EXISTS client_states (
  client_id TEXT NOT NULL,
  round_num INTEGER NOT NULL,
  state BLOB NOT NULL,
  PRIMARY KEY (client_id, round_num)
);
"""


def serialize_state(state: Any) -> bytes:
  """Flattens a nested structure of arrays into one self-describing blob."""
  buffer = io.BytesIO()
  for leaf in tree.flatten(state):
    np.save(buffer, np.asarray(leaf), allow_pickle=False)
  return buffer.getvalue()


def deserialize_state(blob: bytes, structure: Any) -> Any:
  buffer = io.BytesIO(blob)
  leaves = [np.load(buffer, allow_pickle=False)
            for _ in range(len(tree.flatten(structure)))]
  if buffer.tell() != len(blob):
    raise ValueError('client state blob does not match the state structure')
  return tree.unflatten_as(structure, leaves)


class ClientStateStore:
  """Client states keyed by id, versioned by round, lazily initialized."""

  def __init__(self,
               initial_state_fn: Callable[[], Any],
               backend: str = 'memory',
               path: Optional[str] = None):
    if backend not in BACKENDS:
      raise UsageError(
          f'--client_state_store={backend!r} is unknown; allowed: '
          f'{", ".join(BACKENDS)}')
    if backend == 'sqlite' and not path:
      raise ValueError('the sqlite backend needs a file path')
    self._backend = backend
    self._path = path
    self._initial_state = initial_state_fn()
    self._connection = sqlite3.connect(
        path if backend == 'sqlite' else ':memory:', isolation_level=None)
    self._connection.execute('PRAGMA journal_mode=' + (
        'WAL' if backend == 'sqlite' else 'MEMORY'))
    self._connection.execute(_SCHEMA)

  @property
  def backend(self) -> str:
    return self._backend

  @property
  def initial_state(self) -> Any:
    return self._initial_state

  def read(self, client_ids: Sequence[str]) -> list[Any]:
    """Newest state of each client; the initial state for unseen clients."""
    states = []
    for client_id in client_ids:
      row = self._connection.execute(
          'SELECT state FROM client_states WHERE client_id = ? '
          'ORDER BY round_num DESC LIMIT 1', (client_id,)).fetchone()
      states.append(self._initial_state if row is None else
                    deserialize_state(row[0], self._initial_state))
    return states

  def has_state(self, client_ids: Sequence[str]) -> list[bool]:
    """Whether each client has a stored state (was ever sampled)."""
    return [self._connection.execute(
        'SELECT 1 FROM client_states WHERE client_id = ? LIMIT 1',
        (client_id,)).fetchone() is not None for client_id in client_ids]

  def items(self) -> Iterator[tuple[str, Any]]:
    """(client id, newest state) of every client with a stored state."""
    rows = self._connection.execute(
        'SELECT client_id, state FROM client_states AS current'
        ' WHERE round_num = (SELECT MAX(round_num) FROM client_states'
        ' WHERE client_id = current.client_id) ORDER BY client_id')
    for client_id, blob in rows:
      yield client_id, deserialize_state(blob, self._initial_state)

  def write(self, round_num: int, client_ids: Iterable[str],
            states: Iterable[Any]) -> None:
    """Stores one round's new states atomically (all or nothing)."""
    connection = self._connection
    connection.execute('BEGIN IMMEDIATE')
    try:
      for client_id, state in zip(client_ids, states, strict=True):
        connection.execute(
            'INSERT OR REPLACE INTO client_states VALUES (?, ?, ?)',
            (client_id, round_num, serialize_state(state)))
    except BaseException:
      connection.execute('ROLLBACK')
      raise
    connection.execute('COMMIT')

  def num_clients(self) -> int:
    return self._connection.execute(
        'SELECT COUNT(DISTINCT client_id) FROM client_states').fetchone()[0]

  def checkpoint(self, round_num: int,
                 directory: Optional[str] = None) -> bytes:
    """Marks `round_num` as checkpointed; returns what the checkpoint keeps.

    Versions older than each client's newest one at `round_num` are no longer
    reachable by a rollback and are dropped. The sqlite backend returns b''.
    The memory backend's database lives nowhere else: with a `directory` it
    is copied into a file there, at any size, and the file's name is returned
    (after FILE_MARKER); without one (small stores outside a run) the
    database's bytes are returned, which SQLite cannot do above 2 GB.
    """
    connection = self._connection
    connection.execute('BEGIN IMMEDIATE')
    connection.execute(
        'DELETE FROM client_states WHERE round_num < ('
        ' SELECT MAX(newer.round_num) FROM client_states AS newer'
        ' WHERE newer.client_id = client_states.client_id'
        ' AND newer.round_num <= ?)', (round_num,))
    connection.execute('COMMIT')
    if self._backend != 'memory':
      return b''
    if directory is None:
      return connection.serialize()
    name = f'{CHECKPOINT_FILE_PREFIX}{round_num}.sqlite'
    path = os.path.join(directory, name)
    staging = path + '.staging'
    if os.path.exists(staging):
      os.remove(staging)
    target = sqlite3.connect(staging)
    try:
      connection.backup(target)
    finally:
      target.close()
    os.replace(staging, path)
    return FILE_MARKER + name.encode()

  def restore(self, round_num: int, checkpoint_bytes: bytes,
              directory: Optional[str] = None) -> None:
    """Returns the store to its state at checkpoint `round_num`.

    `checkpoint_bytes` is what `checkpoint` returned; a file it names is
    read from `directory`.
    """
    if self._backend == 'memory':
      if checkpoint_bytes.startswith(FILE_MARKER):
        name = checkpoint_bytes[len(FILE_MARKER):].decode()
        path = os.path.join(directory or '', name)
        if directory is None or not os.path.isfile(path):
          raise UsageError(f'the client-state store file {path} of checkpoint '
                           f'round {round_num} is missing')
        source = sqlite3.connect(path)
        try:
          source.backup(self._connection)
        finally:
          source.close()
      elif checkpoint_bytes:
        self._connection.deserialize(checkpoint_bytes)
      else:
        self._connection.execute('DELETE FROM client_states')
    self._connection.execute(
        'DELETE FROM client_states WHERE round_num > ?', (round_num,))

  def close(self) -> None:
    self._connection.close()


def open_store(initial_state_fn: Callable[[], Any], backend: str,
               run_dir: str) -> ClientStateStore:
  path = os.path.join(run_dir, 'client_states.sqlite')
  return ClientStateStore(initial_state_fn, backend, path)
