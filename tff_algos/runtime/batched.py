"""A group of clients run in lockstep over a client axis (the GPU form).

The compiled cohort (`runtime.cohort`) loops over a group's clients, one
client's weights live at a time: what a CPU wants. A GPU wants the clients
side by side: here every tensor of a group carries a leading client axis C,

  weights    [C, ...]         each client's copy, from the broadcast model
  batches    [C, K, B, ...]   client c's k-th batch, padded to the group's
                              largest batch B; K is the group's largest K_i
  counts     [C, K]           examples of each of those batches (0: the
                              client has no k-th step)

and each step is one batched forward pass (the model written as functions of
the stacked weights), one gradient, one SGD step of every client that has
that step. Padded examples are masked out of the loss and the metrics, and a
client without a k-th step keeps its weights, so each client's update is
the loop's; only float summation order differs. The batches come from the
same group stream the loop runs (`cohort.group_stream`), so each client
trains on the same batches in the same order.

What it covers: FedAvg and FedProx with the plain SGD client optimizer, on
Keras Sequential or single-chain functional models of InputLayer, Flatten
and Dense layers (float32, no regularizers or constraints, elementwise or
softmax activations), with one of the Keras losses below and Keras
mean-of-values metrics (accuracies, MSE, ...); clients without state and
tasks without per-client costs. Anything else runs as the loop:
`group_update_or_none` says why, once, in the run's log.
"""

import collections
import logging
import operator
from typing import Callable, Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import cohort

MODES = ('auto', 'on', 'off')

_ALGORITHMS = ('fedavg', 'fedprox')
_LOSSES = (tf.keras.losses.BinaryCrossentropy,
           tf.keras.losses.CategoricalCrossentropy,
           tf.keras.losses.SparseCategoricalCrossentropy,
           tf.keras.losses.MeanSquaredError,
           tf.keras.losses.MeanAbsoluteError)
_METRICS = (tf.keras.metrics.BinaryAccuracy, tf.keras.metrics.Accuracy,
            tf.keras.metrics.CategoricalAccuracy,
            tf.keras.metrics.SparseCategoricalAccuracy,
            tf.keras.metrics.MeanSquaredError,
            tf.keras.metrics.MeanAbsoluteError)
_ACTIVATIONS = ('linear', 'relu', 'tanh', 'sigmoid', 'softmax', 'elu',
                'selu', 'softplus', 'softsign', 'swish', 'gelu')


class Unsupported(Exception):
  """What the batched form cannot run (the reason, for the log)."""


def wanted(mode: str) -> bool:
  """Whether `mode` asks for the batched form here ('auto': on a GPU)."""
  if mode not in MODES:
    raise ValueError(f'batched_cohorts={mode!r} is unknown; allowed: '
                     + ', '.join(MODES))
  if mode == 'auto':
    return bool(tf.config.list_logical_devices('GPU'))
  return mode == 'on'


def group_update_or_none(definition: round_lib.RoundDefinition,
                         client_dataset_fn: Callable,
                         client_cost_fn: Optional[Callable],
                         mode: str) -> Optional[Callable]:
  """The batched `run(message, round_num, group)`, or None for the loop.

  None when `mode` does not ask for it, or when it cannot run this round
  (then one log line says why).
  """
  if not wanted(mode):
    return None
  try:
    return build_group_update(definition, client_dataset_fn, client_cost_fn)
  except Unsupported as reason:
    logging.warning('Batched cohorts: %s; clients run one after another in '
                    'each group instead.', reason)
    return None


