"""What SCAFFOLD's control variates add to FedAvg's round, without a framework.

`benchmarks.rounds` measures this project's rounds. This measures the two
algorithms' client work written as lean as we could, with no framework, to
judge how much of a stateful round's extra time its arithmetic and state
files need on this machine. The workload is `benchmarks.rounds`': the
CelebA-shaped model (flatten + Dense(64, relu) + Dense(1), 1,354,881 float32
weights, 5.4 MB), K=--client_steps plain SGD steps of --client_batch_size
examples, --clients_per_round clients; FedAvg sums n_i (y_i - x), SCAFFOLD
(Option II) also corrects each step by c - c_i and sums c_i+ - c_i.

Six implementations, each timing FedAvg's and SCAFFOLD's rounds alternately
in one process (median of --rounds timed rounds after one untimed); it prints
both rounds, SCAFFOLD's extra seconds and the ratio:

- `c_memory`: both algorithms hand-fused in C (`benchmarks/fused_floor.c`,
  built with the system's `cc -O3 -march=native -fopenmp`, one OpenMP thread
  per core): branch-free, vectorized update loops; each step reads the
  weights once, its update also forming the next step's first-layer
  products, and the last step's update forms the sums and c_i+. The c_i stay
  in RAM.
- `c_file`: the same, each c_i in a file of its own (in the page cache),
  read with pread and written back in place with pwrite: no versions and no
  atomic commit, less than a store that survives a kill must do.
- `c_mapped`: the same files mapped into memory (`mmap`, `MAP_SHARED`), the
  client reading c_i and writing c_i+ in the page cache's own pages.
- `xla`: each algorithm's client as one XLA-compiled TF function
  (`jit_compile=True`), c_i in RAM as tensors: TF's kernels, fused by XLA.
- `xla_file`: the same, each c_i in a file of its own, read with
  `read_file` and `parse_tensor` and written back with `serialize_tensor` and
  `write_file`: the fewest TF ops that keep a state in a file. `write_file`
  truncates the file and writes it whole, into newly allocated page-cache
  pages, where `c_file` rewrites the pages it has (TF's other file writes
  append, or go through SQLite).
- `tf_factored`: plain TF ops, one thread, with W1's c_i and updates kept as
  factors A^T D (`floors.FactoredFloor`): exact under Option II with plain
  SGD, and lean while K*B*(21168 + 64) < 21168*64.

The XLA floors split a round's clients over --threads Python threads.

These are lean implementations, not proofs that nothing is leaner. SCAFFOLD's
extra seconds vary less between implementations than the ratio, which also
depends on how fast the FedAvg beside it is.

Before timing, each implementation's round on 3 clients is checked against a
float64 NumPy reference of the same math (each tensor within 1e-3 of its own
largest value), so they time the algorithms, not something cheaper.

  .venv/bin/python -m benchmarks.fused_floor [--clients_per_round=100]
      [--floors=c_memory,c_file,c_mapped,xla,xla_file,tf_factored] [--rounds=9]
"""

import re
import tempfile

from absl import flags

from binaries import app  # First: imports TensorFlow quietly.
from benchmarks import floors
from pipeline import tf_logs
from pipeline.errors import UsageError

_CLIENTS = flags.DEFINE_integer('clients_per_round', 100, 'Clients a round.')
_STEPS = flags.DEFINE_integer('client_steps', 2, 'K, local steps a client.')
_BATCH = flags.DEFINE_integer('client_batch_size', 5, 'Examples a step.')
_ROUNDS = flags.DEFINE_integer('rounds', 9, 'Timed rounds per algorithm.')
_FLOORS = flags.DEFINE_list(
    'floors', list(floors.FLOORS), 'Which floors to time.')
_THREADS = flags.DEFINE_integer(
    'threads', 0, 'Threads of each floor (0: one per core).')

_XLA_CPU_NOISE = re.compile('SetPriority unimplemented for this stream')
_CHECK_CLIENTS = 3


