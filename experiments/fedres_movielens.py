r"""FedResAvg-II vs FedAvg on MovieLens 100K ratings (task movielens_ratings).

  python -m experiments.fedres_movielens --movielens_dir=DIR \
      [--rounds 80] [--clients_per_round 30] [--root_output_dir DIR]

Each user is a client; the last 20% of each user's ratings (by time) are
held out. Both algorithms run through the driver on TFF's runtime with the
same sampling, K local steps of batch 16, client learning rate eta and server
step 1. Printed on the held-out ratings:
- FedAvg: RMSE of the global model (movie embedding + genres);
- FedResAvg-II: RMSE of each user's personalized model (global model + the
  user's genre-to-offset model theta_i from the client states; users never
  sampled get theta fitted for K steps on their train ratings), and of its
  global model alone.
Run directories (metrics.csv, export/ with the local models) stay under
--root_output_dir: a re-run resumes them (more --rounds), reports those
already at --rounds from their metrics.csv, and refuses runs trained with
other flags (one error line).
"""

import csv
import os

from experiments import cli
from pipeline import tff_runtime

# The flags that change a run's results (its hparams.json, compared when a
# run resumes; its algorithm and seed name the run).
RESULT_FLAGS = ('clients_per_round', 'client_steps', 'client_learning_rate',
                'local_learning_rate')


def final_metrics(run_dir: str, round_num: int) -> dict[str, float]:
  """The metrics of round `round_num` in the run's metrics.csv (a run
  evaluates its last round), also for a run a re-run found finished."""
  with open(os.path.join(run_dir, 'metrics.csv'), newline='') as f:
    (row,) = [row for row in csv.DictReader(f)
              if int(row['round_num']) == round_num]
  return {name: float(value) for name, value in row.items() if value}


def main():
  parser = cli.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--movielens_dir', required=True)
  parser.add_argument('--rounds', type=cli.positive_int, default=80)
  parser.add_argument('--clients_per_round', type=cli.positive_int, default=30)
  parser.add_argument('--client_steps', type=cli.positive_int, default=10)
  parser.add_argument('--client_learning_rate', type=float, default=0.1)
  parser.add_argument('--local_learning_rate', type=float, default=0.1)
  parser.add_argument('--seed', type=cli.seed, default=0)
  parser.add_argument('--root_output_dir', default='runs/fedres_movielens')
  parser.add_argument('--algorithms', default='fedavg,fedres_avg')
  args = parser.parse_args()
  tff_runtime.configure_execution()
  # pylint: disable=g-import-not-at-top
  from experiments import fedres_common
  from pipeline import driver
  from tasks import base
  from tasks import registry as task_registry
  from tff_algos.algorithms import registry
  # pylint: enable=g-import-not-at-top
  unknown = [n for n in args.algorithms.split(',') if n not in registry.NAMES]
  if unknown:
    # Found only after the data had loaded: a KeyError traceback.
    parser.error(f'argument --algorithms: {unknown[0]!r} is unknown; '
                 f'allowed: {", ".join(registry.NAMES)}')

  task = task_registry.build_task('movielens_ratings', base.DataConfig(
      client_steps=args.client_steps, client_batch_size=16,
      eval_batch_size=1024, seed=args.seed,
      options={'movielens_dir': args.movielens_dir}))

  def settings(name):
    if name.startswith('fedres_'):
      return fedres_common.settings(
          name, args.client_learning_rate, args.local_learning_rate,
          option=2, alpha=1.0, fit_unseen=True)
    return registry.settings_class(name)(
        client_learning_rate=args.client_learning_rate)

  # Every run's settings are checked before the first trains (a bad
  # --local_learning_rate was refused after FedAvg's run).
  algorithms = [(name, registry.build(name, task, settings(name)))
                for name in args.algorithms.split(',')]
  print(f'movielens_ratings: {task.num_train_clients} users, '
        f'{args.rounds} rounds x {args.clients_per_round} users, '
        f'K={args.client_steps}, batch 16, eta={args.client_learning_rate}, '
        f'lambda={args.local_learning_rate}', flush=True)
  for name, algorithm in algorithms:
    run = driver.RunConfig(
        root_output_dir=args.root_output_dir,
        experiment_name=f'{name}_seed{args.seed}', total_rounds=args.rounds,
        clients_per_round=args.clients_per_round,
        rounds_per_eval=max(1, args.rounds // 4),
        rounds_per_checkpoint=max(1, args.rounds // 4), seed=args.seed)
    # A re-run resumes its runs; one with other flags is refused (it went
    # on with the new values, unrecorded), and a finished one (no round
    # left, so no metrics from training: a KeyError traceback) reports
    # what it logged.
    driver.train(algorithm, task, run,
                 hparams={flag: getattr(args, flag) for flag in RESULT_FLAGS},
                 hparams_defaults={flag: parser.get_default(flag)
                                   for flag in RESULT_FLAGS})
    metrics = final_metrics(run.run_dir, args.rounds)
    line = (f'{name:>11}: global-only RMSE {metrics["eval/rmse"]:.4f} '
            f'(MAE {metrics["eval/mae"]:.4f})')
    if 'eval_personalized/rmse' in metrics:
      line += (f', personalized RMSE {metrics["eval_personalized/rmse"]:.4f}'
               f' (MAE {metrics["eval_personalized/mae"]:.4f}; '
               f'{metrics["eval_personalized/num_unseen_clients"]:.0f} users '
               'never sampled, fitted at evaluation)')
    print(line + f'  [{os.path.join(args.root_output_dir, run.experiment_name)}]',
          flush=True)


if __name__ == '__main__':
  try:
    cli.run_main(main)
  finally:
    tff_runtime.shutdown_workers()
