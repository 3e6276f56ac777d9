r"""SCAFFOLD vs FedAvg on label-sorted digits ([SCAFFOLD] Sec. 7, Table 3 style).

Runs `binaries.train` on `--task=digits` (scikit-learn's 8x8 digits, 1500
training images dealt to 100 clients with 0% similarity, i.e. label-sorted
shards of 15 images, one or two labels per client), 20 clients per round,
batches of 3 (0.2 of a client's data, as in the paper: 5 steps per epoch),
uniform client weights and eta_s = 1 as in the paper, for each K of a sweep and
each client learning rate of a grid. Then prints, per (algorithm, K, eta), the
global model's training loss (`eval_train/loss`, the objective f(x) over all
1500 images) after the last round, the test accuracy, and the first round at
which the training loss reached `--target_loss`; and checks two claims of
[SCAFFOLD] (docs/scaffold.md, docs/references.md):
  1. SCAFFOLD reaches a lower training loss than FedAvg after the same rounds
     (for every K, at each algorithm's best learning rate of the grid);
  2. FedAvg gets worse as K grows while SCAFFOLD does not: the verdict at each
     algorithm's best learning rate per K, then the same at each fixed rate.
`--l2_regularization` makes the task strongly convex (finite client optima),
the regime in which FedAvg's client drift shows (docs/scaffold.md).

  python -m experiments.scaffold_digits --root_output_dir=/tmp/scaffold_digits
  python -m experiments.scaffold_digits --root_output_dir=/tmp/sd-l2 \
      --learning_rates=0.01,0.03,0.1,0.3,1 --total_rounds=100 \
      --l2_regularization=0.01 --target_loss=0.8
  python -m experiments.scaffold_digits --root_output_dir=/tmp/sd \
      --client_steps=25 --total_rounds=10 --learning_rates=1.0

Runs that already have a checkpoint resume (same flags, more rounds). Run it
from the repository root (`python -m`), so this checkout's code is used.
"""

import csv
import os
import subprocess
import sys

from experiments import cli
from pipeline.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = ('fedavg', 'scaffold')


def run_name(algorithm: str, steps: int, learning_rate: float) -> str:
  return f'{algorithm}_K{steps}_lr{cli.exact(learning_rate)}'


def train(algorithm, steps, learning_rate, args):
  command = [
      sys.executable, '-m', 'binaries.train', '--task=digits',
      f'--algorithm={algorithm}', f'--model={args.model}',
      f'--similarity={cli.exact(args.similarity)}',
      f'--num_clients={args.num_clients}',
      f'--l2_regularization={cli.exact(args.l2_regularization)}',
      f'--runtime={args.runtime}',
      f'--clients_per_round={args.clients_per_round}',
      f'--client_batch_size={args.client_batch_size}',
      f'--client_steps={steps}',
      f'--client_learning_rate={cli.exact(learning_rate)}',
      '--client_weighting=uniform', '--server_learning_rate=1',
      f'--total_rounds={args.total_rounds}', '--rounds_per_eval=1',
      f'--rounds_per_checkpoint={args.total_rounds}', f'--seed={args.seed}',
      f'--experiment_name={run_name(algorithm, steps, learning_rate)}',
      f'--root_output_dir={args.root_output_dir}',
  ]
  print('$ python', ' '.join(command[1:]), flush=True)
  cli.run_binary(command, cwd=REPO, stdout=subprocess.DEVNULL)


def read_curve(run_dir: str, metric: str) -> list[float]:
  path = os.path.join(run_dir, 'metrics.csv')
  if not os.path.isfile(path):
    raise UsageError(f'{path} is missing: train the run first (leave out '
                     '--summarize_only)')
  with open(path, newline='') as f:
    return [float(row[metric]) for row in csv.DictReader(f) if row.get(metric)]


def summarize(args) -> dict:
  rows = {}
  for steps in args.client_steps:
    for learning_rate in args.learning_rates:
      for algorithm in ALGORITHMS:
        run_dir = os.path.join(args.root_output_dir,
                               run_name(algorithm, steps, learning_rate))
        losses = read_curve(run_dir, 'eval_train/loss')
        accuracy = read_curve(run_dir, 'eval/accuracy')
        if len(losses) < args.total_rounds:
          # A run the experiment's interruption left short was summarized
          # as if finished (its claims judged on it), or, without a round,
          # an IndexError traceback.
          raise UsageError(
              f'{run_dir} has {len(losses)} rounds, fewer than the '
              f'{args.total_rounds} summarized (--total_rounds); train it '
              'first (leave out --summarize_only)')
        reached = next((i + 1 for i, v in enumerate(losses)
                        if v <= args.target_loss), None)
        rows[algorithm, steps, learning_rate] = dict(
            loss=losses[-1], accuracy=accuracy[-1], reached=reached,
            rounds=len(losses))
  return rows