def main(argv):
  del argv
  for flag in (_CLIENTS, _STEPS, _BATCH, _ROUNDS):
    if flag.value < 1:
      raise UsageError(f'--{flag.name} must be >= 1, got {flag.value}')
  if _ROUNDS.value > 1024:  # What the C program keeps.
    raise UsageError(f'--rounds must be <= 1024, got {_ROUNDS.value}')
  if _THREADS.value < 0:
    raise UsageError(f'--threads must be >= 0, got {_THREADS.value}')
  if _BATCH.value > 64:
    raise UsageError(f'--client_batch_size must be <= 64, got {_BATCH.value}')
  # The workload is held by this process and by the C program (and written
  # to files), so twice its size must fit in the RAM that is free.
  import psutil  # pylint: disable=g-import-not-at-top
  needed = 2 * floors.workload_bytes(_CLIENTS.value, _STEPS.value,
                                     _BATCH.value)
  available = psutil.virtual_memory().available
  if needed > available:
    raise UsageError(
        f'--clients_per_round={_CLIENTS.value} with --client_steps='
        f'{_STEPS.value} and --client_batch_size={_BATCH.value} needs about '
        f'{needed / 1e9:.1f} GB of RAM, {available / 1e9:.1f} GB is available')
  unknown = sorted(set(_FLOORS.value) - set(floors.FLOORS))
  if unknown or not _FLOORS.value:
    raise UsageError(f'--floors takes some of {",".join(floors.FLOORS)}, got '
                     f'{",".join(_FLOORS.value)}')
  try:
    rows = _measure()
  except floors.MismatchError as e:
    raise SystemExit(f'error: {e}') from e
  print(f'{_CLIENTS.value} clients a round, K={_STEPS.value} steps of '
        f'{_BATCH.value} examples, the 5.4 MB CelebA-shaped model; median '
        f'of {_ROUNDS.value} rounds, each checked against float64 '
        f'NumPy on {_CHECK_CLIENTS} clients:')
  print(f'  {"floor":10s} {"threads":>7s} {"FedAvg s/round":>15s} '
        f'{"SCAFFOLD s/round":>17s} {"extra s/round":>14s} '
        f'{"SCAFFOLD / FedAvg":>18s}')
  for name, threads, fedavg, scaffold in rows:
    print(f'  {name:10s} {threads!s:>7s} {fedavg:15.4f} {scaffold:17.4f} '
          f'{scaffold - fedavg:14.4f} {scaffold / fedavg:17.2f}x')


def _measure():
  small = floors.Workload(_CHECK_CLIENTS, _STEPS.value, _BATCH.value, seed=1)
  want = floors.reference(small)
  workload = floors.Workload(_CLIENTS.value, _STEPS.value, _BATCH.value)
  rows = []
  with tempfile.TemporaryDirectory(prefix='fused_floor_') as directory:
    c_floor = (floors.CFloor(directory, _BATCH.value)
               if {f for f in _FLOORS.value if f.startswith('c_')} else None)
    for name in _FLOORS.value:
      if name == 'tf_factored':
        factored = floors.FactoredFloor(_STEPS.value, _BATCH.value)
        small_factored = floors.Workload(_CHECK_CLIENTS, _STEPS.value,
                                         _BATCH.value, seed=1)
        factors = factored.factor_states(small_factored, seed=8)
        floors.check(name, factored.run(small_factored, factors, 0, True),
                     floors.reference(small_factored))
        fedavg, scaffold = factored.run(
            workload, factored.factor_states(workload, seed=9), _ROUNDS.value,
            False)
        threads = 1
      elif name.startswith('xla'):
        states = 'file' if name == 'xla_file' else 'memory'
        xla_floor = floors.XlaFloor(_STEPS.value, states, directory,
                                    _THREADS.value)
        with tf_logs.stderr_without(_XLA_CPU_NOISE):
          floors.check(name, xla_floor.run(small, 0, check_only=True), want)
          fedavg, scaffold = xla_floor.run(workload, _ROUNDS.value, False)
        threads = xla_floor.threads
      else:
        states = name.split('_')[1]
        floors.check(name, c_floor.run(small, states, 1, _THREADS.value,
                                       True), want)
        threads, fedavg, scaffold = c_floor.run(
            workload, states, _ROUNDS.value, _THREADS.value, False)
      rows.append((name, threads, fedavg, scaffold))
  return rows


if __name__ == '__main__':
  app.run(main)
