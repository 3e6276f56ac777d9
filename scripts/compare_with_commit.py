"""Runs the same training commands on another commit and on this tree, and
compares the results bit for bit.

  .venv/bin/python scripts/compare_with_commit.py --commit=<sha> [--quick]

For a refactoring that must not change results: every algorithm, both
runtimes, a few rounds each on small real or synthetic tasks. The other
commit is checked out into a temporary git worktree and run with this
tree's virtualenv; each command's metrics.csv (every column but timings) and
exported global model weights are compared exactly, and the largest
difference is printed when they are not identical. Flags that only this tree
has are given as `NEW_ONLY_FLAGS` (e.g. the group size, set to one client per
group so the order of float sums is the per-client order of older commits);
`--same_flags` leaves them out, for commits that have them too.
`--tff_flags` adds flags to both trees' TFF runs, e.g. `--runtimes=tff
--tff_flags=--num_subrounds=3` to compare runs in sub-rounds.
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, '.venv', 'bin', 'python')
NEW_ONLY_FLAGS = ['--clients_per_group=1']
_COMMON = ['--total_rounds=3', '--rounds_per_eval=3', '--seed=3']
_DIGITS = ['--task=digits', '--num_clients=20', '--clients_per_round=5',
           '--client_steps=3', '--client_batch_size=8']
_LR = ['--client_learning_rate=0.05']
_CELEBA = ['--task=celeba_smile', '--use_synthetic_data',
           '--clients_per_round=4', '--client_steps=2',
           '--central_batch_size=16']
_FEDRES = ['--task=fedres_logistic', '--clients_per_round=4',
           '--client_steps=3']
COMMANDS = {
    'fedavg': _DIGITS + _LR + ['--algorithm=fedavg'],
    'fedavg_uniform': _DIGITS + _LR + ['--algorithm=fedavg',
                                       '--client_weighting=uniform'],
    'fedprox': _DIGITS + _LR + ['--algorithm=fedprox',
                                '--proximal_strength=0.1'],
    'fedsgd': _DIGITS + ['--algorithm=fedsgd'],
    'scaffold_1': _DIGITS + _LR + ['--algorithm=scaffold',
                                   '--scaffold_option=1'],
    'scaffold_2': _DIGITS + _LR + ['--algorithm=scaffold'],
    'fedpvr': _DIGITS + _LR + ['--algorithm=fedpvr', '--model=mlp',
                               '--drift_diversity'],
    'mixed_pt': _CELEBA + ['--algorithm=mixed_pt'],
    'mixed_1wgt': _CELEBA + ['--algorithm=mixed_1wgt', '--mixed_diagnostics'],
    'mixed_2wgt': _CELEBA + ['--algorithm=mixed_2wgt'],
    'fedres_naive': _FEDRES + ['--algorithm=fedres_naive'],
    'fedres_sgd': _FEDRES + ['--algorithm=fedres_sgd'],
    'fedres_avg': _FEDRES + ['--algorithm=fedres_avg'],
    'fedres_avg_1': _FEDRES + ['--algorithm=fedres_avg', '--fedres_option=1'],
    # The first layer's c_i kept as factors (docs/scaffold.md).
    'scaffold_factored': _DIGITS + _LR + ['--algorithm=scaffold',
                                          '--model=mlp'],
}
QUICK = ('fedavg', 'scaffold_2', 'mixed_2wgt', 'fedres_avg')
_TIMING = ('round_seconds', 'eval_seconds')
# Analytic counts, not results: they change when what is counted changes.
_ACCOUNTING_PREFIX = 'communication/'


def _train(tree: str, name: str, runtime: str, root: str,
           extra: list[str]) -> str:
  command = [PYTHON, '-m', 'binaries.train', f'--experiment_name={name}',
             f'--root_output_dir={root}', f'--runtime={runtime}',
             *_COMMON, *COMMANDS[name], *extra]
  done = subprocess.run(command, cwd=tree, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f'{" ".join(command)} in {tree} failed:\n'
                       f'{done.stderr[-3000:]}')
  return os.path.join(root, name)


def _metrics(run_dir: str) -> dict[str, list[str]]:
  with open(os.path.join(run_dir, 'metrics.csv')) as f:
    rows = list(csv.DictReader(f))
  return {key: [row[key] for row in rows] for key in rows[0]
          if key not in _TIMING}


def _weights(run_dir: str) -> list[np.ndarray]:
  code = ('import sys, numpy as np\n'
          'from pipeline import export\n'
          'w = export.load_model_weights(sys.argv[1])\n'
          'np.savez(sys.argv[2], *w.trainable, *w.non_trainable)\n')
  path = os.path.join(run_dir, 'weights.npz')
  subprocess.run([PYTHON, '-c', code, os.path.join(run_dir, 'export'), path],
                 cwd=ROOT, check=True, capture_output=True)
  with np.load(path) as loaded:
    return [loaded[key] for key in sorted(loaded.files,
                                          key=lambda k: int(k.split('_')[1]))]


def compare(old_dir: str, new_dir: str) -> tuple[str, str]:
  """(differences in results, or 'identical'; notes on other columns)."""
  old_metrics, new_metrics = _metrics(old_dir), _metrics(new_dir)
  problems, notes = [], []
  if set(old_metrics) - set(new_metrics):
    problems.append('metric columns missing: '
                    f'{sorted(set(old_metrics) - set(new_metrics))}')
  if set(new_metrics) - set(old_metrics):
    notes.append('new columns: '
                 f'{sorted(set(new_metrics) - set(old_metrics))}')
  for key in sorted(set(old_metrics) & set(new_metrics)):
    if key.startswith(_ACCOUNTING_PREFIX):
      if old_metrics[key] != new_metrics[key]:
        notes.append(f'{key}: {old_metrics[key][0]} -> {new_metrics[key][0]}')
      continue
    if old_metrics[key] != new_metrics[key]:
      old = np.array([float(v or 'nan') for v in old_metrics[key]])
      new = np.array([float(v or 'nan') for v in new_metrics[key]])
      # Empty cells (rounds without evaluation) read as NaN on both sides.
      difference = np.where(np.isnan(old) & np.isnan(new), 0.0,
                            np.abs(old - new))
      problems.append(f'{key} max diff {np.max(difference):.3g}')
  old_weights, new_weights = _weights(old_dir), _weights(new_dir)
  for i, (old, new) in enumerate(zip(old_weights, new_weights, strict=True)):
    if not np.array_equal(old, new):
      problems.append(f'weight {i} max diff {np.max(np.abs(old - new)):.3g}')
  return ('identical' if not problems else '; '.join(problems),
          '; '.join(notes))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--commit', required=True)
  parser.add_argument('--quick', action='store_true',
                      help=f'only {", ".join(QUICK)}')
  parser.add_argument('--configs', default='',
                      help='comma-separated names of COMMANDS to run '
                      '(default: all, or --quick\'s)')
  parser.add_argument('--runtimes', default='tff,native')
  parser.add_argument('--tff_flags', default='',
                      help='space-separated flags for both trees\' TFF runs '
                      '(e.g. "--num_subrounds=3"; with --runtimes=tff)')
  parser.add_argument('--same_flags', action='store_true',
                      help='no NEW_ONLY_FLAGS: the commit has every flag of '
                      'this tree (e.g. a commit after compiled cohorts)')
  args = parser.parse_args()
  names = QUICK if args.quick else tuple(COMMANDS)
  if args.configs:
    names = tuple(args.configs.split(','))
    unknown = [n for n in names if n not in COMMANDS]
    if unknown:
      print(f'error: unknown --configs {", ".join(unknown)}; known: '
            f'{", ".join(COMMANDS)}', file=sys.stderr)
      return 2
  work = tempfile.mkdtemp(prefix='compare_')
  old_tree = os.path.join(work, 'tree')
  added = subprocess.run(['git', 'worktree', 'add', '--detach', old_tree,
                          args.commit], cwd=ROOT, capture_output=True,
                         text=True)
  if added.returncode:
    # Was a CalledProcessError traceback (e.g. outside a git checkout), and
    # the temporary directory stayed.
    shutil.rmtree(work, ignore_errors=True)
    problem = (added.stderr.strip().splitlines() or ['git failed'])[-1]
    print(f'error: cannot check out --commit={args.commit} from {ROOT} '
          f'(needs a git checkout that has it): {problem}', file=sys.stderr)
    return 2
  os.symlink(os.path.join(ROOT, '.venv'), os.path.join(old_tree, '.venv'))
  identical = 0
  try:
    for runtime in args.runtimes.split(','):
      both = args.tff_flags.split() if runtime == 'tff' else []
      for name in names:
        old = _train(old_tree, name, runtime,
                     os.path.join(work, 'old', runtime), both)
        new = _train(ROOT, name, runtime, os.path.join(work, 'new', runtime),
                     both + ([] if args.same_flags else NEW_ONLY_FLAGS))
        verdict, notes = compare(old, new)
        identical += verdict == 'identical'
        print(f'{runtime:6s} {name:15s} {verdict}' +
              (f'  ({notes})' if notes else ''), flush=True)
  finally:
    subprocess.run(['git', 'worktree', 'remove', '--force', old_tree],
                   cwd=ROOT, capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
  total = len(names) * len(args.runtimes.split(','))
  print(f'{identical} of {total} runs identical to {args.commit}')
  return 0 if identical == total else 1


if __name__ == '__main__':
  sys.exit(main())
