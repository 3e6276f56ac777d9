"""TF math of mixed FL ([MixedFL] Algorithms 1-2 and Appendix A).

Plain TensorFlow over a `tff.learning.models.VariableModel`, lists of weight
tensors, `tff.learning.optimizers` and datasets; `definition` declares the
round the runtimes run.

Conventions, as in the paper:
- a delta is `new - old` (client Delta_i = x_i - x, central Delta_c = x_c - x);
  an optimizer applies a delta as the pseudo-gradient `-Delta`;
- gradients are of the weighted losses of the mixed objective
  f = w_f * f_f + w_c * f_c: a client step uses `w_f * grad f_i` and a central
  step `w_c * grad f_c`, each plus the round's augmenting gradient (if any);
- K_i and the central step count are the steps actually taken (a client with
  little data may take fewer than K).
"""

import collections
import dataclasses
from typing import Any, Callable, Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos.algorithms import non_finite
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import sgd_step

ModelWeights = tff.learning.models.ModelWeights
Weights = list  # Trainable weights: a list of tensors, in model order.
# A data-free centralized loss: trainable variables of the model -> scalar.
CentralLossFn = Callable[[ModelWeights], tf.Tensor]


def add(a, b):
  return tf.nest.map_structure(tf.add, a, b)


def subtract(a, b):
  return tf.nest.map_structure(tf.subtract, a, b)


def scale(factor, a):
  return tf.nest.map_structure(lambda t: factor * t, a)


def zeros_like(a):
  return tf.nest.map_structure(tf.zeros_like, a)


def squared_norm(a) -> tf.Tensor:
  return tf.add_n([tf.reduce_sum(tf.square(t)) for t in tf.nest.flatten(a)])


def _assign(variables, values) -> None:
  tf.nest.map_structure(lambda v, t: v.assign(t), variables, values)


def _weighted_gradient(tape: tf.GradientTape, loss: tf.Tensor,
                       variables: list[tf.Variable]) -> tuple:
  """d loss / d variables; variables the loss does not touch get zeros.

  Dense: an embedding's gradient comes as tf.IndexedSlices, but gradients are
  added to augmenting gradients, kept across steps and returned as state.
  """
  gradients = tape.gradient(loss, variables)
  return tuple(
      tf.zeros_like(v) if g is None else
      # A dense IndexedSlices has an unknown first dimension.
      tf.ensure_shape(tf.convert_to_tensor(g), v.shape)
      for g, v in zip(gradients, variables))


def _optimizer_step(optimizer: tff.learning.optimizers.Optimizer, state,
                    variables: list[tf.Variable], gradient: Weights):
  state, updated = optimizer.next(state, tuple(variables), tuple(gradient))
  _assign(variables, list(updated))
  return state


def _fresh_optimizer_state(optimizer: tff.learning.optimizers.Optimizer,
                           variables: list[tf.Variable]):
  return _fresh_optimizer_state_for_specs(
      optimizer, tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables))


def _fresh_optimizer_state_for_specs(
    optimizer: tff.learning.optimizers.Optimizer, specs):
  return optimizer.initialize(tuple(specs))


# ---------------------------------------------------------------------------
# Centralized losses: one on server batches, or one without data.


class DataCentralLoss:
  """f_c is the model's loss on batches of centralized data."""

  def elements(self, central_batches: tf.data.Dataset) -> tf.data.Dataset:
    return central_batches

  def loss(self, model: tff.learning.models.VariableModel, batch):
    return model.forward_pass(batch, training=True).loss


class DataFreeCentralLoss:
  """f_c is a function of the model weights alone (e.g. a regularizer).

  Each central step evaluates it once; `elements` only counts the steps.
  """

  def __init__(self, loss_fn: CentralLossFn):
    self._loss_fn = loss_fn

  def elements(self, num_steps: int) -> tf.data.Dataset:
    return tf.data.Dataset.range(num_steps)

  def loss(self, model: tff.learning.models.VariableModel, element):
    del element
    return self._loss_fn(ModelWeights.from_model(model))


# ---------------------------------------------------------------------------
# Client and central work.


