"""FedProx with the paper's proximal term, on tff.learning's FedAvg templates.

FedProx ([FedProx] Alg. 2) has client k minimize, from the server model
w^t, the local objective h_k(w; w^t) = F_k(w) + (mu/2) ||w - w^t||^2 (eq. 2),
whose gradient adds mu * (w - w^t) to the loss gradient: the term pulls the
local model back towards the server model.

`tff.learning.algorithms.build_weighted_fed_prox` of TFF 0.87 adds
mu * (w^t - w) instead (learning/templates/proximal_client_work.py,
`delta_l2_regularizer * (y - x)` with x the local and y the initial weights),
so it runs FedProx with -mu: the term pushes clients away from the server
model. This module is FedAvg's client work (tff.learning's
`model_delta_client_work`: same training loop, update = initial - final
weights, client weight, metrics, client-optimizer hyperparameters as state)
with the paper's term added to every step's gradient; at mu = 0 it is FedAvg
exactly. tests/test_fedprox.py checks one round against hand-computed numbers
and that TFF's builder equals this module's algorithm with -mu (so an upstream
fix shows up as a failing test).

`build_client_update` is the one client update of both runtimes: the TFF
process below maps it over the clients, `baselines_native` calls it in-process.
"""

import collections
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.learning import loop_builder
from tensorflow_federated.python.learning import tensor_utils
from tensorflow_federated.python.learning.templates import client_works

ModelWeights = tff.learning.models.ModelWeights


def build_client_update(model_fn: Callable[[], tff.learning.models.VariableModel],
                        *, weighting: tff.learning.ClientWeighting,
                        proximal_strength: float,
                        loop_implementation: tff.learning.LoopImplementation):
  """`client_update(optimizer, initial_weights, data, optimizer_hparams=None)`.

  tff.learning's FedAvg client update (same signature and result:
  `(ClientResult(update=initial - final trainable weights, update_weight),
  unfinalized metrics)`) whose steps use grad F_k(w) + mu * (w - w^t).
  `proximal_strength` (mu) is not checked here: the tests build the -mu
  algorithm with it; `--proximal_strength` is validated by the registry.
  """
  model = model_fn()
  training_loop = loop_builder.build_training_loop(loop_implementation)
  mu = float(proximal_strength)

  @tf.function
  def client_update(optimizer, initial_weights, data, optimizer_hparams=None):
    model_weights = ModelWeights.from_model(model)
    tf.nest.map_structure(lambda v, t: v.assign(t), model_weights,
                          initial_weights)
    trainable = tuple(tf.nest.flatten(model_weights.trainable))
    server_trainable = tuple(tf.nest.flatten(initial_weights.trainable))

    def train_on_batch(state, batch):
      num_examples, optimizer_state = state
      with tf.GradientTape() as tape:
        output = model.forward_pass(batch, training=True)
      gradients = tape.gradient(output.loss, trainable)
      # d/dw (mu/2) ||w - w^t||^2 = mu * (w - w^t): towards the server model.
      gradients = tuple(g + mu * (w - w_server) for g, w, w_server in zip(
          gradients, trainable, server_trainable))
      optimizer_state, updated = optimizer.next(optimizer_state, trainable,
                                                gradients)
      for variable, value in zip(trainable, updated):
        variable.assign(value)
      if output.num_examples is None:
        num_examples += tf.shape(output.predictions, out_type=tf.int64)[0]
      else:
        num_examples += tf.cast(output.num_examples, tf.int64)
      return num_examples, optimizer_state

    def initial_loop_state():
      optimizer_state = optimizer.initialize(
          tuple(tf.TensorSpec(v.shape, v.dtype) for v in trainable))
      if optimizer_hparams is not None:
        optimizer_state = optimizer.set_hparams(optimizer_state,
                                                optimizer_hparams)
      return tf.zeros([], tf.int64), optimizer_state

    num_examples, _ = training_loop(train_on_batch, data, initial_loop_state)
    update = tf.nest.map_structure(tf.subtract, initial_weights.trainable,
                                   model_weights.trainable)
    # As tff.learning's FedAvg: a client whose update is not finite is left
    # out of the mean (weight 0) and of the metrics.
    update, has_non_finite_delta = tensor_utils.zero_all_if_any_non_finite(
        update)
    if has_non_finite_delta > 0:
      update_weight = tf.constant(0.0)
      model.reset_metrics()
    elif weighting == tff.learning.ClientWeighting.NUM_EXAMPLES:
      update_weight = tf.cast(num_examples, tf.float32)
    else:
      update_weight = tf.constant(1.0)
    return (client_works.ClientResult(update=update,
                                      update_weight=update_weight),
            model.report_local_unfinalized_metrics())

  return client_update