def build_group_update(definition: round_lib.RoundDefinition,
                       client_dataset_fn: Callable,
                       client_cost_fn: Optional[Callable] = None) -> Callable:
  """`run(message, round_num, group)` -> the group's result, as the loop's
  (`cohort.build_group_update`, not per client); raises `Unsupported`."""
  if definition.name not in _ALGORITHMS:
    raise Unsupported(f'{definition.name} is not one of '
                      + ', '.join(_ALGORITHMS))
  settings = definition.settings
  if settings.client_optimizer != 'sgd':
    raise Unsupported(f'the client optimizer is {settings.client_optimizer}, '
                      'not sgd')
  if definition.has_client_state:
    raise Unsupported(f'{definition.name} keeps client state')
  if client_cost_fn is not None:
    raise Unsupported('the task models per-client costs')
  model = definition.client_context()
  forward = _functional_model(model)
  loss_fn = _per_example_loss(model)
  metric_updates = _metric_updates(model)
  step = _Step(forward, loss_fn, metric_updates,
               learning_rate=float(settings.client_learning_rate),
               proximal_strength=float(getattr(settings, 'proximal_strength',
                                               0.0)))
  x_of, y_of = _batch_parts(model.input_spec)
  _probe(step, model)
  uniform = settings.client_weighting == 'uniform'

  @tf.function(reduce_retracing=True)
  def run(message, round_num, group):
    del round_num
    initial = list(message['global_model_weights'].trainable)
    count, xs, ys, ns = _stacked_batches(
        client_dataset_fn, group['ids'], group['seeds'], x_of, y_of)
    weights = [tf.broadcast_to(w, tf.concat([[count], tf.shape(w)], 0))
               for w in initial]
    accumulators = step.zero_accumulators(count)
    for k in tf.range(tf.shape(ns)[1]):
      weights, accumulators = step(weights, initial, accumulators,
                                   xs[:, k], ys[:, k], ns[:, k])
    return _group_result(initial, weights, accumulators, count, uniform,
                         metric_updates)

  return run


def _group_result(initial, weights, accumulators, count, uniform,
                  metric_updates):
  """The loop's group result: sums over clients of each client's result,
  a client with a non-finite update counting with weight 0 and no metrics
  (tff.learning's zeroing)."""
  updates = [w0[tf.newaxis] - w for w0, w in zip(initial, weights)]
  finite = tf.reduce_all(tf.stack(
      [tf.reduce_all(tf.math.is_finite(tf.reshape(u, [count, -1])), axis=1)
       for u in updates]), axis=0)
  examples = accumulators['num_examples']
  weight = tf.where(finite, tf.ones([count]) if uniform else
                    tf.cast(examples, tf.float32), 0.0)

  def client_sum(values):
    kept = tf.where(_along_clients(finite, values), values,
                    tf.zeros_like(values))
    return tf.reduce_sum(kept, axis=0)

  model_update = [client_sum(u * _along_clients(weight, u)) for u in updates]
  metrics = collections.OrderedDict(
      (name, [client_sum(v) for v in accumulators['metrics'][name]])
      for name in metric_updates)
  return collections.OrderedDict(
      model_update=model_update, weight=tf.reduce_sum(weight),
      num_clients=tf.cast(count, tf.int32),
      sums=collections.OrderedDict(), measurements=collections.OrderedDict(),
      metrics=metrics)


def _along_clients(per_client, like):
  """[C] -> [C, 1, ...] broadcastable against `like` ([C, ...])."""
  return tf.reshape(per_client, tf.concat(
      [[-1], tf.ones([tf.rank(like) - 1], tf.int32)], 0))


class _Step:
  """One local step of every client of a group, in lockstep."""

  def __init__(self, forward, loss_fn, metric_updates, learning_rate,
               proximal_strength):
    self._forward = forward
    self._loss_fn = loss_fn
    self._metric_updates = metric_updates
    self._learning_rate = learning_rate
    self._mu = proximal_strength

  def zero_accumulators(self, count):
    return collections.OrderedDict(
        num_examples=tf.zeros([count], tf.int64),
        metrics=collections.OrderedDict(
            (name, update.zeros(count))
            for name, update in self._metric_updates.items()))

  def __call__(self, weights, initial, accumulators, x, y, n):
    """x, y: [C, B, ...] (padded); n: [C] examples of each client's batch."""
    mask = tf.range(tf.shape(x)[1])[tf.newaxis] < n[:, tf.newaxis]
    examples = tf.cast(n, tf.float32)
    with tf.GradientTape() as tape:
      tape.watch(weights)
      predictions = self._forward(weights, x)
      per_example = self._loss_fn(y, predictions)
      # Keras's mean over a client's batch (SUM_OVER_BATCH_SIZE).
      client_losses = tf.reduce_sum(
          tf.where(mask, per_example, 0.0), axis=1) / tf.maximum(examples,
                                                                  1.0)
      total = tf.reduce_sum(client_losses)
    gradients = tape.gradient(total, weights)
    if self._mu:
      gradients = [g + self._mu * (w - w0[tf.newaxis])
                   for g, w, w0 in zip(gradients, weights, initial)]
    active = n > 0
    weights = [tf.where(_along_clients(active, w),
                        w - self._learning_rate * g, w)
               for w, g in zip(weights, gradients)]
    context = _BatchContext(y, predictions, mask, examples, active,
                            client_losses)
    metrics = collections.OrderedDict(
        (name, update(accumulators['metrics'][name], context))
        for name, update in self._metric_updates.items())
    return weights, collections.OrderedDict(
        num_examples=accumulators['num_examples'] + tf.cast(n, tf.int64),
        metrics=metrics)


