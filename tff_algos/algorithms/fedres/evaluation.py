"""Personalized evaluation of FedRes: global model + each client's theta_i.

Each evaluated client predicts with f_w(x_g) + f_theta_i(x_l), theta_i read
from the client store. A client the store has no state for (never sampled,
or outside the train population) uses the initial theta, or with
`fit_unseen` the theta that Step 1 fits on its K train batches with w fixed
(the store is not written). Metrics are pooled over all evaluated examples,
so they compare one-to-one with the global-only evaluation on the same
held-out examples.
"""

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tasks import base
from tasks import residual
from tff_algos.algorithms.fedres import math as fedres_tf


class PersonalizedEvaluator:
  """Evaluates in-process; the Keras models and metrics are built once."""

  def __init__(self, spec: residual.ResidualModelSpec,
               data: base.PersonalEvalData, local_learning_rate: float,
               fit_unseen: bool, seed: int = 0):
    self._model = fedres_tf.ResidualModel(spec)
    self._loss = tf.keras.metrics.Mean(name='loss')
    self._metrics = spec.metrics_fn()
    self._data = data
    self._local_learning_rate = local_learning_rate
    self._fit_unseen = fit_unseen
    self._seed = seed

  def __call__(self, global_weights: Sequence[np.ndarray], store,
               local_weights_of: Callable[[Any], Sequence[np.ndarray]]
               ) -> dict[str, float]:
    """Metrics of every client in `data` with its own local model.

    Args:
      global_weights: trainable weights w of the global model.
      store: the committed client states holding theta_i
        (`tff_algos.runtime.client_states.ClientStates`).
      local_weights_of: client state -> theta_i.
    """
    for metric in [self._loss, *self._metrics]:
      metric.reset_state()
    num_unseen = 0
    for client_id, seen in self._personal_models(global_weights, store,
                                                 local_weights_of):
      num_unseen += not seen
      fedres_tf.accumulate_metrics(
          self._model, self._data.test_dataset_fn(client_id), self._loss,
          self._metrics)
    results = {'loss': float(self._loss.result())}
    for metric in self._metrics:
      results[metric.name] = float(np.asarray(metric.result()))
    results['num_clients'] = float(len(self._data.client_ids))
    results['num_unseen_clients'] = float(num_unseen)
    return results

  def fitted_local_models(
      self, global_weights: Sequence[np.ndarray], store,
      local_weights_of: Callable[[Any], Sequence[np.ndarray]]
  ) -> dict[str, list[np.ndarray]]:
    """client id -> the theta `__call__` fits for it, for every evaluated
    client without a stored state (none without `fit_unseen`), so that an
    export serves the predictions the evaluation measured."""
    if not self._fit_unseen:
      return {}
    return {client_id: [v.numpy() for v in self._model.local_weights]
            for client_id, seen in self._personal_models(
                global_weights, store, local_weights_of) if not seen}

  def _personal_models(self, global_weights, store, local_weights_of):
    """Sets the model to w and each evaluated client's theta in turn
    (fitted first if unseen and `fit_unseen`); yields (client id, seen)."""
    model = self._model
    fedres_tf.assign(model.global_weights, global_weights)
    # One state in memory at a time: a state holds more than theta_i (e.g.
    # FedResAvg's c_i, as large as w), and 256 of them read at once held
    # 1 GB for a MovieLens u.item of movie ids up to 100000.
    for client_id in self._data.client_ids:
      (state,), (seen,) = (store.read([client_id]),
                           store.has_state([client_id]))
      fedres_tf.assign(model.local_weights, local_weights_of(state))
      if not seen and self._fit_unseen:
        fedres_tf.fit_local_model(
            model, self._data.train_dataset_fn(client_id, self._seed),
            self._local_learning_rate)
      yield client_id, seen
