"""SCAFFOLD / FedPVR update logic in plain TensorFlow ([SCAFFOLD] Alg. 1, [FedPVR] Alg. I).

One implementation serves both algorithms: a mask over the model's trainable
variables picks those that get control variates. Masked variables take
SCAFFOLD's corrected step y <- y - eta * (g - c_i + c) and SCAFFOLD's c_i update;
the others take the client optimizer's step on the plain gradient (FedAvg).
Mask empty = FedAvg, mask everything = SCAFFOLD. Control variates exist only
for masked variables, so client and server state, and communication, grow by v
(the masked size) rather than d.

Nothing here knows about TFF placements: `scaffold_tff` wraps these functions.
"""

import collections
from typing import Any, Optional, Sequence

import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.learning import loop_builder

from pipeline.errors import UsageError

# tff.learning's loops over a dataset. DATASET_ITERATOR (a while loop over an
# iterator) runs local steps about 3x faster than DATASET_REDUCE (inside
# tf.data's reduce; README, Benchmark), but Option I passes over a client's
# dataset twice in one computation, and there only DATASET_REDUCE gives both
# runtimes the same second pass (tests/test_native_runtime.py).
_ITERATOR_LOOP = loop_builder.build_training_loop(
    tff.learning.LoopImplementation.DATASET_ITERATOR)
_REDUCE_LOOP = loop_builder.build_training_loop(
    tff.learning.LoopImplementation.DATASET_REDUCE)

ModelWeights = tff.learning.models.ModelWeights

# Control-variate options of SCAFFOLD ([SCAFFOLD] Alg. 1 line 12).
OPTION_GRADIENT_AT_SERVER_MODEL = 1  # c_i+ = g_i(x), one extra pass.
OPTION_FROM_LOCAL_STEPS = 2  # c_i+ = c_i - c + (x - y) / (K_i * eta).
OPTIONS = (OPTION_GRADIENT_AT_SERVER_MODEL, OPTION_FROM_LOCAL_STEPS)


# ----------------------------------------------------------------------------
# Which variables get control variates.


def variable_layers(variable_names: Sequence[str]) -> tuple[int, ...]:
  """Index of the Keras layer owning each variable, in order of appearance.

  A layer is the innermost Keras layer that owns the variable, read from the
  variable's name scope (`dense_1/kernel:0` -> `dense_1`; nested layers such
  as `block/conv/kernel:0` -> `block/conv`). Keras lists a layer's variables
  together, so equal scopes are consecutive; a variable without a scope is a
  layer of its own.
  """
  layers = []
  previous_scope = None
  for name in variable_names:
    scope = name.rsplit('/', 1)[0] if '/' in name else None
    same_layer = layers and scope is not None and scope == previous_scope
    layers.append(layers[-1] if same_layer else len(set(layers)))
    previous_scope = scope
  return tuple(layers)


def control_variate_mask(variable_names: Sequence[str],
                         last_layers: Optional[int] = None,
                         start_variable: Optional[int] = None
                         ) -> tuple[bool, ...]:
  """Which trainable variables get control variates (FedPVR's p).

  Exactly one of:
    last_layers: the variables of the last L layers that have trainable
      variables (`--pvr_last_layers`); 0 masks nothing, L >= the number of
      such layers masks everything.
    start_variable: variables with index >= j in the trainable-variable list
      (`--pvr_start_variable`; the paper's "SVR: j -> end").
  """
  if (last_layers is None) == (start_variable is None):
    raise ValueError('pass exactly one of last_layers and start_variable')
  num_variables = len(variable_names)
  if start_variable is not None:
    if not 0 <= start_variable <= num_variables:
      raise UsageError(
          f'--pvr_start_variable={start_variable} is out of range: the model '
          f'has {num_variables} trainable variables (allowed: 0..'
          f'{num_variables})')
    return tuple(i >= start_variable for i in range(num_variables))
  if last_layers < 0:
    raise UsageError(f'--pvr_last_layers must be >= 0, got {last_layers}')
  layers = variable_layers(variable_names)
  num_layers = (layers[-1] + 1) if layers else 0
  first_masked_layer = num_layers - min(last_layers, num_layers)
  return tuple(layer >= first_masked_layer for layer in layers)


def split_masked(values: Sequence[Any], mask: Sequence[bool]):
  """(masked values, unmasked values), each in variable order."""
  values = list(values)
  return ([v for v, m in zip(values, mask, strict=True) if m],
          [v for v, m in zip(values, mask, strict=True) if not m])


def masked_specs(specs: Sequence[tf.TensorSpec], mask: Sequence[bool]):
  return split_masked(specs, mask)[0]


def zeros_like_specs(specs: Sequence[tf.TensorSpec]) -> list[tf.Tensor]:
  return [tf.zeros(s.shape, s.dtype) for s in specs]


