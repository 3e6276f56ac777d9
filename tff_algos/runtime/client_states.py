"""Persistent per-client state, read and written where each client runs.

SCAFFOLD/FedPVR's control variates c_i and FedRes's personal models theta_i
belong to their clients. In a deployment they never leave the device, so
here they never pass through the Python driver, TFF's aggregation or gRPC
either: each client's TF computation reads its state from a file by client
id, trains, and writes its new state to a new file, on whichever worker runs
it. Only the client id and a version number (a small handle) cross between
the driver and the runtime each round.

Layout under the store directory (one flag, `--client_state_dir`; remote
workers need it on a path they share):

  round_<r>/<client id, base64url>.state   the state a client had after
                                           round r and its checksum
                                           (`encode`)
  .owner                                   outside the run directory: the
                                           run whose store it is (the
                                           driver's `mark_store_directory`)

Versions are the rounds that wrote them. The driver keeps the *index*: for
every train client the round of its newest committed state (-1: never
sampled, so the algorithm's initializer). A round's files become visible by
committing the round's clients into the index after the round has finished,
and durable when the index is saved inside the round's checkpoint, together
with the server state. So:
- a kill at any moment of a round leaves the last checkpoint intact: files of
  rounds after it are ignored, and removed at the next start (`recover`),
  whether they are complete or half written;
- a resumed run reads exactly the files of the checkpoint's index, so it is
  bit-identical to an uninterrupted run;
- files are garbage-collected when no kept checkpoint's index names them
  (`collect_garbage`), so an older kept checkpoint stays resumable; a state
  a client replaces goes once the round that replaced it is logged (the
  driver's `ClientStateKeeper.release_superseded`), unless a kept
  checkpoint names it (`delete_superseded`);
- memory is O(train clients) for the index, whatever the number of clients
  ever sampled; states are only ever held one client at a time;
- the store deletes only the state files it writes (and round directories
  they leave empty): anything else in a round directory, such as a file of
  the user's, is never deleted (`recover`, `collect_garbage` leave it, with
  its directory) and a resume refuses it (`foreign_entries`);
- a state whose values were altered in place (its size and header intact,
  which a resume checks for every file) fails its checksum when its client
  reads it: an error naming the file, not a client training on garbage.

Why files rather than a database: TF ops read and write files on any worker
(`tf.io.read_file` / `write_file`), with no server and no Python in the loop;
one file per (client, version) needs no locking between concurrent clients,
and a version is committed by the index, not by the file system.
"""

import base64
import logging
import os
import re
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf

from pipeline.errors import DAMAGED_CLIENT_STATE

NEVER_WRITTEN = -1
_ROUND_DIR = re.compile(r'^round_(\d+)$')
SUFFIX = '.state'


def round_directory(directory: str, round_num: int) -> str:
  return os.path.join(directory, f'round_{round_num}')


def file_name(client_id: str) -> str:
  """The file name of a client's state: its id in unpadded base64url."""
  encoded = base64.urlsafe_b64encode(client_id.encode()).decode()
  return encoded.rstrip('=') + SUFFIX


def file_key(client_id: str, version: int) -> str:
  """What a state's checksum is keyed with: its path in the store."""
  return f'round_{version}/{file_name(client_id)}'


def is_state_file_name(name: str) -> bool:
  """Whether `name` is one the store gives a state file (`file_name`)."""
  client_id = client_id_of(name)
  return client_id is not None and file_name(client_id) == name


def client_id_of(name: str) -> Optional[str]:
  if not name.endswith(SUFFIX):
    return None
  encoded = name[:-len(SUFFIX)]
  try:
    return base64.urlsafe_b64decode(
        encoded + '=' * (-len(encoded) % 4)).decode()
  except (ValueError, UnicodeDecodeError):
    return None