def build_client_work(model_fn: Callable[[], tff.learning.models.VariableModel],
                      optimizer: tff.learning.optimizers.Optimizer,
                      client_weighting: tff.learning.ClientWeighting,
                      proximal_strength: float,
                      loop_implementation: tff.learning.LoopImplementation
                      ) -> client_works.ClientWorkProcess:
  """FedAvg's `ClientWorkProcess` (state: the client optimizer's
  hyperparameters, broadcast to the clients) with `build_client_update`."""
  with tf.Graph().as_default():
    model = model_fn()
    metrics_aggregation = tff.learning.metrics.sum_then_finalize(
        model.metric_finalizers())
    data_type = tff.SequenceType(tff.types.tensorflow_to_type(
        model.input_spec))
    weights_type = tff.learning.models.weights_type_from_model(model)

  @tff.tensorflow.computation
  def initial_hparams():
    return optimizer.get_hparams(optimizer.initialize(
        tf.TensorSpec([], tf.float32)))

  hparams_type = initial_hparams.type_signature.result

  @tff.federated_computation
  def init_fn():
    return tff.federated_eval(initial_hparams, tff.SERVER)

  @tff.tensorflow.computation(hparams_type)
  def get_hparams(state):
    return state

  @tff.tensorflow.computation(hparams_type, hparams_type)
  def set_hparams(state, hparams):
    del state
    return hparams

  @tff.tensorflow.computation(hparams_type, weights_type, data_type)
  def client_update(hparams, initial_weights, dataset):
    update = build_client_update(
        model_fn, weighting=client_weighting,
        proximal_strength=proximal_strength,
        loop_implementation=loop_implementation)
    return update(optimizer, initial_weights, dataset, hparams)

  @tff.federated_computation(init_fn.type_signature.result,
                             tff.FederatedType(weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, client_data):
    client_result, model_outputs = tff.federated_map(
        client_update, (tff.federated_broadcast(state), weights, client_data))
    measurements = tff.federated_zip(collections.OrderedDict(
        train=metrics_aggregation(model_outputs)))
    return tff.templates.MeasuredProcessOutput(state, client_result,
                                               measurements)

  return client_works.ClientWorkProcess(
      init_fn, next_fn, get_hparams_fn=get_hparams,
      set_hparams_fn=set_hparams)


def build_weighted_fed_prox(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer_fn: tff.learning.optimizers.Optimizer,
    server_optimizer_fn: tff.learning.optimizers.Optimizer,
    client_weighting: tff.learning.ClientWeighting,
    proximal_strength: float,
    loop_implementation: tff.learning.LoopImplementation,
) -> tff.learning.templates.LearningProcess:
  """FedProx as `build_weighted_fed_avg` composes FedAvg: broadcast of the
  model, `build_client_work`, weighted mean of the updates, server optimizer
  step (rejected if not finite)."""

  @tff.tensorflow.computation
  def initial_model_weights():
    return ModelWeights.from_model(model_fn())

  weights_type = initial_model_weights.type_signature.result
  return tff.learning.templates.compose_learning_process(
      initial_model_weights,
      tff.learning.templates.build_broadcast_process(weights_type),
      build_client_work(model_fn, client_optimizer_fn, client_weighting,
                        proximal_strength, loop_implementation),
      tff.aggregators.MeanFactory().create(weights_type.trainable,
                                           tff.TensorType(np.float32)),
      tff.learning.templates.build_apply_optimizer_finalizer(
          server_optimizer_fn, weights_type))
