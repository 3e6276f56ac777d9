r"""FedPVR's claims on Dirichlet-partitioned digits ([FedPVR] Sec. 4, Tables 2-3).

Runs `binaries.train` on `--task=digits --model=cnn` (scikit-learn's 8x8
digits, 1500 training images dealt to 10 clients by FedDF's Dirichlet(alpha)
procedure; a four-layer CNN: conv, conv, dense, dense), all 10 clients every
round, `--client_epochs` local epochs of batches of `--client_batch_size`,
uniform client weights and eta_s = 1 as in the paper, one client learning rate
for every method, for each alpha and seed:

  fedavg     FedAvg, run as `fedpvr --pvr_last_layers=0` (the empty mask:
             equal to `--algorithm=fedavg` to float rounding,
             tests/test_scaffold_equalities.py) so it logs drift diversity
  fedprox    `fedprox --proximal_strength=--fedprox_mu`
  scaffold   `scaffold` (control variates on every variable)
  pvr_j<j>   `fedpvr --pvr_start_variable=j` for each j of `--pvr_starts`:
             control variates on variables j.. of the CNN's 8 (j = 6: the
             output layer, L = 1; j = 4: L = 2; j = 2: L = 3; the paper's
             "SVR: j -> end" ablation); with `--pvr_client_optimizer=sgdm`
             (the paper's momentum on the other variables) pvr_j<j>_sgdm

Then prints, per alpha and method (mean over seeds): rounds to a test
accuracy of `--target_accuracy`, test accuracy at round `--at_round`, bytes
per client and round (`communication/bytes_{down,up}_per_client` of the
logged metrics) and that as copies of the model (4 bytes per parameter), and
the bytes one client sent and received until the target; and drift diversity
([FedPVR] Def. 1, logged by `--drift_diversity` as drift_diversity/layer_<k>)
per layer, averaged over rounds, with a plot (`--plot`) of it over rounds.
Last, it prints a verdict for each of the issue's claims 1-4.

  python -m experiments.fedpvr_digits --root_output_dir=/tmp/fedpvr_digits \
      --plot=docs/fedpvr_digits_drift.png
  python -m experiments.fedpvr_digits --root_output_dir=/tmp/fedpvr_fast --fast

Runs that already have `--total_rounds` rounds are not trained again (more
rounds resume); the runs' flags must be those they were trained with (a run
of other flags is one error line; `--summarize_only` reads the runs as
they are). Run it from the repository root (`python -m`).
"""

import argparse
import csv
import math
import os
import subprocess
import sys

import numpy as np

from experiments import cli
from experiments import scaffold_digits
from pipeline.errors import UsageError

# The CNN of tasks/digits.py: 8 trainable variables in 4 layers.
NUM_LAYERS = 4
LAYER_NAMES = ('conv1', 'conv2', 'dense', 'output')
NUM_VARIABLES = 2 * NUM_LAYERS  # a kernel and a bias each
CNN_PARAMETERS = 38282
BYTES_PER_PARAMETER = 4
DRIFT_METHODS = ('fedavg', 'scaffold')  # and every pvr_j<j>
FAST = dict(total_rounds=6, seeds='0', alphas='0.1', pvr_starts='6',
            client_epochs=2, with_fedprox=False)


def methods(args) -> list[str]:
  names = ['fedavg'] + (['fedprox'] if args.with_fedprox else []) + [
      'scaffold']
  suffix = ('' if args.pvr_client_optimizer == 'sgd' else
            f'_{args.pvr_client_optimizer}')
  return names + [f'pvr_j{j}{suffix}' for j in args.pvr_starts]


def pvr_start(method: str) -> int:
  """j of a FedPVR method `pvr_j<j>[_<client optimizer>]`."""
  return int(method[len('pvr_j'):].split('_')[0])


def algorithm_flags(method: str, args) -> list[str]:
  if method == 'fedavg':
    return ['--algorithm=fedpvr', '--pvr_last_layers=0', '--drift_diversity']
  if method == 'fedprox':
    return ['--algorithm=fedprox',
            f'--proximal_strength={cli.exact(args.fedprox_mu)}']
  if method == 'scaffold':
    return ['--algorithm=scaffold', '--drift_diversity']
  start = pvr_start(method)
  return ['--algorithm=fedpvr', f'--pvr_start_variable={start}',
          '--drift_diversity',
          f'--client_optimizer={args.pvr_client_optimizer}']


