"""A run's metrics.csv and TensorBoard events, cut back to a checkpoint.

Rows and events of a round are written when the round ends, checkpoints only
every --rounds_per_checkpoint rounds (and at a Ctrl-C): a run that is killed
(or hits a full disk) leaves rows and events of rounds after its latest
checkpoint, maybe a half-written last row or event record. The resumed run
re-runs those rounds, so `trim_metrics` and `trim_tensorboard` first remove
everything after the checkpoint; a round then appears once, as in an
uninterrupted run. Kept rows are kept byte for byte.

Only what a kill can leave is cleaned up: rows after the checkpoint, a last
row or event record cut off mid-write. Anything else (metrics.csv missing
while a checkpoint exists, rows of rounds up to the checkpoint missing,
repeated or out of order; an events file damaged before its last record, or
not an events file of this pipeline) is a UsageError naming the file, raised
before anything is rewritten (`check_metrics`, `check_tensorboard`).

A header whose column names were changed (a renamed, damaged, added or
swapped name) would pass those checks, and TFF's CSV writer would then put
the resumed rounds' values of a renamed metric into a new column at the end
(its name taken from the row, any column missing from the header is added):
one metric split across two columns. The names a run logs are known only
once it has run a round, but every row was released to TensorBoard too,
with the same names and values, so `check_columns` compares each kept row
with its round's scalar events: every scalar logged for the round must be a
column holding that value (a renamed or damaged name leaves its metric
without a column, a swapped one holds the other's values). Columns may
legitimately differ from row to row - a round without evaluation leaves the
evaluation columns empty, a column first logged later (the first evaluation)
is added at the end, and the header keeps the columns of rows a resume
dropped - so the rule is per row, not on the header alone. TensorBoard's
writer buffers events, so a killed run may lose a round's last ones: rounds
without events are not compared, and a column with values the events lack
is named in the error but is not by itself a reason for one.
"""

import dataclasses
import logging
import os
import secrets
import struct
from typing import Mapping, Optional, Union

from pipeline.errors import UsageError

METRICS_FILE = 'metrics.csv'
ROUND_COLUMN = 'round_num'
# Wall times: the only columns that differ between runs of the same flags.
TIMING_COLUMNS = ('round_seconds', 'eval_seconds')
_EVENTS_PREFIX = 'events.out.tfevents.'
# A TFRecord is length (8 bytes), its CRC (4), the data, the data's CRC (4).
_RECORD_FRAMING_BYTES = 16
_RECORD_HEADER_BYTES = 12
# An events file's first record (TF's EventsWriter) is an Event whose data
# starts with wall_time (field 1, a double) and file_version (field 3).
_FIRST_EVENT_PREFIX = (b'\x09', 8, b'\x1a\x0dbrain.Event:')
# Longer than any first record TF writes (about 60 bytes).
_MAX_FIRST_RECORD_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class MetricsLines:
  """metrics.csv split into lines (each with its newline)."""
  header: str
  rows: list[str]
  rounds: list[int]
  # A last line without its newline: a write that was cut off.
  partial_tail: str
  # The header's column names and each row's fields.
  columns: list[str] = dataclasses.field(default_factory=list)
  fields: list[list[str]] = dataclasses.field(default_factory=list)


def _damaged(path: str, what: str) -> UsageError:
  return UsageError(f'{path} {what}; it is not a metrics file of this '
                    'pipeline: restore it, or use a new --experiment_name')


def read_metrics(path: str) -> Optional[MetricsLines]:
  """The file's lines; None if it does not exist; UsageError if it is not a
  metrics file (a directory, empty, not UTF-8, rows that do not parse)."""
  import csv  # pylint: disable=g-import-not-at-top
  if not os.path.lexists(path):
    return None
  if os.path.isdir(path):
    raise _damaged(path, 'is a directory')
  with open(path, 'rb') as f:
    data = f.read()
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise _damaged(path, f'is not UTF-8 text (byte {e.start})') from e
  lines = text.splitlines(keepends=True)
  partial_tail = ''
  if lines and not lines[-1].endswith('\n'):
    partial_tail = lines.pop()
  if not lines:
    raise _damaged(path, 'has no header line' if partial_tail else 'is empty')
  header = next(csv.reader([lines[0]]))
  if not header or header[0] != ROUND_COLUMN:
    raise _damaged(path, f'does not start with a {ROUND_COLUMN} column')
  repeated = sorted({c for c in header if header.count(c) > 1})
  if repeated:
    raise _damaged(path, f'names the column {repeated[0]} twice')
  rounds = []
  rows = []
  for number, line in enumerate(lines[1:], start=2):
    fields = next(csv.reader([line]), [])
    if len(fields) != len(header) or not fields[0].isdigit():
      after = f' (after the row of round {rounds[-1]})' if rounds else ''
      raise _damaged(path, f'line {number}{after} is not a row of its columns')
    rounds.append(int(fields[0]))
    rows.append(fields)
  return MetricsLines(lines[0], lines[1:], rounds, partial_tail, header, rows)