@tf.function
def central_update(model: tff.learning.models.VariableModel,
                   optimizer: tff.learning.optimizers.Optimizer,
                   initial_weights: ModelWeights,
                   elements: tf.data.Dataset,
                   central_loss: Any,
                   augmenting_gradient: Optional[Weights],
                   loss_weight: float,
                   measure_first_gradient: bool = False):
  """Central model of Algorithm 1: from x, one CentralOpt step on
  g_c + gtilde_f per element of `elements` (a central batch, or a step index
  for a data-free loss).

  Returns an OrderedDict with `delta` (x_c - x; 0 if not finite),
  `num_steps` (0 then), the mean unweighted central `loss`, and with `measure_first_gradient` (diagnostics)
  `first_gradient` = g_c(x) on the first batch.
  """
  model_weights = ModelWeights.from_model(model)
  _assign(model_weights, initial_weights)
  variables = list(model_weights.trainable)
  optimizer_state = _fresh_optimizer_state(optimizer, variables)
  num_steps = tf.constant(0, tf.int32)
  loss_sum = tf.constant(0.0, tf.float32)
  # Tuples, not lists: a loop would stack a list into one tensor.
  first_gradient = (tuple(tf.zeros_like(v) for v in variables)
                    if measure_first_gradient else ())
  for element in iter(elements):
    with tf.GradientTape() as tape:
      loss = tf.cast(central_loss.loss(model, element), tf.float32)
      weighted_loss = loss_weight * loss
    gradient = _weighted_gradient(tape, weighted_loss, variables)
    if measure_first_gradient:
      first_gradient = tf.cond(tf.equal(num_steps, 0), lambda g=gradient: g,
                               lambda f=first_gradient: f)
    if augmenting_gradient is not None:
      gradient = tuple(g + a for g, a in zip(gradient, augmenting_gradient))
    optimizer_state = _optimizer_step(optimizer, optimizer_state, variables,
                                      gradient)
    num_steps += 1
    loss_sum += loss
  steps = tf.cast(num_steps, tf.float32)
  # A central model that diverged (the server's data or its learning rate)
  # is dropped for the round as a diverged client is: Delta_c = 0 and no
  # steps counted, so gtilde_c stays; the loss it reached is still reported.
  delta, dropped = non_finite.zero_all_if_any_non_finite(
      subtract([v.read_value() for v in variables],
               list(initial_weights.trainable)))
  result = collections.OrderedDict(
      delta=delta,
      num_steps=tf.where(tf.equal(dropped, 0), steps, 0.0),
      loss=tf.math.divide_no_nan(loss_sum, steps))
  if measure_first_gradient:
    result['first_gradient'] = list(first_gradient)
  return result


@tf.function
def central_gradient(model: tff.learning.models.VariableModel,
                     initial_weights: ModelWeights,
                     elements: tf.data.Dataset,
                     central_loss: Any,
                     loss_weight: float):
  """g_c = w_c * grad f_c(x; B_c) on the first element (1-w GT).

  Returns an OrderedDict with `gradient`, `num_steps` (1, or 0 when there is
  no central data or the gradient is not finite: it is then 0) and the
  unweighted `loss`.
  """
  model_weights = ModelWeights.from_model(model)
  _assign(model_weights, initial_weights)
  variables = list(model_weights.trainable)
  gradient = tuple(tf.zeros_like(v) for v in variables)
  loss = tf.constant(0.0, tf.float32)
  num_steps = tf.constant(0.0, tf.float32)
  for element in elements.take(1):
    with tf.GradientTape() as tape:
      loss = tf.cast(central_loss.loss(model, element), tf.float32)
      weighted_loss = loss_weight * loss
    gradient = _weighted_gradient(tape, weighted_loss, variables)
    num_steps = tf.constant(1.0, tf.float32)
  # A gradient that is not finite is not sent (as `central_update` drops a
  # central model that diverged): clients take plain steps this round.
  gradient, dropped = non_finite.zero_all_if_any_non_finite(gradient)
  return collections.OrderedDict(
      gradient=list(gradient),
      num_steps=tf.where(tf.equal(dropped, 0), num_steps, 0.0), loss=loss)


# ---------------------------------------------------------------------------
# Server side.


