"""TF math of Federated Residual Learning ([FedRes], Algorithms 2-4).

Plain TensorFlow over a `ResidualModel` (a global and a local Keras model
whose outputs add) and one client's dataset. `definition` declares the
round around these functions, and the personalized evaluation runs them
in-process, so they are testable without TFF.

Notation: w global weights, theta a client's local weights, eta the client
learning rate of w, lambda the learning rate of theta, c and c_i the server
and client control variates of FedResAvg Option II. One pass over a client's
dataset is K mini-batches (K_i when the client has less data; the formulas use
the actual count). Steps that the paper writes as "sample a mini-batch" draw
the batches of a fresh pass over the dataset.
"""

import collections
import dataclasses
from typing import Optional, Sequence

import tensorflow as tf

from tasks import residual
from tff_algos.algorithms import non_finite
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import sgd_step
from tff_algos.algorithms.scaffold import factored


class ResidualModel:
  """f_w(x_g) + f_theta(x_l): the Keras models FedRes computes with."""

  def __init__(self, spec: residual.ResidualModelSpec):
    self.global_model = spec.global_model_fn()
    self.local_model = spec.local_model_fn()
    self._split_inputs = spec.split_inputs
    self.loss_fn = spec.loss_fn()

  @property
  def global_weights(self) -> list[tf.Variable]:
    return self.global_model.trainable_variables

  @property
  def local_weights(self) -> list[tf.Variable]:
    return self.local_model.trainable_variables

  def global_inputs(self, x):
    """What the global model reads of the inputs `x`."""
    return self._split_inputs(x)[0]

  def outputs(self, x, training: bool = True) -> tf.Tensor:
    global_inputs, local_inputs = self._split_inputs(x)
    return (self.global_model(global_inputs, training=training) +
            self.local_model(local_inputs, training=training))

  def batch_loss(self, batch) -> tf.Tensor:
    x, y = batch
    return self.loss_fn(y, self.outputs(x))


def global_model_parts(model: ResidualModel):
  """The Keras model and variables of w, whose kernels `factored` keeps
  (`factored.plan`, `factored.install`)."""
  return model.global_model, model.global_weights


def num_examples_in(batch) -> tf.Tensor:
  return tf.shape(tf.nest.flatten(batch[1])[0], out_type=tf.int64)[0]


def _dense_gradients(tape, loss, variables) -> list[tf.Tensor]:
  return _as_dense(tape.gradient(loss, variables), variables)


def _as_dense(gradients, variables) -> list[tf.Tensor]:
  # Embedding gradients arrive as IndexedSlices; control variates and
  # averaged deltas are dense anyway. Some ops lose the static shape, which
  # the loop states below must keep.
  return [tf.zeros_like(v) if g is None else
          tf.ensure_shape(tf.convert_to_tensor(g), v.shape)
          for v, g in zip(variables, gradients)]


def assign(variables: Sequence[tf.Variable], values) -> None:
  for variable, value in zip(variables, values, strict=True):
    variable.assign(value)


