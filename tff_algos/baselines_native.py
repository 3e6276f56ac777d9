"""FedAvg, FedProx and FedSGD rounds in-process (the native runtime, `--runtime=native`).

The client updates are the tf.functions the TFF processes map over the
clients: tff.learning's
`model_delta_client_work.build_model_delta_update_with_tff_optimizer`
(FedAvg) and `fed_sgd._build_client_update` (FedSGD; private in TFF 0.87,
hence the parity test), and `fedprox.build_client_update` (FedProx). The
server side of tff.learning has no TF function outside its TFF
computations, so it is written here after TFF 0.87's
components: `MeanFactory` (sum of weight * update over sum of weights),
`build_apply_optimizer_finalizer` (ServerOpt step on the mean update used as
the gradient, rejected when not finite) and `sum_then_finalize` for the
metrics. The server state is the `LearningAlgorithmState` the TFF process
keeps, so checkpoints are interchangeable.
"""

import collections
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.learning.algorithms import fed_sgd
from tensorflow_federated.python.learning.templates import apply_optimizer_finalizer
from tensorflow_federated.python.learning.templates import composers
from tensorflow_federated.python.learning.templates import model_delta_client_work

from tff_algos import fedprox
from tff_algos import native

ModelWeights = tff.learning.models.ModelWeights
KINDS = ('fedavg', 'fedprox', 'fedsgd')
# Both runtimes (baselines.py passes it to TFF's builders): TFF's default,
# DATASET_REDUCE, runs each training step inside tf.data's reduce function;
# on the benchmark's CelebA-shaped task that made a client's update 3x slower
# (README, Benchmark). Same steps, same results.
LOOP = tff.learning.LoopImplementation.DATASET_ITERATOR


class LearningProcessRounds:
  """Rounds of a tff.learning baseline (`kind` in KINDS)."""

  def __init__(self, kind: str, model_fn: Callable,
               client_optimizer: tff.learning.optimizers.Optimizer,
               server_optimizer: tff.learning.optimizers.Optimizer,
               client_weighting: tff.learning.ClientWeighting,
               proximal_strength: float, communication_metrics):
    if kind not in KINDS:
      raise ValueError(f'unknown baseline {kind!r}')
    self._kind = kind
    # One model for all clients; TFF builds one per client, so its metrics
    # are reset before each client (`_client_result`).
    self._model = model_fn()
    self._client_optimizer = client_optimizer
    self._server_optimizer = server_optimizer
    self._communication_metrics = communication_metrics
    if kind == 'fedavg':
      self._client_update = (
          model_delta_client_work.build_model_delta_update_with_tff_optimizer(
              lambda: self._model, weighting=client_weighting,
              loop_implementation=LOOP))
    elif kind == 'fedprox':
      self._client_update = fedprox.build_client_update(
          lambda: self._model, weighting=client_weighting,
          proximal_strength=proximal_strength, loop_implementation=LOOP)
    else:
      self._client_update = fed_sgd._build_client_update(  # pylint: disable=protected-access
          self._model, loop_implementation=LOOP)
    self._metric_finalizers = self._model.metric_finalizers()
    self._trainable_specs = tuple(
        tf.TensorSpec(v.shape, v.dtype)
        for v in self._model.trainable_variables)

  def initialize(self):
    weights = ModelWeights.from_model(self._model)
    # As the TFF process's state: FedAvg's and FedProx's client work keep the
    # client optimizer's hyperparameters, FedSGD's nothing; the
    # broadcast and the mean aggregator keep nothing; the finalizer keeps the
    # server optimizer's state.
    client_work = ()
    if self._kind in ('fedavg', 'fedprox'):
      client_work = self._client_optimizer.get_hparams(
          self._client_optimizer.initialize(tf.TensorSpec([], tf.float32)))
    return native.to_numpy(composers.LearningAlgorithmState(
        global_model_weights=ModelWeights(
            trainable=[v.read_value() for v in weights.trainable],
            non_trainable=[v.read_value() for v in weights.non_trainable]),
        distributor=(),
        client_work=client_work,
        aggregator=collections.OrderedDict(value_sum_process=(),
                                           weight_sum_process=()),
        finalizer=self._server_optimizer.initialize(self._trainable_specs)))

  def _client_result(self, server_state, dataset):
    self._model.reset_metrics()
    weights = server_state.global_model_weights
    if self._kind in ('fedavg', 'fedprox'):
      return self._client_update(self._client_optimizer, weights, dataset,
                                 server_state.client_work)
    return self._client_update(weights, dataset)

  def next(self, server_state, datasets, client_states=None,
           server_data=None):
    del client_states, server_data  # Stateless, no server data.
    results = [native.to_numpy(self._client_result(server_state, dataset))
               for dataset in datasets]
    mean_update = native.weighted_mean(
        [list(result.update) for result, _ in results],
        [result.update_weight for result, _ in results])
    weights = server_state.global_model_weights
    optimizer_state, trainable, _ = _apply_optimizer(
        self._server_optimizer, server_state.finalizer,
        tuple(weights.trainable), tuple(mean_update))
    new_state = server_state._replace(
        global_model_weights=ModelWeights(
            trainable=list(trainable),
            non_trainable=list(weights.non_trainable)),
        finalizer=optimizer_state)
    metrics = collections.OrderedDict(
        train=native.sum_then_finalize(self._metric_finalizers,
                                       [m for _, m in results]),
        communication=self._communication_metrics)
    return native.to_numpy(new_state), None, metrics


@tf.function
def _apply_optimizer(optimizer, optimizer_state, trainable_weights, update):
  # apply_optimizer_finalizer's step (its TF function is built inside a TFF
  # computation only): the update is the gradient; a non-finite update is
  # rejected, leaving weights and optimizer state as they were.
  new_state, new_weights = optimizer.next(optimizer_state, trainable_weights,
                                          update)
  should_reject, measurements = (
      apply_optimizer_finalizer.reject_non_finite_update(new_state, update))
  if should_reject:
    return optimizer_state, trainable_weights, measurements
  return new_state, new_weights, measurements
