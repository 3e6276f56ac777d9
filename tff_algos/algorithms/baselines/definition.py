"""FedAvg, FedProx and FedSGD as round definitions.

FedAvg and FedSGD compute exactly what `tff.learning.algorithms.
build_weighted_fed_avg` and `build_fed_sgd` compute (their client updates,
written here as steps, and their server step, `build_apply_optimizer_
finalizer`: the server optimizer takes the mean update as its gradient, and
a non-finite mean update is rejected). FedProx is FedAvg with the paper's
proximal gradient (tff.learning's FedProx has the opposite sign,
docs/references.md).

Server state: <global_model_weights, server_optimizer_state>.
"""

import collections
import dataclasses

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos.algorithms import keras_model
from tff_algos.algorithms import non_finite as non_finite_lib
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import settings as settings_lib

ModelWeights = tff.learning.models.ModelWeights


@dataclasses.dataclass(frozen=True)
class FedAvgSettings(settings_lib.ClientOptimizerSettings):
  # [FedAvg] Alg. 1 weights client k by n_k.
  client_weighting: str = settings_lib.client_weighting('num_examples')


@dataclasses.dataclass(frozen=True)
class FedProxSettings(FedAvgSettings):
  proximal_strength: float = settings_lib.setting(
      0.01, 'FedProx: mu, the strength of (mu/2)||w - w^t||^2.',
      bound=settings_lib.NON_NEGATIVE)


@dataclasses.dataclass(frozen=True)
class FedSgdSettings(settings_lib.ServerSettings):
  pass


def _weighting(name: str) -> tff.learning.ClientWeighting:
  return {'num_examples': tff.learning.ClientWeighting.NUM_EXAMPLES,
          'uniform': tff.learning.ClientWeighting.UNIFORM}[name]


def _definition(name: str, model_fn: keras_model.ModelFn, settings,
                client_work_fn) -> round_lib.RoundDefinition:
  """The definition the three share: they differ in the client work."""
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

  def server_update(state, aggregates, central):
    del central
    weights = state['global_model_weights']
    optimizer_state, trainable, measurements = non_finite_lib.apply_optimizer(
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
      client_work=client_work_fn(info), server_update=server_update,
      **keras_model.client_fields(model_fn, info))


def model_delta_work(client_optimizer: tff.learning.optimizers.Optimizer,
                     weighting: tff.learning.ClientWeighting,
                     info: keras_model.ModelInfo,
                     gradient_term=None) -> round_lib.ClientWork:
  """FedAvg's client update (tff.learning's `model_delta_client_work`).

  K_i steps of the client optimizer from x; the update is x - y (its
  negated delta, tff.learning's convention), zeroed with weight 0 if not
  finite. `gradient_term(trainable variables, initial trainable weights)`
  is added to every gradient (FedProx's proximal term).
  """
  specs = info.trainable_specs

  def start(model, message, client_state):
    del client_state
    keras_model.assign_weights(model, message['global_model_weights'])
    return collections.OrderedDict(
        num_examples=tf.constant(0, tf.int64),
        optimizer_state=client_optimizer.initialize(specs))

  def step(model, message, client_state, carry, batch):
    del client_state
    trainable = ModelWeights.from_model(model).trainable
    with tf.GradientTape() as tape:
      output = model.forward_pass(batch, training=True)
    gradients = tape.gradient(output.loss, trainable)
    if gradient_term is not None:
      gradients = tf.nest.map_structure(
          tf.add, gradients,
          gradient_term(trainable, message['global_model_weights'].trainable))
    optimizer_state, updated = client_optimizer.next(
        carry['optimizer_state'], tuple(tf.nest.flatten(trainable)),
        tuple(tf.nest.flatten(gradients)))
    tf.nest.map_structure(lambda v, t: v.assign(t), trainable,
                          tf.nest.pack_sequence_as(trainable, updated))
    return collections.OrderedDict(
        num_examples=carry['num_examples'] + keras_model.num_examples(output),
        optimizer_state=optimizer_state)

  def finish(model, message, client_state, carry):
    del client_state
    trainable = ModelWeights.from_model(model).trainable
    update, non_finite = non_finite_lib.zero_all_if_any_non_finite(
        tf.nest.map_structure(tf.subtract,
                              message['global_model_weights'].trainable,
                              trainable))
    weight = tf.cond(
        non_finite > 0, lambda: tf.constant(0.0),
        lambda: (tf.cast(carry['num_examples'], tf.float32)
                 if weighting == tff.learning.ClientWeighting.NUM_EXAMPLES
                 else tf.constant(1.0)))
    non_finite_lib.reset_metrics_if(non_finite, model)
    return round_lib.ClientResult(
        model_update=list(update), weight=weight, sums={},
        metrics=model.report_local_unfinalized_metrics())

  return round_lib.ClientWork(start=start, steps=(step,), finish=finish)