def _read(variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
  return [tf.identity(v.read_value()) for v in variables]


# Each per-batch step is its own tf.function: the round's steps run inside
# the runtime's compiled group loop, and the in-process personalized
# evaluation calls the same steps from a Python loop, one compiled call each.


def _step(fn):
  # Batch shapes vary (last batch, client sizes): trace once for any shape.
  # Straight-line code: AutoGraph would only spend time converting it.
  return tf.function(fn, reduce_retracing=True, autograph=False)


@_step
def _local_step(model: ResidualModel, batch, local_learning_rate: float):
  """theta <- theta - lambda grad_theta l(w, theta), w fixed. -> (loss, n)."""
  with tf.GradientTape() as tape, factored.at_x(model):
    loss = model.batch_loss(batch)
  gradients = _dense_gradients(tape, loss, model.local_weights)
  sgd_step.sgd_step(model.local_weights, gradients, local_learning_rate)
  return loss, num_examples_in(batch)


@_step
def _joint_step(model: ResidualModel, batch, learning_rate: float,
                local_learning_rate: float):
  """FedResNaive: w_i and theta step together from one gradient at (w_i,
  theta). The paper calls the two updates simultaneous, so theta chases the
  temporary w_i that the server's averaging later overwrites. -> (loss, n)."""
  variables = model.global_weights + model.local_weights
  with tf.GradientTape() as tape:
    loss = model.batch_loss(batch)
  gradients = _dense_gradients(tape, loss, variables)
  num_global = len(model.global_weights)
  sgd_step.sgd_step(model.global_weights, gradients[:num_global],
                    learning_rate)
  sgd_step.sgd_step(model.local_weights, gradients[num_global:],
                    local_learning_rate)
  return loss, num_examples_in(batch)


@_step
def _global_gradient(model: ResidualModel, batch):
  """(grad_w l(w, theta), n) at the model's current weights."""
  with tf.GradientTape() as tape:
    loss = model.batch_loss(batch)
  return (tuple(_dense_gradients(tape, loss, model.global_weights)),
          num_examples_in(batch))


@_step
def _corrected_global_step(model: ResidualModel, batch, learning_rate: float,
                           client_minus_server):
  """w_i <- w_i - eta (g - c_i + c) with g = grad_w l(w_i, theta), theta
  fixed; `client_minus_server` is c_i - c (None: Option I, w_i - eta g).
  -> g."""
  with tf.GradientTape() as tape:
    loss = model.batch_loss(batch)
  gradients = _dense_gradients(tape, loss, model.global_weights)
  if client_minus_server is None:
    sgd_step.sgd_step(model.global_weights, gradients, learning_rate)
  else:
    sgd_step.corrected_sgd_step(model.global_weights, gradients,
                                learning_rate, client_minus_server)
  return tuple(gradients)


@_step
def _factored_corrected_global_step(model: ResidualModel, batch,
                                    learning_rate: float,
                                    client_minus_server, step,
                                    dense_indices: tuple[int, ...]):
  """`_corrected_global_step` as step `step` of Option II with the kernels
  of `factored` (all of w but `dense_indices`): their layers compute W_k
  from the round's factors and record this batch's; the other variables
  step on their gradients. -> the other variables' g."""
  variables = [model.global_weights[i] for i in dense_indices]
  _, gradients = factored.recorded_gradients(
      model, lambda: (None, model.batch_loss(batch)), variables, step)
  gradients = _as_dense(gradients, variables)
  sgd_step.corrected_sgd_step(variables, gradients, learning_rate,
                              client_minus_server)
  return tuple(gradients)


@_step
def _evaluation_step(model: ResidualModel, batch, loss_metric, metrics):
  x, y = batch
  outputs = model.outputs(x, training=False)
  loss_metric.update_state(
      model.loss_fn(y, outputs),
      sample_weight=tf.cast(num_examples_in(batch), tf.float32))
  for metric in metrics:
    metric.update_state(y, outputs)


def _zero_stats():
  # (sum of per-example losses, examples, steps) of a pass.
  return (tf.constant(0.0), tf.constant(0, tf.int64), tf.constant(0, tf.int64))


def _add_batch(stats, loss, n):
  loss_sum, num_examples, num_steps = stats
  return (loss_sum + loss * tf.cast(n, tf.float32), num_examples + n,
          num_steps + 1)


def _local_steps(model: ResidualModel, dataset: tf.data.Dataset,
                 local_learning_rate: float):
  """Step 1 of FedResSGD/FedResAvg: one `_local_step` per batch. Returns the
  pass's (loss sum, examples, steps), losses taken before each step."""
  stats = _zero_stats()
  for batch in dataset:
    loss, n = _local_step(model, batch, local_learning_rate)
    stats = _add_batch(stats, loss, n)
  return stats


def client_minus_server(server_control, client_control) -> list[tf.Tensor]:
  """c_i - c: FedResAvg Option II's local steps subtract it from every
  local gradient (`sgd_step.corrected_sgd_step`)."""
  return [ci - c for c, ci in zip(server_control, client_control)]


def updated_client_control(client_control, mean_gradient, num_steps):
  """Option II: c_i+ = (1/K) sum_k g_k; a client without data keeps c_i.

  A cond, not a where: a where is one more pass over the weights."""
  return tf.cond(num_steps > 0, lambda: list(mean_gradient),
                 lambda: list(client_control))


def server_weights_update(global_weights, mean_delta, server_step: float):
  """w <- w + alpha * mean_i (w_i - w) (alpha = 1 for Naive and SGD)."""
  return [w + server_step * d for w, d in zip(global_weights, mean_delta)]


def server_control_update(server_control, control_delta_sum,
                          num_train_clients: int):
  """c <- c + (|S|/N) mean_{i in S} (c_i+ - c_i) = c + sum_S (c_i+ - c_i) / N.

  SCAFFOLD's rule under client sampling; with every client sampled and c
  starting at mean_i c_i it is the paper's c <- mean_i c_i."""
  return [c + d / float(num_train_clients)
          for c, d in zip(server_control, control_delta_sum)]


def fit_local_model(model: ResidualModel, dataset: tf.data.Dataset,
                    local_learning_rate: float):
  """Step 1 alone (w fixed), in-process: fits one client's local model."""
  return _local_steps(model, dataset, local_learning_rate)


def accumulate_metrics(model: ResidualModel, dataset: tf.data.Dataset,
                       loss_metric: tf.keras.metrics.Mean,
                       metrics: Sequence[tf.keras.metrics.Metric]) -> None:
  """Adds the model's predictions on `dataset` to example-weighted metrics
  (in-process)."""
  for batch in dataset:
    _evaluation_step(model, batch, loss_metric, metrics)


VARIANTS = ('naive', 'sgd', 'avg')


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
  """What one FedRes round needs besides the data and the states."""
  variant: str  # One of VARIANTS.
  learning_rate: float  # eta
  local_learning_rate: float  # lambda
  option: int = 1  # FedResAvg: 1 (c = c_i = 0) or 2 (control variates).
  server_step: float = 1.0  # alpha; 1 for Naive and SGD.
  num_train_clients: int = 1  # N of the |S|/N rule.
  # Option II: the kernels of w whose c_i are kept as factors.
  factored_kernels: tuple[factored.FactoredKernel, ...] = ()
  # Their products with w and w - k eta c taken for many clients at once
  # (`factored.shared_products`; `factored.shareable` must hold).
  shared_products: bool = False

  @property
  def uses_control(self) -> bool:
    return self.variant == 'avg' and self.option == 2


def initial_client_state(hparams: Hyperparameters, initial_local_weights,
                         global_specs: Sequence[tf.TensorSpec]):
  """<local_model=theta_0[, control=0]> (c_i = 0, so round 1 of Option II is
  Option I's; a factored kernel's c_i is its zero factors)."""
  state = collections.OrderedDict(local_model=list(initial_local_weights))
  if hparams.uses_control:
    factored_at = {k.variable_index: k for k in hparams.factored_kernels}
    state['control'] = [
        factored_at[i].zeros() if i in factored_at else
        tf.zeros(s.shape, s.dtype) for i, s in enumerate(global_specs)]
  return state


def client_work(hparams: Hyperparameters) -> round_lib.ClientWork:
  """One sampled client's round of the chosen variant, as steps.

  The context is the client's `ResidualModel`; the message holds w
  (`global_weights`) and, for Option II, c (`control`); the client state
  theta_i (`local_model`) and, for Option II, c_i (`control`).

  - Naive (Algorithm 2): one pass of joint steps on (w_i, theta_i).
  - SGD (Algorithm 3): Step 1, a pass of local steps on theta with w fixed;
    then one step on w with the large-batch gradient of a second pass at
    (w, theta'): w_i - w = -eta K grad_w.
  - Avg (Algorithm 4): Step 1; then a second pass of K corrected steps on a
    copy of w with theta fixed; Option II's new c_i is the mean of those K
    gradients (a client without data keeps c_i).

  The result sends w_i - w (uniform weight) and, for Option II, sums
  c_i+ - c_i; its metrics are Step 1's (Naive: the joint steps') loss sum and
  examples, losses taken before each step. theta_i (and c_i) stay on the
  client as its new state. A client whose w_i - w or new state is not
  finite is dropped: it sends 0 (it still counts in the uniform mean, as a
  client without data), keeps theta_i (and c_i) and reports no metrics.

  With `hparams.factored_kernels` (Option II) those kernels' c_i are kept as
  factors and Step 2 takes their steps in factored form, as SCAFFOLD's
  (`factored`): Step 2 is SCAFFOLD's corrected SGD on w, and c_i+ the mean
  of its K_i gradients, A^T (D / K_i) for a Dense kernel. The kernel
  variable keeps w all round, so Step 1 reads w there; the kernel's
  w_i - w is sent as -K_i eta (c_i+ - c_i + c).
  """
  variant = hparams.variant
  eta, lam = hparams.learning_rate, hparams.local_learning_rate
  kernels = tuple(hparams.factored_kernels)
  if kernels and not hparams.uses_control:
    raise ValueError('factored control variates need FedResAvg option 2')
  # With all of w under control variates, a kernel's position among them is
  # its variable index.
  kernel_positions = [k.variable_index for k in kernels]
  factored_at = {p: j for j, p in enumerate(kernel_positions)}

  def dense_indices(model) -> tuple[int, ...]:
    """The variables of w that are not factored kernels."""
    return tuple(i for i in range(len(model.global_weights))
                 if i not in factored_at)

  def prepare(model, message):
    factored.start_group(
        model, [message['global_weights'][p] for p in kernel_positions],
        [message['control'][p] for p in kernel_positions])

  def start(model, message, client_state):
    dense = dense_indices(model)
    # The factored kernels keep w all round (`prepare`).
    assign([model.global_weights[i] for i in dense],
           [message['global_weights'][i] for i in dense])
    assign(model.local_weights, client_state['local_model'])
    carry = collections.OrderedDict(stats=_zero_stats())
    # FedResSGD's large-batch gradient and Option II's c_i+ sum the pass's
    # gradients; Option I uses neither.
    if variant == 'sgd' or hparams.uses_control:
      # Tuples, not lists: a loop would stack a list into one tensor.
      carry['gradient_sums'] = tuple(tf.zeros_like(model.global_weights[i])
                                     for i in dense)
      carry['gradient_examples'] = tf.constant(0, tf.int64)
      carry['gradient_steps'] = tf.constant(0, tf.int64)
    if variant == 'avg' and hparams.uses_control:
      # c_i - c once per client, not once per step (the same values).
      carry['client_minus_server'] = tuple(client_minus_server(
          [message['control'][i] for i in dense],
          [client_state['control'][i] for i in dense]))
    if kernels:
      factored.start_client(model, [client_state['control'][p]
                                    for p in kernel_positions])
    return carry

  def with_stats(carry, loss, n):
    carry = collections.OrderedDict(carry)
    carry['stats'] = _add_batch(carry['stats'], loss, n)
    return carry

  def joint_step(model, message, client_state, carry, batch):
    del message, client_state
    return with_stats(carry, *_joint_step(model, batch, eta, lam))

  def local_step(model, message, client_state, carry, batch):
    del message, client_state
    return with_stats(carry, *_local_step(model, batch, lam))

  def large_batch_gradient_step(model, message, client_state, carry, batch):
    del message, client_state
    gradients, n = _global_gradient(model, batch)
    carry = collections.OrderedDict(carry)
    carry['gradient_sums'] = tuple(
        s + tf.cast(n, tf.float32) * g
        for s, g in zip(carry['gradient_sums'], gradients))
    carry['gradient_examples'] = carry['gradient_examples'] + n
    carry['gradient_steps'] = carry['gradient_steps'] + 1
    return carry

  def corrected_global_step(model, message, client_state, carry, batch):
    del message, client_state
    difference = (list(carry['client_minus_server']) if hparams.uses_control
                  else None)
    if kernels:
      gradients = _factored_corrected_global_step(
          model, batch, eta, difference, carry['gradient_steps'],
          dense_indices(model))
    else:
      gradients = _corrected_global_step(model, batch, eta, difference)
    carry = collections.OrderedDict(carry)
    if hparams.uses_control:
      carry['gradient_sums'] = tuple(
          s + g for s, g in zip(carry['gradient_sums'], gradients))
      carry['gradient_steps'] = carry['gradient_steps'] + 1
    return carry

  def finish(model, message, client_state, carry):
    global_weights = message['global_weights']
    dense = dense_indices(model)
    if variant == 'sgd':
      denominator = tf.cast(tf.maximum(carry['gradient_examples'], 1),
                            tf.float32)
      scale = eta * tf.cast(carry['gradient_steps'], tf.float32)
      delta = [-scale * (s / denominator) for s in carry['gradient_sums']]
    else:
      # The factored kernels' w_i - w come from their factors, below.
      delta = [None] * len(global_weights)
      for i, v in zip(dense, _read([model.global_weights[i]
                                    for i in dense])):
        delta[i] = v - global_weights[i]
    new_state = collections.OrderedDict(
        local_model=_read(model.local_weights))
    differences = []  # The factored kernels' c_i+ - c_i.
    if hparams.uses_control:
      num_steps = carry['gradient_steps']
      denominator = tf.cast(tf.maximum(num_steps, 1), tf.float32)
      mean_gradient = dict(zip(dense, [s / denominator
                                       for s in carry['gradient_sums']]))
      if kernels:
        new_state['control'], differences = factored.new_control_variates(
            model, kernels, kernel_positions, num_steps,
            lambda p: mean_gradient[p], client_state['control'])
        # Checked below in place of the kernels' w_i - w: with c finite,
        # w_i - w = -K_i eta (c_i+ - c_i + c) is finite when c_i+ - c_i is.
        for kernel, difference in zip(kernels, differences):
          delta[kernel.variable_index] = difference
      else:
        new_state['control'] = updated_client_control(
            client_state['control'], [mean_gradient[i] for i in dense],
            num_steps)
    # A client whose w_i - w or new state is not finite (it diverged) is
    # dropped as FedAvg drops it (`non_finite`), in FedRes's uniform mean as
    # a client without data: w_i - w = 0, theta_i (and c_i) kept, no
    # metrics.
    (delta, _), dropped = non_finite.zero_all_if_any_non_finite(
        (delta, new_state))
    kept = tf.equal(dropped, 0)
    new_state = tf.cond(kept, lambda: new_state,
                        lambda: collections.OrderedDict(
                            (k, list(client_state[k])) for k in new_state))
    sums = collections.OrderedDict()
    if hparams.uses_control:
      updated = (tf.logical_and(carry['gradient_steps'] > 0, kept)
                 if kernels else None)
      sums['control_delta'] = [
          factored.control_variate_delta(
              updated, n, c,
              differences[factored_at[p]] if p in factored_at else None)
          for p, (n, c) in enumerate(zip(new_state['control'],
                                         client_state['control']))]
      # FedRes weighs every client 1.
      factored.set_model_updates(
          delta, kernels, kernel_positions, dropped, carry['gradient_steps'],
          eta, message_key='control', sums_key='control_delta',
          common_weight=1.0)
    loss_sum, num_examples, _ = carry['stats']
    loss_sum = tf.where(kept, loss_sum, 0.0)
    num_examples = tf.where(kept, num_examples, tf.zeros_like(num_examples))
    return round_lib.ClientResult(
        model_update=delta, weight=tf.constant(1.0), sums=sums,
        metrics=collections.OrderedDict(loss_sum=loss_sum,
                                        num_examples=num_examples),
        state=new_state)

  steps = {'naive': (joint_step,),
           'sgd': (local_step, large_batch_gradient_step),
           'avg': (local_step, corrected_global_step)}[variant]
  shared = None
  if hparams.shared_products:
    # Step 1 reads w (`factored.at_x`); Step 2's step k, w - k eta c.
    shared = factored.shared_products(
        kernels, lambda model, batch: model.global_inputs(batch[0]),
        lambda pass_index, step: tf.where(
            tf.equal(pass_index, 0), 0,
            tf.minimum(step, max(k.steps for k in kernels) - 1)),
        len(steps))
  return round_lib.ClientWork(start=start, steps=steps, finish=finish,
                              prepare=prepare if kernels else None,
                              shared_products=shared)
