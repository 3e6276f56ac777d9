"""Re-partitioned client data stored in TFF's SqlClientData format.

Tasks that pool a dataset and deal it to synthetic clients (EMNIST with the
s% similarity rule, CIFAR with a Dirichlet partition) cannot keep the pooled
data in the TFF computation: a client dataset computation carrying hundreds of
MB of constants would be serialized into the runtime. Instead the partition is
written once to an SQLite file in the schema of
`tff.simulation.datasets.SqlClientData` (tables `examples` and
`client_metadata`, one serialized `tf.train.Example` per row), and clients read
their rows by id inside the computation, as TFF's own loaders do.

The file is a cache: its name and a stored fingerprint (source file, sizes,
partition parameters) decide whether an existing file can be reused; it is
written to a staging name and renamed, so a crash never leaves a half-written
partition behind.
"""

import atexit
import fcntl
import hashlib
import os
import re
import shutil
import sqlite3
import tempfile
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import tensorflow_federated as tff

from pipeline.errors import UsageError

SPLIT_NAME = 'train'
_FINGERPRINT_TABLE = 'partition_fingerprint'
# Rows per INSERT batch while streaming the pooled examples.
_WRITE_CHUNK = 2000

_scratch_dir: Optional[str] = None


def scratch_dir() -> str:
  """A directory removed at process exit (for synthetic data)."""
  global _scratch_dir
  if _scratch_dir is None:
    _scratch_dir = tempfile.mkdtemp(prefix='client_partitions_')
    atexit.register(shutil.rmtree, _scratch_dir, ignore_errors=True)
  return _scratch_dir


def client_ids(num_clients: int) -> tuple[str, ...]:
  width = len(str(num_clients - 1))
  return tuple(f'client_{j:0{width}d}' for j in range(num_clients))


def create_sql_client_data_tables(connection: sqlite3.Connection) -> None:
  """The two tables `tff.simulation.datasets.SqlClientData` reads."""
  connection.execute('CREATE TABLE examples (split_name TEXT NOT NULL, '
                     'client_id TEXT NOT NULL, '
                     'serialized_example_proto BLOB NOT NULL)')
  connection.execute('CREATE TABLE client_metadata (client_id TEXT NOT NULL, '
                     'split_name TEXT NOT NULL, num_examples INTEGER NOT NULL)')


def insert_client_examples(connection: sqlite3.Connection, split_name: str,
                           client_id: str,
                           serialized_examples: Sequence[bytes]) -> None:
  """One client's rows of a split, with its `client_metadata` row."""
  connection.executemany('INSERT INTO examples VALUES (?, ?, ?)',
                         [(split_name, client_id, example)
                          for example in serialized_examples])
  connection.execute('INSERT INTO client_metadata VALUES (?, ?, ?)',
                     (client_id, split_name, len(serialized_examples)))


def require_readable_client_ids(database: str, client_data: Iterable,
                                separator: str = '') -> None:
  """UsageError for a client id of `database` that its clients could not
  read their data by: TFF's SqlClientData pastes the id into its SQL query
  unquoted (an id with a ' was a worker's SQL syntax error traceback), and a
  composite client (`separator`) splits its id into raw ones."""
  for data in client_data:
    for client_id in data.client_ids:
      bad = [c for c in ("'", separator) if c and c in client_id]
      if bad:
        raise UsageError(
            f'{database} has client id {client_id!r}, which holds {bad[0]!r}: '
            'TFF\'s reader cannot look it up; rename that client in the '
            'file\'s examples and client_metadata tables')


def require_text_client_ids(database: str, splits: Sequence[str]) -> None:
  """UsageError naming `database`, the split and the id if a client of
  `splits` has an id that is not UTF-8 text (a blob, or text of other
  bytes): TFF's loader failed on it with "'<' not supported between
  instances of 'bytes' and 'str'" or SQLite's decoding error, naming no
  client. A file SQLite cannot read is left to the loader's own error."""
  try:
    connection = sqlite3.connect(f'file:{database}?mode=ro', uri=True)
    try:
      connection.text_factory = bytes
      rows = connection.execute(
          'SELECT split_name, client_id, typeof(client_id) FROM '
          'client_metadata WHERE split_name IN '
          f'({", ".join("?" * len(splits))})', tuple(splits)).fetchall()
    finally:
      connection.close()
  except sqlite3.Error:
    return
  for split, client_id, kind in rows:
    if kind == b'blob':
      shown = f"x'{client_id.hex()}' (a blob, not text)"
    elif kind != b'text':
      # An integer or real id was an AttributeError traceback here.
      shown = f'{client_id!r} (of SQLite type {kind.decode()}, not text)'
    else:
      try:
        client_id.decode('utf-8')
        continue
      except UnicodeDecodeError:
        shown = f'{client_id!r} (not UTF-8)'
    raise UsageError(
        f'{database} has client id {shown} in its '
        f'{split.decode("utf-8", "replace")} split: TFF\'s reader takes only '
        'UTF-8 text ids; rename that client in the file\'s examples and '
        'client_metadata tables')


