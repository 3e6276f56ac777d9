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
--root_output_dir.
"""

import os

from experiments import cli
from pipeline import tff_runtime


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

  print(f'movielens_ratings: {task.num_train_clients} users, '
        f'{args.rounds} rounds x {args.clients_per_round} users, '
        f'K={args.client_steps}, batch 16, eta={args.client_learning_rate}, '
        f'lambda={args.local_learning_rate}', flush=True)
  for name in args.algorithms.split(','):
    algorithm = registry.build(name, task, settings(name))
    run = driver.RunConfig(
        root_output_dir=args.root_output_dir,
        experiment_name=f'{name}_seed{args.seed}', total_rounds=args.rounds,
        clients_per_round=args.clients_per_round,
        rounds_per_eval=max(1, args.rounds // 4),
        rounds_per_checkpoint=max(1, args.rounds // 4), seed=args.seed)
    metrics = driver.train(algorithm, task, run).last_metrics
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
    cli.run_main(main, runs_kept=False)
  finally:
    tff_runtime.shutdown_workers()
