"""SCAFFOLD and FedPVR as TFF processes on the common contract ([SCAFFOLD], [FedPVR]).

The TF math is in `scaffold_tf`; this module only places, broadcasts, maps
and aggregates. Server state: the model x (`global_model_weights`), the server
control variate c (masked variables only) and the server optimizer's state;
all three are checkpointed by the driver. Client state: c_i (masked variables
only), kept in the driver's client-state store and created as zeros the first
time a client is sampled.

Aggregation: the model update weights client i by p_i, the examples it
processed (`--client_weighting=num_examples`) or 1 (`uniform`, the papers'
setting); the control variate update is always the uniform mean:
  x <- ServerOpt(x, -mean_p(y_i - x))       (SGD: x + eta_s * mean_p(y_i - x))
  c <- c + (|S|/N) * mean_{i in S}(c_i+ - c_i)
The c rule is [SCAFFOLD] Alg. 1 line 17 (and eq. 21): it keeps c equal to
(1/N) sum_i c_i over all N clients, stored or never sampled (c_i = 0), for
any client sizes; an example-weighted mean would not (tests/test_scaffold_math.py).
"""

import collections
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tff_algos import communication
from tff_algos import contract
from tff_algos import optimizers
from tff_algos import scaffold_native
from tff_algos import scaffold_tf
from tff_algos.config import AlgorithmConfig
from tff_algos.config import CLIENT_WEIGHTINGS

ModelWeights = tff.learning.models.ModelWeights

_COMMON_FLAGS = ('client_learning_rate', 'server_optimizer',
                 'server_learning_rate', 'scaffold_option', 'client_weighting',
                 'drift_diversity')
# With every variable masked there is no plain-SGD block for a client
# optimizer to act on, so SCAFFOLD does not take --client_optimizer.
SCAFFOLD_FLAGS = _COMMON_FLAGS
FEDPVR_FLAGS = _COMMON_FLAGS + ('client_optimizer', 'pvr_last_layers',
                                'pvr_start_variable')

# What a client sends of its `scaffold_tf.build_client_update` result (the
# rest stays on the client, or is a simulation-only measurement: the drift
# diversity's per-layer norms).
UPLOADED = ('model_delta', 'control_variate_delta', 'weight', 'metrics')


