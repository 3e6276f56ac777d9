"""FedResNaive, FedResSGD and FedResAvg as TFF processes ([FedRes] Algs. 2-4).

The TF math is in `fedres_tf`; this module only places, broadcasts and
aggregates around it, following the process contract (`contract`):

  server state  <global_model_weights=ModelWeights w[, control=c]> @SERVER
  client state  <local_model=theta_i[, control=c_i]>              @CLIENTS
  next          (state, <data, state>@CLIENTS)
                -> <state, <state=new client state>@CLIENTS, <train=...>>

theta_i (and Option II's c_i) is persistent client state: it enters a round
from the client store and leaves only as the client's own output state, which
the driver writes back to the store ("on the client side" in simulation). It
is never aggregated or sent to the server. Only sampled clients run, so only
they update theta_i. Clients upload w_i - w (and c_i+ - c_i for Option II);
the server applies w <- w + alpha mean_S(w_i - w) (alpha = 1 for Naive and
SGD; clients are weighted uniformly, as in the paper's objective
(1/N) sum_i L_i) and c <- c + sum_S(c_i+ - c_i) / N, SCAFFOLD's |S|/N rule.

Metrics: `train/loss`, `train/num_examples` and, as every algorithm,
`communication/bytes_down_per_client` (w, and c for Option II) and
`communication/bytes_up_per_client` (w_i - w, c_i+ - c_i for Option II, and
the client's loss and example sums): what `server_message` broadcasts and a
client's round result holds besides its own state (`uploaded`).
"""

import collections
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tasks import base
from tff_algos import communication
from tff_algos import contract
from tff_algos import fedres_eval
from tff_algos import fedres_export
from tff_algos import fedres_tf
from tff_algos.config import AlgorithmConfig

ModelWeights = tff.learning.models.ModelWeights
OPTIONS = (1, 2)
_COMMON_FLAGS = ('client_learning_rate', 'local_learning_rate',
                 'fedres_fit_unseen')
_FLAGS = {
    'naive': _COMMON_FLAGS,
    'sgd': _COMMON_FLAGS,
    'avg': _COMMON_FLAGS + ('fedres_option', 'fedres_alpha'),
}
RESIDUAL_TASKS_HINT = 'fedres_toy, fedres_logistic, movielens_ratings'


def build_fedres_naive(task: base.Task, config: AlgorithmConfig):
  """FedResNaive ([FedRes] Alg. 2)."""
  return _build('naive', task, config)


def build_fedres_sgd(task: base.Task, config: AlgorithmConfig):
  """FedResSGD ([FedRes] Alg. 3)."""
  return _build('sgd', task, config)


def build_fedres_avg(task: base.Task, config: AlgorithmConfig):
  """FedResAvg, Option I or II ([FedRes] Alg. 4)."""
  return _build('avg', task, config)


def _validate(name: str, task: base.Task, config: AlgorithmConfig) -> None:
  if task.residual_spec is None:
    raise UsageError(
        f'--algorithm={name} needs a task with a global + local (residual) '
        f'model; --task={task.name} has none (tasks with one: '
        f'{RESIDUAL_TASKS_HINT})')
  if not config.client_learning_rate > 0:
    raise UsageError('--client_learning_rate (eta) must be > 0, got '
                     f'{config.client_learning_rate}')
  if not config.local_learning_rate >= 0:
    raise UsageError('--local_learning_rate (lambda) must be >= 0, got '
                     f'{config.local_learning_rate}')
  if not config.fedres_alpha > 0:
    raise UsageError(f'--fedres_alpha must be > 0, got {config.fedres_alpha}')
  if config.fedres_option not in OPTIONS:
    raise UsageError(f'--fedres_option={config.fedres_option} is unknown; '
                     'allowed: 1 (no control variates), 2 (control variates)')


def _tensor_type(structure) -> tff.Type:
  return tff.types.tensorflow_to_type(tf.nest.map_structure(
      lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)),
      structure))