# What a task does with a split's examples, by its role (`require_examples`).
_USE_OF_SPLIT = {'train': 'train', 'test': 'evaluate'}


def require_examples(database: str, dataset: str,
                     splits: Mapping[str, str]) -> None:
  """UsageError naming `database` and the split if a split the task reads
  (`splits`: {its name in the file: 'train' or 'test'}) holds no example
  of its clients (rows of `examples` for clients `client_metadata` lists):
  TFF's loader reads such a file, and the run trained on nothing (a train
  loss of 0) or logged no evaluation, with status 0."""
  try:
    connection = sqlite3.connect(f'file:{database}?mode=ro', uri=True)
    try:
      # Client by client, each looked up as TFF's reader does (by id and
      # split, which the files index): the first client with a row ends
      # it. An automatic index would read the whole examples table first.
      connection.execute('PRAGMA automatic_index = OFF')
      for split, role in splits.items():
        (found,) = connection.execute(
            'SELECT EXISTS (SELECT 1 FROM client_metadata AS m WHERE '
            'm.split_name = ? AND EXISTS (SELECT 1 FROM examples AS e WHERE '
            'e.client_id = m.client_id AND e.split_name = m.split_name))',
            (split,)).fetchone()
        if not found:
          raise UsageError(
              f'{database} holds no {role} examples (its {split} clients '
              f'have no rows in its examples table): the run would '
              f'{_USE_OF_SPLIT[role]} on nothing; it is cut short or not '
              f'TFF\'s {dataset}')
    finally:
      connection.close()
  except sqlite3.Error as e:
    raise UsageError(f'cannot read {dataset} from {database}: {e}') from e


def _stored_fingerprint(path: str) -> Optional[str]:
  try:
    connection = sqlite3.connect(f'file:{path}?mode=ro', uri=True)
    try:
      row = connection.execute(
          f'SELECT value FROM {_FINGERPRINT_TABLE}').fetchone()
    finally:
      connection.close()
  except sqlite3.Error:
    return None
  return row[0] if row else None


def source_fingerprint(path: str) -> str:
  """What a partition's fingerprint says of its source at `path` (a file, or
  a directory such as a prepared TFDS dataset's): where it is and each
  file's size and modification time, so that data replaced in place is
  partitioned again, not read from a stale cache."""
  if not os.path.exists(path):  # Not a local path (e.g. TFDS's gs://).
    return path
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    stat = os.stat(path)
    return f'{path} size={stat.st_size} mtime_ns={stat.st_mtime_ns}'
  digest = hashlib.sha256()
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      stat = os.stat(full)
      digest.update(f'{os.path.relpath(full, path)} {stat.st_size} '
                    f'{stat.st_mtime_ns}\n'.encode())
  return f'{path} files={digest.hexdigest()}'


def materialize(
    path: str, fingerprint: str,
    make_partition: Callable[[], tuple[Sequence[np.ndarray], Iterable[bytes]]],
) -> tff.simulation.datasets.SqlClientData:
  """The client database at `path`, built first unless it is up to date.

  Args:
    path: the SQLite file.
    fingerprint: identifies the source and the partition parameters; a file
      at `path` with the same fingerprint is reused without calling
      `make_partition`.
    make_partition: returns (indices into the pooled examples, one array per
      client; the pooled examples in index order, each a serialized
      `tf.train.Example`). Examples in no client are left out.

  Returns:
    Clients `client_0..` as SqlClientData of serialized examples.
  """
  _make_directory(os.path.dirname(os.path.abspath(path)))
  if not (os.path.exists(path) and _stored_fingerprint(path) == fingerprint):
    partition, serialized_examples = make_partition()
    _build(path, partition, serialized_examples, fingerprint)
  return tff.simulation.datasets.SqlClientData(path, split_name=SPLIT_NAME)