class StateFormat:
  """How one client's state (a structure of fixed-shape tensors) is stored.

  The TF methods run inside a client's computation; the Python ones serve
  the driver (validation) and in-process readers (FedRes evaluation/export).
  """

  def __init__(self, directory: str, specs: Any,
               initial_state_fn: Callable[[], Any]):
    self.directory = os.path.abspath(directory)
    self.specs = specs
    self._initial_state_fn = initial_state_fn
    # A graph, as in a client's computation: a damaged state's error then
    # reads the same here as from a worker.
    self._read_path = tf.function(
        lambda path, key: decode(tf.io.read_file(path), specs, path, key),
        autograph=False)

  # ---- TF, inside the client's computation --------------------------------

  def _key(self, client_id: tf.Tensor, version: tf.Tensor) -> tf.Tensor:
    """`file_key` in TF (encode_base64 is base64url without padding)."""
    return tf.strings.join(['round_', tf.strings.as_string(version), '/',
                            tf.io.encode_base64(client_id), SUFFIX])

  def _path(self, client_id: tf.Tensor, version: tf.Tensor) -> tf.Tensor:
    return tf.strings.join([self.directory, '/',
                            self._key(client_id, version)])

  def read(self, client_id: tf.Tensor, version: tf.Tensor):
    """The client's state of `version`; the initializer's when it is -1."""

    def stored():
      path = self._path(client_id, version)
      return decode(tf.io.read_file(path), self.specs, path,
                    self._key(client_id, version))

    def initial():
      return tf.nest.map_structure(
          lambda t, s: tf.ensure_shape(tf.cast(t, s.dtype), s.shape),
          self._initial_state_fn(), self.specs)

    return tf.cond(version >= 0, stored, initial)

  def write(self, client_id: tf.Tensor, version: tf.Tensor, state) -> tf.Operation:
    # write_file creates the round directory when it is missing.
    return tf.io.write_file(self._path(client_id, version),
                            encode(state, self.specs,
                                   self._key(client_id, version)))

  # ---- Python -------------------------------------------------------------

  def file_path(self, client_id: str, version: int) -> str:
    return os.path.join(self.directory, file_key(client_id, version))

  def load(self, client_id: str, version: int):
    """A stored state as numpy arrays (or the initial state, version -1)."""
    if version < 0:
      return tf.nest.map_structure(np.asarray, self._initial_state_fn())
    return tf.nest.map_structure(
        lambda t: t.numpy(),
        self._read_path(tf.constant(self.file_path(client_id, version)),
                        tf.constant(file_key(client_id, version))))


class StateIndex:
  """Which version of each train client's state is current (driver side)."""

  def __init__(self, client_ids: Sequence[str],
               versions: Optional[np.ndarray] = None):
    self.client_ids = tuple(client_ids)
    self._position = {cid: i for i, cid in enumerate(self.client_ids)}
    if versions is None:
      versions = np.full(len(self.client_ids), NEVER_WRITTEN, np.int64)
    if versions.shape != (len(self.client_ids),):
      raise ValueError(
          f'the checkpoint indexes {versions.shape[0]} client states but the '
          f'task has {len(self.client_ids)} train clients')
    self.versions = np.array(versions, np.int64)

  def versions_of(self, indices: Sequence[int]) -> np.ndarray:
    return self.versions[np.asarray(indices, np.int64)]

  def commit(self, indices: Sequence[int], round_num: int) -> None:
    """The clients at `indices` now have the state round `round_num` wrote."""
    self.versions[np.asarray(indices, np.int64)] = round_num

  def position(self, client_id: str) -> Optional[int]:
    return self._position.get(client_id)

  def version(self, client_id: str) -> int:
    position = self._position.get(client_id)
    return NEVER_WRITTEN if position is None else int(self.versions[position])


class ClientStates:
  """Read access to the committed states, for in-process readers.

  FedRes's personalized evaluation and export read theta_i through this;
  `read`, `has_state` and `items` are in client order of the arguments.
  """

  def __init__(self, state_format: StateFormat, index: StateIndex):
    self._format = state_format
    self._index = index

  @property
  def initial_state(self):
    return self._format.load('', NEVER_WRITTEN)

  def read(self, client_ids: Sequence[str]) -> list[Any]:
    return [self._format.load(cid, self._index.version(cid))
            for cid in client_ids]

  def has_state(self, client_ids: Sequence[str]) -> list[bool]:
    return [self._index.version(cid) >= 0 for cid in client_ids]

  def items(self) -> Iterator[tuple[str, Any]]:
    """(client id, state) of every client with a stored state, by id."""
    for cid in sorted(self._index.client_ids):
      version = self._index.version(cid)
      if version >= 0:
        yield cid, self._format.load(cid, version)

  def num_clients(self) -> int:
    return int(np.sum(self._index.versions >= 0))


