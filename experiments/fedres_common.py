"""Shared runs of the FedRes experiment scripts: the driver, in-process.

Every run goes through `pipeline.driver.train` on the native runtime
(`--runtime=native`: the same round definitions as under TFF, run
in-process, which these tiny problems need: TFF's per-round overhead would
dominate them), with the driver's seeded sampling, initial weights, client
states and personalized evaluation (`eval_personalized/*`). A run's
directory is temporary; what the scripts print comes from the driver's last
metrics and, for loss curves, its metrics.csv.
"""

import contextlib
import csv
import io
import os
import tempfile
from typing import Optional

import tensorflow as tf

from pipeline import driver
from tasks import base
from tff_algos.algorithms import registry
from tff_algos.algorithms.fedres import definition as fedres

PERSONALIZED_LOSS = 'eval_personalized/loss'


def disable_graph_optimizer() -> None:
  """Turns off Grappler for this process.

  These models are a handful of weights; optimizing their round graphs
  takes longer than running them. Results do not depend on it.
  """
  tf.config.optimizer.set_experimental_options(
      {'disable_meta_optimizer': True})


def settings(algorithm: str, client_learning_rate: float,
             local_learning_rate: float, option: int = 1,
             alpha: float = 1.0, fit_unseen: bool = False):
  """The settings of `algorithm` (fedres_naive, fedres_sgd or fedres_avg)."""
  common = dict(client_learning_rate=client_learning_rate,
                local_learning_rate=local_learning_rate,
                fedres_fit_unseen=fit_unseen)
  if algorithm == 'fedres_avg':
    return fedres.FedResAvgSettings(fedres_option=option, fedres_alpha=alpha,
                                    **common)
  return fedres.FedResSettings(**common)


def _history(run_dir: str, every: int) -> list[tuple[int, float]]:
  """(round, personalized loss) of the rounds that are multiples of
  `every`, from the run's metrics.csv."""
  with open(os.path.join(run_dir, 'metrics.csv'), newline='') as f:
    rows = list(csv.DictReader(f))
  return [(int(row['round_num']), float(row[PERSONALIZED_LOSS]))
          for row in rows
          if row.get(PERSONALIZED_LOSS) and int(row['round_num']) % every == 0]


def run_fedres(algorithm: str, task: base.Task, algorithm_settings,
               rounds: int, clients_per_round: Optional[int] = None,
               seed: int = 0, eval_every: int = 0) -> dict:
  """Trains `algorithm` through the driver; returns its final metrics.

  Returns the driver's metrics of the last round ('eval_personalized/...',
  'eval/...' of the global model alone, 'train/...') and 'history': [(round,
  personalized loss)] every `eval_every` rounds (empty if 0).
  """
  definition = registry.build(algorithm, task, algorithm_settings)
  with tempfile.TemporaryDirectory() as root:
    config = driver.RunConfig(
        root_output_dir=root, experiment_name=algorithm, total_rounds=rounds,
        clients_per_round=clients_per_round or task.num_train_clients,
        rounds_per_eval=eval_every or rounds, rounds_per_checkpoint=rounds,
        seed=seed, export=False, runtime='native')
    # The driver reports each evaluation on stdout; the scripts print
    # their own tables there.
    with contextlib.redirect_stdout(io.StringIO()):
      result = driver.train(definition, task, config)
    results = dict(result.last_metrics)
    results['history'] = (_history(config.run_dir, eval_every)
                          if eval_every else [])
  return results


if __name__ == '__main__':
  from pipeline import errors as _errors  # pylint: disable=g-import-not-at-top
  _errors.refuse_to_run_library_module(__spec__)