class _BatchContext:
  """What the metrics of one lockstep step read."""

  def __init__(self, y, predictions, mask, examples, active, client_losses):
    self.y = y
    self.predictions = predictions
    self.mask = mask
    self.examples = examples
    self.active = active
    self.client_losses = client_losses


class _MetricUpdate:
  """A metric's per-client variables ([C] each) and their update."""

  def __init__(self, dtypes, update):
    self._dtypes = dtypes
    self._update = update

  def zeros(self, count):
    return [tf.zeros([count], d) for d in self._dtypes]

  def __call__(self, values, context):
    return [v + tf.cast(d, v.dtype)
            for v, d in zip(values, self._update(context))]


def _metric_updates(model) -> dict:
  """name -> _MetricUpdate, for each of the model's metrics, in order."""
  updates = collections.OrderedDict()
  for metric in model.get_metrics():
    dtypes = [v.dtype for v in metric.variables]
    if isinstance(metric, tff.learning.metrics.NumExamplesCounter):
      update = lambda c: [c.examples]
    elif isinstance(metric, tff.learning.metrics.NumBatchesCounter):
      update = lambda c: [c.active]
    elif metric.name == 'loss' and hasattr(metric, '_loss_fns'):
      # tff.learning's loss metric: a Mean of batch losses weighted by the
      # batch size.
      update = lambda c: [c.client_losses * c.examples, c.examples]
    elif type(metric) in _METRICS:  # pylint: disable=unidiomatic-typecheck
      update = _mean_metric_update(metric)
    else:
      raise Unsupported(f'metric {metric.name} '
                        f'({type(metric).__name__}) is not supported')
    updates[metric.name] = _MetricUpdate(dtypes, update)
  return updates


def _mean_metric_update(metric):
  """A Keras MeanMetricWrapper's (total, count) increments, per client."""
  # pylint: disable=protected-access
  fn, kwargs = metric._fn, metric._fn_kwargs

  def update(context):
    y_true = tf.cast(context.y, metric.dtype)
    y_pred = tf.cast(context.predictions, metric.dtype)
    y_pred, y_true = _squeeze_or_expand(y_pred, y_true)
    # [C, B, ...]: Keras counts every value (e.g. binary_accuracy keeps a
    # label's last axis), so an example adds as many as it has values.
    values = tf.cast(fn(y_true, y_pred, **kwargs), metric.dtype)
    values = tf.reshape(values, [tf.shape(values)[0], tf.shape(values)[1], -1])
    kept = tf.where(context.mask[:, :, tf.newaxis], values, 0.0)
    per_example = tf.cast(tf.shape(values)[2], metric.dtype)
    return [tf.reduce_sum(kept, axis=[1, 2]), context.examples * per_example]

  return update


def _squeeze_or_expand(y_pred, y_true):
  # Keras's alignment of label and prediction ranks, as its metrics do.
  from keras.src.utils import losses_utils  # pylint: disable=g-import-not-at-top
  return losses_utils.squeeze_or_expand_dimensions(y_pred, y_true)


def _per_example_loss(model) -> Callable:
  """(y [C, B, ...], predictions [C, B, ...]) -> the loss of each example."""
  # pylint: disable=protected-access
  losses = model._loss_fns
  if len(losses) != 1:
    raise Unsupported('the model has several losses')
  loss = losses[0]
  if type(loss) not in _LOSSES:  # pylint: disable=unidiomatic-typecheck
    raise Unsupported(f'the loss {type(loss).__name__} is not supported')
  if loss.reduction not in (tf.keras.losses.Reduction.AUTO,
                            tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE):
    raise Unsupported(f'the loss reduces by {loss.reduction}')
  if loss._fn_kwargs.get('ignore_class') is not None:
    raise Unsupported('the loss ignores a class')
  if loss._fn_kwargs.get('axis', -1) != -1:
    raise Unsupported('the loss reduces over an axis other than the last')

  def per_example(y, predictions):
    values = loss.call(y, predictions)
    return tf.ensure_shape(tf.cast(values, tf.float32), [None, None])

  return per_example


