"""Shared loop of the FedRes experiment scripts: in-process rounds.

Rounds run through `fedres_native.InProcessRounds` (the TFF process's client
function and aggregation, parity-tested against it), with the driver's
seeded sampling and initial weights, client states in the driver's
`ClientStateStore`, and the personalized evaluation the driver reports as
`eval_personalized/*`. TFF's per-round overhead would otherwise dominate
these tiny problems.
"""

from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline import client_store as client_store_lib
from pipeline import driver
from pipeline import evaluation
from tasks import base
from tff_algos import fedres_eval
from tff_algos import fedres_native
from tff_algos.config import AlgorithmConfig


def disable_graph_optimizer() -> None:
  """Turns off Grappler for this process.

  These models are a handful of weights; TF re-optimizes the client step
  graphs whenever a client's dataset iterator is created, which is most of
  the time of a round. Results do not depend on it.
  """
  tf.config.optimizer.set_experimental_options(
      {'disable_meta_optimizer': True})


def run_fedres(variant: str, task: base.Task, config: AlgorithmConfig,
               rounds: int, clients_per_round: Optional[int] = None,
               seed: int = 0, eval_every: int = 0) -> dict:
  """Trains `fedres_<variant>`; returns final metrics (and a loss history).

  Returns {'history': [(round, personalized loss)], 'eval_personalized/...',
  'eval/...' (global model alone)}.
  """
  runner = fedres_native.InProcessRounds(variant, task, config)
  weights = driver.initial_model_weights(task, seed)
  state = runner.initialize()
  state['global_model_weights'] = tff.learning.models.ModelWeights(
      trainable=[np.asarray(w) for w in weights.trainable], non_trainable=[])
  store = client_store_lib.ClientStateStore(runner.initial_client_state)
  evaluator = fedres_eval.PersonalizedEvaluator(
      task.residual_spec, task.personal_eval_data,
      config.local_learning_rate, config.fedres_fit_unseen)
  ids = task.train_client_ids
  clients_per_round = clients_per_round or len(ids)
  history = []

  def personalized():
    return evaluator(state['global_model_weights'].trainable, store,
                     lambda s: s['local_model'])

  for round_num in range(1, rounds + 1):
    plan = driver.plan_round(seed, round_num, len(ids), clients_per_round)
    sampled = [ids[i] for i in plan.client_indices]
    datasets = [task.personal_eval_data.train_dataset_fn(c, s)
                for c, s in zip(sampled, plan.client_seeds)]
    state, new_states, _ = runner.next(state, datasets, store.read(sampled))
    store.write(round_num, sampled, new_states)
    if eval_every and round_num % eval_every == 0:
      history.append((round_num, personalized()['loss']))
  results = {f'eval_personalized/{k}': v for k, v in personalized().items()}
  global_only = evaluation.Evaluator(task)(state['global_model_weights'])
  results.update(global_only)
  results['history'] = history
  store.close()
  return results
