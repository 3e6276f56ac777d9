"""Client drift on the two-client quadratic of [FedRes] App. E.1.

  python -m experiments.fedres_toy [--rounds 300] [--ks 1,5,10,20,50]

L_1(w, theta_1) = 0.1 (w + theta_1)^2 + 10 w, L_2(w, theta_2) = 0.1 theta_2^2
- 10 w (task fedres_toy), eta = lambda = 0.01, alpha = 1, both clients every
round. Prints the average loss (1/2) sum_i L_i(w, theta_i) (the personalized
evaluation loss) after each algorithm's rounds, for every K, and the K = 10
curves. The paper's claim: FedResSGD and FedResAvg-II go to 0 for every K;
FedResNaive and FedResAvg-I stall at a positive loss that grows with K.
"""


from experiments import cli
from pipeline import tff_runtime

ALGORITHMS = {  # column -> (algorithm, fedres_option)
    'FedResNaive': ('fedres_naive', 1),
    'FedResSGD': ('fedres_sgd', 1),
    'FedResAvg-I': ('fedres_avg', 1),
    'FedResAvg-II': ('fedres_avg', 2),
}
LEARNING_RATE = 0.01  # eta = lambda, as in the paper.


def toy_losses(k: int, rounds: int, seed: int = 0, eval_every: int = 0):
  """{algorithm: run results} on fedres_toy with K = k."""
  # Imports here so `--help` does not load TensorFlow.
  # pylint: disable=g-import-not-at-top
  from experiments import fedres_common
  from tasks import base
  from tasks import registry as task_registry
  # pylint: enable=g-import-not-at-top
  task = task_registry.build_task('fedres_toy', base.DataConfig(
      client_steps=k, client_batch_size=1, seed=seed))
  results = {}
  for name, (algorithm, option) in ALGORITHMS.items():
    settings = fedres_common.settings(algorithm, LEARNING_RATE, LEARNING_RATE,
                                      option=option, alpha=1.0)
    results[name] = fedres_common.run_fedres(
        algorithm, task, settings, rounds, seed=seed, eval_every=eval_every)
  return results


def main():
  parser = cli.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=cli.positive_int, default=300)
  parser.add_argument('--ks', default='1,5,10,20,50',
                      type=cli.comma_list(cli.positive_int))
  parser.add_argument('--seed', type=cli.seed, default=0)
  args = parser.parse_args()
  tff_runtime.configure_execution()
  from experiments import fedres_common  # pylint: disable=g-import-not-at-top
  fedres_common.disable_graph_optimizer()
  ks = args.ks
  print(f'fedres_toy: average loss after {args.rounds} rounds '
        f'(eta = lambda = {LEARNING_RATE}, alpha = 1, seed {args.seed})')
  print(f'{"K":>4} ' + ' '.join(f'{name:>13}' for name in ALGORITHMS))
  curves = None
  for k in ks:
    eval_every = max(1, args.rounds // 10) if k == 10 else 0
    results = toy_losses(k, args.rounds, args.seed, eval_every)
    print(f'{k:>4} ' + ' '.join(
        f'{results[name]["eval_personalized/loss"]:>13.3e}'
        for name in ALGORITHMS), flush=True)
    if k == 10:
      curves = results
  if curves:
    print('\nK = 10, average loss by round')
    print(f'{"round":>6} ' + ' '.join(f'{name:>13}' for name in ALGORITHMS))
    rounds = [r for r, _ in curves['FedResSGD']['history']]
    for i, round_num in enumerate(rounds):
      print(f'{round_num:>6} ' + ' '.join(
          f'{curves[name]["history"][i][1]:>13.3e}' for name in ALGORITHMS))


if __name__ == '__main__':
  try:
    cli.run_main(main, runs_kept=False)
  finally:
    tff_runtime.shutdown_workers()