def _functional_model(model) -> Callable:
  """(stacked trainable weights, x [C, B, ...]) -> predictions [C, B, ...]:
  the Keras model as a function of per-client weights."""
  keras_model = getattr(model, '_keras_model', None)  # pylint: disable=protected-access
  if keras_model is None:
    raise Unsupported('the model is not a Keras model')
  if keras_model.non_trainable_weights:
    raise Unsupported('the model has non-trainable weights')
  if keras_model.losses:
    raise Unsupported('the model has layer losses (regularizers)')
  layers = _layer_chain(keras_model)
  position = {v.ref(): i for i, v in enumerate(keras_model.trainable_weights)}
  ops = []
  used = []
  for layer in layers:
    if isinstance(layer, tf.keras.layers.InputLayer):
      continue
    if isinstance(layer, tf.keras.layers.Flatten):
      if layer.data_format != 'channels_last':
        raise Unsupported(f'layer {layer.name} flattens channels first')
      ops.append(_flatten)
    elif type(layer) is tf.keras.layers.Dense:  # pylint: disable=unidiomatic-typecheck
      ops.append(_dense(layer, position))
      used += [layer.kernel] + ([layer.bias] if layer.use_bias else [])
    else:
      raise Unsupported(f'layer {layer.name} ({type(layer).__name__}) is '
                        'not supported')
  if len(used) != len(position):
    raise Unsupported('the model has weights outside its Dense layers')

  def forward(weights, x):
    h = x
    for op in ops:
      h = op(weights, h)
    return h

  return forward


def _layer_chain(keras_model) -> list:
  """The model's layers, if they form one chain from input to output."""
  if isinstance(keras_model, tf.keras.Sequential):
    return list(keras_model.layers)
  if not getattr(keras_model, '_is_graph_network', False):
    raise Unsupported('the model is a subclassed Keras model')
  if len(keras_model.inputs) != 1 or len(keras_model.outputs) != 1:
    raise Unsupported('the model has several inputs or outputs')
  layers = list(keras_model.layers)
  for previous, layer in zip(layers, layers[1:]):
    if (len(layer._inbound_nodes) != 1  # pylint: disable=protected-access
        or layer.input is not previous.output):
      raise Unsupported('the model\'s layers are not one chain')
  if keras_model.outputs[0] is not layers[-1].output:
    raise Unsupported('the model\'s layers are not one chain')
  return layers


def _flatten(weights, h):
  del weights
  shape = tf.shape(h)
  return tf.reshape(h, [shape[0], shape[1], -1])


def _dense(layer, position) -> Callable:
  for attribute in ('kernel_regularizer', 'bias_regularizer',
                    'activity_regularizer', 'kernel_constraint',
                    'bias_constraint'):
    if getattr(layer, attribute) is not None:
      raise Unsupported(f'layer {layer.name} has a {attribute}')
  if layer.dtype_policy.compute_dtype != 'float32':
    raise Unsupported(f'layer {layer.name} computes in '
                      f'{layer.dtype_policy.compute_dtype}')
  if len(layer.input_shape) != 2:
    raise Unsupported(f'layer {layer.name} takes inputs of rank '
                      f'{len(layer.input_shape)}, not 2')
  activation = tf.keras.activations.serialize(layer.activation)
  if activation not in _ACTIVATIONS:
    raise Unsupported(f'layer {layer.name}\'s activation {activation} is not '
                      'supported')
  kernel = position[layer.kernel.ref()]
  bias = position[layer.bias.ref()] if layer.use_bias else None
  apply_activation = layer.activation

  def dense(weights, h):
    # [C, B, I] @ [C, I, O]: each client's batch times its own kernel.
    h = tf.matmul(tf.cast(h, tf.float32), weights[kernel])
    if bias is not None:
      h = h + weights[bias][:, tf.newaxis]
    return apply_activation(h)

  return dense


