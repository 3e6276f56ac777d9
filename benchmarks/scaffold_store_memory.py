"""Resident memory of a SCAFFOLD run as the clients ever sampled grow.

Trains SCAFFOLD through `pipeline.driver.train` on a synthetic population of
`--population` clients (default 10,000; each a few generated examples of one
label) with an MLP whose control variate c_i is `--hidden` * 74 + 10 floats
(default 128 hidden units: 9,610 floats, 38 KB per client), once per client
store backend. A parent process samples the resident set size (RSS) of the
training process and of TFF's worker process every `--poll_seconds`, and
prints one line per round: clients ever sampled (from the driver's seeded
sampling), RSS, and the store's size on disk. With `--client_state_store=sqlite`
RSS stays flat while the clients ever sampled (and the file) grow; the
`memory` backend, shown for contrast, grows by about one c_i per new client.
`--algorithm=fedavg` (no client state) is the control for what TFF's own
runtime does over the same rounds.

Rounds and clients ever sampled grow together in one run. To tell them apart,
`--populations=10000,200` repeats the run with a population that is sampled
whole every round (200 clients per round out of 200: the clients ever sampled
stay at 200): the same rounds and the same per-round traffic, only the number
of distinct clients differs. A final table prints both runs' RSS round by
round; equal columns mean the memory follows the rounds, not the clients ever
sampled.

  python -m benchmarks.scaffold_store_memory
  python -m benchmarks.scaffold_store_memory --backends=sqlite --rounds=20
  python -m benchmarks.scaffold_store_memory --algorithm=fedavg --backends=memory
  python -m benchmarks.scaffold_store_memory --backends=sqlite \
      --populations=10000,200 --rounds=30

Run it from the repository root (`python -m`), so this checkout's code is used.
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from binaries import process_memory

NUM_FEATURES = 64
NUM_CLASSES = 10


def build_population_task(population: int, examples_per_client: int,
                          hidden: int):
  """A task of `population` generated clients (one label each)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tasks import base  # pylint: disable=g-import-not-at-top

  def client_dataset(client_id, seed):
    del seed
    key = tf.strings.to_hash_bucket_fast(client_id, 2**31 - 1)
    features = tf.random.stateless_normal(
        [examples_per_client, NUM_FEATURES], tf.stack([key, key]))
    labels = tf.fill([examples_per_client], key % NUM_CLASSES)
    return tf.data.Dataset.from_tensor_slices(
        (features + tf.cast(labels[:, None], tf.float32), labels)).batch(
            examples_per_client)

  def keras_model():
    return tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(NUM_FEATURES,)),
        tf.keras.layers.Dense(hidden, activation='relu'),
        tf.keras.layers.Dense(NUM_CLASSES),
    ])

  def eval_datasets():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, NUM_CLASSES, 200)
    features = (rng.normal(size=(200, NUM_FEATURES)) +
                labels[:, None]).astype(np.float32)
    return {'': tf.data.Dataset.from_tensor_slices(
        (features, labels)).batch(200)}

  return base.Task(
      name='population',
      train_client_ids=tuple(f'{k:05d}' for k in range(population)),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=keras_model,
      loss_fn=lambda: tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True),
      metrics_fn=lambda: [],
      batch_spec=(tf.TensorSpec([None, NUM_FEATURES], tf.float32),
                  tf.TensorSpec([None], tf.int64)),
      eval_datasets_fn=eval_datasets,
      serving=base.ServingSpec(
          'x', tf.TensorSpec([None, NUM_FEATURES], tf.float32),
          lambda x: x, lambda y: {'logits': y}))


def train_child(args) -> None:
  """The measured process: one SCAFFOLD run with the chosen store."""
  from pipeline import driver  # pylint: disable=g-import-not-at-top
  from pipeline import tff_runtime  # pylint: disable=g-import-not-at-top
  from tff_algos import registry  # pylint: disable=g-import-not-at-top
  from tff_algos.config import AlgorithmConfig  # pylint: disable=g-import-not-at-top
  tff_runtime.configure_execution()
  task = build_population_task(args.population, args.examples_per_client,
                               args.hidden)
  algorithm = registry.build_algorithm(args.algorithm, task.model_fn,
                                       AlgorithmConfig(
                                           client_learning_rate=0.1,
                                           num_train_clients=args.population))
  driver.train(algorithm, task, driver.RunConfig(
      root_output_dir=args.root_output_dir,
      experiment_name=f'{args.algorithm}_{args.backend}',
      total_rounds=args.rounds, clients_per_round=args.clients_per_round,
      rounds_per_eval=args.rounds, rounds_per_checkpoint=args.rounds,
      seed=args.seed, client_state_store=args.backend, export=False))
  tff_runtime.shutdown_workers()


def _rounds_done(run_dir: str) -> int:
  path = os.path.join(run_dir, 'metrics.csv')
  if not os.path.exists(path):
    return 0
  with open(path, newline='') as f:
    return sum(1 for _ in csv.DictReader(f))


def _store_mb(run_dir: str) -> float:
  total = 0
  for suffix in ('', '-wal'):
    path = os.path.join(run_dir, 'client_states.sqlite' + suffix)
    if os.path.exists(path):
      total += os.path.getsize(path)
  return total / 2**20