def run_name(method: str, alpha: float, seed: int) -> str:
  return f'{method}_a{cli.exact(alpha)}_s{seed}'


def train_argv(method: str, alpha: float, seed: int, args) -> list[str]:
  return [
      '--task=digits', '--model=cnn', f'--dirichlet_alpha={cli.exact(alpha)}',
      '--num_clients=10', '--clients_per_round=10',
      f'--client_epochs={args.client_epochs}',
      f'--client_batch_size={args.client_batch_size}',
      f'--client_learning_rate={cli.exact(args.learning_rate)}',
      '--client_weighting=uniform', '--server_learning_rate=1',
      '--runtime=native', f'--total_rounds={args.total_rounds}',
      '--rounds_per_eval=1',
      f'--rounds_per_checkpoint={args.total_rounds}', f'--seed={seed}',
      f'--experiment_name={run_name(method, alpha, seed)}',
      f'--root_output_dir={args.root_output_dir}',
      *algorithm_flags(method, args)]


def train_in_subprocess(argv: list[str]) -> None:
  print('$ python -m binaries.train', ' '.join(argv), flush=True)
  cli.run_binary([sys.executable, '-m', 'binaries.train', *argv],
                 cwd=scaffold_digits.REPO, stdout=subprocess.DEVNULL)


def read_rows(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, 'metrics.csv')
  if not os.path.exists(path):
    return []
  with open(path, newline='') as f:
    return list(csv.DictReader(f))


def run_all(args, train=train_in_subprocess) -> None:
  """Trains every (method, alpha, seed) run. The binary resumes one with
  fewer rounds, leaves a finished one as it is (a few seconds), and refuses
  one trained with other flags: skipping runs that had enough rows reported
  them under the new flags."""
  for alpha in args.alphas:
    for seed in args.seeds:
      for method in methods(args):
        train(train_argv(method, alpha, seed, args))


def _column(rows, metric) -> np.ndarray:
  return np.array([float(row[metric]) for row in rows if row.get(metric)])


def summarize(args) -> dict:
  """{(method, alpha): per-seed curves and numbers}."""
  model_bytes = CNN_PARAMETERS * BYTES_PER_PARAMETER
  results = {}
  for alpha in args.alphas:
    for method in methods(args):
      runs = []
      for seed in args.seeds:
        run_dir = os.path.join(args.root_output_dir,
                               run_name(method, alpha, seed))
        rows = read_rows(run_dir)[:args.total_rounds]
        if len(rows) < args.at_round:
          raise UsageError(
              f'{run_dir} has {len(rows)} rounds, fewer than the '
              f'{args.at_round} summarized (--at_round, --total_rounds); '
              'train it first (leave out --summarize_only)')
        accuracy = _column(rows, 'eval/accuracy')
        reached = next((i + 1 for i, a in enumerate(accuracy)
                        if a >= args.target_accuracy), None)
        per_round = (_column(rows, 'communication/bytes_down_per_client')[0] +
                     _column(rows, 'communication/bytes_up_per_client')[0])
        drift = (np.stack([_column(rows, f'drift_diversity/layer_{k}')
                           for k in range(NUM_LAYERS)])
                 if rows and f'drift_diversity/layer_0' in rows[0] else None)
        runs.append(dict(accuracy=accuracy, reached=reached,
                         bytes=per_round, drift=drift))
      reached = [r['reached'] for r in runs]
      at_round = [r['accuracy'][args.at_round - 1] for r in runs]
      per_round = float(np.mean([r['bytes'] for r in runs]))
      results[method, alpha] = dict(
          runs=runs, reached=reached,
          # Mean over seeds, counting a seed that never reached it as
          # total_rounds + 1 (a lower bound): '>' marks it.
          mean_reached=float(np.mean([r or args.total_rounds + 1
                                      for r in reached])),
          all_reached=all(r is not None for r in reached),
          accuracy=float(np.mean(at_round)), accuracy_std=float(
              np.std(at_round)),
          bytes=per_round, copies=per_round / model_bytes,
          drift=(np.mean([r['drift'] for r in runs], axis=0)
                 if runs[0]['drift'] is not None else None))
  return results