def apply_delta(optimizer: tff.learning.optimizers.Optimizer, state,
                weights: Weights, delta: Weights):
  """(state, optimizer(weights, -delta)): ServerOpt / MergeOpt."""
  state, updated = optimizer.next(state, tuple(weights),
                                  tuple(scale(-1.0, delta)))
  return state, list(updated)


def mean_client_delta(delta_mean: Weights, total_weight: tf.Tensor) -> Weights:
  """The weighted mean of client deltas; zero if no client processed data."""
  return tf.cond(total_weight > 0, lambda: delta_mean,
                 lambda: zeros_like(delta_mean))


def updated_gtilde_c(central_delta: Weights, central_learning_rate: float,
                     central_steps: tf.Tensor, gtilde_f: Weights,
                     gtilde_c: Weights) -> Weights:
  """gtilde_c <- -Delta_c / (eta_c * K) - gtilde_f  (Algorithm 1).

  The mean total central gradient minus its augmenting part: the mean central
  gradient of the round. Unchanged if no central step was taken.
  """
  return tf.cond(
      central_steps > 0,
      lambda: subtract(
          scale(-1.0 / (central_learning_rate * central_steps), central_delta),
          gtilde_f),
      lambda: gtilde_c)


def updated_gtilde_f(client_delta_sum: Weights, client_learning_rate: float,
                     client_steps_sum: tf.Tensor, gtilde_c: Weights,
                     gtilde_f: Weights) -> Weights:
  """gtilde_f <- -sum_i Delta_i / (eta * sum_i K_i) - gtilde_c  (eq. 10).

  Derived from the deltas clients upload anyway (Appendix A.2; exact for SGD
  as ClientOpt). `gtilde_c` is the one the clients used this round. Unchanged
  if no client took a step.
  """
  return tf.cond(
      client_steps_sum > 0,
      lambda: subtract(
          scale(-1.0 / (client_learning_rate * client_steps_sum),
                client_delta_sum), gtilde_c),
      lambda: gtilde_f)


def mixing_diagnostics(federated_gradient: Weights, central_gradient: Weights,
                       federated_weight: float,
                       central_weight: float) -> collections.OrderedDict:
  """Sampled (G, B)-BGD approximations Gtilde_t^2, Btilde_t^2 (eq. 7).

  `federated_gradient` is the cohort mean of the clients' (w_f-weighted)
  gradients at x(t), `central_gradient` the (w_c-weighted) central gradient
  at x(t); their sum approximates grad f.
  """
  weighted = (squared_norm(federated_gradient) / federated_weight +
              squared_norm(central_gradient) / central_weight)
  total = squared_norm(add(federated_gradient, central_gradient))
  return collections.OrderedDict(
      gtilde_squared=weighted - total,
      btilde_squared=tf.math.divide_no_nan(weighted, total))


# ---------------------------------------------------------------------------
# One round's pieces, as the round definition uses them.


@dataclasses.dataclass(frozen=True)
class RoundSettings:
  """What distinguishes PT, 1-w GT and 2-w GT, and their hyperparameters."""
  has_central_model: bool  # PT, 2-w GT.
  transfers_gradients: bool  # 1-w GT, 2-w GT.
  keeps_augmenting_gradients: bool  # 2-w GT.
  data_free: bool  # The central loss needs no server data.
  central_steps: Optional[int]
  federated_weight: float
  central_weight: float
  client_learning_rate: float
  central_learning_rate: float
  diagnostics: bool
  # ClientOpt is plain SGD: a gradient-transfer step is then taken in place
  # (`sgd_step.augmented_sgd_step`), two passes over the weights where the
  # sum, the optimizer's step and the assignment make four.
  client_plain_sgd: bool = False


def central_work(settings: RoundSettings,
                 model: tff.learning.models.VariableModel,
                 optimizer: Optional[tff.learning.optimizers.Optimizer],
                 central_loss: Any, model_weights: ModelWeights,
                 gtilde_f: Optional[Weights],
                 central_batches: Optional[tf.data.Dataset]):
  """The round's central work at x: K CentralOpt steps (PT, 2-w GT, from
  `central_update`) or one central gradient (1-w GT, `central_gradient`)."""
  if settings.data_free:
    elements = central_loss.elements(
        settings.central_steps if settings.has_central_model else 1)
  elif settings.has_central_model:
    elements = central_batches.take(settings.central_steps)
  else:
    elements = central_batches
  if not settings.has_central_model:
    return central_gradient(model, model_weights, elements, central_loss,
                            settings.central_weight)
  return central_update(model, optimizer, model_weights, elements,
                        central_loss,
                        gtilde_f if settings.keeps_augmenting_gradients
                        else None, settings.central_weight,
                        measure_first_gradient=settings.diagnostics)


