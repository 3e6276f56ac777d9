"""FedAvg and FedSGD from `tff.learning.algorithms`, unchanged, and FedProx
on tff.learning's FedAvg templates with the paper's proximal term
(`tff_algos.fedprox`: TFF's own FedProx builder has the term's sign
reversed), adapted to the common process contract (tff_algos.contract)."""

import collections
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tff_algos import baselines_native
from tff_algos import communication
from tff_algos import contract
from tff_algos import fedprox
from tff_algos import optimizers
from tff_algos.config import AlgorithmConfig
from tff_algos.config import CLIENT_WEIGHTINGS


def communication_bytes(state_type: tff.Type,
                         model_fn: Callable) -> tuple[int, int]:
  """(down, up) bytes per client of a tff.learning model-delta process.

  Down: the global model weights, plus the client work's state, which
  tff.learning broadcasts (the client optimizer's hyperparameters for FedAvg
  and FedProx; empty for FedSGD). Up: the model update (trainable weights),
  its float32 weight and the model's unfinalized metric sums.
  """
  weights_type = state_type.member.global_model_weights
  down = (communication.type_bytes(weights_type) +
          communication.type_bytes(state_type.member.client_work))
  with tf.Graph().as_default():
    model = model_fn()
    metrics_type = tff.types.tensorflow_to_type(tf.nest.map_structure(
        tf.TensorSpec.from_tensor, model.report_local_unfinalized_metrics()))
  up = (communication.type_bytes(weights_type.trainable) + 4 +
        communication.type_bytes(metrics_type))
  return down, up


def get_model_weights(state) -> tff.learning.models.ModelWeights:
  # In Python rather than the LearningProcess's TFF computation, so the
  # native runtime never starts TFF's executor.
  return state.global_model_weights


def set_model_weights(state, weights: tff.learning.models.ModelWeights):
  return state._replace(global_model_weights=tff.learning.models.ModelWeights(
      trainable=[np.asarray(w) for w in weights.trainable],
      non_trainable=[np.asarray(w) for w in weights.non_trainable]))


def adapt_learning_process(name: str,
                           learning_process: tff.learning.templates.LearningProcess,
                           flag_names: tuple[str, ...],
                           model_fn: Callable,
                           config: Optional[AlgorithmConfig] = None
                           ) -> contract.FederatedAlgorithm:
  """Wraps a LearningProcess: no client state, `train/*` and
  `communication/*` metrics. With `config` (and `name` one of
  `baselines_native.KINDS`) it also has the native runtime's process."""
  state_type = learning_process.initialize.type_signature.result
  data_type = learning_process.next.type_signature.parameter[1]
  bytes_down, bytes_up = communication_bytes(state_type, model_fn)

  @tff.tensorflow.computation(data_type.member)
  def no_client_state(dataset):
    del dataset
    return collections.OrderedDict()

  @tff.federated_computation(state_type, data_type)
  def next_fn(server_state, client_data):
    output = learning_process.next(server_state, client_data)
    metrics = tff.federated_zip(collections.OrderedDict(
        train=output.metrics.client_work.train,
        communication=communication.metrics_at_server(bytes_down, bytes_up)))
    return (output.state, tff.federated_map(no_client_state, client_data),
            metrics)

  native_process_fn = None
  if config is not None:

    def native_process_fn():
      optimizers_by_role = _client_and_server_optimizers(config)
      return baselines_native.LearningProcessRounds(
          name, model_fn, optimizers_by_role['client_optimizer_fn'],
          optimizers_by_role['server_optimizer_fn'],
          optimizers_by_role['client_weighting'], config.proximal_strength,
          communication.metrics(bytes_down, bytes_up))

  return contract.FederatedAlgorithm(
      name=name,
      process=tff.templates.IterativeProcess(learning_process.initialize,
                                             next_fn),
      get_model_weights=get_model_weights,
      set_model_weights=set_model_weights,
      flag_names=flag_names,
      native_process_fn=native_process_fn)


_CLIENT_FLAGS = ('client_optimizer', 'client_learning_rate',
                 'client_weighting')
_SERVER_FLAGS = ('server_optimizer', 'server_learning_rate')


def client_weighting(name: str) -> tff.learning.ClientWeighting:
  if name not in CLIENT_WEIGHTINGS:
    raise UsageError(f'--client_weighting={name!r} is unknown; allowed: '
                     f'{", ".join(CLIENT_WEIGHTINGS)}')
  return {'num_examples': tff.learning.ClientWeighting.NUM_EXAMPLES,
          'uniform': tff.learning.ClientWeighting.UNIFORM}[name]


def _client_and_server_optimizers(config: AlgorithmConfig) -> dict:
  return dict(
      client_weighting=client_weighting(config.client_weighting),
      client_optimizer_fn=optimizers.build(
          config.client_optimizer, config.client_learning_rate,
          'client_optimizer'),
      server_optimizer_fn=optimizers.build(
          config.server_optimizer, config.server_learning_rate,
          'server_optimizer'))


def build_fedavg(model_fn: Callable, config: AlgorithmConfig):
  process = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, loop_implementation=baselines_native.LOOP,
      **_client_and_server_optimizers(config))
  return adapt_learning_process('fedavg', process, _CLIENT_FLAGS + _SERVER_FLAGS,
                                model_fn, config)


def build_fedprox(model_fn: Callable, config: AlgorithmConfig):
  process = fedprox.build_weighted_fed_prox(
      model_fn, proximal_strength=config.proximal_strength,
      loop_implementation=baselines_native.LOOP,
      **_client_and_server_optimizers(config))
  return adapt_learning_process(
      'fedprox', process,
      _CLIENT_FLAGS + _SERVER_FLAGS + ('proximal_strength',), model_fn,
      config)


def build_fedsgd(model_fn: Callable, config: AlgorithmConfig):
  process = tff.learning.algorithms.build_fed_sgd(
      model_fn, loop_implementation=baselines_native.LOOP,
      server_optimizer_fn=optimizers.build(
          config.server_optimizer, config.server_learning_rate,
          'server_optimizer'))
  return adapt_learning_process('fedsgd', process, _SERVER_FLAGS, model_fn,
                                config)
