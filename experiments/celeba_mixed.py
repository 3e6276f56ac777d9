r"""Fig. 1a / 2a of [MixedFL] on celeba_smile: mixed FL vs. FL only vs. oracle.

Runs, through `binaries.train` with the task's paper defaults ([MixedFL] App. C.2):
  fl_only   FedAvg on the federated (smiling) data alone
  oracle    FedAvg with both labels on the same composite clients
  mixed_pt, mixed_1wgt, mixed_2wgt   on federated smiling + central non-smiling
then prints a table of eval AUC / loss and writes the AUC and loss curves
(binaries.plot).

  # Synthetic CelebA-format data (no download):
  python -m experiments.celeba_mixed --use_synthetic_data --total_rounds=30 \
      --root_output_dir=/tmp/celeba_mixed --plot_prefix=docs/celeba_mixed_synthetic
  # Real TFF CelebA (cache_dir holds celeba.sqlite):
  python -m experiments.celeba_mixed --cache_dir=$HOME/.tff --total_rounds=1000 \
      --root_output_dir=runs/celeba_mixed --plot_prefix=runs/celeba_mixed/fig

Runs that already have a checkpoint resume (same flags, more rounds).
"""

import csv
import os
import subprocess
import sys

from experiments import cli

# (experiment name, algorithm, celeba_mode)
RUNS = (
    ('fl_only', 'fedavg', 'fl_only'),
    ('oracle', 'fedavg', 'oracle'),
    ('mixed_pt', 'mixed_pt', 'mixed'),
    ('mixed_1wgt', 'mixed_1wgt', 'mixed'),
    ('mixed_2wgt', 'mixed_2wgt', 'mixed'),
)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(name, algorithm, mode, args, extra_flags):
  command = [
      sys.executable, '-m', 'binaries.train', '--task=celeba_smile',
      f'--algorithm={algorithm}', f'--celeba_mode={mode}',
      f'--experiment_name={name}', f'--root_output_dir={args.root_output_dir}',
      f'--total_rounds={args.total_rounds}',
      f'--rounds_per_eval={args.rounds_per_eval}', f'--seed={args.seed}',
  ] + extra_flags
  print('$ python', ' '.join(command[1:]), flush=True)
  cli.run_binary(command, cwd=REPO)


def last_and_best(run_dir, metric):
  with open(os.path.join(run_dir, 'metrics.csv'), newline='') as f:
    values = [float(row[metric]) for row in csv.DictReader(f)
              if row.get(metric)]
  return values[-1], max(values), min(values)


def main():
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--root_output_dir', required=True)
  parser.add_argument('--total_rounds', type=int, default=30)
  parser.add_argument('--rounds_per_eval', type=int, default=1)
  parser.add_argument('--seed', type=cli.seed, default=0)
  parser.add_argument('--use_synthetic_data', action='store_true')
  parser.add_argument('--cache_dir', default=None)
  parser.add_argument('--plot_prefix', default=None,
                      help='Write <prefix>_auc.png and <prefix>_loss.png.')
  parser.add_argument('--runs', default=','.join(r[0] for r in RUNS),
                      help='Comma-separated subset of the runs.')
  parser.add_argument(
      '--check_margin', type=cli.finite_number, default=None,
      help='Exit 1 unless every mixed run ends with an eval AUC at least '
      'this much above fl_only\'s.')
  args = parser.parse_args()
  # The binaries run from the repository root.
  args.root_output_dir = os.path.abspath(args.root_output_dir)
  if args.plot_prefix:
    args.plot_prefix = os.path.abspath(args.plot_prefix)
  extra_flags = []
  if args.use_synthetic_data:
    extra_flags.append('--use_synthetic_data')
  if args.cache_dir:
    extra_flags.append(
        f'--cache_dir={os.path.abspath(os.path.expanduser(args.cache_dir))}')
  names = args.runs.split(',')
  unknown = [name for name in names if name not in [r[0] for r in RUNS]]
  if unknown:
    # They were skipped: an empty table, or a KeyError with --check_margin.
    parser.error(f'argument --runs: {unknown[0]!r} is not one of '
                 f'{", ".join(r[0] for r in RUNS)}')
  if args.check_margin is not None and 'fl_only' not in names:
    parser.error('argument --check_margin: compares with fl_only, which '
                 '--runs leaves out')
  selected = [r for r in RUNS if r[0] in names]
  for name, algorithm, mode in selected:
    train(name, algorithm, mode, args, extra_flags)

  run_dirs = [os.path.join(args.root_output_dir, r[0]) for r in selected]
  print(f'\nceleba_smile after {args.total_rounds} rounds '
        f'({"synthetic" if args.use_synthetic_data else "real"} data)')
  print(f'{"run":<12} {"eval/auc":>9} {"best auc":>9} {"eval/loss":>10} '
        f'{"min loss":>9}')
  final_auc = {}
  for (name, _, _), run_dir in zip(selected, run_dirs):
    auc, best_auc, _ = last_and_best(run_dir, 'eval/auc')
    final_auc[name] = auc
    loss, _, min_loss = last_and_best(run_dir, 'eval/loss')
    print(f'{name:<12} {auc:9.4f} {best_auc:9.4f} {loss:10.4f} '
          f'{min_loss:9.4f}')
  if args.plot_prefix:
    for metric, suffix in (('eval/auc', 'auc'), ('eval/loss', 'loss')):
      cli.run_binary(
          [sys.executable, '-m', 'binaries.plot', *run_dirs,
           f'--metric={metric}', f'--output={args.plot_prefix}_{suffix}.png',
           f'--title=celeba_smile {metric}'], cwd=REPO)
  if args.check_margin is not None:
    failed = [name for name in final_auc if name.startswith('mixed') and
              not final_auc[name] >= final_auc['fl_only'] + args.check_margin]
    verdict = 'FAILED for ' + ', '.join(failed) if failed else 'passed'
    print(f'check: every mixed eval/auc >= fl_only '
          f'({final_auc["fl_only"]:.4f}) + {args.check_margin}: {verdict}')
    if failed:
      sys.exit(1)


if __name__ == '__main__':
  cli.run_main(main)