def _batch_parts(input_spec):
  """(batch -> x, batch -> y) as tff.learning's Keras model reads them."""
  if isinstance(input_spec, collections.abc.Mapping):
    keys = ('x', 'y')
  else:
    keys = (0, 1)
  x_spec, y_spec = input_spec[keys[0]], input_spec[keys[1]]
  parts = tuple(operator.itemgetter(key) for key in keys)
  for spec in (x_spec, y_spec):
    if not isinstance(spec, tf.TensorSpec):
      raise Unsupported('the model\'s inputs or labels are not single tensors')
  return parts


def _probe(step: _Step, model) -> None:
  """One lockstep step on zeros: the model's shapes fit the batched form."""
  x_spec, y_spec = [tf.nest.flatten(s)[0] for s in (
      model.input_spec if not isinstance(model.input_spec,
                                         collections.abc.Mapping)
      else (model.input_spec['x'], model.input_spec['y']))]
  if not (x_spec.shape[1:].is_fully_defined()
          and y_spec.shape[1:].is_fully_defined()):
    raise Unsupported('examples have shapes not known in advance')
  clients, batch = 2, 3

  def zeros(spec):
    return tf.zeros([clients, batch] + spec.shape[1:].as_list(), spec.dtype)

  weights = [tf.zeros([clients] + v.shape.as_list(), v.dtype)
             for v in model.trainable_variables]
  try:
    step(weights, [w[0] for w in weights], step.zero_accumulators(clients),
         zeros(x_spec), zeros(y_spec), tf.constant([batch, 1], tf.int32))
  except (ValueError, TypeError, tf.errors.InvalidArgumentError) as error:
    raise Unsupported('the model does not run over a client axis '
                      f'({type(error).__name__})') from error


def _stacked_batches(client_dataset_fn, ids, seeds, x_of, y_of):
  """count, x [C, K, B, ...], y [C, K, B, ...], n [C, K] of a group.

  The batches of the loop's group stream (same datasets, same order), each
  client's k-th batch at [c, k], padded with zeros to the largest batch.
  """
  count = tf.shape(ids, out_type=tf.int32)[0]
  stream = cohort.group_stream(client_dataset_fn, ids, seeds, passes=1)
  _, batch_spec = stream.element_spec
  # The group's examples end to end, and each batch's client and size.
  examples = [tf.TensorArray(spec.dtype, size=0, dynamic_size=True,
                             infer_shape=False, element_shape=spec.shape)
              for spec in (x_of(batch_spec), y_of(batch_spec))]
  owners = tf.TensorArray(tf.int32, size=0, dynamic_size=True)
  sizes = tf.TensorArray(tf.int32, size=0, dynamic_size=True)
  batches = tf.constant(0, tf.int32)
  for (index, _, is_marker), batch in iter(stream):
    if tf.logical_not(is_marker):
      examples = [array.write(batches, part) for array, part in zip(
          examples, (x_of(batch), y_of(batch)))]
      owners = owners.write(batches, index)
      sizes = sizes.write(batches, tf.shape(x_of(batch), out_type=tf.int32)[0])
      batches += 1
  owners, sizes = owners.stack(), sizes.stack()
  x, y = [array.concat() for array in examples]
  positions = tf.range(batches)
  first = tf.math.unsorted_segment_min(positions, owners, count)
  step = positions - tf.gather(first, owners)
  steps = tf.reduce_max(tf.concat([step + 1, [0]], 0))
  largest = tf.reduce_max(tf.concat([sizes, [0]], 0))
  # Each example's batch and its place in it.
  batch_of = tf.repeat(positions, sizes)
  offsets = tf.cumsum(sizes, exclusive=True)
  place_in_batch = tf.range(tf.shape(batch_of)[0]) - tf.gather(offsets,
                                                                batch_of)
  coordinates = tf.stack([tf.gather(owners, batch_of),
                          tf.gather(step, batch_of), place_in_batch], axis=1)

  def place(values):
    shape = tf.concat([[count, steps, largest], tf.shape(values)[1:]], 0)
    return tf.scatter_nd(coordinates, values, shape)

  n = tf.scatter_nd(tf.stack([owners, step], axis=1), sizes, [count, steps])
  return count, place(x), place(y), n