def print_table(rows, args) -> None:
  print(f'\ndigits, similarity {args.similarity:g}%, {args.clients_per_round} '
        f'of {args.num_clients} clients per round, batch '
        f'{args.client_batch_size}, model {args.model}, L2 lambda '
        f'{args.l2_regularization:g}, seed {args.seed}')
  print(f'{"algorithm":10s} {"K":>4s} {"eta":>6s} {"rounds":>6s} '
        f'{"train loss":>10s} {"test acc":>8s} '
        f'{"rounds to loss<=" + format(args.target_loss, "g"):>18s}')
  for (algorithm, steps, learning_rate), row in sorted(
      rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    reached = str(row['reached']) if row['reached'] else f'>{row["rounds"]}'
    print(f'{algorithm:10s} {steps:4d} {learning_rate:6g} {row["rounds"]:6d} '
          f'{row["loss"]:10.4f} {row["accuracy"]:8.4f} {reached:>18s}')


def _monotone(values, worse: bool) -> bool:
  """Each value above (worse) / not above (not worse) the one before it."""
  pairs = list(zip(values, values[1:]))
  return all(b > a for a, b in pairs) if worse else all(
      b <= a for a, b in pairs)


def check_claims(rows, args) -> bool:
  """Prints both claims, at each algorithm's best step of the grid for each K
  (the verdict) and at each fixed step (the drift view: SCAFFOLD's analysis
  fixes eta and grows K)."""
  ks = sorted(args.client_steps)
  best = {}
  for (algorithm, steps, _), row in rows.items():
    key = (algorithm, steps)
    best[key] = min(best.get(key, float('inf')), row['loss'])
  print('\nbest train loss over the learning-rate grid:')
  print(f'{"K":>4s} ' + ' '.join(f'{a:>10s}' for a in ALGORITHMS) +
        f' {"scaffold/fedavg":>16s}')
  for steps in ks:
    fedavg, scaffold = best['fedavg', steps], best['scaffold', steps]
    print(f'{steps:4d} {fedavg:10.4f} {scaffold:10.4f} '
          f'{scaffold / fedavg:16.3f}')
  lower = all(best['scaffold', k] < best['fedavg', k] for k in ks)
  fedavg_worse = _monotone([best['fedavg', k] for k in ks], worse=True)
  scaffold_not_worse = _monotone([best['scaffold', k] for k in ks],
                                 worse=False)
  verdict = lambda holds: 'holds' if holds else 'does NOT hold'
  print(f'\nclaim 1, SCAFFOLD lower train loss than FedAvg at every K: '
        f'{verdict(lower)}')
  if len(ks) > 1:
    print(f'claim 2, FedAvg worse as K grows: {verdict(fedavg_worse)}; '
          f'SCAFFOLD not worse as K grows: {verdict(scaffold_not_worse)}')
    print('\nclaim 2 at each fixed step eta (train loss at K = '
          f'{", ".join(map(str, ks))}):')
    for learning_rate in sorted(args.learning_rates):
      curves = {a: [rows[a, k, learning_rate]['loss'] for k in ks]
                for a in ALGORITHMS}
      print(f'  eta {learning_rate:g}: FedAvg '
            f'{" ".join(f"{v:.4f}" for v in curves["fedavg"])} worse as K '
            f'grows: {verdict(_monotone(curves["fedavg"], worse=True))}; '
            f'SCAFFOLD {" ".join(f"{v:.4f}" for v in curves["scaffold"])} '
            'not worse: '
            f'{verdict(_monotone(curves["scaffold"], worse=False))}')
  return lower and (len(ks) == 1 or (fedavg_worse and scaffold_not_worse))


def main() -> int:
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--root_output_dir', required=True)
  parser.add_argument('--total_rounds', type=int, default=50)
  parser.add_argument('--client_steps', default=[5, 25, 50],
                      type=cli.comma_list(int),
                      help='Comma-separated K sweep.')
  parser.add_argument('--learning_rates', default=[0.3, 1.0],
                      type=cli.comma_list(float),
                      help='Comma-separated grid of client learning rates.')
  parser.add_argument('--model', default='logistic')
  parser.add_argument('--similarity', type=float, default=0.0)
  parser.add_argument('--l2_regularization', type=float, default=0.0,
                      help='lambda of the (lambda / 2) * ||kernel||^2 penalty '
                      '(the train loss then includes it).')
  parser.add_argument('--runtime', default='tff', choices=('tff', 'native'),
                      help='Both give the same rounds to float rounding; '
                      'native is faster.')
  parser.add_argument('--num_clients', type=int, default=100)
  parser.add_argument('--clients_per_round', type=int, default=20)
  parser.add_argument('--client_batch_size', type=int, default=3)
  parser.add_argument('--target_loss', type=cli.finite_number, default=0.5)
  parser.add_argument('--seed', type=cli.seed, default=0)
  parser.add_argument('--summarize_only', action='store_true',
                      help='Print the table of existing runs; train nothing.')
  args = parser.parse_args()
  args.root_output_dir = os.path.abspath(args.root_output_dir)
  if not args.summarize_only:
    for steps in args.client_steps:
      for learning_rate in args.learning_rates:
        for algorithm in ALGORITHMS:
          train(algorithm, steps, learning_rate, args)
  rows = summarize(args)
  print_table(rows, args)
  return 0 if check_claims(rows, args) else 1


if __name__ == '__main__':
  cli.run_main(main)