def comparable_rows(path: str) -> list[dict[str, str]]:
  """metrics.csv's rows without the timing columns, to compare runs."""
  import csv  # pylint: disable=g-import-not-at-top
  with open(path, newline='') as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    for column in TIMING_COLUMNS:
      row.pop(column, None)
  return rows


def replace_file(path: str, content: Union[str, bytes]) -> None:
  """Writes `content` (text, or bytes) to `path` whole or not at all: a
  failed write (a full disk, a kill, a Ctrl-C) leaves the file as it was,
  and no staging file. Each write stages in a file of its own
  (`<path>.<8 random characters>.staging`, as an export's directory): two
  processes writing `path` at once (two evaluates of a run) shared one
  staging file, which each truncated, so `path` could get a mix of both and
  the later one's rename failed (a traceback)."""
  staging = f'{path}.{secrets.token_hex(4)}.staging'
  try:
    # O_EXCL: the name is this write's alone; 0o666: the umask's mode.
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with (os.fdopen(descriptor, 'wb') if isinstance(content, bytes) else
          os.fdopen(descriptor, 'w', encoding='utf-8', newline='')) as f:
      f.write(content)
      f.flush()
      os.fsync(f.fileno())
    os.replace(staging, path)
  except BaseException as e:
    if os.path.lexists(staging):
      os.remove(staging)
    if isinstance(e, OSError) and e.filename in (None, staging):
      e.filename = path  # The error line names the file the user knows.
    raise


def _round_ranges(rounds: list[int]) -> str:
  return f'{rounds[0]}' if len(rounds) == 1 else f'{rounds[0]}-{rounds[-1]}'


def _rows_of(first: int, last: int) -> str:
  """'the row of round 3 is' / 'the rows of rounds 3-6 are'."""
  return (f'the row of round {first} is' if first == last else
          f'the rows of rounds {first}-{last} are')


def check_metrics(path: str, last_round: int) -> Optional[MetricsLines]:
  """The file's lines if a run may resume from checkpoint `last_round`
  with it: one row per round 1..`last_round`, in order, then only rows of
  later rounds (which the resume drops); otherwise a UsageError naming the
  rounds. The file may be missing only when no round was checkpointed."""
  metrics = read_metrics(path)
  advice = ('restore the file, or use a new --experiment_name (the run '
            'cannot record those rounds again)')
  if metrics is None:
    if last_round > 0:
      raise UsageError(
          f'{path} is missing, but the run has checkpoint round {last_round}:'
          f' {_rows_of(1, last_round)} lost; {advice}')
    return None
  rounds = metrics.rounds
  for index, round_num in enumerate(rounds[:last_round]):
    expected = index + 1
    if round_num == expected:
      continue
    line = index + 2
    if round_num < expected:
      problem = f'line {line} repeats the row of round {round_num}'
    elif expected in rounds[index:]:
      problem = (f'its rows are out of order (line {line} holds round '
                 f'{round_num} where round {expected} belongs)')
    else:
      problem = f'{_rows_of(expected, min(round_num - 1, last_round))} missing'

    raise UsageError(f'{path}: {problem}, up to checkpoint round '
                     f'{last_round}; {advice}')
  if len(rounds) < last_round:
    cut = (f' (the row of round {len(rounds) + 1} was cut off mid-write)'
           if metrics.partial_tail else '')
    raise UsageError(
        f'{path}: {_rows_of(len(rounds) + 1, last_round)} missing{cut}, up '
        f'to checkpoint round {last_round}; {advice}')
  for index, round_num in enumerate(rounds[last_round:], start=last_round):
    if round_num <= last_round:
      raise UsageError(
          f'{path}: line {index + 2} repeats the row of round {round_num}, '
          f'up to checkpoint round {last_round}; {advice}')
  return metrics