def is_round_directory(name: str) -> bool:
  """Whether `name`, in a store directory, is one of its round directories."""
  return _ROUND_DIR.match(name) is not None


def _round_directories(directory: str) -> dict[int, str]:
  if not os.path.isdir(directory):
    return {}
  found = {}
  for name in os.listdir(directory):
    match = _ROUND_DIR.match(name)
    if match:
      found[int(match.group(1))] = os.path.join(directory, name)
  return found


def _is_state_file(round_path: str, name: str) -> bool:
  return is_state_file_name(name) and os.path.isfile(
      os.path.join(round_path, name))


def foreign_entries(directory: str) -> list[str]:
  """Paths in the store `directory` the store does not make: a round's name
  that is not a directory, or an entry of a round that is not a state file
  (`file_name`), such as a file of the user's."""
  foreign = []
  for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
    path = os.path.join(directory, name)
    if not is_round_directory(name):
      continue
    if not os.path.isdir(path):
      foreign.append(path)
      continue
    foreign.extend(os.path.join(path, entry) for entry in sorted(os.listdir(path))
                   if not _is_state_file(path, entry))
  return foreign


def _remove_round_if_empty(path: str) -> None:
  """Removes the round directory `path` unless something is left in it
  (what the store did not write, which it never deletes)."""
  if not os.listdir(path):
    os.rmdir(path)


def recover(directory: str, committed_round: int) -> list[int]:
  """Removes the state files of rounds after `committed_round` (a killed
  run's), and their directories once empty; anything else in them (not the
  store's: `foreign_entries`) is left.

  Returns the rounds whose files were removed.
  """
  removed = []
  for round_num, path in sorted(_round_directories(directory).items()):
    if round_num > committed_round:
      for name in os.listdir(path):
        if _is_state_file(path, name):
          os.remove(os.path.join(path, name))
      _remove_round_if_empty(path)
      removed.append(round_num)
  if removed:
    logging.warning('Removed client states of uncommitted rounds %s in %s',
                    ', '.join(map(str, removed)), directory)
  return removed


def missing_files(state_format: StateFormat, index: StateIndex,
                  expected_size: Optional[int],
                  expected_header: bytes = b'') -> list[str]:
  """Paths of indexed states that are missing or damaged: of the wrong size,
  or not starting with `expected_header` (`file_header`)."""
  missing = []
  for position in np.flatnonzero(index.versions >= 0):
    path = state_format.file_path(index.client_ids[position],
                                  int(index.versions[position]))
    try:
      size = os.stat(path).st_size
      with open(path, 'rb') as f:
        header = f.read(len(expected_header))
    except (FileNotFoundError, IsADirectoryError):
      missing.append(path)
      continue
    if (expected_size is not None and size != expected_size) or (
        header != expected_header):
      missing.append(path)
  return missing


def collect_garbage(directory: str, kept_indexes: Sequence[StateIndex],
                    up_to_round: int) -> int:
  """Deletes state files no kept checkpoint names, of rounds <= up_to_round,
  and round directories left empty; anything else in them (not the
  store's: `foreign_entries`) is left, with its directory.

  Returns the number of files deleted. Rounds after `up_to_round` are not
  touched (they may belong to a round in progress).
  """
  if not kept_indexes:
    return 0
  client_ids = kept_indexes[0].client_ids
  position = {file_name(cid): i for i, cid in enumerate(client_ids)}
  kept = np.stack([index.versions for index in kept_indexes])
  deleted = 0
  for round_num, path in _round_directories(directory).items():
    if round_num > up_to_round:
      continue
    for name in os.listdir(path):
      i = position.get(name)
      if not _is_state_file(path, name) or (
          i is not None and np.any(kept[:, i] == round_num)):
        continue
      os.remove(os.path.join(path, name))
      deleted += 1
    _remove_round_if_empty(path)
  return deleted


