"""Checks that pfl_benchmark.py's pfl side computes the project's rounds.

Run with the project's Python from the repository root, after
setup_pfl_venv.sh:

  .venv/bin/python -m benchmarks.peers.check_same_math [--peers_venv=.peers-venv]

One client with a fixed dataset (K=2 batches of 5 CelebA-shaped examples,
in order) and fixed initial weights of the benchmark's model, --rounds
rounds (default 2, so SCAFFOLD's second round starts from non-zero c and
c_i), a population of --population clients (SCAFFOLD's |S|/N). The project
side is the registry's algorithm (`tff_algos.registry`, the one the
benchmark's driver runs) fed that dataset through TFF; the pfl side is
pfl_benchmark.py --check_fixture in the peer venv. Per round it compares
the global model (and SCAFFOLD's c and c_i) and exits 1 unless:
  - FedAvg: every round's model is the project's (up to --tolerance,
    relative to the largest change of the weights);
  - pfl's SCAFFOLD: round 1's model is the project's and its c, c_i are
    minus the project's (pfl's control variates have the opposite sign, so
    later rounds differ; printed, not held);
  - pfl's SCAFFOLD with the drift correction's two terms swapped
    (pfl_benchmark.swap_scaffold_correction): every round's model is the
    project's and its c, c_i are minus the project's, i.e. the sign is the
    only difference.
"""

import argparse
import collections
import os
import subprocess
import sys
import tempfile

import numpy as np

from binaries import app
from pipeline import tf_logs

# Before TensorFlow is imported (in this process, for the project's side).
tf_logs.quiet_tensorflow_import()

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NAMES = ('kernel_0', 'bias_0', 'kernel_1', 'bias_1')
IMAGE_SHAPE = (84, 84, 3)
BATCH_SIZE, STEPS = 5, 2


def make_fixture(seed: int, population: int, rounds: int) -> dict:
  rng = np.random.default_rng(seed)
  inputs = int(np.prod(IMAGE_SHAPE))
  # Glorot-uniform kernels, small random biases (non-zero, so every
  # variable's arithmetic shows).
  fixture = {
      'kernel_0': rng.uniform(-1, 1, (inputs, 64)) * np.sqrt(6 / (inputs + 64)),
      'bias_0': rng.normal(0, 0.05, 64),
      'kernel_1': rng.uniform(-1, 1, (64, 1)) * np.sqrt(6 / 65),
      'bias_1': rng.normal(0, 0.05, 1),
      'images': rng.integers(0, 256, (BATCH_SIZE * STEPS, *IMAGE_SHAPE)) / 255,
      'labels': (rng.random((BATCH_SIZE * STEPS, 1)) < 0.5),
  }
  fixture = {k: v.astype(np.float32) for k, v in fixture.items()}
  fixture.update(population=np.int64(population), rounds=np.int64(rounds),
                 batch_size=np.int64(BATCH_SIZE))
  return fixture


