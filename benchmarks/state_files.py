"""What the client-state store alone costs a round: the floor under
SCAFFOLD's round time over FedAvg's.

Times the store's own TF read and write (`tff_algos/runtime/client_states`)
of a client's state in `benchmarks.rounds` (`--state`): SCAFFOLD's c_i, a
full-model state (the CelebA model: 1,354,881 float32 weights, 5.4 MB),
FedResAvg's theta_i and c_i (1,524,242 weights, 6.1 MB), or SCAFFOLD's c_i
with its first layer as factors (`benchmarks.floors.FactoredFloor`; 212,449
weights, 0.8 MB: the size of the state SCAFFOLD keeps on this model since
its c_i became factored, `tff_algos/algorithms/scaffold/factored.py`; the
dense one is what it kept before, and what FedResAvg's c_i still is), for a
round's
clients, with no training, split over one thread per core as the native
runtime runs its groups:

- `first visits`: each round's clients write states that did not exist
  before (the store grows by a cohort's states a round, as in the first
  rounds of a population much larger than the cohort: every new byte needs
  a fresh page-cache page);
- `revisits`: the same clients every round, each replacing its previous
  state, which is deleted when the round commits (as the driver does), so
  the writes reuse the pages the deletions freed.

Then, for scale, the same number of files of the same size written by plain
system calls from one Python thread, with no TF, no serialization and no
page-cache handling: `write_file`'s own calls (open with truncation, write;
each rewrite gets new page-cache pages), a new file renamed over the old one,
a rewrite in place (`pwrite` into the file's existing pages, which no TF op
does cheaply: TF's file writes truncate, append or go through SQLite) and a
whole read.

As in a run, each written state is dropped from the page cache once closed
unless the next round reads it (`tff_algos/runtime/page_cache`): first
visits drop every state, revisits none. `--noevict_written_states` leaves
them all to the kernel, to see what dropping saves on this machine.

  .venv/bin/python -m benchmarks.state_files [--clients_per_round=100]
      [--state=scaffold|fedres_avg|scaffold_factored] [--noevict_written_states]
"""

import math
import os
import shutil
import tempfile
import threading
import time

from absl import flags

from binaries import app  # First: imports TensorFlow quietly.
from benchmarks import floors
from pipeline.errors import UsageError

_CLIENTS = flags.DEFINE_integer('clients_per_round', 100, 'Clients a round.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Timed rounds per case.')
_WARMUP = flags.DEFINE_integer('warmup_rounds', 1, 'Untimed first rounds.')

# The benchmark model's trainable variables (benchmarks.rounds), and FedRes's
# personal model there (flatten + Dense(8) + Dense(1)).
GLOBAL_SHAPES = floors.SHAPES
LOCAL_SHAPES = ((84 * 84 * 3, 8), (8,), (8, 1), (1,))
# SCAFFOLD's c_i with W1's part as factors A^T D / K (benchmarks.floors.
# FactoredFloor): the K*B = 10 images and first-layer gradients of the
# benchmark's K=2 steps of 5, and the small tensors.
FACTORED_SHAPES = ((10, GLOBAL_SHAPES[0][0]), (10, GLOBAL_SHAPES[0][1])
                   ) + GLOBAL_SHAPES[1:]
STATE_SHAPES = {
    'scaffold': GLOBAL_SHAPES,  # c_i
    'fedres_avg': LOCAL_SHAPES + GLOBAL_SHAPES,  # theta_i, c_i (Option II)
    'scaffold_factored': FACTORED_SHAPES,
}
_STATE = flags.DEFINE_enum('state', 'scaffold', list(STATE_SHAPES),
                           'Whose client state to store.')
_EVICT = flags.DEFINE_boolean(
    'evict_written_states', True,
    'Drop each written state from the page cache as a run does; false: '
    'leave the pages to the kernel.')