def delete_superseded(state_format: StateFormat, client_ids: Sequence[str],
                      replaced_versions: Sequence[int],
                      kept_versions: Sequence[np.ndarray]) -> int:
  """Deletes the replaced states of `client_ids` no kept checkpoint names.

  `kept_versions`: per kept checkpoint, the versions it names for the same
  clients. A round directory left empty goes too: between checkpoints
  nothing else removes it, and a long run would leave one per round.
  Returns the number of files deleted.
  """
  deleted = 0
  emptied = set()
  for position, (client_id, version) in enumerate(
      zip(client_ids, replaced_versions, strict=True)):
    if version < 0 or any(versions[position] == version
                          for versions in kept_versions):
      continue
    try:
      os.remove(state_format.file_path(client_id, int(version)))
      deleted += 1
      emptied.add(int(version))
    except FileNotFoundError:
      pass
  for version in emptied:
    try:
      os.rmdir(round_directory(state_format.directory, version))
    except OSError:  # Not empty: kept or unreplaced states are in it.
      pass
  return deleted


# What a state's checksum is summed as, by the width of its values.
_CHECKSUM_DTYPES = {4: tf.uint32, 8: tf.uint64}


def _flat_format(specs) -> bool:
  """Whether a state is stored as one flat tensor (see `encode`): its
  values are of one dtype, numbers 4 or 8 bytes wide."""
  flat = tf.nest.flatten(specs)
  if not flat or len({s.dtype for s in flat}) != 1:
    return False
  dtype = flat[0].dtype
  return ((dtype.is_floating or dtype.is_integer) and
          dtype.size in _CHECKSUM_DTYPES)


def _checksum(leaves: Sequence[tf.Tensor], key: tf.Tensor) -> tf.Tensor:
  """The leaves' bit patterns as unsigned integers, plus a fingerprint of
  `key` (the state's client and round, `file_key`), summed modulo 2^width.

  One read of the values, and exact in any order. A change of any one value
  changes it; random damage to several goes unseen with probability 2^-32
  (2^-64). With the key, another client's or another round's state copied
  over a file fails it too (it passes every size and header check). Not a
  defence against deliberate edits.
  """
  unsigned = _CHECKSUM_DTYPES[leaves[0].dtype.size]
  return tf.add_n(
      [tf.reduce_sum(tf.bitcast(leaf, unsigned)) for leaf in leaves] +
      [tf.cast(_fingerprints(key), unsigned)])


def _verified(leaves: list[tf.Tensor], matches: tf.Tensor,
              path: tf.Tensor) -> list[tf.Tensor]:
  """`leaves`, once `matches` holds; else an error naming `path`.

  A damaged state would otherwise train on as if it were the client's: one
  state overwritten mid-file drove a SCAFFOLD run's loss to 1e27, exit 0.
  """
  check = tf.debugging.Assert(matches, [DAMAGED_CLIENT_STATE, path])
  with tf.control_dependencies([check]):
    return [tf.identity(leaf) for leaf in leaves]


def encode(state, specs, key) -> tf.Tensor:
  """One state as the bytes of its file, with a checksum of its values and
  of `key`, the state's name (`file_key`).

  States of one dtype (every algorithm's here) are their leaves flattened
  into one tensor, their checksum (`_checksum`, bit-cast to the same dtype)
  its last element, serialized once: reading one back is one parse and no
  copy per leaf. A 5.4 MB state read and parsed in 2 ms this way against
  15 ms as a serialized vector of serialized leaves (protobuf copies every
  string of a string tensor), which other states still need; theirs end
  with the fingerprints of the serialized leaves.
  """
  leaves = [tf.convert_to_tensor(leaf) for leaf in tf.nest.flatten(state)]
  if _flat_format(specs):
    checksum = tf.bitcast(_checksum(leaves, key), leaves[0].dtype)
    return tf.io.serialize_tensor(tf.concat(
        [tf.reshape(leaf, [-1]) for leaf in leaves] +
        [tf.reshape(checksum, [1])], 0))
  parts = [tf.io.serialize_tensor(leaf) for leaf in leaves]
  parts = tf.stack(parts) if parts else tf.zeros([0], tf.string)
  fingerprints = tf.io.serialize_tensor(_keyed_fingerprints(parts, key))
  return tf.io.serialize_tensor(tf.concat([parts, [fingerprints]], 0))


def _fingerprints(parts: tf.Tensor) -> tf.Tensor:
  return tf.strings.to_hash_bucket_fast(parts, 2**63 - 1)


def _keyed_fingerprints(parts: tf.Tensor, key) -> tf.Tensor:
  return tf.concat([_fingerprints(parts), [_fingerprints(key)]], 0)


