"""FedResAvg-II vs FedAvg and SCAFFOLD on fedres_logistic ([FedRes] E.2).

  python -m experiments.fedres_logistic [--rounds 10] [--heterogeneities 0,1]

N = 10 clients, M = 2 classes, d = 10, K = 50 local steps of batch 10, every
client every round, server step 1. Test loss = logistic loss pooled over the
clients' held-out examples: FedResAvg-II predicts with W + Theta_i
(personalized evaluation), FedAvg and SCAFFOLD with their global W.

Learning rates come from the paper's grid {0.1, 0.03, 0.01, 0.003, 0.001}
per algorithm (FedResAvg-II: eta from the grid, lambda from {0.1, 0.01}),
chosen on an independent replicate of the problem (seed + 1: other
W*, Theta_i*, data) and reported on the main seed.

Runs go through the driver on the native runtime (in-process; the same
rounds as under TFF). FedAvg is FedResAvg-I with lambda = 0 (theta stays
at its zero start): FedAvg with client SGD and server step 1, clients
weighted equally (they have equal sizes). SCAFFOLD is FedResAvg-II with
lambda = 0, i.e. SCAFFOLD Option II under full participation
(theta stays at 0, so FedResAvg-II's corrected steps and control
variates are SCAFFOLD's). The script cross-checks the FedAvg number against
the fedavg algorithm (tff.learning's FedAvg computation) run through the
driver on TFF's runtime at the chosen learning rate (equal up to batch
order: FedRes's Step 2 takes the second pass over a client's reshuffled
data).
"""

import contextlib
import io
import tempfile

from experiments import cli
from pipeline import tff_runtime

GRID = (0.1, 0.03, 0.01, 0.003, 0.001)
LOCAL_GRID = (0.1, 0.01)
LOCAL_STEPS = 50
BATCH_SIZE = 10


def _task(heterogeneity: float, seed: int):
  from tasks import base  # pylint: disable=g-import-not-at-top
  from tasks import fedres_synthetic  # pylint: disable=g-import-not-at-top
  return fedres_synthetic.build_logistic_task(base.DataConfig(
      client_steps=LOCAL_STEPS, client_batch_size=BATCH_SIZE, seed=seed,
      options={'heterogeneity': heterogeneity}))


def _candidates():
  """algorithm -> [(algorithm, option, eta, lambda)] to try."""
  return {
      'FedAvg': [('fedres_avg', 1, eta, 0.0) for eta in GRID],
      'SCAFFOLD': [('fedres_avg', 2, eta, 0.0) for eta in GRID],
      'FedResAvg-II': [('fedres_avg', 2, eta, lam) for eta in GRID
                       for lam in LOCAL_GRID],
  }


def _run(task, candidate, rounds, seed):
  from experiments import fedres_common  # pylint: disable=g-import-not-at-top
  algorithm, option, eta, lam = candidate
  settings = fedres_common.settings(algorithm, eta, lam, option=option,
                                    alpha=1.0)
  results = fedres_common.run_fedres(algorithm, task, settings, rounds,
                                     seed=seed)
  # With lambda = 0, theta stays 0 and the personalized model is the global
  # one; FedRes reports its personalized evaluation.
  return (results['eval_personalized/loss'],
          results['eval_personalized/accuracy'])


def _driver_fedavg(task, eta, rounds, seed):
  """eval/loss of the fedavg algorithm through the driver on TFF's runtime."""
  # pylint: disable=g-import-not-at-top
  from pipeline import driver
  from tff_algos.algorithms import registry
  from tff_algos.algorithms.baselines import definition as baselines
  # pylint: enable=g-import-not-at-top
  algorithm = registry.build('fedavg', task, baselines.FedAvgSettings(
      client_learning_rate=eta, server_learning_rate=1.0))
  with tempfile.TemporaryDirectory() as root:
    with contextlib.redirect_stdout(io.StringIO()):
      result = driver.train(algorithm, task, driver.RunConfig(
          root_output_dir=root, experiment_name='fedavg', total_rounds=rounds,
          clients_per_round=task.num_train_clients, rounds_per_eval=rounds,
          rounds_per_checkpoint=rounds, seed=seed, export=False))
  return result.last_metrics['eval/loss']


def main():
  parser = cli.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=cli.positive_int, default=10)
  parser.add_argument('--heterogeneities', default='0,1',
                      type=cli.comma_list(float))
  parser.add_argument('--seed', type=cli.seed, default=0)
  parser.add_argument('--skip_driver_check', action='store_true')
  args = parser.parse_args()
  for heterogeneity in args.heterogeneities:
    # Refused by the task only when its turn came, after the others ran.
    if not 0 <= heterogeneity <= 1:
      parser.error(f'argument --heterogeneities: {heterogeneity:g} is not in '
                   '[0, 1]')
  tff_runtime.configure_execution()
  from experiments import fedres_common  # pylint: disable=g-import-not-at-top
  fedres_common.disable_graph_optimizer()

  print(f'fedres_logistic: N=10, M=2, d=10, K={LOCAL_STEPS}, batch '
        f'{BATCH_SIZE}, {args.rounds} rounds, full participation')
  print(f'{"alpha":>5} {"algorithm":>13} {"eta":>6} {"lambda":>6} '
        f'{"val loss":>9} {"test loss":>9} {"test acc":>8}')
  for heterogeneity in args.heterogeneities:
    validation_task = _task(heterogeneity, args.seed + 1)
    test_task = _task(heterogeneity, args.seed)
    for name, candidates in _candidates().items():
      scored = [(_run(validation_task, c, args.rounds, args.seed)[0], c)
                for c in candidates]
      val_loss, best = min(scored, key=lambda s: s[0])
      test_loss, test_accuracy = _run(test_task, best, args.rounds, args.seed)
      lam = f'{best[3]:>6}' if name == 'FedResAvg-II' else f'{"-":>6}'
      print(f'{heterogeneity:>5} {name:>13} {best[2]:>6} {lam} '
            f'{val_loss:>9.4f} {test_loss:>9.4f} {test_accuracy:>8.3f}',
            flush=True)
      if name == 'FedAvg' and not args.skip_driver_check:
        driver_loss = _driver_fedavg(test_task, best[2], args.rounds,
                                     args.seed)
        print(f'{"":>5} {"(FedAvg check: fedavg via the driver on TFF,":>13}'
              f' same eta: test loss {driver_loss:.4f})', flush=True)


if __name__ == '__main__':
  try:
    cli.run_main(main, runs_kept=False)
  finally:
    tff_runtime.shutdown_workers()