def _round_function(state_format, clients: int):
  """One thread's share of a round: read, change and write `clients` states
  (ids as an input, so every round runs the same traced graph)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  @tf.function
  def run(client_ids, read_version, write_version):
    done = []
    for i in range(clients):
      state = state_format.read(client_ids[i], read_version)
      # A new value (as a client's update makes): not the bytes read.
      new_state = tf.nest.map_structure(lambda t: t + 1.0, state)
      done.append(state_format.write(client_ids[i], write_version, new_state))
    with tf.control_dependencies(done):
      return tf.constant(0)

  return run


def _time_case(directory: str, revisit: bool, threads: int) -> list[float]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tff_algos.runtime import client_states  # pylint: disable=g-import-not-at-top
  from tff_algos.runtime import page_cache  # pylint: disable=g-import-not-at-top
  specs = [tf.TensorSpec(shape, tf.float32)
           for shape in STATE_SHAPES[_STATE.value]]
  state_format = client_states.StateFormat(
      directory, specs, lambda: [tf.zeros(s.shape) for s in specs])
  shares = [len(range(t, _CLIENTS.value, threads)) for t in range(threads)]
  functions = [_round_function(state_format, n) for n in shares]
  seconds = []
  evictor = page_cache.ClosedFileEvictor(client_states.SUFFIX)
  try:
    for round_num in range(1, _WARMUP.value + _ROUNDS.value + 1):
      first = 0 if revisit else (round_num - 1) * _CLIENTS.value
      ids = [f'client_{first + i}' for i in range(_CLIENTS.value)]
      read = tf.constant(np.int64(round_num - 1 if revisit and round_num > 1
                                  else -1))
      write = tf.constant(np.int64(round_num))
      started = time.perf_counter()
      if _EVICT.value:  # The driver's ClientStateKeeper.prepare: the
        # states of the next round's clients (revisits: these) stay cached.
        round_directory = client_states.round_directory(directory, round_num)
        os.makedirs(round_directory, exist_ok=True)
        evictor.follow(round_directory, [client_states.file_name(i)
                                         for i in ids] if revisit else [])
      workers = [threading.Thread(target=function, args=(
          tf.constant(ids[t::threads]), read, write))
                 for t, function in enumerate(functions)]
      for worker in workers:
        worker.start()
      for worker in workers:
        worker.join()
      if revisit and round_num > 1:  # The driver's commit.
        client_states.delete_superseded(
            state_format, ids, np.full(len(ids), round_num - 1), [])
      seconds.append(time.perf_counter() - started)
  finally:
    evictor.close()
  return seconds[_WARMUP.value:]


def _system_calls(directory: str, size: int) -> dict[str, float]:
  """Median seconds a round of plain writes and reads of `size`-byte files
  (see the module docstring), one thread."""
  payload = os.urandom(size)
  paths = [os.path.join(directory, f'client_{i}') for i in range(_CLIENTS.value)]

  def truncate_and_write(path):
    with open(path, 'wb') as f:
      f.write(payload)

  def new_file_renamed(path):
    truncate_and_write(path + '.new')
    os.replace(path + '.new', path)

  def in_place(path):
    fd = os.open(path, os.O_WRONLY)
    try:
      os.pwrite(fd, payload, 0)
    finally:
      os.close(fd)

  def read(path):
    with open(path, 'rb') as f:
      f.read()

  cases = {'truncate and write (write_file)': truncate_and_write,
           'new file, renamed over the old': new_file_renamed,
           'in place (pwrite)': in_place, 'read': read}
  for path in paths:
    truncate_and_write(path)
  seconds = {name: [] for name in cases}
  for round_num in range(_WARMUP.value + _ROUNDS.value):
    for name, case in cases.items():
      started = time.perf_counter()
      for path in paths:
        case(path)
      if round_num >= _WARMUP.value:
        seconds[name].append(time.perf_counter() - started)
  return {name: sorted(v)[len(v) // 2] for name, v in seconds.items()}


def main(argv):
  del argv
  for flag in (_CLIENTS, _ROUNDS):
    if flag.value < 1:
      raise UsageError(f'--{flag.name} must be >= 1, got {flag.value}')
  if _WARMUP.value < 0:
    raise UsageError(f'--warmup_rounds must be >= 0, got {_WARMUP.value}')
  threads = os.cpu_count() or 1
  state_bytes = 4 * sum(math.prod(shape)
                        for shape in STATE_SHAPES[_STATE.value])
  size_mb = state_bytes / 1e6
  print(f'state files ({_STATE.value}): {_CLIENTS.value} clients a round, '
        f'{size_mb:.1f} MB a state, {threads} threads, {_ROUNDS.value} timed '
        'rounds, written states ' + (
            'dropped from the page cache' if _EVICT.value
            else 'left in the page cache'))
  for revisit in (False, True):
    directory = tempfile.mkdtemp(prefix='state_files_')
    try:
      seconds = sorted(_time_case(directory, revisit, threads))
    finally:
      shutil.rmtree(directory, ignore_errors=True)
    median = seconds[len(seconds) // 2]
    name = 'revisits' if revisit else 'first visits'
    print(f'  {name:12s} {median:.3f} s/round (read + write, no training; '
          f'{1000 * median * threads / _CLIENTS.value:.1f} ms per client '
          f'per thread)')
  print(f'the same files by plain system calls, one thread, no TF '
        f'({_CLIENTS.value} files of {size_mb:.1f} MB a round):')
  directory = tempfile.mkdtemp(prefix='state_files_')
  try:
    for name, median in _system_calls(directory, state_bytes).items():
      print(f'  {name:32s} {median:.3f} s/round')
  finally:
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == '__main__':
  app.run(main)