def trim_metrics(path: str, last_round: int) -> None:
  """Removes rows of rounds after `last_round` and a partial last row;
  UsageError (nothing changed) if the file is not as `check_metrics`
  requires."""
  metrics = check_metrics(path, last_round)
  if metrics is None:
    return
  keep = [row for row, round_num in zip(metrics.rows, metrics.rounds)
          if round_num <= last_round]
  dropped = [r for r in metrics.rounds if r > last_round]
  if not dropped and not metrics.partial_tail:
    return
  replace_file(path, metrics.header + ''.join(keep))
  removed = []
  if metrics.partial_tail:
    removed.append('a partial last row (a write that was cut off)')
  if dropped:
    removed.append(f'the rows of rounds {_round_ranges(dropped)}')
  logging.warning('%s: removed %s, after checkpoint round %d (those rounds '
                  'are run again)', path, ' and '.join(removed), last_round)


def event_files(directory: str) -> list[str]:
  paths = []
  for root, dirs, files in os.walk(directory):
    dirs.sort()
    paths += [os.path.join(root, name) for name in sorted(files)
              if name.startswith(_EVENTS_PREFIX)]
  return paths


def _masked_crc32c(data: bytes) -> int:
  from tensorboard.compat.tensorflow_stub import pywrap_tensorflow  # pylint: disable=g-import-not-at-top
  return pywrap_tensorflow.masked_crc32c(data)


def _not_events(path: str, what: str) -> UsageError:
  return UsageError(f'{path} {what}; move it out of the run\'s tensorboard '
                    'directory to resume without its events')


def _is_cut_off_record(tail: bytes) -> bool:
  """Whether `tail` (the bytes after the last complete record) is the start
  of a record whose write was cut off: too short for its header, or a
  header whose CRC checks that promises more bytes than there are."""
  if len(tail) < _RECORD_HEADER_BYTES:
    return True
  length_bytes = tail[:8]
  (crc,) = struct.unpack('<I', tail[8:12])
  if crc != _masked_crc32c(length_bytes):
    return False
  (length,) = struct.unpack('<Q', length_bytes)
  return _RECORD_FRAMING_BYTES + length > len(tail)


def _is_cut_off_first_record(tail: bytes) -> bool:
  """Whether `tail`, a file without a complete record, is the start of the
  first record TF's EventsWriter writes (a kill or a full disk while the
  file was being made), rather than some other file's bytes."""
  if not tail:
    return True
  header = tail[:8]
  # A little-endian length below _MAX_FIRST_RECORD_BYTES.
  if any(header[2:]) or (len(header) > 1 and
                         header[0] + 256 * header[1] >=
                         _MAX_FIRST_RECORD_BYTES):
    return False
  if not _is_cut_off_record(tail):
    return False
  data = tail[_RECORD_HEADER_BYTES:]
  offset = 0
  for part in _FIRST_EVENT_PREFIX:
    if isinstance(part, int):
      offset += part
      continue
    present = data[offset:offset + len(part)]
    if present != part[:len(present)]:
      return False
    offset += len(part)
  return True


def read_events(path: str) -> tuple[list[bytes], bool]:
  """(the file's records, whether it ended in a cut-off record: a write
  that was cut off). UsageError if the file is damaged elsewhere (a record
  whose checksum fails, followed by more data) or is not an events file
  (its first record is not TF's file-version event). An empty file has no
  records."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  if os.path.isdir(path):
    raise _not_events(path, 'is a directory')
  records = []
  try:
    for record in tf.data.TFRecordDataset(path):
      records.append(record.numpy())
  except tf.errors.DataLossError:
    pass  # Where and why the reader stopped is found below.
  with open(path, 'rb') as f:
    data = f.read()
  framed = sum(len(r) + _RECORD_FRAMING_BYTES for r in records)
  tail = data[framed:]
  if not records:
    if tail and not _is_cut_off_first_record(tail):
      raise _not_events(path, 'is not a TensorBoard events file (its first '
                        'record is not an event)')
    return records, bool(tail)
  if tail and not _is_cut_off_record(tail):
    raise _not_events(
        path, f'is damaged at byte {framed} (record {len(records) + 1}) '
        f'with {len(tail)} bytes from there: not a cut-off last record, '
        'which is all a killed write leaves')
  try:
    first = event_pb2.Event.FromString(records[0])
  except Exception:  # pylint: disable=broad-except
    first = None
  if first is None or not first.file_version.startswith('brain.Event:'):
    raise _not_events(path, 'is not a TensorBoard events file (it does not '
                      'start with a file-version event)')
  for number, record in enumerate(records[1:], start=2):
    try:
      event_pb2.Event.FromString(record)
    except Exception as e:  # pylint: disable=broad-except
      raise _not_events(path, f'record {number} is not an event') from e
  return records, bool(tail)


# {round: {metric name: the value logged}}: a run's scalar events.
LoggedScalars = Mapping[int, Mapping[str, float]]


def check_tensorboard(directory: str) -> LoggedScalars:
  """UsageError if an events file under `directory` is damaged other than
  by a cut-off last record, or is not one this pipeline wrote (see
  `read_events`). Writes nothing. Returns the scalars of the events files
  the run's writer makes (those directly in `directory`), by round."""
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  if os.path.lexists(directory) and not os.path.isdir(directory):
    # TensorFlow's summary writer failed on it with a traceback.
    raise UsageError(f'{directory} is a file, not the run\'s TensorBoard '
                     'directory: move it away, or use a new --experiment_name')
  logged = {}
  for path in event_files(directory):
    records, _ = read_events(path)
    if os.path.dirname(path) != directory.rstrip(os.sep):
      continue  # Not the run's writer's (e.g. a profile of the user's).
    for record in records[1:]:
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name == 'scalars':
          logged.setdefault(event.step, {})[value.tag] = _scalar(value)
  return logged