def client_work(settings: RoundSettings,
                optimizer: tff.learning.optimizers.Optimizer,
                trainable_specs) -> round_lib.ClientWork:
  """ClientUpdate of Algorithm 1 as steps: K_i ClientOpt steps on
  w_f * g_i + gtilde (gtilde: the broadcast augmenting gradient of 1-w and
  2-w GT).

  The result sends Delta_i = x_i - x (weighted by the examples processed,
  p_i) and the model's metrics; 2-w GT also sums K_i (eq. 10; its Delta_i
  sum comes from the same uploads). A client whose Delta_i is not finite is
  dropped (weight 0, K_i not counted, no metrics). With diagnostics it
  measures g_i(x) on the first batch and whether it has one (a
  simulation-only measurement, not uploaded).
  """
  specs = tuple(trainable_specs)

  def start(model, message, client_state):
    del client_state
    _assign(ModelWeights.from_model(model), message['global_model_weights'])
    return collections.OrderedDict(
        optimizer_state=_fresh_optimizer_state_for_specs(optimizer, specs),
        num_steps=tf.constant(0, tf.int32),
        num_examples=tf.constant(0, tf.int64),
        # Tuples, not lists: a loop would stack a list into one tensor. Only
        # diagnostics measure it: otherwise no model-sized zeros per client.
        first_gradient=(tuple(tf.zeros(s.shape, s.dtype) for s in specs)
                        if settings.diagnostics else ()))

  def step(model, message, client_state, carry, batch):
    del client_state
    variables = list(ModelWeights.from_model(model).trainable)
    with tf.GradientTape() as tape:
      output = model.forward_pass(batch, training=True)
      loss = settings.federated_weight * output.loss
    gradient = _weighted_gradient(tape, loss, variables)
    first_gradient = carry['first_gradient']
    if settings.diagnostics:
      first_gradient = tf.cond(tf.equal(carry['num_steps'], 0),
                               lambda g=gradient: g,
                               lambda f=first_gradient: f)
    optimizer_state = carry['optimizer_state']
    if settings.transfers_gradients and settings.client_plain_sgd:
      sgd_step.augmented_sgd_step(variables, gradient,
                                  settings.client_learning_rate,
                                  message['augmenting_gradient'])
    else:
      if settings.transfers_gradients:
        gradient = tuple(g + a for g, a in zip(
            gradient, message['augmenting_gradient']))
      optimizer_state = _optimizer_step(optimizer, optimizer_state,
                                        variables, gradient)
    return collections.OrderedDict(
        optimizer_state=optimizer_state,
        num_steps=carry['num_steps'] + 1,
        num_examples=carry['num_examples'] + tf.cast(output.num_examples,
                                                     tf.int64),
        first_gradient=first_gradient)

  def finish(model, message, client_state, carry):
    del client_state
    variables = list(ModelWeights.from_model(model).trainable)
    # A client whose Delta_i is not finite (it diverged) is dropped as
    # FedAvg drops it (`non_finite`): Delta_i zeroed, weight 0, no steps
    # counted for gtilde_f, no metrics.
    model_update, dropped = non_finite.zero_all_if_any_non_finite(
        subtract([v.read_value() for v in variables],
                 list(message['global_model_weights'].trainable)))
    kept = tf.equal(dropped, 0)
    sums = collections.OrderedDict()
    if settings.keeps_augmenting_gradients:
      sums['num_steps'] = tf.where(
          kept, tf.cast(carry['num_steps'], tf.float32), 0.0)
    measurements = collections.OrderedDict()
    if settings.diagnostics:
      # eq. 7 averages g_i(x) over the clients that have one: a client
      # without data (or whose g_i(x) is not finite) is not counted.
      first_gradient, unusable = non_finite.zero_all_if_any_non_finite(
          list(carry['first_gradient']))
      measured = tf.logical_and(carry['num_steps'] > 0,
                                tf.equal(unusable, 0))
      measurements['first_gradient'] = list(first_gradient)
      measurements['first_gradient_count'] = tf.where(measured, 1.0, 0.0)
    non_finite.reset_metrics_if(dropped, model)
    return round_lib.ClientResult(
        model_update=model_update,
        weight=tf.where(kept, tf.cast(carry['num_examples'], tf.float32),
                        0.0),
        sums=sums, measurements=measurements,
        metrics=model.report_local_unfinalized_metrics())

  return round_lib.ClientWork(start=start, steps=(step,), finish=finish)


