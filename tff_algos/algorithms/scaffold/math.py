"""SCAFFOLD / FedPVR update logic in plain TensorFlow.

One implementation serves both algorithms: a mask over the model's trainable
variables picks those that get control variates. Masked variables take
SCAFFOLD's corrected step y <- y - eta * (g - c_i + c) and SCAFFOLD's c_i update;
the others take the client optimizer's step on the plain gradient (FedAvg).
Mask empty = FedAvg, mask everything = SCAFFOLD. Control variates exist only
for masked variables, so client and server state, and communication, grow by v
(the masked size) rather than d.

Nothing here knows about TFF placements: `definition` declares the round
that the runtimes run.
"""

import collections
from typing import Any, Optional, Sequence

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos.algorithms import non_finite
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import sgd_step
from tff_algos.algorithms.scaffold import factored

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
      raise ValueError(
          f'start_variable={start_variable} is out of range: the model has '
          f'{num_variables} trainable variables (allowed: 0..'
          f'{num_variables})')
    return tuple(i >= start_variable for i in range(num_variables))
  if last_layers < 0:
    raise ValueError(f'last_layers must be >= 0, got {last_layers}')
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


def build_client_work(client_optimizer: tff.learning.optimizers.Optimizer,
                      learning_rate: float,
                      mask: Sequence[bool],
                      option: int,
                      uniform_weighting: bool,
                      trainable_specs: Sequence[tf.TensorSpec],
                      layer_of_variable: Optional[Sequence[int]] = None,
                      factored_kernels: Sequence[
                          factored.FactoredKernel] = ()
                      ) -> round_lib.ClientWork:
  """One client's round, as steps over its batches (`round.ClientWork`).

  Starting from the server model x, one step per batch: masked variables
  y <- y - eta * (g - c_i + c) with plain SGD (so Option II's closed form
  holds exactly), unmasked variables take `client_optimizer`'s step on g
  (freshly initialized each round, as in tff.learning's FedAvg). With
  Option I, a first pass at x over the client's round data (its E epochs'
  batches, or with `--client_steps` its K batches, which repeat examples
  when K batches exceed the data) computes c_i+ = g_i(x), their
  example-weighted mean gradient; the training pass follows (the data
  reshuffled).

  The context is the client's `tff.learning` VariableModel; the message
  holds `global_model_weights` (x) and `control_variate` (c); the client
  state `control_variate` (c_i). The result sends y - x (weighted by the
  examples processed, or 1 with `uniform_weighting`), sums c_i+ - c_i, keeps
  c_i+ as the new state; a client without data leaves y = x and c_i, and
  one whose y - x or c_i+ is not finite is dropped (weight 0, c_i kept). With
  `layer_of_variable`, it also measures ||y - x||^2 per layer and y - x
  (drift diversity).

  With `factored_kernels` (Option II only) those kernels' c_i are kept as
  factors (`factored`): c_i and c_i+ in the state are (A, E) pairs, the
  steps record each batch's rows of them.
  """
  mask = tuple(mask)
  option = int(option)
  if option not in OPTIONS:
    raise ValueError(f'option={option} is unknown; allowed: 1, 2')
  kernels = tuple(factored_kernels)
  if kernels and option != OPTION_FROM_LOCAL_STEPS:
    raise ValueError('factored control variates need option 2')
  kernel_positions = factored.positions(mask, kernels)
  # Position in the control-variate list -> index in `kernels`.
  factored_at = {p: j for j, p in enumerate(kernel_positions)}
  factored_variables = {k.variable_index for k in kernels}
  # The masked variables whose c_i is dense, and the positions of their
  # control variates.
  dense_mask = tuple(m and i not in factored_variables
                     for i, m in enumerate(mask))
  dense_positions = [p for p in range(sum(mask)) if p not in factored_at]
  learning_rate = float(learning_rate)
  has_unmasked = not all(mask)
  masked_specs_, unmasked_specs = split_masked(trainable_specs, mask)

  def prepare(model, message):
    factored.start_group(
        model, [message['global_model_weights'].trainable[k.variable_index]
                for k in kernels],
        [message['control_variate'][p] for p in kernel_positions])

  def start(model, message, client_state):
    weights = ModelWeights.from_model(model)
    x = message['global_model_weights']
    # The factored kernels keep x all round (`prepare`).
    for i, (variable, value) in enumerate(zip(weights.trainable,
                                              x.trainable)):
      if i not in factored_variables:
        variable.assign(value)
    for variable, value in zip(weights.non_trainable, x.non_trainable):
      variable.assign(value)
    carry = collections.OrderedDict(
        num_steps=tf.constant(0, tf.int64),
        num_examples=tf.constant(0, tf.int64),
        # Tuples, not lists: a loop would stack a list into one tensor.
        optimizer_state=(client_optimizer.initialize(tuple(unmasked_specs))
                         if has_unmasked else ()),
        # c_i - c of the dense c_i, the same at every step: computed once
        # per client, and the first term of c_i+ (Option II).
        client_minus_server=tuple(
            client_state['control_variate'][p] -
            message['control_variate'][p] for p in dense_positions))
    if kernels:
      factored.start_client(model, [client_state['control_variate'][p]
                                    for p in kernel_positions])
    if option == OPTION_GRADIENT_AT_SERVER_MODEL:
      carry['gradient_sums'] = tuple(zeros_like_specs(masked_specs_))
      carry['gradient_examples'] = tf.constant(0.0)
      carry['gradient_at_x'] = tuple(zeros_like_specs(masked_specs_))
    return carry

  def gradient_at_model_step(model, message, client_state, carry, batch):
    """Option I's first pass: sum of batch_size * grad(mean batch loss)."""
    del message, client_state
    masked_vars, _ = split_masked(
        list(ModelWeights.from_model(model).trainable), mask)
    with tf.GradientTape() as tape:
      output = model.forward_pass(batch, training=True)
    batch_size = tf.cast(output.num_examples, tf.float32)
    gradients = tape.gradient(output.loss, masked_vars)
    carry = collections.OrderedDict(carry)
    carry['gradient_sums'] = tuple(
        s + batch_size * g for s, g in zip(carry['gradient_sums'], gradients))
    carry['gradient_examples'] = carry['gradient_examples'] + batch_size
    return carry

  def gradient_at_model_done(model, message, client_state, carry):
    del message, client_state
    carry = collections.OrderedDict(carry)
    carry['gradient_at_x'] = tuple(
        s / tf.maximum(carry['gradient_examples'], 1.0)
        for s in carry['gradient_sums'])
    # The extra pass must not count towards the training metrics.
    model.reset_metrics()
    return carry

  def train_step(model, message, client_state, carry, batch):
    trainable = list(ModelWeights.from_model(model).trainable)
    num_steps = carry['num_steps']
    # The factored kernels are neither differentiated nor updated: their
    # layers compute each step's W_k from the round's factors (`factored`),
    # which the step records: the gradient at the layer's pre-activations
    # comes from the same backward pass as the other variables' gradients.
    differentiated = [v for i, v in enumerate(trainable)
                      if i not in factored_variables]
    output, gradients = factored.forward_and_gradients(
        model, batch, differentiated, num_steps)
    gradients = iter(gradients)
    gradients = [None if i in factored_variables else next(gradients)
                 for i in range(len(trainable))]
    dense_vars, _ = split_masked(trainable, dense_mask)
    dense_grads, _ = split_masked(gradients, dense_mask)
    _, unmasked_vars = split_masked(trainable, mask)
    _, unmasked_grads = split_masked(gradients, mask)
    sgd_step.corrected_sgd_step(dense_vars, dense_grads, learning_rate,
                                carry['client_minus_server'])
    optimizer_state = carry['optimizer_state']
    if has_unmasked:
      optimizer_state, updated = client_optimizer.next(
          optimizer_state, tuple(unmasked_vars), tuple(unmasked_grads))
      for variable, value in zip(unmasked_vars, updated):
        variable.assign(value)
    carry = collections.OrderedDict(carry)
    carry['num_steps'] = num_steps + 1
    carry['num_examples'] = carry['num_examples'] + tf.cast(
        output.num_examples, tf.int64)
    carry['optimizer_state'] = optimizer_state
    return carry

  def finish(model, message, client_state, carry):
    x = message['global_model_weights']
    client_cv = client_state['control_variate']
    trainable = list(ModelWeights.from_model(model).trainable)
    # The factored kernels' y - x come from their factors, below.
    model_delta = [None if i in factored_variables else v - w
                   for i, (v, w) in enumerate(zip(trainable, x.trainable))]
    num_steps = carry['num_steps']
    trained = num_steps > 0
    differences = []  # The factored kernels' c_i+ - c_i.
    if option == OPTION_GRADIENT_AT_SERVER_MODEL:
      new_cv = _unless_untrained(trained, lambda: list(carry['gradient_at_x']),
                                 client_cv)
    else:
      steps_times_lr = tf.cast(num_steps, tf.float32) * learning_rate
      masked_delta, _ = split_masked(model_delta, mask)
      client_minus_server = dict(zip(dense_positions,
                                     carry['client_minus_server']))

      def new_dense_control_variate(position):
        # c_i+ = c_i - c + (x - y) / (K_i * eta); x - y = -delta.
        return (client_minus_server[position] -
                masked_delta[position] / steps_times_lr)

      if kernels:
        # The kernels' c_i+ is their mean gradient A^T (D / K_i).
        new_cv, differences = factored.new_control_variates(
            model, kernels, kernel_positions, num_steps,
            new_dense_control_variate, client_cv)
        # Checked below in place of the kernels' y - x: with c finite,
        # y - x = -K_i eta (c_i+ - c_i + c) is finite when c_i+ - c_i is.
        for kernel, difference in zip(kernels, differences):
          model_delta[kernel.variable_index] = difference
      else:
        new_cv = _unless_untrained(
            trained, lambda: [new_dense_control_variate(p)
                              for p in range(len(masked_delta))], client_cv)
    # A client whose update or c_i+ is not finite (it diverged) is dropped
    # as FedAvg drops it (`non_finite`), and keeps its c_i.
    (model_delta, new_cv), dropped = non_finite.zero_all_if_any_non_finite(
        (model_delta, new_cv))
    updated = tf.logical_and(trained, tf.equal(dropped, 0))
    new_cv = _unless_untrained(tf.equal(dropped, 0), lambda: list(new_cv),
                              client_cv)
    weight = tf.cond(
        dropped > 0, lambda: tf.constant(0.0),
        lambda: (tf.constant(1.0) if uniform_weighting else
                 tf.cast(carry['num_examples'], tf.float32)))
    non_finite.reset_metrics_if(dropped, model)
    factored.set_model_updates(
        model_delta, kernels, kernel_positions, dropped, num_steps,
        learning_rate, sums_key='control_variate_delta',
        common_weight=1.0 if uniform_weighting else None)
    measurements = collections.OrderedDict()
    if layer_of_variable is not None:
      model_delta = round_lib.dense_update(model_delta, message)
      measurements['layer_sq_norms'] = layer_squared_norms(model_delta,
                                                           layer_of_variable)
      measurements['model_delta'] = model_delta
    return round_lib.ClientResult(
        model_update=model_delta, weight=weight,
        sums=collections.OrderedDict(control_variate_delta=[
            factored.control_variate_delta(
                updated, n, o,
                differences[factored_at[p]] if p in factored_at else None)
            for p, (n, o) in enumerate(zip(new_cv, client_cv))]),
        measurements=measurements,
        metrics=model.report_local_unfinalized_metrics(),
        state=collections.OrderedDict(control_variate=new_cv))

  if option == OPTION_GRADIENT_AT_SERVER_MODEL:
    return round_lib.ClientWork(
        start=start, steps=(gradient_at_model_step, train_step),
        end_pass=(gradient_at_model_done,
                  lambda model, message, client_state, carry: carry),
        finish=finish)
  return round_lib.ClientWork(start=start, steps=(train_step,), finish=finish,
                              prepare=prepare if kernels else None)


