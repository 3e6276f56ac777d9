"""Mixed FL processes: Parallel Training, 1-way and 2-way Gradient Transfer.

[MixedFL] Algs. 1 and 2 as dataset-level processes of the
common contract (tff_algos.contract). The math lives in `mixed_tf`; here TFF
only places it: the central work runs at the server on the round's central
batches (or on a data-free central loss), the server broadcasts the model
(plus the augmenting gradient for GT), clients train, and the server
aggregates and updates.

Server state (an OrderedDict, checkpointed by the driver):
  global_model_weights  x
  server_optimizer      ServerOpt state
  merge_optimizer       MergeOpt state                     (PT, 2-w GT)
  gtilde_c, gtilde_f    augmenting gradients, start at 0   (2-w GT)
ClientOpt and CentralOpt start fresh every round: the central model is a
"meta-client" that, like the clients, takes K steps from x. Non-trainable
weights are not trained; the server keeps its own (as tff.learning's FedAvg).

Metrics: `train/*` (the model's metrics on the clients' batches, summed over
the cohort), `central/loss` (mean unweighted central loss of the round) and
`central/num_steps`, `diagnostics/gtilde_squared` and
`diagnostics/btilde_squared` with `mixed_diagnostics` (eq. 7), and
`communication/bytes_{down,up}_per_client`.
"""

import collections
import functools
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tff_algos import communication
from tff_algos import contract
from tff_algos import mixed_native
from tff_algos import mixed_tf
from tff_algos import optimizers
from tff_algos.config import AlgorithmConfig

PARALLEL_TRAINING = 'mixed_pt'
ONE_WAY_GT = 'mixed_1wgt'
TWO_WAY_GT = 'mixed_2wgt'
NAMES = (PARALLEL_TRAINING, ONE_WAY_GT, TWO_WAY_GT)

_COMMON_FLAGS = ('client_optimizer', 'client_learning_rate', 'server_optimizer',
                 'server_learning_rate', 'central_batch_size',
                 'federated_weight', 'central_weight', 'mixed_diagnostics')
_CENTRAL_MODEL_FLAGS = ('central_optimizer', 'central_learning_rate',
                        'merge_optimizer', 'merge_learning_rate')
FLAG_NAMES = {
    PARALLEL_TRAINING: _COMMON_FLAGS + _CENTRAL_MODEL_FLAGS,
    ONE_WAY_GT: _COMMON_FLAGS,
    TWO_WAY_GT: _COMMON_FLAGS + _CENTRAL_MODEL_FLAGS,
}
# Optimizer flags that must stay plain SGD (docs/mixed_fl.md): 2-w GT
# recovers its augmenting gradients from the round's deltas, and the mean
# gradient is -delta / (eta * steps) only for plain SGD steps ([MixedFL]
# Algorithm 1's gtilde_c update, Appendix A.2 eqs. 8-10).
PLAIN_SGD_FLAGS = {TWO_WAY_GT: ('client_optimizer', 'central_optimizer')}


def _validate(name: str, config: AlgorithmConfig) -> None:
  not_sgd = [f'--{flag}={getattr(config, flag)}'
             for flag in PLAIN_SGD_FLAGS.get(name, ())
             if getattr(config, flag) != 'sgd']
  if not_sgd:
    raise UsageError(
        f'--algorithm={name} needs plain SGD as '
        + ' and '.join(f'--{f}' for f in PLAIN_SGD_FLAGS[name])
        + ' (its augmenting gradients are recovered from the deltas of plain '
        f'SGD steps; docs/mixed_fl.md); got {", ".join(not_sgd)}')
  for flag in ('federated_weight', 'central_weight'):
    value = getattr(config, flag)
    if not value >= 0:
      raise UsageError(f'--{flag} must be >= 0, got {value}')
  if config.mixed_diagnostics and not (config.federated_weight > 0 and
                                       config.central_weight > 0):
    raise UsageError('--mixed_diagnostics needs --federated_weight > 0 and '
                     '--central_weight > 0 (eq. 7 divides by both)')
  if name != ONE_WAY_GT and config.central_steps is None:
    raise UsageError(
        f'--algorithm={name} needs --client_steps (K): its central model '
        'takes K steps per round')
  if config.central_steps is not None and config.central_steps < 1:
    raise UsageError(f'--client_steps must be >= 1, got {config.central_steps}')


def _weights_to_numpy(weights: tff.learning.models.ModelWeights):
  return tff.learning.models.ModelWeights(
      trainable=[np.asarray(w) for w in weights.trainable],
      non_trainable=[np.asarray(w) for w in weights.non_trainable])


def _get_model_weights(state) -> tff.learning.models.ModelWeights:
  return state['global_model_weights']