def server_update(settings: RoundSettings,
                  server_optimizer: tff.learning.optimizers.Optimizer,
                  merge_optimizer: Optional[tff.learning.optimizers.Optimizer],
                  state, central, client_delta_mean: Weights,
                  client_weight_sum, client_delta_sum: Optional[Weights] = None,
                  client_steps_sum=None):
  """The server's step: x_f = ServerOpt(x, -Delta); PT and 2-w GT merge
  x <- MergeOpt(x, -(Delta_c + Delta_f)); 2-w GT updates gtilde_c, gtilde_f.

  `state` is the server state (see `definition`); the result has its keys
  in its order.
  """
  x = list(state['global_model_weights'].trainable)
  delta = mean_client_delta(list(client_delta_mean), client_weight_sum)
  new_state = collections.OrderedDict()
  optimizer_state, x_f = apply_delta(server_optimizer,
                                     state['server_optimizer'], x, delta)
  # A round without client data keeps x_f = x and ServerOpt's state, as
  # FedAvg's finalizer does (its mean is 0/0, not finite, so rejected): a
  # step on a zero delta still moves a momentum or adaptive optimizer.
  optimizer_state, x_f = tf.cond(
      client_weight_sum > 0, lambda: (optimizer_state, x_f),
      lambda: (state['server_optimizer'], x))
  new_state['server_optimizer'] = optimizer_state
  if settings.has_central_model:
    delta_f = subtract(x_f, x)
    merged = add(list(central['delta']), delta_f)
    merge_state, new_x = apply_delta(merge_optimizer,
                                     state['merge_optimizer'], x, merged)
    new_state['merge_optimizer'] = merge_state
  else:
    new_x = x_f
  if settings.keeps_augmenting_gradients:
    gtilde_c = list(state['gtilde_c'])
    gtilde_f = list(state['gtilde_f'])
    new_state['gtilde_c'] = updated_gtilde_c(
        list(central['delta']), settings.central_learning_rate,
        central['num_steps'], gtilde_f, gtilde_c)
    new_state['gtilde_f'] = updated_gtilde_f(
        list(client_delta_sum), settings.client_learning_rate,
        client_steps_sum, gtilde_c, gtilde_f)
  new_state['global_model_weights'] = ModelWeights(
      new_x, list(state['global_model_weights'].non_trainable))
  return collections.OrderedDict((key, new_state[key]) for key in state)


def initial_server_state(settings: RoundSettings,
                         model: tff.learning.models.VariableModel,
                         server_optimizer: tff.learning.optimizers.Optimizer,
                         merge_optimizer: Optional[
                             tff.learning.optimizers.Optimizer]):
  """<global_model_weights=x, server_optimizer[, merge_optimizer][, gtilde_c,
  gtilde_f]> (augmenting gradients start at 0)."""
  weights = ModelWeights.from_model(model)
  weights = tf.nest.map_structure(lambda v: v.read_value(), weights)
  trainable_specs = tuple(tf.TensorSpec(w.shape, w.dtype)
                          for w in weights.trainable)
  state = collections.OrderedDict(
      global_model_weights=ModelWeights(list(weights.trainable),
                                        list(weights.non_trainable)),
      server_optimizer=server_optimizer.initialize(trainable_specs))
  if settings.has_central_model:
    state['merge_optimizer'] = merge_optimizer.initialize(trainable_specs)
  if settings.keeps_augmenting_gradients:
    state['gtilde_c'] = zeros_like(list(weights.trainable))
    state['gtilde_f'] = zeros_like(list(weights.trainable))
  return state