def build_control_variate_algorithm(
    name: str,
    model_fn: Callable[[], tff.learning.models.VariableModel],
    config: AlgorithmConfig,
    mask_fn: Callable[[list[str]], tuple[bool, ...]],
    flag_names: tuple[str, ...],
) -> contract.FederatedAlgorithm:
  """The shared SCAFFOLD/FedPVR process; `mask_fn(names)` picks the variables."""
  if config.client_weighting not in CLIENT_WEIGHTINGS:
    raise UsageError(f'--client_weighting={config.client_weighting!r} is '
                     f'unknown; allowed: {", ".join(CLIENT_WEIGHTINGS)}')
  if config.scaffold_option not in scaffold_tf.OPTIONS:
    raise UsageError(f'--scaffold_option={config.scaffold_option} is unknown; '
                     'allowed: 1, 2')
  if config.num_train_clients < 1:
    raise ValueError('num_train_clients must be >= 1')
  client_optimizer = optimizers.build(
      config.client_optimizer, config.client_learning_rate, 'client_optimizer')
  server_optimizer = optimizers.build(
      config.server_optimizer, config.server_learning_rate, 'server_optimizer')

  with tf.Graph().as_default():
    # Probe the model once for its variables; the computations below build
    # their own copies.
    probe = model_fn()
    variable_names = [v.name for v in probe.trainable_variables]
    metric_finalizers = probe.metric_finalizers()
    weights_type = tff.learning.models.weights_type_from_model(probe)
    data_type = tff.SequenceType(tff.types.tensorflow_to_type(
        probe.input_spec))
    trainable_specs = [tf.TensorSpec(v.shape, v.dtype)
                       for v in probe.trainable_variables]
  mask = tuple(mask_fn(variable_names))
  layer_of_variable = scaffold_tf.variable_layers(variable_names)
  num_layers = (max(layer_of_variable) + 1) if layer_of_variable else 0
  cv_specs = scaffold_tf.masked_specs(trainable_specs, mask)
  cv_type = tff.types.tensorflow_to_type(cv_specs)
  uniform = config.client_weighting == 'uniform'
  metrics_aggregation = tff.learning.metrics.sum_then_finalize(
      metric_finalizers)

  @tff.tensorflow.computation
  def initial_server_state():
    return scaffold_tf.initial_server_state(model_fn(), server_optimizer,
                                            cv_specs)

  server_state_type = initial_server_state.type_signature.result

  @tff.federated_computation
  def initialize():
    return tff.federated_eval(initial_server_state, tff.SERVER)

  @tff.tensorflow.computation(weights_type, cv_type, cv_type, data_type)
  def client_update(initial_weights, server_cv, client_cv, dataset):
    update = scaffold_tf.build_client_update(
        model_fn(), client_optimizer, config.client_learning_rate, mask,
        config.scaffold_option, uniform,
        layer_of_variable if config.drift_diversity else None)
    return update(initial_weights, server_cv, client_cv, dataset)

  @tff.tensorflow.computation(server_state_type, weights_type.trainable,
                              cv_type, np.int32)
  def server_update(state, mean_model_delta, mean_cv_delta, num_clients):
    update = scaffold_tf.build_server_update(server_optimizer,
                                             config.num_train_clients)
    return update(state, mean_model_delta, mean_cv_delta, num_clients)

  @tff.tensorflow.computation(np.float32)
  def one_client(weight):
    del weight
    return tf.constant(1, tf.int32)

  # Per client: x (all weights) and c down; y - x, c_i+ - c_i, the weight and
  # the metric sums up. With v masked numbers out of d: about 2d + 2v.
  bytes_down = (communication.type_bytes(weights_type) +
                communication.type_bytes(cv_type))
  client_result_type = client_update.type_signature.result
  bytes_up = sum(communication.type_bytes(client_result_type[name])
                 for name in UPLOADED)

  @tff.tensorflow.computation(tff.TensorType(np.float32, [num_layers]),
                              weights_type.trainable)
  def drift_diversity(sum_of_sq_norms, sum_of_deltas):
    return scaffold_tf.drift_diversity_metrics(sum_of_sq_norms, sum_of_deltas,
                                               layer_of_variable)

  client_inputs_type = tff.FederatedType(
      tff.StructType([
          ('data', data_type),
          ('state', tff.StructType([('control_variate', cv_type)])),
      ]), tff.CLIENTS)

  @tff.federated_computation(initialize.type_signature.result,
                             client_inputs_type)
  def next_fn(server_state, client_inputs):
    outputs = tff.federated_map(client_update, (
        tff.federated_broadcast(server_state.global_model_weights),
        tff.federated_broadcast(server_state.control_variate),
        client_inputs.state.control_variate, client_inputs.data))
    mean_model_delta = tff.federated_mean(outputs.model_delta, outputs.weight)
    # Uniform, whatever the model's weighting: c = (1/N) sum_i c_i.
    mean_cv_delta = tff.federated_mean(outputs.control_variate_delta)
    num_clients = tff.federated_sum(tff.federated_map(one_client,
                                                      outputs.weight))
    new_state = tff.federated_map(server_update, (
        server_state, mean_model_delta, mean_cv_delta, num_clients))
    metrics = collections.OrderedDict(
        train=metrics_aggregation(outputs.metrics),
        communication=communication.metrics_at_server(bytes_down, bytes_up))
    if config.drift_diversity:
      metrics['drift_diversity'] = tff.federated_map(drift_diversity, (
          tff.federated_sum(outputs.layer_sq_norms),
          tff.federated_sum(outputs.model_delta)))
    client_outputs = tff.federated_zip(
        collections.OrderedDict(state=outputs.client_state))
    return new_state, client_outputs, tff.federated_zip(metrics)

  def client_state_fn():
    return collections.OrderedDict(control_variate=[
        np.zeros(s.shape, s.dtype.as_numpy_dtype) for s in cv_specs])

  def native_process_fn():
    return scaffold_native.ControlVariateRounds(
        model_fn, client_optimizer, server_optimizer, config, mask, cv_specs,
        layer_of_variable, uniform, metric_finalizers,
        communication_metrics=communication.metrics(bytes_down, bytes_up))

  return contract.FederatedAlgorithm(
      name=name,
      process=tff.templates.IterativeProcess(initialize, next_fn),
      get_model_weights=get_model_weights,
      set_model_weights=set_model_weights,
      client_state_fn=client_state_fn,
      flag_names=flag_names,
      native_process_fn=native_process_fn)


def get_model_weights(server_state) -> ModelWeights:
  return server_state['global_model_weights']


def set_model_weights(server_state, weights: ModelWeights):
  state = collections.OrderedDict(server_state)
  state['global_model_weights'] = ModelWeights(
      trainable=[np.asarray(v) for v in weights.trainable],
      non_trainable=[np.asarray(v) for v in weights.non_trainable])
  return state


def build_scaffold(model_fn: Callable,
                   config: AlgorithmConfig) -> contract.FederatedAlgorithm:
  """SCAFFOLD ([SCAFFOLD] Alg. 1): control variates on every variable."""
  return build_control_variate_algorithm(
      'scaffold', model_fn, config,
      lambda names: tuple(True for _ in names), SCAFFOLD_FLAGS)


def build_fedpvr(model_fn: Callable,
                 config: AlgorithmConfig) -> contract.FederatedAlgorithm:
  """FedPVR ([FedPVR] Alg. I): control variates on the last layers only."""
  start: Optional[int] = config.pvr_start_variable
  last_layers = None if start is not None else config.pvr_last_layers
  return build_control_variate_algorithm(
      'fedpvr', model_fn, config,
      lambda names: scaffold_tf.control_variate_mask(names, last_layers, start),
      FEDPVR_FLAGS)