def measure(backend: str, population: int, args) -> list[dict]:
  """Runs the child and returns one record per finished round."""
  import psutil  # pylint: disable=g-import-not-at-top
  from pipeline import driver  # pylint: disable=g-import-not-at-top
  root = os.path.join(args.root_output_dir, f'population_{population}')
  run_dir = os.path.join(root, f'{args.algorithm}_{backend}')
  shutil.rmtree(run_dir, ignore_errors=True)
  command = [sys.executable, '-m', 'benchmarks.scaffold_store_memory',
             '--child', f'--backend={backend}', f'--algorithm={args.algorithm}',
             f'--root_output_dir={root}',
             f'--population={population}', f'--rounds={args.rounds}',
             f'--clients_per_round={args.clients_per_round}',
             f'--examples_per_client={args.examples_per_client}',
             f'--hidden={args.hidden}', f'--seed={args.seed}']
  child = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
  process = psutil.Process(child.pid)
  ever_sampled = set()
  records = []
  print(f'\n{args.algorithm}, --client_state_store={backend}: population '
        f'{population}, '
        f'{args.clients_per_round} clients per round, c_i of '
        f'{args.hidden * (NUM_FEATURES + 1 + NUM_CLASSES) + NUM_CLASSES} '
        'floats')
  print(f'{"round":>5s} {"ever sampled":>12s} {"RSS train MB":>12s} '
        f'{"RSS worker MB":>13s} {"store on disk MB":>16s}', flush=True)
  reported = 0
  peak = (0.0, 0.0)
  while child.poll() is None:
    own, workers = process_memory.rss_mb(process)
    peak = (max(peak[0], own), max(peak[1], workers))
    done = _rounds_done(run_dir)
    while reported < done:
      reported += 1
      ever_sampled.update(driver.plan_round(
          args.seed, reported, population,
          args.clients_per_round).client_indices)
      record = dict(round=reported, ever_sampled=len(ever_sampled),
                    rss=peak[0], worker_rss=peak[1],
                    store=_store_mb(run_dir))
      records.append(record)
      print(f'{reported:5d} {len(ever_sampled):12d} {peak[0]:12.0f} '
            f'{peak[1]:13.0f} {record["store"]:16.1f}', flush=True)
      peak = (0.0, 0.0)
    time.sleep(args.poll_seconds)
  if child.returncode:
    raise SystemExit(f'the {backend} run failed ({child.returncode}): '
                     + ' '.join(command))
  return records


def summarize(label: str, records: list[dict]) -> None:
  """Peak RSS over the first and the last quarter of the rounds.

  Round 1 (compilation) is left out. The training process holds the store;
  TFF's worker process is reported apart.
  """
  body = records[1:]
  quarter = max(1, len(body) // 4)
  first, last = body[:quarter], body[-quarter:]
  sampled = lambda rs: rs[-1]['ever_sampled']
  new_clients = sampled(last) - sampled(first)
  parts = []
  for name, key in (('training process', 'rss'), ('TFF worker', 'worker_rss')):
    before = max(r[key] for r in first)
    after = max(r[key] for r in last)
    per_client = (f'{1000 * (after - before) / new_clients:+.1f} MB per 1000 '
                  'new clients' if new_clients else 'no new clients')
    parts.append(f'{name} {before:.0f} -> {after:.0f} MB ({per_client})')
  print(f'{label}, clients ever sampled {sampled(first)} -> {sampled(last)}: '
        + '; '.join(parts))


def print_side_by_side(backend: str, runs: dict[int, list[dict]]) -> None:
  """RSS per round of runs that differ only in the clients ever sampled."""
  print(f'\n{backend}: RSS MB per round (training process / TFF worker) by '
        'population (clients ever sampled)')
  print(f'{"round":>5s} ' + ' '.join(f'{"pop " + str(p):>24s}' for p in runs))
  for index in range(min(len(r) for r in runs.values())):
    cells = [f'{r[index]["rss"]:6.0f} / {r[index]["worker_rss"]:5.0f} '
             f'({r[index]["ever_sampled"]:5d})' for r in runs.values()]
    print(f'{index + 1:5d} ' + ' '.join(f'{c:>24s}' for c in cells))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--population', type=int, default=10_000,
                      help=argparse.SUPPRESS)  # The child's population.
  parser.add_argument('--populations', default='10000',
                      help='Comma-separated train populations, one run each '
                      '(per backend); each must be >= --clients_per_round.')
  parser.add_argument('--clients_per_round', type=int, default=200)
  parser.add_argument('--rounds', type=int, default=40)
  parser.add_argument('--examples_per_client', type=int, default=4)
  parser.add_argument('--hidden', type=int, default=128)
  parser.add_argument('--backends', default='sqlite,memory')
  parser.add_argument('--algorithm', default='scaffold',
                      choices=('scaffold', 'fedavg'))
  parser.add_argument('--root_output_dir', default=None,
                      help='Default: a temporary directory, deleted after.')
  parser.add_argument('--poll_seconds', type=float, default=0.5)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--backend', default='sqlite', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    train_child(args)
    return
  temporary = args.root_output_dir is None
  args.root_output_dir = os.path.abspath(
      args.root_output_dir or tempfile.mkdtemp(prefix='scaffold_store_'))
  populations = [int(p) for p in args.populations.split(',')]
  if min(populations) < args.clients_per_round:
    parser.error(f'--populations={args.populations}: every population must be '
                 f'>= --clients_per_round={args.clients_per_round}')
  try:
    results = {(b, p): measure(b, p, args)
               for b in args.backends.split(',') for p in populations}
    print()
    for (backend, population), records in results.items():
      summarize(f'{args.algorithm}, {backend}, population {population}',
                records)
    if len(populations) > 1:
      for backend in args.backends.split(','):
        print_side_by_side(
            backend, {p: results[backend, p] for p in populations})
  finally:
    # This process imported TFF (for the driver's sampling plan); drop its
    # context now, not in interpreter teardown where TFF's __del__ fails.
    from pipeline import tff_runtime  # pylint: disable=g-import-not-at-top
    tff_runtime.shutdown_workers()
    if temporary:
      shutil.rmtree(args.root_output_dir, ignore_errors=True)


if __name__ == '__main__':
  main()