def fed_sgd_work(info: keras_model.ModelInfo) -> round_lib.ClientWork:
  """FedSGD's client update (tff.learning's): the example-weighted mean
  gradient at x over the client's batches, zeroed with weight 0 if not
  finite."""

  def start(model, message, client_state):
    del client_state
    keras_model.assign_weights(model, message['global_model_weights'])
    return collections.OrderedDict(
        gradient_sums=tuple(tf.zeros(s.shape, s.dtype)
                            for s in info.trainable_specs),
        num_examples=tf.constant(0.0))

  def step(model, message, client_state, carry, batch):
    del message, client_state
    trainable = ModelWeights.from_model(model).trainable
    with tf.GradientTape() as tape:
      output = model.forward_pass(batch)
    gradients = tape.gradient(
        output.loss, trainable,
        unconnected_gradients=tf.UnconnectedGradients.ZERO)
    num_examples = tf.cast(output.num_examples, tf.float32)
    return collections.OrderedDict(
        gradient_sums=tuple(s + num_examples * g for s, g in zip(
            carry['gradient_sums'], gradients)),
        num_examples=carry['num_examples'] + num_examples)

  def finish(model, message, client_state, carry):
    del message, client_state
    metrics = model.report_local_unfinalized_metrics()
    average = [s / carry['num_examples'] for s in carry['gradient_sums']]
    average, non_finite = non_finite_lib.zero_all_if_any_non_finite(average)
    weight = tf.cond(non_finite > 0, lambda: tf.constant(0.0),
                     lambda: carry['num_examples'])
    return round_lib.ClientResult(model_update=list(average), weight=weight,
                                  sums={}, metrics=metrics)

  return round_lib.ClientWork(start=start, steps=(step,), finish=finish)


def fedavg(model_fn: keras_model.ModelFn,
           settings: FedAvgSettings) -> round_lib.RoundDefinition:
  """FedAvg (McMahan et al. 2017), as tff.learning computes it."""
  client_optimizer = settings_lib.optimizer(settings.client_optimizer,
                                            settings.client_learning_rate)
  weighting = _weighting(settings.client_weighting)
  return _definition(
      'fedavg', model_fn, settings,
      lambda info: model_delta_work(client_optimizer, weighting, info))


def fedprox(model_fn: keras_model.ModelFn,
            settings: FedProxSettings) -> round_lib.RoundDefinition:
  """FedProx ([FedProx] Alg. 2): each client minimizes
  F_k(w) + (mu/2) ||w - w^t||^2, so every step's gradient gets
  mu * (w - w^t), pulling the client towards the server model w^t.
  (tff.learning's build_weighted_fed_prox adds mu * (w^t - w).)"""
  client_optimizer = settings_lib.optimizer(settings.client_optimizer,
                                            settings.client_learning_rate)
  weighting = _weighting(settings.client_weighting)
  mu = float(settings.proximal_strength)

  def proximal_gradient(trainable, server_trainable):
    return tf.nest.map_structure(lambda w, w_server: mu * (w - w_server),
                                 trainable, server_trainable)

  return _definition(
      'fedprox', model_fn, settings,
      lambda info: model_delta_work(client_optimizer, weighting, info,
                                    gradient_term=proximal_gradient))


def fedsgd(model_fn: keras_model.ModelFn,
           settings: FedSgdSettings) -> round_lib.RoundDefinition:
  """FedSGD: each client's example-weighted mean gradient at x."""
  return _definition('fedsgd', model_fn, settings, fed_sgd_work)