def _unless_untrained(trained: tf.Tensor, new_fn, old: Sequence[tf.Tensor]
                      ) -> list[tf.Tensor]:
  """new_fn()'s tensors if `trained`, else `old` (a client without data, or
  a dropped one, keeps c_i). A cond, not a where: a where is one more pass
  over the weights."""
  if not old:
    return []
  return tf.cond(trained, new_fn, lambda: list(old))


# ----------------------------------------------------------------------------
# Drift diversity ([FedPVR] Definition 1).


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


# ----------------------------------------------------------------------------
# Server update.


def server_update(server_optimizer: tff.learning.optimizers.Optimizer,
                  model_weights: ModelWeights, optimizer_state,
                  control_variate, mean_model_delta, control_variate_delta_sum,
                  num_clients, num_train_clients: int):
  """x <- ServerOpt(x, -mean_p(y_i - x));
  c <- c + (|S|/N) * (1/|S|) sum_S (c_i+ - c_i).

  With SGD at eta_s the first is x + eta_s * mean_p(y_i - x). The second is
  [SCAFFOLD] Alg. 1's rule: a uniform mean whatever p weights the model
  deltas with, so c stays the mean of all N clients' c_i (eq. 21). A mean
  that is not finite (0 / 0 when every sampled client has weight 0) leaves x
  and the optimizer state as they are, as FedAvg's server does.
  Returns (weights, optimizer state, c).
  """
  optimizer_state, trainable, _ = non_finite.apply_optimizer(
      server_optimizer, optimizer_state, tuple(model_weights.trainable),
      tuple(-d for d in mean_model_delta))
  clients = tf.cast(num_clients, tf.float32)
  participation = clients / float(num_train_clients)
  new_control_variate = [
      c + participation * (d / clients)
      for c, d in zip(control_variate, control_variate_delta_sum)]
  return (ModelWeights(list(trainable), list(model_weights.non_trainable)),
          optimizer_state, new_control_variate)