def _staging_file(path: str) -> tuple[str, int]:
  """A new staging file beside `path` and a descriptor holding an
  exclusive lock on it while this process writes it (the kernel frees the
  lock when the process ends, however it ends)."""
  staging = f'{path}.staging-{os.getpid()}'
  # Locked before it takes its name: another process's clean-up could
  # otherwise lock the new file and remove it.
  unnamed = f'{staging}.new'
  for leftover in (staging, f'{staging}-journal', unnamed):
    if os.path.exists(leftover):
      os.remove(leftover)
  fd = os.open(unnamed, os.O_RDWR | os.O_CREAT, 0o644)
  fcntl.flock(fd, fcntl.LOCK_EX)
  os.rename(unnamed, staging)
  return staging, fd


def _remove_abandoned_staging_files(path: str) -> None:
  """Removes the staging files (and SQLite journals) of builds of `path`
  whose process has ended: a build SIGKILLed mid-write left hundreds of MB
  (EMNIST's pooled examples) that no later run removed."""
  directory, name = os.path.split(os.path.abspath(path))
  pattern = re.compile(re.escape(name) + r'\.staging-\d+(-journal)?$')
  for entry in sorted(os.listdir(directory)):
    match = pattern.match(entry)
    if not match:
      continue
    staged = os.path.join(directory, entry)
    try:
      fd = os.open(staged[:len(staged) - len(match.group(1) or '')],
                   os.O_RDONLY)
    except FileNotFoundError:
      fd = None  # A journal whose file is gone.
    if fd is not None:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        continue  # Its writer still runs.
      finally:
        os.close(fd)
    try:
      os.remove(staged)
    except FileNotFoundError:
      pass


def _make_directory(directory: str) -> None:
  """Makes the partitions' directory; UsageError if a file or a broken link
  is in its place (it was a FileExistsError traceback)."""
  try:
    os.makedirs(directory, exist_ok=True)
  except (FileExistsError, NotADirectoryError) as e:
    raise UsageError(f'{directory} cannot hold the cached client partitions: '
                     f'{e.filename} is not a directory; move it, or pass '
                     'another --cache_dir') from e


def _build(path, partition, serialized_examples, fingerprint):
  ids = client_ids(len(partition))
  num_pooled = 1 + max((int(p.max()) for p in partition if len(p)), default=-1)
  owner = np.full(num_pooled, -1, dtype=np.int64)
  for client, indices in enumerate(partition):
    if np.any(owner[indices] >= 0):
      raise ValueError('partition assigns an example to two clients')
    owner[indices] = client
  _remove_abandoned_staging_files(path)
  staging, lock_fd = _staging_file(path)
  try:
    _write(staging, ids, partition, owner, num_pooled, serialized_examples,
           fingerprint)
    os.replace(staging, path)
  except BaseException:
    if os.path.exists(staging):
      os.remove(staging)
    raise
  finally:
    os.close(lock_fd)


def _write(staging, ids, partition, owner, num_pooled, serialized_examples,
           fingerprint):
  """The client database of `partition` in the file `staging`."""
  connection = sqlite3.connect(staging)
  try:
    create_sql_client_data_tables(connection)
    connection.execute(f'CREATE TABLE {_FINGERPRINT_TABLE} (value TEXT)')
    rows = []
    seen = 0
    for index, example in enumerate(serialized_examples):
      seen = index + 1
      if index < num_pooled and owner[index] >= 0:
        rows.append((SPLIT_NAME, ids[owner[index]], example))
      if len(rows) >= _WRITE_CHUNK:
        connection.executemany('INSERT INTO examples VALUES (?, ?, ?)', rows)
        rows = []
    connection.executemany('INSERT INTO examples VALUES (?, ?, ?)', rows)
    if seen < num_pooled:
      raise ValueError(f'partition refers to example {num_pooled - 1} but the '
                       f'source has only {seen} examples')
    connection.executemany(
        'INSERT INTO client_metadata VALUES (?, ?, ?)',
        [(ids[j], SPLIT_NAME, len(indices))
         for j, indices in enumerate(partition)])
    # TFF reads one client's rows at a time.
    connection.execute('CREATE INDEX examples_by_client ON examples '
                       '(client_id, split_name)')
    connection.execute(f'INSERT INTO {_FINGERPRINT_TABLE} VALUES (?)',
                       (fingerprint,))
    connection.commit()
  finally:
    connection.close()