def run_project(algorithm_name: str, fixture: dict) -> dict:
  """The project's algorithm on the fixture: weights (and c, c_i) per round."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tensorflow_federated as tff  # pylint: disable=import-outside-toplevel
  from binaries import benchmark  # pylint: disable=import-outside-toplevel
  from pipeline import tff_runtime  # pylint: disable=import-outside-toplevel
  from tasks import base  # pylint: disable=import-outside-toplevel
  from tasks import celeba  # pylint: disable=import-outside-toplevel
  from tff_algos import registry  # pylint: disable=import-outside-toplevel
  from tff_algos.config import AlgorithmConfig  # pylint: disable=import-outside-toplevel
  # The project's TFF context, whose exit hooks stop TFF's worker process.
  tff_runtime.configure_execution()
  population = int(fixture['population'])
  task = celeba.build_task(base.DataConfig(
      client_batch_size=BATCH_SIZE, client_steps=STEPS,
      use_synthetic_data=True,
      options={'celeba_mode': 'federated',
               'synthetic_train_clients': population}))
  algorithm = registry.build_algorithm(algorithm_name, task.model_fn,
                                       AlgorithmConfig(
      client_learning_rate=benchmark.CLIENT_LEARNING_RATE,
      server_learning_rate=benchmark.SERVER_LEARNING_RATE,
      num_train_clients=population, clients_per_round=1))
  dataset = tf.data.Dataset.from_tensor_slices(
      (fixture['images'], fixture['labels'])).batch(BATCH_SIZE)
  state = algorithm.set_model_weights(
      algorithm.process.initialize(), tff.learning.models.ModelWeights(
          trainable=[fixture[n] for n in NAMES], non_trainable=[]))
  client_state = (algorithm.client_state_fn() if algorithm.has_client_state
                  else None)
  results = {}
  for round_num in range(1, int(fixture['rounds']) + 1):
    client_input = dataset if client_state is None else (
        collections.OrderedDict(data=dataset, state=client_state))
    state, client_outputs, _ = algorithm.process.next(state, [client_input])
    prefix = f'round{round_num}/'
    weights = algorithm.get_model_weights(state).trainable
    results.update({f'{prefix}model/{n}': np.asarray(w)
                    for n, w in zip(NAMES, weights)})
    if client_state is not None:
      client_state = client_outputs[0]['state']
      results.update({f'{prefix}c/{n}': np.asarray(c) for n, c in zip(
          NAMES, state['control_variate'])})
      results.update({f'{prefix}c_i/{n}': np.asarray(c) for n, c in zip(
          NAMES, client_state['control_variate'])})
  return results


def run_pfl(algorithm_name: str, fixture_path: str, peers_python: str,
            swap_correction: bool = False) -> dict:
  with tempfile.TemporaryDirectory(prefix='pfl_check_') as work:
    output = os.path.join(work, 'pfl.npz')
    subprocess.run([peers_python, os.path.join(HERE, 'pfl_benchmark.py'),
                    f'--algorithm={algorithm_name}',
                    f'--check_fixture={fixture_path}',
                    f'--check_output={output}'] + (
                        ['--check_swap_correction'] if swap_correction else []),
                   check=True, stdout=subprocess.DEVNULL)
    return dict(np.load(output))


def compare(project: dict, pfl: dict, fixture: dict, tolerance: float
            ) -> dict:
  """{'roundR/quantity': (verdict, relative difference)}.

  The relative difference is max |project - pfl| over the quantity's
  variables divided by the largest change of the project's quantity since
  the start (the initial weights for the model, zero for c and c_i). The
  verdict is 'same', 'negated' (c and c_i only: within the tolerance of
  minus the project's) or 'DIFFERENT'.
  """
  groups = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
  for key in sorted(project):
    quantity, name = key.rsplit('/', 1)
    start = fixture[name] if quantity.endswith('/model') else 0.0
    group = groups[quantity]
    group[0] = max(group[0], np.abs(project[key] - pfl[key]).max())
    group[1] = max(group[1], np.abs(project[key] + pfl[key]).max())
    group[2] = max(group[2], np.abs(project[key] - start).max())
  out = {}
  for quantity, (difference, negated_difference, change) in groups.items():
    relative = difference / change if change else float(difference > 0)
    relative_negated = (negated_difference / change if change
                        else float(negated_difference > 0))
    if relative <= tolerance:
      out[quantity] = ('same', relative)
    elif not quantity.endswith('/model') and relative_negated <= tolerance:
      out[quantity] = ('negated', relative_negated)
    else:
      out[quantity] = ('DIFFERENT', relative)
  return out


def expected_verdicts(variant: str, quantities) -> dict:
  """What the check holds pfl to (None: printed, not held)."""
  if variant == 'fedavg':
    return {q: 'same' for q in quantities}
  if variant == 'scaffold, c - c_i swapped':
    return {q: 'same' if q.endswith('/model') else 'negated'
            for q in quantities}
  # pfl's own SCAFFOLD: only its first round is the project's (up to the
  # sign of c and c_i); later rounds follow from its sign (README).
  return {q: ('same' if q.endswith('/model') else 'negated')
          if q.startswith('round1/') else None for q in quantities}


def main(argv=None) -> int:
  parser = app.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--peers_venv', default=os.path.join(REPO, '.peers-venv'))
  parser.add_argument('--population', type=int, default=4)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--tolerance', type=float, default=1e-4,
                      help='Largest relative difference still "same".')
  args = parser.parse_args(argv)
  peers_python = os.path.join(args.peers_venv, 'bin', 'python')
  if not os.access(peers_python, os.X_OK):
    print(f'error: no {peers_python}; run benchmarks/peers/setup_pfl_venv.sh',
          file=sys.stderr)
    return 2
  if args.rounds < 2 or args.population < 1:
    print('error: --rounds must be >= 2 (SCAFFOLD\'s c matters from round 2) '
          'and --population >= 1', file=sys.stderr)
    return 2
  fixture = make_fixture(seed=0, population=args.population,
                         rounds=args.rounds)
  failed = False
  with tempfile.TemporaryDirectory(prefix='same_math_') as work:
    fixture_path = os.path.join(work, 'fixture.npz')
    np.savez(fixture_path, **fixture)
    project = {name: run_project(name, fixture)
               for name in ('fedavg', 'scaffold')}
    for variant, name, swap in (
        ('fedavg', 'fedavg', False), ('scaffold', 'scaffold', False),
        ('scaffold, c - c_i swapped', 'scaffold', True)):
      verdicts = compare(project[name], run_pfl(name, fixture_path,
                                                peers_python, swap),
                         fixture, args.tolerance)
      expected = expected_verdicts(variant, verdicts)
      for quantity, (verdict, relative) in verdicts.items():
        held = expected[quantity]
        ok = held is None or verdict == held
        failed |= not ok
        print(f'{variant:26s} {quantity:14s} {verdict:9s} (relative '
              f'difference {relative:.1e})' + (
                  '' if held else '  [not held]') + (
                      '' if ok else f'  FAILED: expected {held}'), flush=True)
  print('FAILED' if failed else
        'pfl computes the project\'s FedAvg; its SCAFFOLD is the project\'s '
        'with the sign of the control variates flipped (same work per client)')
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