def hyperparameters(variant: str, task: base.Task,
                    config: AlgorithmConfig) -> fedres_tf.Hyperparameters:
  """Validated round hyperparameters of `fedres_<variant>` on `task`."""
  _validate(f'fedres_{variant}', task, config)
  return fedres_tf.Hyperparameters(
      variant=variant,
      learning_rate=config.client_learning_rate,
      local_learning_rate=config.local_learning_rate,
      option=config.fedres_option if variant == 'avg' else 1,
      server_step=config.fedres_alpha if variant == 'avg' else 1.0,
      num_train_clients=task.num_train_clients)


def initial_weights(spec) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """(w_0, theta_0) of freshly built models; theta_0 is every client's."""
  global_model = spec.global_model_fn()
  local_model = spec.local_model_fn()
  if global_model.non_trainable_weights or local_model.non_trainable_weights:
    raise ValueError('FedRes models with non-trainable weights (e.g. batch '
                     'norm statistics) are not supported')
  return ([v.numpy() for v in global_model.trainable_variables],
          [v.numpy() for v in local_model.trainable_variables])


def initial_server_state(hparams: fedres_tf.Hyperparameters, global_weights):
  state = collections.OrderedDict(global_model_weights=ModelWeights(
      trainable=list(global_weights), non_trainable=[]))
  if hparams.uses_control:
    state['control'] = [tf.zeros_like(w) for w in global_weights]
  return state


def server_message(hparams: fedres_tf.Hyperparameters, state):
  """What the server broadcasts: w (and c)."""
  message = collections.OrderedDict(
      global_weights=state['global_model_weights'].trainable)
  if hparams.uses_control:
    message['control'] = state['control']
  return message


def uploaded(client_result):
  """The part of `fedres_tf.client_round`'s result a client sends."""
  return collections.OrderedDict(
      (key, value) for key, value in client_result.items() if key != 'state')


def server_update(hparams: fedres_tf.Hyperparameters, state, mean_delta,
                  control_delta_sum=None):
  new_state = collections.OrderedDict(global_model_weights=ModelWeights(
      trainable=fedres_tf.server_weights_update(
          state['global_model_weights'].trainable, mean_delta, hparams.server_step),
      non_trainable=[]))
  if hparams.uses_control:
    new_state['control'] = fedres_tf.server_control_update(
        state['control'], control_delta_sum, hparams.num_train_clients)
  return new_state