def _scalar(value) -> float:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return float(tf.make_ndarray(value.tensor).reshape(()))


def _same_value(text: str, logged: float) -> bool:
  """Whether a metrics.csv field holds the value TensorBoard logged (as
  float32, which TensorBoard keeps)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  try:
    written = np.float32(float(text))
  except ValueError:
    return False
  logged = np.float32(logged)
  return bool(written == logged or (np.isnan(written) and np.isnan(logged)))


def check_columns(path: str, metrics: MetricsLines, logged: LoggedScalars,
                  last_round: int, tensorboard_dir: str) -> None:
  """UsageError unless metrics.csv's rows up to `last_round` hold, each in
  the column of its name, the scalars the run logged to TensorBoard for
  their rounds (`logged`, from `check_tensorboard`; see the module doc).
  Rounds without logged scalars are not compared, and a column the events
  lack is no proof (a killed run may lose a round's last events): it is
  named in the error, not a reason for it. Writes nothing."""
  index = {column: i for i, column in enumerate(metrics.columns)}
  missing = {}  # Logged names that are not columns -> their rounds.
  differing = []  # (column, round, field, logged value).
  compared = set()  # Columns with a value in a compared row.
  logged_names = set()
  for fields, round_num in zip(metrics.fields, metrics.rounds):
    scalars = logged.get(round_num)
    if round_num > last_round or not scalars:
      continue
    logged_names.update(scalars)
    compared.update(c for c, f in zip(metrics.columns[1:], fields[1:]) if f)
    for name, value in sorted(scalars.items()):
      if name not in index:
        missing.setdefault(name, []).append(round_num)
      elif not _same_value(fields[index[name]], value):
        differing.append((name, round_num, fields[index[name]], value))
  if not missing and not differing:
    return
  problems = [f'no column {name} (logged for round'
              f'{"s" if len(rounds) > 1 else ""} {_round_ranges(rounds)})'
              for name, rounds in sorted(missing.items())]
  # Only named: a killed run's events may lack a round's last scalars.
  problems += [f'column {name} holds values the run did not log'
               for name in sorted(compared - logged_names)]
  if not missing:
    name, round_num, field, value = differing[0]
    problems.append(f'column {name} holds {field or "nothing"} in the row of'
                    f' round {round_num}, where the run logged {value:g}')
  raise UsageError(
      f'{path}: its header does not name the columns the run wrote '
      f'(compared with the events in {tensorboard_dir}): '
      f'{"; ".join(problems)}; restore the header, or use a new '
      '--experiment_name')


def trim_tensorboard(directory: str, last_round: int) -> None:
  """Removes events of steps (rounds) after `last_round` from every event
  file under `directory`, and cut-off last records; a file whose only
  record was cut off is removed. Checks every file first (UsageError,
  nothing changed: `check_tensorboard`)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  contents = [(path, *read_events(path)) for path in event_files(directory)]
  for path, records, cut_off in contents:
    keep = [r for r in records
            if event_pb2.Event.FromString(r).step <= last_round]
    if len(keep) == len(records) and not cut_off:
      continue
    if not records:
      os.remove(path)
      logging.warning('%s: removed, its only record was cut off mid-write',
                      path)
      continue
    staging = path + '.staging'
    with tf.io.TFRecordWriter(staging) as writer:
      for record in keep:
        writer.write(record)
    os.replace(staging, path)
    logging.warning('%s: removed %d events of rounds after checkpoint round '
                    '%d%s (those rounds are run again)', path,
                    len(records) - len(keep), last_round,
                    ' and a cut-off last record' if cut_off else '')