# ----------------------------------------------------------------------------
# Client update.


def build_client_update(model: tff.learning.models.VariableModel,
                        client_optimizer: tff.learning.optimizers.Optimizer,
                        learning_rate: float,
                        mask: Sequence[bool],
                        option: int,
                        uniform_weighting: bool,
                        layer_of_variable: Optional[Sequence[int]] = None):
  """Returns `client_update(initial_weights, server_cv, client_cv, dataset)`.

  Local training of one client for one round: starting from the server model
  x, one step per batch; masked variables y <- y - eta * (g - c_i + c) with
  plain SGD (so Option II's closed form holds exactly), unmasked variables take
  `client_optimizer`'s step on g (freshly initialized each round, as in
  tff.learning's FedAvg). With Option I, a pass over the same dataset at x
  first computes c_i+ = g_i(x) (example-weighted mean gradient).

  The result (an OrderedDict):
    model_delta: y - x of every trainable variable.
    control_variate_delta: c_i+ - c_i (masked variables).
    client_state: OrderedDict(control_variate=c_i+).
    weight: examples processed (0 if none) or 1.0 under uniform weighting.
    local_steps: K_i, the batches processed.
    metrics: the model's unfinalized training metrics (local steps only).
    layer_sq_norms: ||y - x||^2 per layer (only with `layer_of_variable`).

  A client without data leaves y = x and c_i unchanged.
  """
  mask = tuple(mask)
  option = int(option)
  if option not in OPTIONS:
    raise UsageError(f'--scaffold_option={option} is unknown; allowed: 1, 2')
  learning_rate = float(learning_rate)
  has_unmasked = not all(mask)
  training_loop = (_REDUCE_LOOP if option == OPTION_GRADIENT_AT_SERVER_MODEL
                   else _ITERATOR_LOOP)

  def sum_of_gradients_at_model(dataset, variables):
    """Sum over batches of batch_size * grad(mean batch loss), and n."""

    def add_batch(state, batch):
      gradient_sums, num_examples = state
      with tf.GradientTape() as tape:
        output = model.forward_pass(batch, training=True)
      batch_size = tf.cast(output.num_examples, tf.float32)
      gradients = tape.gradient(output.loss, variables)
      return (tuple(s + batch_size * g
                    for s, g in zip(gradient_sums, gradients)),
              num_examples + batch_size)

    # Tuples, not lists: the loop would stack a list into one tensor.
    return training_loop(add_batch, dataset, lambda: (
        tuple(tf.zeros_like(v) for v in variables), tf.constant(0.0)))

  @tf.function
  def client_update(initial_weights, server_cv, client_cv, dataset):
    weights = ModelWeights.from_model(model)
    tf.nest.map_structure(lambda v, t: v.assign(t), weights, initial_weights)
    trainable = list(weights.trainable)
    masked_vars, unmasked_vars = split_masked(trainable, mask)
    corrections = [c - ci for c, ci in zip(server_cv, client_cv)]

    if option == OPTION_GRADIENT_AT_SERVER_MODEL:
      gradient_sums, total = sum_of_gradients_at_model(dataset, masked_vars)
      gradient_at_x = [s / tf.maximum(total, 1.0) for s in gradient_sums]
      # The extra pass must not count towards the training metrics.
      model.reset_metrics()

    def train_on_batch(state, batch):
      num_steps, num_examples, optimizer_state = state
      with tf.GradientTape() as tape:
        output = model.forward_pass(batch, training=True)
      gradients = tape.gradient(output.loss, trainable)
      masked_grads, unmasked_grads = split_masked(gradients, mask)
      for variable, gradient, correction in zip(masked_vars, masked_grads,
                                                corrections):
        variable.assign_sub(learning_rate * (gradient + correction))
      if has_unmasked:
        optimizer_state, updated = client_optimizer.next(
            optimizer_state, tuple(unmasked_vars), tuple(unmasked_grads))
        for variable, value in zip(unmasked_vars, updated):
          variable.assign(value)
      return (num_steps + 1,
              num_examples + tf.cast(output.num_examples, tf.int64),
              optimizer_state)

    optimizer_state = ()
    if has_unmasked:
      optimizer_state = client_optimizer.initialize(tuple(
          tf.TensorSpec(v.shape, v.dtype) for v in unmasked_vars))
    num_steps, num_examples, _ = training_loop(
        train_on_batch, dataset, lambda: (
            tf.constant(0, tf.int64), tf.constant(0, tf.int64),
            optimizer_state))

    model_delta = [v - x for v, x in zip(trainable, initial_weights.trainable)]
    trained = num_steps > 0
    if option == OPTION_GRADIENT_AT_SERVER_MODEL:
      new_cv = [tf.where(trained, g, ci)
                for g, ci in zip(gradient_at_x, client_cv)]
    else:
      steps_times_lr = tf.cast(num_steps, tf.float32) * learning_rate
      masked_delta, _ = split_masked(model_delta, mask)
      # c_i+ = c_i - c + (x - y) / (K_i * eta); x - y = -delta.
      new_cv = [tf.where(trained, ci - c - d / tf.maximum(steps_times_lr,
                                                            learning_rate),
                         ci)
                for ci, c, d in zip(client_cv, server_cv, masked_delta)]
    if uniform_weighting:
      weight = tf.constant(1.0)
    else:
      weight = tf.cast(num_examples, tf.float32)
    result = collections.OrderedDict(
        model_delta=model_delta,
        control_variate_delta=[n - o for n, o in zip(new_cv, client_cv)],
        client_state=collections.OrderedDict(control_variate=new_cv),
        weight=weight,
        local_steps=num_steps,
        metrics=model.report_local_unfinalized_metrics())
    if layer_of_variable is not None:
      result['layer_sq_norms'] = layer_squared_norms(model_delta,
                                                     layer_of_variable)
    return result

  return client_update