def _build(variant: str, task: base.Task,
           config: AlgorithmConfig) -> contract.FederatedAlgorithm:
  hparams = hyperparameters(variant, task, config)
  spec = task.residual_spec
  initial_global, initial_local = initial_weights(spec)

  def client_state_fn():
    return tf.nest.map_structure(
        np.asarray, fedres_tf.initial_client_state(
            hparams, initial_local, initial_global))

  @tff.tensorflow.computation
  def initial_state_computation():
    return initial_server_state(
        hparams, [tf.constant(w) for w in initial_global])

  server_state_type = initial_state_computation.type_signature.result
  client_state_type = _tensor_type(client_state_fn())
  data_type = task.client_dataset_computation.type_signature.result
  weights_type = server_state_type.global_model_weights.trainable

  @tff.tensorflow.computation(server_state_type)
  def message_computation(state):
    return server_message(hparams, state)

  @tff.tensorflow.computation(data_type, client_state_type,
                              message_computation.type_signature.result)
  def client_computation(dataset, client_state, message):
    result = fedres_tf.client_round(
        fedres_tf.ResidualModel(spec), hparams, dataset, client_state,
        message['global_weights'], message.get('control'))
    return collections.OrderedDict(
        upload=uploaded(result),
        client_output=collections.OrderedDict(state=result['state']))

  bytes_down = communication.type_bytes(
      message_computation.type_signature.result)
  bytes_up = communication.type_bytes(
      client_computation.type_signature.result.upload)

  if hparams.uses_control:

    @tff.tensorflow.computation(server_state_type, weights_type, weights_type)
    def server_computation(state, mean_delta, control_delta_sum):
      return server_update(hparams, state, mean_delta, control_delta_sum)
  else:

    @tff.tensorflow.computation(server_state_type, weights_type)
    def server_computation(state, mean_delta):
      return server_update(hparams, state, mean_delta)

  @tff.tensorflow.computation(np.float32, np.int64)
  def train_metrics(loss_sum, num_examples):
    return collections.OrderedDict(
        loss=loss_sum / tf.cast(tf.maximum(num_examples, 1), tf.float32),
        num_examples=num_examples)

  @tff.federated_computation
  def initialize_fn():
    return tff.federated_eval(initial_state_computation, tff.SERVER)

  client_inputs_type = tff.FederatedType(
      tff.StructType([('data', data_type), ('state', client_state_type)]),
      tff.CLIENTS)

  @tff.federated_computation(
      tff.FederatedType(server_state_type, tff.SERVER), client_inputs_type)
  def next_fn(server_state, client_inputs):
    message = tff.federated_broadcast(
        tff.federated_map(message_computation, server_state))
    outputs = tff.federated_map(
        client_computation, (client_inputs.data, client_inputs.state, message))
    upload = outputs.upload
    mean_delta = tff.federated_mean(upload.weights_delta)
    if hparams.uses_control:
      new_state = tff.federated_map(
          server_computation, (server_state, mean_delta,
                               tff.federated_sum(upload.control_delta)))
    else:
      new_state = tff.federated_map(server_computation,
                                    (server_state, mean_delta))
    metrics = tff.federated_map(
        train_metrics, (tff.federated_sum(upload.loss_sum),
                        tff.federated_sum(upload.num_examples)))
    return (new_state, outputs.client_output,
            tff.federated_zip(collections.OrderedDict(
                train=metrics,
                communication=communication.metrics_at_server(
                    bytes_down, bytes_up))))

  def get_model_weights(state) -> ModelWeights:
    return state['global_model_weights']

  def set_model_weights(state, weights: ModelWeights):
    new_state = collections.OrderedDict(state)
    new_state['global_model_weights'] = ModelWeights(
        trainable=list(weights.trainable),
        non_trainable=list(weights.non_trainable))
    return new_state

  def native_process_fn():
    # fedres_native builds on this module's server functions.
    from tff_algos import fedres_native  # pylint: disable=g-import-not-at-top
    return fedres_native.InProcessRounds(variant, task, config)

  return contract.FederatedAlgorithm(
      name=f'fedres_{variant}',
      process=tff.templates.IterativeProcess(initialize_fn, next_fn),
      get_model_weights=get_model_weights,
      set_model_weights=set_model_weights,
      client_state_fn=client_state_fn,
      flag_names=_FLAGS[variant],
      personalization=_personalization(task, config, initial_local),
      native_process_fn=native_process_fn)


def _local_weights_of(client_state) -> list[Any]:
  return client_state['local_model']


def _personalization(task: base.Task, config: AlgorithmConfig,
                     initial_local: list[np.ndarray]) -> contract.Personalization:
  evaluators = []  # Built on first use: Keras models for in-process eval.

  def evaluate(server_state, store):
    if task.personal_eval_data is None:
      return {}
    if not evaluators:
      evaluators.append(fedres_eval.PersonalizedEvaluator(
          task.residual_spec, task.personal_eval_data,
          config.local_learning_rate, config.fedres_fit_unseen))
    return evaluators[0](server_state['global_model_weights'].trainable, store,
                         _local_weights_of)

  def export(server_state, store, export_dir):
    fedres_export.export_personal_models(
        task, server_state['global_model_weights'].trainable, store,
        _local_weights_of, initial_local, export_dir)

  return contract.Personalization(evaluate=evaluate, export=export)
