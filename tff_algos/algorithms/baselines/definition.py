"""FedAvg, FedProx and FedSGD as round definitions.

FedAvg and FedSGD run tff.learning's own client updates (the functions
`tff.learning.algorithms.build_weighted_fed_avg` and `build_fed_sgd` map over
their clients) and tff.learning's server step (`build_apply_optimizer_
finalizer`: the server optimizer takes the mean update as its gradient and a
non-finite mean update is rejected). FedProx is FedAvg with the paper's
proximal gradient (`math.fedprox_client_update`; tff.learning's FedProx has
the opposite sign, docs/references.md).

Server state: <global_model_weights, server_optimizer_state>.
"""

import collections
import dataclasses

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos import tff_internals
from tff_algos.algorithms import keras_model
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import settings as settings_lib

ModelWeights = tff.learning.models.ModelWeights
# tff.learning's DATASET_REDUCE runs each step inside tf.data's reduce,
# about 3x slower than a while loop over an iterator (README, Benchmark);
# same steps, same results.
LOOP = tff.learning.LoopImplementation.DATASET_ITERATOR


@dataclasses.dataclass(frozen=True)
class FedAvgSettings:
  client_optimizer: str = settings_lib.client_optimizer()
  client_learning_rate: float = settings_lib.client_learning_rate()
  server_optimizer: str = settings_lib.server_optimizer()
  server_learning_rate: float = settings_lib.server_learning_rate()
  client_weighting: str = settings_lib.client_weighting()

  def __post_init__(self):
    settings_lib.check(self)


@dataclasses.dataclass(frozen=True)
class FedSgdSettings:
  server_optimizer: str = settings_lib.server_optimizer()
  server_learning_rate: float = settings_lib.server_learning_rate()

  def __post_init__(self):
    settings_lib.check(self)


def _weighting(name: str) -> tff.learning.ClientWeighting:
  return {'num_examples': tff.learning.ClientWeighting.NUM_EXAMPLES,
          'uniform': tff.learning.ClientWeighting.UNIFORM}[name]


@dataclasses.dataclass
class _Context:
  model: tff.learning.models.VariableModel
  update: object


def _definition(name, model_fn, settings, make_client_update,
                run_client_update) -> round_lib.RoundDefinition:
  """The definition shared by the three: they differ in the client update."""
  info = keras_model.model_info(model_fn)
  server_optimizer = settings_lib.optimizer(settings.server_optimizer,
                                            settings.server_learning_rate)

  def initial_server_state():
    return collections.OrderedDict(
        global_model_weights=keras_model.initial_weights(model_fn),
        server_optimizer_state=server_optimizer.initialize(
            info.trainable_specs))

  def broadcast(state, central):
    del central
    return collections.OrderedDict(
        global_model_weights=state['global_model_weights'])

  def client_context():
    model = model_fn()
    return _Context(model, make_client_update(model))

  def client_update(context, message, dataset, client_state):
    del client_state
    result, metrics = run_client_update(
        context.update, message['global_model_weights'], dataset)
    return round_lib.ClientResult(
        model_update=list(result.update), weight=result.update_weight,
        sums={}, metrics=metrics)

  def server_update(state, aggregates, central):
    del central
    weights = state['global_model_weights']
    optimizer_state, trainable, measurements = _apply_optimizer(
        server_optimizer, state['server_optimizer_state'],
        tuple(weights.trainable), tuple(aggregates['model_update']))
    new_state = collections.OrderedDict(
        global_model_weights=ModelWeights(list(trainable),
                                          list(weights.non_trainable)),
        server_optimizer_state=optimizer_state)
    return new_state, collections.OrderedDict(finalizer=measurements)

  return round_lib.RoundDefinition(
      name=name, settings=settings,
      initial_server_state=initial_server_state, broadcast=broadcast,
      client_context=client_context, client_update=client_update,
      reset_client=lambda context: context.model.reset_metrics(),
      server_update=server_update,
      finalize_metrics=lambda sums: keras_model.finalize_metrics(
          info.metric_finalizers, sums))


def _apply_optimizer(optimizer, optimizer_state, weights, update):
  """tff.learning's finalizer: a step with `update` as the gradient, unless
  it is not finite (then weights and state stay)."""
  new_state, new_weights = optimizer.next(optimizer_state, weights, update)
  reject, measurements = tff_internals.reject_non_finite_update(new_state,
                                                                update)
  kept_state, kept_weights = tf.cond(
      reject, lambda: (optimizer_state, weights),
      lambda: (new_state, new_weights))
  return kept_state, kept_weights, measurements


def fedavg(model_fn: keras_model.ModelFn,
           settings: FedAvgSettings) -> round_lib.RoundDefinition:
  """FedAvg (McMahan et al. 2017) with tff.learning's client update."""
  client_optimizer = settings_lib.optimizer(settings.client_optimizer,
                                            settings.client_learning_rate)
  weighting = _weighting(settings.client_weighting)
  return _definition(
      'fedavg', model_fn, settings,
      lambda model: tff_internals.build_model_delta_update(
          lambda: model, weighting=weighting, loop_implementation=LOOP),
      lambda update, weights, dataset: update(client_optimizer, weights,
                                              dataset))


def fedsgd(model_fn: keras_model.ModelFn,
           settings: FedSgdSettings) -> round_lib.RoundDefinition:
  """FedSGD: each client's example-weighted mean gradient at x."""
  return _definition(
      'fedsgd', model_fn, settings,
      lambda model: tff_internals.build_fed_sgd_client_update(model, LOOP),
      lambda update, weights, dataset: update(weights, dataset))