# ----------------------------------------------------------------------------
# Server state and update.


def initial_server_state(model: tff.learning.models.VariableModel,
                         server_optimizer: tff.learning.optimizers.Optimizer,
                         cv_specs: Sequence[tf.TensorSpec]):
  """<global_model_weights=x, control_variate=c=0, optimizer_state>."""
  weights = ModelWeights.from_model(model)
  return collections.OrderedDict(
      global_model_weights=ModelWeights(
          trainable=[tf.identity(v) for v in weights.trainable],
          non_trainable=[tf.identity(v) for v in weights.non_trainable]),
      control_variate=zeros_like_specs(cv_specs),
      optimizer_state=server_optimizer.initialize(tuple(
          tf.TensorSpec(v.shape, v.dtype) for v in weights.trainable)))


def build_server_update(server_optimizer: tff.learning.optimizers.Optimizer,
                        num_train_clients: int):
  """Returns `server_update(state, mean_delta, mean_cv_delta, num_clients)`.

  x <- ServerOpt(x, -mean_p(y_i - x)), which with SGD at eta_s is
  x + eta_s * mean_p(y_i - x); c <- c + (|S|/N) * mean(c_i+ - c_i) with the
  uniform mean over the round's clients, so c stays the mean of every
  client's c_i ([SCAFFOLD] eq. 21).
  """
  population = float(num_train_clients)

  @tf.function
  def server_update(state, mean_model_delta, mean_cv_delta, num_clients):
    weights = state['global_model_weights']
    negative_delta = tuple(-d for d in mean_model_delta)
    optimizer_state, trainable = server_optimizer.next(
        state['optimizer_state'], tuple(weights.trainable), negative_delta)
    participation = tf.cast(num_clients, tf.float32) / population
    control_variate = [c + participation * d for c, d in zip(
        state['control_variate'], mean_cv_delta)]
    return collections.OrderedDict(
        global_model_weights=ModelWeights(list(trainable),
                                          list(weights.non_trainable)),
        control_variate=control_variate,
        optimizer_state=optimizer_state)

  return server_update


# ----------------------------------------------------------------------------
# Drift diversity ([FedPVR] Def. 1).


def layer_squared_norms(tensors: Sequence[tf.Tensor],
                        layer_of_variable: Sequence[int]) -> tf.Tensor:
  """Squared L2 norm of each layer's part of `tensors`, shape [num_layers]."""
  num_layers = max(layer_of_variable) + 1
  per_layer = [tf.constant(0.0)] * num_layers
  for tensor, layer in zip(tensors, layer_of_variable, strict=True):
    per_layer[layer] += tf.reduce_sum(tf.square(tf.cast(tensor, tf.float32)))
  return tf.stack(per_layer)


def drift_diversity(sum_of_sq_norms: tf.Tensor, sum_of_deltas,
                    layer_of_variable: Sequence[int]) -> tf.Tensor:
  """xi per layer = sum_i ||m_i||^2 / ||sum_i m_i||^2, m_i = y_i - x."""
  return sum_of_sq_norms / layer_squared_norms(sum_of_deltas, layer_of_variable)


def drift_diversity_metrics(sum_of_sq_norms: tf.Tensor, sum_of_deltas,
                            layer_of_variable: Sequence[int]
                            ) -> collections.OrderedDict:
  """`drift_diversity` as metrics `layer_<k>`."""
  xi = drift_diversity(sum_of_sq_norms, sum_of_deltas, layer_of_variable)
  num_layers = max(layer_of_variable) + 1
  return collections.OrderedDict(
      (f'layer_{k}', xi[k]) for k in range(num_layers))