def _rounds(row, args) -> str:
  text = f'{row["mean_reached"]:.1f}'
  return text if row['all_reached'] else '>' + text


def print_table(results, args) -> None:
  print(f'\ndigits CNN, Dirichlet partition over 10 clients (all every '
        f'round), {args.client_epochs} local epochs of batches of '
        f'{args.client_batch_size}, eta {args.learning_rate:g}, eta_s 1, '
        f'uniform weights, {args.total_rounds} rounds, seeds '
        f'{",".join(map(str, args.seeds))} (means)')
  print(f'{"alpha":>5s} {"method":9s} {"rounds to " + format(args.target_accuracy, "g"):>14s} '
        f'{"acc@" + str(args.at_round):>8s} {"+-":>5s} {"bytes/round":>11s} '
        f'{"x model":>7s} {"MB to target":>12s}')
  for (method, alpha), row in results.items():
    to_target = row['bytes'] * row['mean_reached'] / 1e6
    print(f'{alpha:5g} {method:9s} {_rounds(row, args):>14s} '
          f'{row["accuracy"]:8.4f} {row["accuracy_std"]:5.3f} '
          f'{row["bytes"]:11.0f} {row["copies"]:7.3f} '
          f'{("" if row["all_reached"] else ">") + format(to_target, ".2f"):>12s}')
  print('\ndrift diversity per layer (mean over rounds and seeds; '
        f'{" / ".join(LAYER_NAMES)}):')
  for (method, alpha), row in results.items():
    if row['drift'] is not None:
      means = row['drift'].mean(axis=1)
      print(f'{alpha:5g} {method:9s} ' + ' '.join(f'{v:7.3f}' for v in means))


def _verdict(holds: bool) -> str:
  return 'holds' if holds else 'does NOT hold'


def claim_one(results, alpha, margin: float = 1.0) -> bool:
  """Under FedAvg, the output layer's drift diversity (mean over rounds)
  exceeds `margin` x every other layer's."""
  means = results['fedavg', alpha]['drift'].mean(axis=1)
  return bool(means[-1] > margin * means[:-1].max())


def claim_three(results, alpha, pvr='pvr_j6') -> tuple[bool, float, float]:
  """FedPVR (output layer) sends 1.9-2.2 model copies a round, SCAFFOLD
  3.9-4.1 (both ways, per client)."""
  pvr_copies = results[pvr, alpha]['copies']
  scaffold_copies = results['scaffold', alpha]['copies']
  return (1.9 <= pvr_copies <= 2.2 and 3.9 <= scaffold_copies <= 4.1,
          pvr_copies, scaffold_copies)