def decode(blob: tf.Tensor, specs, path, key):
  """The state `encode` wrote with `key`, its shapes checked against
  `specs` and its values and key against its checksum (an error naming
  `path` if they differ)."""
  flat_specs = tf.nest.flatten(specs)
  if _flat_format(specs):
    flat = tf.io.parse_tensor(blob, flat_specs[0].dtype)
    sizes = [spec.shape.num_elements() for spec in flat_specs]
    flat = tf.ensure_shape(flat, [sum(sizes) + 1])
    # Slices, not tf.split: a slice whose ends are aligned shares the parsed
    # buffer, where a split copies every piece unless all are aligned (the
    # one-float checksum never is): 0.4 ms less per 5.4 MB state.
    ends = np.cumsum([0] + sizes + [1]).tolist()
    *pieces, stored = [flat[start:end]
                       for start, end in zip(ends[:-1], ends[1:])]
    leaves = [tf.reshape(piece, spec.shape)
              for piece, spec in zip(pieces, flat_specs)]
    unsigned = _CHECKSUM_DTYPES[stored.dtype.size]
    # One sum over the values, not one a leaf (each op costs the executor
    # 7-9 us; modulo 2^width the totals are equal). Over all of `flat`,
    # less the stored checksum: the slice flat[:-1] would copy the values
    # when their end is not aligned.
    stored_checksum = tf.bitcast(stored[0], unsigned)
    matches = tf.equal(_checksum([flat], key) - stored_checksum,
                       stored_checksum)
    return tf.nest.pack_sequence_as(specs, _verified(leaves, matches, path))
  parts = tf.io.parse_tensor(blob, tf.string)
  parts = tf.ensure_shape(parts, [len(flat_specs) + 1])
  # Checked before the leaves are parsed: damage to a leaf's own framing
  # is then found as damage, not as a parse error.
  # As bytes: fingerprints of another length are a mismatch, not an error.
  parts = _verified([parts], tf.equal(
      tf.io.serialize_tensor(_keyed_fingerprints(parts[:-1], key)),
      parts[-1]), path)[0]
  leaves = [tf.ensure_shape(tf.io.parse_tensor(parts[i], spec.dtype),
                            spec.shape)
            for i, spec in enumerate(flat_specs)]
  return tf.nest.pack_sequence_as(specs, leaves)


def file_header(specs) -> bytes:
  """The bytes every stored state of `specs` starts with.

  A state's file is a serialized TensorProto: its dtypes, shapes and lengths
  come first and are the same for every state of `specs`, then the values.
  Found as what states with different values (zeros, and values with no
  zero byte) and names have in common at the start. A file overwritten with other bytes
  fails this check; damage inside the values themselves does not (that would
  take a checksum of every state, read and written every round).
  """
  flat = tf.nest.flatten(specs)

  def encoded(fill, key):
    leaves = [tf.fill(s.shape, tf.constant(fill(s.dtype), s.dtype))
              for s in flat]
    return encode(tf.nest.pack_sequence_as(specs, leaves), specs, key).numpy()

  def zero(dtype):
    return False if dtype.is_bool else ('' if dtype == tf.string else 0)

  # Keys differ too: a state without values (e.g. FedPVR's control variate
  # with no variable under it) is its checksum alone, which its key sets;
  # one key made that checksum part of the header, so every real state
  # failed the check. These keys' checksums differ from their first byte
  # on, so the header ends where the checksum starts.
  encodings = [encoded(zero, 'round_0/a'),
               encoded(_without_zero_bytes, 'round_1/b'),
               encoded(zero, 'round_2/c')]
  length = min(len(e) for e in encodings)
  length = next((i for i in range(length)
                 if len({e[i] for e in encodings}) > 1), length)
  return encodings[0][:length]


def _without_zero_bytes(dtype: tf.DType):
  """A value of `dtype` whose encoding starts with a non-zero byte."""
  if dtype.is_bool:
    return True
  if dtype.is_floating:
    return 1.1
  if dtype.is_unsigned:
    return dtype.max
  if dtype.is_integer:
    return -1
  if dtype.is_complex:
    return 1.1 + 1.1j
  return 'x'


def serialized_size(specs) -> int:
  """Bytes of one stored state of `specs` (fixed shapes), for validation."""
  zeros = [tf.zeros(s.shape, s.dtype) for s in tf.nest.flatten(specs)]
  return len(encode(tf.nest.pack_sequence_as(specs, zeros), specs,
                    '').numpy())
