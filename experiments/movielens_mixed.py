r"""[MixedFL] Sec. 5.3 on MovieLens: mixed FL vs. the baseline, recall@10 and
per-client communication and computation (Table 5).

Runs, through `binaries.train --task=movielens` with the task's paper
defaults (S=100, |B_i|=16, K=10, eta=0.5, eta_s=eta_m=1, eta_c=eta,
w_f=w_c=0.5; [MixedFL] App. C.2):
  baseline    fedavg, hinge + spreadout on every client (--spreadout_on_clients)
  mixed_pt, mixed_1wgt, mixed_2wgt   hinge on clients, spreadout at the server
then prints, per run, recall@10 on the test users (last evaluation), and the
per-client per-round means over all rounds of `train/client_flops` and
`train/client_comm_floats` (what a client of a sparse-row implementation
computes and sends; see docs/movielens.md), with the reductions relative to
the baseline and whether the acceptance target holds (recall@10 within 10%
of the baseline's, at least 90% less client computation and communication).

  python -m experiments.movielens_mixed \
      --movielens_dir=DIR \
      --root_output_dir=/tmp/movielens_mixed --total_rounds=200 \
      --rounds_per_eval=20 --clients_per_round=20

(DIR: a directory holding ML-100K's u.data or ML-1M's ratings.dat.)

Runs that already have a checkpoint resume (same flags, more rounds; a run
trained with other flags is one error line); runs already at or past
--total_rounds are not trained again, and every run is
reported at round --total_rounds (recall@10 of the last evaluation up to it,
costs averaged over rounds 1..total_rounds).
"""

import csv
import os
import subprocess
import sys

from experiments import cli

# (experiment name, algorithm)
RUNS = (
    ('baseline', 'fedavg'),
    ('mixed_pt', 'mixed_pt'),
    ('mixed_1wgt', 'mixed_1wgt'),
    ('mixed_2wgt', 'mixed_2wgt'),
)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECALL = 'eval/recall_at_10'
FLOPS = 'train/client_flops'
COMMUNICATION = 'train/client_comm_floats'


def train(name, algorithm, args, extra_flags):
  command = [
      sys.executable, '-m', 'binaries.train', '--task=movielens',
      f'--algorithm={algorithm}', f'--experiment_name={name}',
      f'--root_output_dir={args.root_output_dir}',
      f'--total_rounds={args.total_rounds}',
      f'--rounds_per_eval={args.rounds_per_eval}',
      f'--rounds_per_checkpoint={args.total_rounds}', f'--seed={args.seed}',
  ] + extra_flags
  print('$ python', ' '.join(command[1:]), flush=True)
  cli.run_binary(command, cwd=REPO, stdout=subprocess.DEVNULL)


def read_rows(run_dir, total_rounds):
  path = os.path.join(run_dir, 'metrics.csv')
  if not os.path.exists(path):
    return []
  with open(path, newline='') as f:
    return [row for row in csv.DictReader(f)
            if int(row['round_num']) <= total_rounds]


def summary(run_dir, total_rounds):
  """Last recall@10, and per-round means of client FLOPs and floats sent."""
  rows = read_rows(run_dir, total_rounds)

  def mean(metric):
    values = [float(row[metric]) for row in rows if row.get(metric)]
    return sum(values) / len(values)

  recalls = [float(row[RECALL]) for row in rows if row.get(RECALL)]
  return {'recall': recalls[-1], 'flops': mean(FLOPS),
          'floats': mean(COMMUNICATION)}


def main():
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--movielens_dir', default=None)
  parser.add_argument('--use_synthetic_data', action='store_true')
  parser.add_argument('--root_output_dir', required=True)
  parser.add_argument('--total_rounds', type=cli.positive_int, default=100)
  parser.add_argument('--rounds_per_eval', type=cli.positive_int, default=None,
                      help='default: total_rounds / 5')
  parser.add_argument('--clients_per_round', type=cli.positive_int,
                      default=None,
                      help='default: the task\'s (S=100)')
  parser.add_argument('--seed', type=cli.seed, default=0)
  args = parser.parse_args()
  # The binaries run from the repository root: a relative directory was
  # theirs there and the summary's here (an IndexError traceback).
  args.root_output_dir = os.path.abspath(args.root_output_dir)
  if args.rounds_per_eval is None:
    args.rounds_per_eval = max(1, args.total_rounds // 5)
  if args.use_synthetic_data and args.movielens_dir:
    # It was ignored; the binary refuses a data location with synthetic
    # data too.
    parser.error('argument --movielens_dir does not apply with '
                 '--use_synthetic_data (synthetic data reads no files); pass '
                 'one of them')
  if args.use_synthetic_data:
    data_flags = ['--use_synthetic_data']
  elif args.movielens_dir:
    data_flags = [f'--movielens_dir={os.path.abspath(args.movielens_dir)}']
  else:
    parser.error('pass --movielens_dir or --use_synthetic_data')
  if args.clients_per_round:
    data_flags.append(f'--clients_per_round={args.clients_per_round}')

  results = {}
  for name, algorithm in RUNS:
    # Also a finished run: the binary leaves it as it is, and refuses it if
    # it was trained with other flags (skipped, it was reported as if not).
    train(name, algorithm, args, data_flags)
    results[name] = summary(os.path.join(args.root_output_dir, name),
                            args.total_rounds)

  base = results['baseline']
  print(f'\nmovielens, {args.total_rounds} rounds; per client and round: '
        'FLOPs and floats sent (down + up) of a sparse-row client')
  print(f'{"run":>11} {"recall@10":>10} {"vs base":>8} {"client FLOPs":>13} '
        f'{"saved":>8} {"comm floats":>12} {"saved":>8}  target')
  for name, result in results.items():
    recall_change = result['recall'] / base['recall'] - 1
    flops_saved = 1 - result['flops'] / base['flops']
    floats_saved = 1 - result['floats'] / base['floats']
    meets = (abs(recall_change) <= 0.10 or recall_change > 0) and (
        flops_saved >= 0.9 and floats_saved >= 0.9)
    target = '' if name == 'baseline' else ('met' if meets else 'NOT met')
    print(f'{name:>11} {result["recall"]:>10.4f} {recall_change:>+8.1%} '
          f'{result["flops"]:>13.4g} {flops_saved:>8.2%} '
          f'{result["floats"]:>12.4g} {floats_saved:>8.2%}  {target}')


if __name__ == '__main__':
  cli.run_main(main)