def check_claims(results, args) -> None:
  pvr = [m for m in methods(args) if m.startswith('pvr_')]
  for alpha in args.alphas:
    print(f'\nalpha {alpha:g}:')
    fedavg = results['fedavg', alpha]['drift'].mean(axis=1)
    print(f'  claim 1: FedAvg drift diversity highest in the output layer '
          f'({" / ".join(f"{v:.3f}" for v in fedavg)}): '
          f'{_verdict(claim_one(results, alpha))}')
    for method in ['scaffold'] + pvr:
      ratios = results[method, alpha]['drift'].mean(axis=1) / fedavg
      print(f'    {method} / FedAvg per layer: '
            + ' / '.join(f'{v:.2f}' for v in ratios))
    # Means over seeds; a seed that missed the target counts as
    # total_rounds + 1 (the table marks those with '>').
    rounds = {m: results[m, alpha]['mean_reached'] for m in methods(args)}
    baselines = [m for m in ('fedavg', 'fedprox') if m in rounds]
    for method in pvr:
      faster = all(rounds[method] < rounds[b] for b in baselines)
      print(f'  claim 2, {method} reaches {args.target_accuracy:g} in fewer '
            f'rounds than {" and ".join(baselines)} '
            f'({rounds[method]:.1f} vs '
            f'{" / ".join(format(rounds[b], ".1f") for b in baselines)}): '
            f'{_verdict(faster)}; vs SCAFFOLD {rounds["scaffold"]:.1f}')
    last_layer = [m for m in pvr if pvr_start(m) == 6]
    if last_layer:
      holds, pvr_copies, scaffold_copies = claim_three(results, alpha,
                                                       last_layer[0])
      to_target = {m: results[m, alpha]['bytes'] * rounds[m] / 1e6
                   for m in (last_layer[0], 'scaffold')}
      fewer = (_verdict(to_target[last_layer[0]] < to_target['scaffold'])
               if all(results[m, alpha]['all_reached'] for m in to_target)
               else 'not measured (a seed missed the target)')
      print(f'  claim 3: bytes per round {pvr_copies:.3f} (FedPVR L=1) vs '
            f'{scaffold_copies:.3f} (SCAFFOLD) model copies: '
            f'{_verdict(holds)}; bytes to the target '
            f'{to_target[last_layer[0]]:.2f} vs {to_target["scaffold"]:.2f} '
            f'MB: FedPVR fewer {fewer}')
    by_start = sorted(pvr, key=pvr_start)
    order = (['scaffold (j=0)'] + [f'j={pvr_start(m)}' for m in by_start] +
             ['fedavg (j=8)'])
    values = ([rounds['scaffold']] + [rounds[m] for m in by_start] +
              [rounds['fedavg']])
    # Runs that missed the target tie at total_rounds + 1, which would
    # make "not worse" hold by default.
    later_not_worse = (
        _verdict(all(b <= a for a, b in zip(values[:-1], values[1:-1])))
        if all(results[m, alpha]['all_reached']
               for m in ['scaffold'] + by_start)
        else 'not measured (a seed missed the target)')
    print(f'  claim 4, rounds to target from SVR j -> end, '
          f'{", ".join(order)}: {" / ".join(f"{v:.1f}" for v in values)}; '
          f'every start better than none: '
          f'{_verdict(all(v < rounds["fedavg"] for v in values[:-1]))}; '
          f'later start not worse: {later_not_worse}')


def plot(results, args, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  drift_methods = [m for m in methods(args)
                   if m in DRIFT_METHODS or m.startswith('pvr_')]
  figure, axes = plt.subplots(
      len(args.alphas), len(drift_methods) + 1, squeeze=False,
      figsize=(3.2 * (len(drift_methods) + 1), 2.8 * len(args.alphas)))
  for row_axes, alpha in zip(axes, args.alphas):
    for axis, method in zip(row_axes, drift_methods):
      drift = results[method, alpha]['drift']
      for k in range(NUM_LAYERS):
        axis.plot(np.arange(1, drift.shape[1] + 1), drift[k],
                  label=LAYER_NAMES[k])
      axis.set_yscale('log')
      axis.set_title(f'{method}, alpha {alpha:g}', fontsize=9)
      axis.set_xlabel('round')
    row_axes[0].set_ylabel('drift diversity')
    row_axes[0].legend(fontsize=7)
    accuracy_axis = row_axes[-1]
    for method in methods(args):
      curves = [r['accuracy'] for r in results[method, alpha]['runs']]
      accuracy_axis.plot(np.arange(1, len(curves[0]) + 1),
                         np.mean(curves, axis=0), label=method)
    accuracy_axis.axhline(args.target_accuracy, color='grey', lw=0.5)
    accuracy_axis.set_title(f'test accuracy, alpha {alpha:g}', fontsize=9)
    accuracy_axis.set_xlabel('round')
    accuracy_axis.set_ylim(0.5, 1.0)
    accuracy_axis.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=90)
  print(f'wrote {path}')


