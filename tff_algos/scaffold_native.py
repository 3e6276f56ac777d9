"""SCAFFOLD / FedPVR rounds in-process (the native runtime, `--runtime=native`).

The same `scaffold_tf` functions as `scaffold_tff`'s process, with its
aggregation: x from the p_i-weighted mean of the clients' model deltas, c from
the uniform mean of their control variate deltas, |S| the number of clients,
metrics summed then finalized.
"""

import collections
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algos import native
from tff_algos import scaffold_tf
from tff_algos.config import AlgorithmConfig


class ControlVariateRounds:
  """Rounds of `scaffold_tff.build_control_variate_algorithm`'s process."""

  def __init__(self, model_fn: Callable,
               client_optimizer: tff.learning.optimizers.Optimizer,
               server_optimizer: tff.learning.optimizers.Optimizer,
               config: AlgorithmConfig, mask: Sequence[bool],
               cv_specs: Sequence[tf.TensorSpec],
               layer_of_variable: Sequence[int], uniform_weighting: bool,
               metric_finalizers, communication_metrics):
    # One model for every client; its metrics are reset per client, as TFF
    # builds a fresh model for each.
    self._model = model_fn()
    self._server_optimizer = server_optimizer
    self._cv_specs = cv_specs
    self._drift_diversity = config.drift_diversity
    self._layer_of_variable = layer_of_variable
    self._metric_finalizers = metric_finalizers
    self._communication_metrics = communication_metrics
    self._client_update = scaffold_tf.build_client_update(
        self._model, client_optimizer, config.client_learning_rate, mask,
        config.scaffold_option, uniform_weighting,
        layer_of_variable if config.drift_diversity else None)
    self._server_update = scaffold_tf.build_server_update(
        server_optimizer, config.num_train_clients)

  def initialize(self):
    return native.to_numpy(scaffold_tf.initial_server_state(
        self._model, self._server_optimizer, self._cv_specs))

  def next(self, server_state, datasets, client_states, server_data=None):
    del server_data  # None: SCAFFOLD uses no server data.
    outputs = []
    for dataset, client_state in zip(datasets, client_states, strict=True):
      self._model.reset_metrics()
      outputs.append(native.to_numpy(self._client_update(
          server_state['global_model_weights'],
          server_state['control_variate'],
          client_state['control_variate'], dataset)))
    weights = [o['weight'] for o in outputs]
    num_clients = np.int32(len(outputs))
    new_state = native.to_numpy(self._server_update(
        server_state,
        native.weighted_mean([o['model_delta'] for o in outputs], weights),
        native.mean([o['control_variate_delta'] for o in outputs]),
        num_clients))
    metrics = collections.OrderedDict(
        train=native.sum_then_finalize(self._metric_finalizers,
                                       [o['metrics'] for o in outputs]),
        communication=self._communication_metrics)
    if self._drift_diversity:
      metrics['drift_diversity'] = native.to_numpy(
          scaffold_tf.drift_diversity_metrics(
              native.sum_structures([o['layer_sq_norms'] for o in outputs]),
              native.sum_structures([o['model_delta'] for o in outputs]),
              self._layer_of_variable))
    return new_state, [o['client_state'] for o in outputs], metrics