def _set_model_weights(state, weights: tff.learning.models.ModelWeights):
  state = collections.OrderedDict(state)
  state['global_model_weights'] = _weights_to_numpy(weights)
  return state


def build_mixed(name: str, model_fn: Callable[[], tff.learning.models.VariableModel],
                config: AlgorithmConfig) -> contract.FederatedAlgorithm:
  """The mixed FL algorithm `name` (one of NAMES) under the contract.

  With `config.central_loss_fn` the central loss is data-free: the process
  takes no server data and the central model evaluates that function.
  """
  if name not in NAMES:
    raise ValueError(f'unknown mixed FL algorithm {name!r}')
  _validate(name, config)
  has_central_model = name != ONE_WAY_GT
  transfers_gradients = name != PARALLEL_TRAINING
  keeps_augmenting_gradients = name == TWO_WAY_GT
  data_free = config.central_loss_fn is not None
  diagnostics = config.mixed_diagnostics
  w_f, w_c = config.federated_weight, config.central_weight
  client_lr = config.client_learning_rate
  central_lr = config.central_learning_rate

  client_optimizer = optimizers.build(config.client_optimizer, client_lr,
                                      'client_optimizer')
  server_optimizer = optimizers.build(config.server_optimizer,
                                      config.server_learning_rate,
                                      'server_optimizer')
  central_optimizer = merge_optimizer = None
  if has_central_model:
    central_optimizer = optimizers.build(config.central_optimizer, central_lr,
                                         'central_optimizer')
    merge_optimizer = optimizers.build(config.merge_optimizer,
                                       config.merge_learning_rate,
                                       'merge_optimizer')
  if data_free:
    central_loss = mixed_tf.DataFreeCentralLoss(config.central_loss_fn)
  else:
    central_loss = mixed_tf.DataCentralLoss()
  settings = mixed_tf.RoundSettings(
      has_central_model=has_central_model,
      transfers_gradients=transfers_gradients,
      keeps_augmenting_gradients=keeps_augmenting_gradients,
      data_free=data_free, central_steps=config.central_steps,
      federated_weight=w_f, central_weight=w_c,
      client_learning_rate=client_lr, central_learning_rate=central_lr,
      diagnostics=diagnostics)

  with tf.Graph().as_default():
    model = model_fn()
    metric_finalizers = model.metric_finalizers()
    batch_type = tff.types.tensorflow_to_type(model.input_spec)
  data_type = tff.SequenceType(batch_type)
  weights_type = tff.learning.models.weights_type_from_model(model)
  trainable_type = weights_type.trainable

  # --- Initialization -------------------------------------------------------

  @tff.tensorflow.computation
  def initial_state():
    return mixed_tf.initial_server_state(settings, model_fn(),
                                         server_optimizer, merge_optimizer)

  @tff.federated_computation
  def initialize():
    return tff.federated_eval(initial_state, tff.SERVER)

  state_type = initialize.type_signature.result.member

  # --- Central work (at the server) ------------------------------------------

  central_input_fields = [('model_weights', weights_type)]
  if keeps_augmenting_gradients:
    central_input_fields.append(('gtilde_f', trainable_type))
  if not data_free:
    central_input_fields.append(('central_batches', data_type))
  central_input_type = tff.StructWithPythonType(central_input_fields,
                                                collections.OrderedDict)

  @tff.tensorflow.computation(central_input_type)
  def central_work(inputs):
    return mixed_tf.central_work(
        settings, model_fn(), central_optimizer, central_loss,
        inputs['model_weights'], inputs.get('gtilde_f'),
        inputs.get('central_batches'))

  # --- Client work ----------------------------------------------------------

  payload_fields = [('model_weights', weights_type)]
  if transfers_gradients:
    payload_fields.append(('augmenting_gradient', trainable_type))
  payload_type = tff.StructWithPythonType(payload_fields,
                                          collections.OrderedDict)

  @tff.tensorflow.computation(payload_type, data_type)
  def client_work(payload, dataset):
    return mixed_tf.client_work(settings, model_fn(), client_optimizer,
                                payload, dataset)

  # (down, up, the augmenting gradient's part of down) per client: the
  # broadcast payload, the upload.
  communication_bytes = (
      communication.type_bytes(payload_type),
      communication.type_bytes(client_work.type_signature.result.upload),
      communication.type_bytes(trainable_type) if transfers_gradients else 0)

  @tff.tensorflow.computation(data_type)
  def no_client_state(dataset):
    del dataset
    return collections.OrderedDict()

  # --- Server update ----------------------------------------------------------

  server_input_fields = [
      ('state', state_type),
      ('central', central_work.type_signature.result),
      ('client_delta_mean', trainable_type),
      ('client_weight_sum', np.float32)]
  if keeps_augmenting_gradients:
    server_input_fields += [('client_delta_sum', trainable_type),
                            ('client_steps_sum', np.float32)]

  @tff.tensorflow.computation(
      tff.StructWithPythonType(server_input_fields, collections.OrderedDict))
  def server_update(inputs):
    state = collections.OrderedDict(
        (key, inputs['state'][key])
        for key in tff.structure.name_list(state_type))
    return mixed_tf.server_update(
        settings, server_optimizer, merge_optimizer, state, inputs['central'],
        inputs['client_delta_mean'], inputs['client_weight_sum'],
        inputs.get('client_delta_sum'), inputs.get('client_steps_sum'))

  @tff.tensorflow.computation(trainable_type, trainable_type)
  def diagnostics_fn(federated_gradient, central_gradient):
    return mixed_tf.mixing_diagnostics(list(federated_gradient),
                                       list(central_gradient), w_f, w_c)

  # --- One round ------------------------------------------------------------

  def _round(state, client_data, server_data):
    weights = state.global_model_weights
    central_inputs = collections.OrderedDict(model_weights=weights)
    if keeps_augmenting_gradients:
      central_inputs['gtilde_f'] = state.gtilde_f
    if server_data is not None:
      central_inputs['central_batches'] = server_data
    central = tff.federated_map(central_work,
                                tff.federated_zip(central_inputs))

    payload = collections.OrderedDict(model_weights=weights)
    if name == ONE_WAY_GT:
      payload['augmenting_gradient'] = central.gradient
    elif name == TWO_WAY_GT:
      payload['augmenting_gradient'] = state.gtilde_c
    broadcast = tff.federated_broadcast(tff.federated_zip(payload))
    client_outputs = tff.federated_map(client_work, (broadcast, client_data))
    upload = client_outputs.upload

    server_inputs = collections.OrderedDict(
        state=state, central=central,
        client_delta_mean=tff.federated_mean(upload.delta,
                                             weight=upload.weight),
        client_weight_sum=tff.federated_sum(upload.weight))
    if keeps_augmenting_gradients:
      server_inputs['client_delta_sum'] = tff.federated_sum(upload.delta)
      server_inputs['client_steps_sum'] = tff.federated_sum(upload.num_steps)
    new_state = tff.federated_map(server_update,
                                  tff.federated_zip(server_inputs))

    train_metrics = tff.learning.metrics.sum_then_finalize(
        metric_finalizers, upload.metrics.type_signature.member)(
            upload.metrics)
    metrics = collections.OrderedDict(
        train=train_metrics,
        central=tff.federated_zip(collections.OrderedDict(
            loss=central.loss, num_steps=central.num_steps)))
    if diagnostics:
      central_gradient = (central.gradient if name == ONE_WAY_GT else
                          central.first_gradient)
      federated_gradient = tff.federated_mean(client_outputs.first_gradient)
      metrics['diagnostics'] = tff.federated_map(
          diagnostics_fn,
          tff.federated_zip((federated_gradient, central_gradient)))
    metrics['communication'] = communication.metrics_at_server(
        *communication_bytes)
    return (new_state, tff.federated_map(no_client_state, client_data),
            tff.federated_zip(metrics))

  state_at_server = tff.FederatedType(state_type, tff.SERVER)
  data_at_clients = tff.FederatedType(data_type, tff.CLIENTS)
  if data_free:

    @tff.federated_computation(state_at_server, data_at_clients)
    def next_fn(state, client_data):
      return _round(state, client_data, None)
  else:

    @tff.federated_computation(state_at_server, data_at_clients,
                               tff.FederatedType(data_type, tff.SERVER))
    def next_fn(state, client_data, server_data):
      return _round(state, client_data, server_data)

  def native_process_fn():
    return mixed_native.MixedRounds(
        name, settings, model_fn, client_optimizer, server_optimizer,
        central_optimizer, merge_optimizer, central_loss, metric_finalizers,
        communication_bytes)

  return contract.FederatedAlgorithm(
      name=name,
      process=tff.templates.IterativeProcess(initialize, next_fn),
      get_model_weights=_get_model_weights,
      set_model_weights=_set_model_weights,
      uses_server_data=not data_free,
      flag_names=FLAG_NAMES[name],
      native_process_fn=native_process_fn)


build_mixed_pt = functools.partial(build_mixed, PARALLEL_TRAINING)
build_mixed_1wgt = functools.partial(build_mixed, ONE_WAY_GT)
build_mixed_2wgt = functools.partial(build_mixed, TWO_WAY_GT)