def parse_args(argv=None) -> argparse.Namespace:
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--root_output_dir', required=True)
  parser.add_argument('--fast', action='store_true',
                      help='The test variant: ' + ', '.join(
                          f'{k}={v}' for k, v in FAST.items()))
  parser.add_argument('--total_rounds', type=int, default=30)
  parser.add_argument('--at_round', type=int, default=None,
                      help='Round of the accuracy column (default: the last).')
  parser.add_argument('--alphas', default='0.1,0.5')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--pvr_starts', default='6,4,2',
                      help='FedPVR runs: --pvr_start_variable values.')
  parser.add_argument('--client_epochs', type=cli.positive_int, default=5)
  parser.add_argument('--client_batch_size', type=cli.positive_int,
                      default=20)
  parser.add_argument('--learning_rate', type=float, default=0.05)
  parser.add_argument('--fedprox_mu', type=float, default=None,
                      help='FedProx\'s mu (default 0.1); not with --fast, '
                      'which runs no FedProx.')
  parser.add_argument('--pvr_client_optimizer', default='sgd',
                      help='FedPVR\'s optimizer of the variables without '
                      'control variates (the paper: sgdm).')
  parser.add_argument('--target_accuracy', type=float, default=0.9)
  parser.add_argument('--plot', default=None, help='PNG of drift diversity '
                      'per layer and test accuracy over rounds.')
  parser.add_argument('--summarize_only', action='store_true')
  args = parser.parse_args(argv)
  if args.fast:
    # FAST's values are defaults: a flag given with --fast still holds
    # (it was overwritten without a word).
    parser.set_defaults(**FAST)
    args = parser.parse_args(argv)
  else:
    args.with_fedprox = True
  args.root_output_dir = os.path.abspath(args.root_output_dir)
  # Parsed after --fast's values are in.
  for name, kind in (('alphas', float), ('seeds', int), ('pvr_starts', int)):
    try:
      setattr(args, name, cli.comma_list(kind)(str(getattr(args, name))))
    except argparse.ArgumentTypeError as e:
      parser.error(f'argument --{name}: {e}')
  if args.total_rounds < 1:
    parser.error(f'argument --total_rounds: {args.total_rounds} is not >= 1')
  # Checked before any run trains (the binary refused them only when their
  # run came, after the runs before it had trained).
  for alpha in args.alphas:
    if not alpha > 0:  # The Dirichlet's concentration.
      parser.error(f'argument --alphas: {alpha:g} is not > 0')
  for value in args.seeds:
    try:
      cli.seed(str(value))
    except argparse.ArgumentTypeError as e:
      parser.error(f'argument --seeds: {e}')
  if not args.learning_rate > 0 or not math.isfinite(args.learning_rate):
    parser.error(f'argument --learning_rate: {args.learning_rate} is not a '
                 'finite number > 0')
  for start in args.pvr_starts:
    if not 0 <= start <= NUM_VARIABLES:
      parser.error(f'argument --pvr_starts: {start} is not a variable index '
                   f'of the CNN (0..{NUM_VARIABLES})')
  if args.fedprox_mu is None:
    args.fedprox_mu = 0.1
  elif not args.with_fedprox:
    # It was ignored.
    parser.error('argument --fedprox_mu does not apply with --fast (its runs '
                 'leave out FedProx)')
  if args.with_fedprox and not args.fedprox_mu >= 0:
    # FedProx trains second: refused by the binary after FedAvg trained.
    parser.error(f'argument --fedprox_mu: {args.fedprox_mu} is not a number '
                 '>= 0')
  if args.pvr_client_optimizer != 'sgd':
    from tff_algos.algorithms import settings  # pylint: disable=g-import-not-at-top
    if args.pvr_client_optimizer not in settings.OPTIMIZERS:
      parser.error(f'argument --pvr_client_optimizer: '
                   f'{args.pvr_client_optimizer!r} is not one of '
                   f'{", ".join(settings.OPTIMIZERS)}')
  if not 0 < args.target_accuracy <= 1:
    parser.error(f'argument --target_accuracy: {args.target_accuracy} is not '
                 'an accuracy in (0, 1]')
  if args.at_round is None:
    args.at_round = args.total_rounds
  if not 1 <= args.at_round <= args.total_rounds:
    # 0 or less indexed the accuracy curves from their end.
    parser.error(f'argument --at_round: {args.at_round} is not a round of '
                 f'1..{args.total_rounds} (--total_rounds)')
  return args


def main(argv=None, train=train_in_subprocess) -> int:
  args = parse_args(argv)
  if not args.summarize_only:
    run_all(args, train)
  results = summarize(args)
  print_table(results, args)
  check_claims(results, args)
  if args.plot:
    plot(results, args, args.plot)
  return 0


if __name__ == '__main__':
  cli.run_main(main)
