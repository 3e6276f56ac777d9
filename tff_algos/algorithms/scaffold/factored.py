"""Control variates of Dense kernels kept as factors (SCAFFOLD Option II).

With Option II and plain SGD on the corrected variables, a client's new
control variate is the mean of the K gradients it took:
y = x - eta * sum_k (g_k - c_i + c), so
c_i+ = c_i - c + (x - y) / (K eta) = (1/K) sum_k g_k ([SCAFFOLD] Alg. 1
line 12). A Dense layer's kernel gradient on a batch is A_k^T D_k: the b_k
inputs the layer saw times the loss's gradient at its pre-activations. So a
kernel's c_i+ is exactly A^T E, with A the R = sum_k b_k input rows of the
client's steps and E their pre-activation gradients divided by K:
R * (inputs + units) numbers where the kernel has inputs * units. With
--client_steps K of batch B, R <= K * B; while that is below
inputs * units / (inputs + units) the factors are the smaller form, and the
client's state file, its reads, writes and checksums shrink with them (the
benchmark's first layer: 10 x 21232 floats against 21168 x 64, 0.85 MB
against 5.4 MB).

The client's steps never form the kernel's update either. With plain SGD
the kernel at step k is
W_k = x - eta sum_{j<k} A_j^T D_j + k eta A^T E - k eta c,
so the layer computes its pre-activations inputs W_k as
inputs x - k eta (inputs c) + (inputs [A; A_0..A_{k-1}]^T)
[k eta E; -eta D_0..D_{k-1}]: one product of the step's B rows with a
kernel-sized matrix (x - k eta c, formed once per group of clients), as
any forward pass has, and products of B rows with at most 2R. The kernel
variable keeps x all round; nothing kernel-sized is differentiated,
updated or written per step. At the end, c_i+ - c_i,
which the server sums, is one product of stacked factors, [A; A+]^T
[-E; E+], and the kernel's y - x follows from it: line 12 solved for y,
y - x = -K eta (c_i+ - c_i + c). (The other way round, the sum of
c_i+ - c_i from a y the steps formed, (x - y) / (K eta) - c, has a
rounding of eps |w| / (K eta) a client that does not cancel against the
stored factors', and c drifts from the mean of the c_i over the rounds:
1e-4 relative after 30 rounds at eta = 0.001.)

A kernel is kept as factors only where that is exact: a plain
`tf.keras.layers.Dense` of float32 whose kernel has a control variate, in a
Keras graph model without regularization losses (which would add their own
gradient at the kernel), with Option II and --client_steps, and whose
kernel one traced forward pass reads exactly once, as the right operand of
a product with float32 inputs of one row per example (`_single_products`).
Each step checks that the layer ran once, on at most B rows, within K
steps. In floats, these products round differently from dense steps;
`--factored_control_variates=false` keeps every c_i and step dense.

FedResAvg's Option II (`fedres.math`) keeps the c_i of its global model's
kernels the same way: its Step 2 is this corrected SGD on w, and its c_i+
the mean of Step 2's gradients.

Every client of a group then takes its products with the same kernel-sized
matrices, x and x - k eta c (FedResAvg's Step 1 with x too). Where the
layer's inputs are the model's inputs, reshaped (`shareable`), those
products are taken for a chunk of clients at once (`shared_products`, run
by `runtime.cohort`): oneDNN gives each row of a product of two rows or
more the same bits whatever the other rows, so a client computes what its
own batches' products give, and at the benchmark's 5 rows a batch the
shared product costs a fraction a row.
"""

import contextlib
import dataclasses
import weakref
from typing import Optional, Sequence

import tensorflow as tf

from tff_algos import tff_internals
from tff_algos.algorithms import round as round_lib


@dataclasses.dataclass(frozen=True)
class FactoredKernel:
  """A kernel whose control variate is kept as factors (A [rows, inputs],
  E [rows, units]), rows = steps * batch: batch rows a step, zero rows for
  a smaller batch."""
  variable_index: int  # In the model's trainable variables.
  steps: int
  batch: int
  inputs: int
  units: int

  @property
  def rows(self) -> int:
    return self.steps * self.batch

  def specs(self) -> tuple[tf.TensorSpec, tf.TensorSpec]:
    return (tf.TensorSpec([self.rows, self.inputs], tf.float32),
            tf.TensorSpec([self.rows, self.units], tf.float32))

  def zeros(self) -> tuple[tf.Tensor, tf.Tensor]:
    return tuple(tf.zeros(s.shape, s.dtype) for s in self.specs())


def _dense_layers(keras_model) -> list:
  """Plain Dense layers of the model (a subclass may compute otherwise)."""
  layers, seen = [], set()
  for module in [keras_model] + list(keras_model.submodules):
    if type(module) is tf.keras.layers.Dense and id(module) not in seen:  # pylint: disable=unidiomatic-typecheck
      seen.add(id(module))
      layers.append(module)
  return layers


def tff_model_parts(model) -> tuple[Optional[tf.keras.Model], list]:
  """(The Keras model, the trainable variables the kernels are indexed in)
  of a `from_keras_model` model."""
  return tff_internals.keras_model_of(model), model.trainable_variables


def _kernel_layers(model, parts=tff_model_parts
                   ) -> dict[int, tf.keras.layers.Dense]:
  """Variable index -> the plain Dense layer owning that kernel, for a
  Keras model without regularization losses: `parts(model)` gives the Keras
  model and the variables."""
  keras_model, variables = parts(model)
  if keras_model is None or keras_model.losses:
    return {}
  index = {v.ref(): i for i, v in enumerate(variables)}
  return {index[layer.kernel.ref()]: layer
          for layer in _dense_layers(keras_model)
          if layer.kernel.ref() in index}


# The most that one kernel's shifts x - k eta c may take in a client's
# model (`_Capture`); steps past them take one more product of their batch.
SHIFTED_KERNELS_BYTES = 64 << 20


def _shifted_kernels(kernel: FactoredKernel) -> int:
  """How many of x - k eta c (k = 1..K-1) a capture holds."""
  return min(kernel.steps - 1,
             SHIFTED_KERNELS_BYTES // (4 * kernel.inputs * kernel.units))


# A batch size the probe trace below gives the model: a layer whose input
# has another number of rows does not see one row per example.
_PROBE_ROWS = 7


def _single_products(keras_model) -> set:
  """Refs of the Dense kernels that one forward pass reads exactly once, as
  the right operand of a product whose left one is float32 with one row per
  example: then, and only then, their gradient on a batch is A^T D.

  Read from the graph of one traced call (batch of `_PROBE_ROWS`): a layer
  called twice, a kernel another layer also reads, inputs cast from another
  dtype or reshaped into other rows, all show there. A model without one
  known input shape (not a Keras graph model) gets none.
  """
  inputs = getattr(keras_model, 'inputs', None)
  if not inputs or len(inputs) != 1:
    return set()
  shape = tf.TensorShape([_PROBE_ROWS]).concatenate(inputs[0].shape[1:])
  if not shape.is_fully_defined():
    return set()
  graph = tf.function(
      lambda x: keras_model(x, training=True), autograph=False
  ).get_concrete_function(tf.TensorSpec(shape, inputs[0].dtype)).graph
  placeholders = {id(value): placeholder
                  for value, placeholder in graph.captures}
  found = set()
  for layer in _dense_layers(keras_model):
    placeholder = placeholders.get(id(layer.kernel.handle))
    if placeholder is None:
      continue
    reads = placeholder.consumers()
    if len(reads) != 1 or reads[0].type != 'ReadVariableOp':
      continue
    uses = reads[0].outputs[0].consumers()
    if len(uses) != 1 or uses[0].type != 'MatMul':
      continue
    product = uses[0]
    left = product.inputs[0]
    if (product.inputs[1] is reads[0].outputs[0]
        and not product.get_attr('transpose_a')
        and not product.get_attr('transpose_b')
        and left.dtype == tf.float32 and left.op.type != 'Cast'
        and left.shape.rank == 2 and left.shape[0] == _PROBE_ROWS):
      found.add(layer.kernel.ref())
  return found


def plan(model_fn, mask: Sequence[bool], steps: Optional[int], batch: int,
         parts=tff_model_parts) -> tuple[FactoredKernel, ...]:
  """The masked kernels whose control variates are smaller as factors of
  `steps` batches of at most `batch` rows (steps None: unbounded, none).
  `parts` as `_kernel_layers`' (the default: a tff.learning model)."""
  if steps is None:
    return ()
  with tf.Graph().as_default():
    model = model_fn()
    layers = _kernel_layers(model, parts)
    if not any(mask[i] for i in layers):
      return ()
    single_products = _single_products(parts(model)[0])
    kernels = []
    for i, layer in sorted(layers.items()):
      inputs, units = (int(d) for d in layer.kernel.shape)
      if not (mask[i] and layer.kernel_regularizer is None
              and layer.dtype_policy.compute_dtype == 'float32'
              and layer.kernel.dtype == tf.float32
              and layer.kernel.ref() in single_products):
        continue
      if steps * batch * (inputs + units) < inputs * units:
        kernels.append(FactoredKernel(i, steps, batch, inputs, units))
  return tuple(kernels)


def positions(mask: Sequence[bool], kernels: Sequence[FactoredKernel]
              ) -> list[int]:
  """Each kernel's place in the list of control variates (one per masked
  variable, in variable order)."""
  masked = [i for i, m in enumerate(mask) if m]
  return [masked.index(k.variable_index) for k in kernels]


class _Capture:
  """One factored kernel's layer in a client's model, computing its calls
  from the round's factors.

  `rows` holds 2R input rows: the A of the client's c_i [0, R), then the
  round's, batch by batch at the step's place [R, 2R): the A of c_i+.
  `right` holds the matching right factors: c_i's E, then each step's raw
  D_k. The kernel variable keeps the server's x all round: at step k the
  layer computes inputs W_k with
  W_k = x - eta sum_{j<k} A_j^T D_j + k eta A^T E - k eta c, as
  inputs (x - k eta c) + (inputs [A; A_0..A_{k-1}]^T)
  [k eta E; -eta D_0..D_{k-1}], which never forms a kernel-sized update:
  x - k eta c is the same for every client of a group, and `shifted` holds
  it for k = 1..J, set once per group (`start_group`). J is K - 1 unless
  those J kernels would take more than `SHIFTED_KERNELS_BYTES`; a step past
  J computes inputs (x - J eta c) - (k - J) eta (inputs c).
  A zero `probe` added to the layer's pre-activations has the loss's
  gradient there (D_k) as its gradient. Variables, not tensors:
  tff.learning's forward pass runs the Keras model inside a tf.function of
  its own, whose tensors the client's step cannot reach; a variable's value
  and gradient cross that boundary.
  """

  def __init__(self, layer, kernel: FactoredKernel, learning_rate: float):
    self.layer = layer
    self.kernel = kernel
    self.learning_rate = float(learning_rate)
    zeros = lambda *shape: tf.Variable(tf.zeros(shape), trainable=False)
    self.rows = zeros(2 * kernel.rows, kernel.inputs)
    self.right = zeros(2 * kernel.rows, kernel.units)
    self.shifted = [zeros(kernel.inputs, kernel.units)
                    for _ in range(_shifted_kernels(kernel))]
    # c itself, for the steps past the shifted kernels.
    self.server_control_variate = (
        zeros(kernel.inputs, kernel.units)
        if len(self.shifted) < kernel.steps - 1 else None)
    self.probe = zeros(kernel.batch, kernel.units)
    self.step = tf.Variable(0, trainable=False)
    self.calls = tf.Variable(0, trainable=False)
    # Dense.call, for passes traced under `at_x` (only plain Dense layers
    # are captured).
    self.plain_call = tf.keras.layers.Dense.call.__get__(layer)
    self.traces_at_x = False
    # With products shared by a group's clients (`shared_products`): a
    # chunk's products inputs x (or x - k eta c) of its recorded batches,
    # their rows in reading order, where each batch's rows start, and the
    # batch whose step runs.
    self.table = None
    self.table_starts = None
    self.table_row = None
    self.left_operand = None  # The model's inputs -> this layer's inputs.

  def step_start(self, step) -> tf.Tensor:
    """The first row of step `step`'s batch in `rows` and `right`."""
    return self.kernel.rows + step * self.kernel.batch

  def call(self, inputs, *args, **kwargs):
    """Dense.call for float32 inputs of rank 2 at the step's weights W_k
    (its ops, in its order), plus the probe."""
    if self.traces_at_x:
      if self.table is None:
        return self.plain_call(inputs, *args, **kwargs)
      # Dense.call's ops after its product, in its order.
      outputs = self._table_rows(inputs)
      if self.layer.use_bias:
        outputs = tf.nn.bias_add(outputs, self.layer.bias)
      if self.layer.activation is not None:
        outputs = self.layer.activation(outputs)
      return outputs
    del args, kwargs  # Dense.call takes none.
    layer, batch = self.layer, self.kernel.batch
    inputs = tf.convert_to_tensor(inputs)
    if inputs.dtype != tf.float32 or inputs.shape.rank != 2:
      raise ValueError(
          f'Dense layer {layer.name} got inputs {inputs.dtype.name}'
          f'{inputs.shape}, not float32 of rank 2; pass '
          '--factored_control_variates=false')
    rows = tf.shape(inputs)[0]
    step = self.step.read_value()
    fits = [
        tf.debugging.assert_less_equal(
            rows, batch, message=f'Dense layer {layer.name} got a batch of '
            f'more than --client_batch_size={batch} rows; pass '
            '--factored_control_variates=false'),
        tf.debugging.assert_less(
            step, self.kernel.steps, message='a client took more than '
            f'--client_steps={self.kernel.steps} steps; pass '
            '--factored_control_variates=false')]
    with tf.control_dependencies(fits):
      if self.table is None:
        outputs = self._shifted_product(inputs, step)
      else:
        outputs = self._table_rows(inputs)
      # Step 0 is at x itself.
      outputs = tf.cond(step > 0,
                        lambda: outputs + self._update_product(inputs, step),
                        lambda: outputs)
      recorded = [
          _write_rows(self.rows, self.step_start(step),
                      tf.pad(inputs, [[0, batch - rows], [0, 0]])),
          self.calls.assign_add(1)]
    if layer.use_bias:
      outputs = tf.nn.bias_add(outputs, layer.bias)
    with tf.control_dependencies(recorded):
      outputs = outputs + self.probe[:rows]
    if layer.activation is not None:
      outputs = layer.activation(outputs)
    return outputs

  def _table_rows(self, inputs) -> tf.Tensor:
    """The selected batch's rows of the shared products (`inputs`' rows)."""
    start = self.table_starts.sparse_read(self.table_row.read_value())
    return tf.slice(self.table.read_value(), tf.stack([start, 0]),
                    tf.stack([tf.shape(inputs)[0], -1]))

  def _shifted_product(self, inputs, step) -> tf.Tensor:
    """inputs (x - k eta c)."""
    kernels = [self.layer.kernel] + self.shifted
    shifts = len(self.shifted)
    shift = tf.minimum(step, shifts)
    outputs = round_lib.switch(shift, [lambda v=v: tf.matmul(inputs, v)
                                       for v in kernels])
    if self.server_control_variate is None:
      return outputs
    return tf.cond(step > shifts, lambda: outputs - (
        tf.cast(step - shifts, tf.float32) * self.learning_rate) * tf.matmul(
            inputs, self.server_control_variate), lambda: outputs)

  def _update_product(self, inputs, step) -> tf.Tensor:
    """inputs (W_k - x + k eta c), from the factors of the client's earlier
    steps."""
    eta = self.learning_rate
    steps_times_eta = tf.cast(step, tf.float32) * eta
    known = self.step_start(step)  # c_i's rows and the earlier steps'.
    scale = tf.concat([tf.fill([self.kernel.rows], steps_times_eta),
                       tf.fill([known - self.kernel.rows], -eta)], 0)
    right = _read_rows(self.right)[:known] * scale[:, None]
    return tf.matmul(
        tf.matmul(inputs, _read_rows(self.rows)[:known], transpose_b=True),
        right)


def _write_rows(variable: tf.Variable, first, rows: tf.Tensor
                ) -> tf.Operation:
  """variable[first:first + len(rows)] = rows, in place.

  A scatter: a strided-slice assignment measured 25x slower here (0.2 ms
  for 5 rows of the benchmark's layer)."""
  return tf.raw_ops.ResourceScatterUpdate(
      resource=variable.handle,
      indices=tf.range(first, first + tf.shape(rows)[0]), updates=rows)


def _read_rows(variable: tf.Variable) -> tf.Tensor:
  """The value of a variable `_write_rows` writes, without a copy.

  A scatter puts its variable in copy-on-read mode, in which every read
  copies it (TF's guard against reads racing concurrent scatters): 1.7 MB
  three times a client on the benchmark's first layer, 0.7 ms of a
  FedResAvg client's 13. Out of that mode a read shares the buffer, and a
  scatter that finds the buffer still shared copies it before it writes
  (TF's copy-on-write), so readers never see a later write either way.
  The ops of one variable run in program order; where a read's value still
  lives at the next scatter (e.g. kept for a gradient), that scatter copies
  in place of the read."""
  with tf.control_dependencies(
      [tf.raw_ops.DisableCopyOnRead(resource=variable.handle)]):
    return variable.read_value()


_captures = weakref.WeakKeyDictionary()


def install(model, kernels: Sequence[FactoredKernel],
            learning_rate: float, parts=tff_model_parts,
            shared: bool = False) -> None:
  """Makes `kernels`' layers of this client model compute their calls from
  the round's factors (plain SGD at `learning_rate`); `parts` as
  `plan`'s. `shared`: their products with x and x - k eta c come from
  `shared_products` (`shareable` must hold).

  Called where the client's model is built (its variables are made there,
  outside any loop)."""
  if not kernels:
    return
  layers = _kernel_layers(model, parts)
  found = []
  for kernel in kernels:
    capture = _Capture(layers[kernel.variable_index], kernel, learning_rate)
    capture.layer.call = capture.call
    if shared:
      capture.left_operand = _left_operand_model(parts(model)[0],
                                                 capture.layer)
      capture.table = tf.Variable(
          tf.zeros([0, kernel.units]), trainable=False,
          shape=tf.TensorShape([None, kernel.units]))
      capture.table_starts = tf.Variable(
          tf.zeros([0], tf.int32), trainable=False,
          shape=tf.TensorShape([None]))
      capture.table_row = tf.Variable(0, trainable=False)
    found.append(capture)
  _captures[model] = found


# Layers that only reshape their inputs: a kernel behind nothing else takes
# inputs that no step changes.
_RESHAPING_LAYERS = (tf.keras.layers.InputLayer, tf.keras.layers.Flatten,
                     tf.keras.layers.Reshape)

# The most a chunk of clients' held first-layer inputs may take
# (`shared_products`): a chunk of the benchmark's clients is 19.
SHARED_CHUNK_BYTES = 32 << 20


def _left_operand_model(keras_model, layer) -> Optional[tf.keras.Model]:
  """The model's inputs -> `layer`'s inputs, if only reshaping layers
  without weights lie between; else None."""
  inputs = getattr(keras_model, 'inputs', None)
  if not inputs or len(inputs) != 1:
    return None
  try:
    left = tf.keras.Model(inputs, layer.input)
  except (AttributeError, ValueError):
    return None
  if left.weights or not all(isinstance(l, _RESHAPING_LAYERS)
                             for l in left.layers):
    return None
  return left


def shareable(model_fn, kernels: Sequence[FactoredKernel],
              parts=tff_model_parts) -> bool:
  """Whether a group's clients can share the kernels' products with x and
  x - k eta c (`shared_products`): each kernel's layer takes the model's
  inputs through reshapes alone (so no step changes them), batches have
  B >= 2 rows (oneDNN rounds a one-row product as another kernel, where a
  row of any product of two or more rows comes out the same), and every
  step's shifted kernel is held."""
  if not kernels:
    return False
  with tf.Graph().as_default():
    model = model_fn()
    layers = _kernel_layers(model, parts)
    for kernel in kernels:
      layer = layers.get(kernel.variable_index)
      if (layer is None or kernel.batch < 2
          or _shifted_kernels(kernel) < kernel.steps - 1
          or _left_operand_model(parts(model)[0], layer) is None):
        return False
  return True


def shared_products(kernels: Sequence[FactoredKernel], model_inputs,
                    operand_index, passes: int) -> round_lib.SharedProducts:
  """The kernels' products with x and x - k eta c, taken for a chunk of a
  group's clients at once (`round_lib.SharedProducts`).

  `model_inputs(model, batch)`: the inputs of the Keras model holding the
  kernels; `operand_index(pass, step)`: which product a batch's step takes,
  0 for x (`at_x` passes and step 0) or k for x - k eta c. A row of these
  products is the one a batch's own product gives (`shareable`), so a
  client's results do not depend on its chunk or group.

  Each batch's layer inputs are held with the others of its operand (one
  product each, no copy to sort them); the products go into one table in
  reading order, where a batch's step finds its rows (`select`).
  """
  rows_per_client = passes * max(k.steps * k.batch * k.inputs * 4
                                 for k in kernels)
  clients_per_chunk = max(1, SHARED_CHUNK_BYTES // rows_per_client)

  def initial(model):
    acc = []
    for capture in captures(model):
      # Each starts with a zero row, so that no product is of one row
      # alone (it would round as a one-row product does); its product row
      # is dropped.
      held = tuple(
          tf.TensorArray(tf.float32, size=0, dynamic_size=True,
                         infer_shape=False,
                         element_shape=[None, capture.kernel.inputs]
                         ).write(0, tf.zeros([1, capture.kernel.inputs]))
          for _ in range(1 + len(capture.shifted)))
      # Each recorded batch's operand and rows, in reading order.
      batches = tf.TensorArray(tf.int32, size=0, dynamic_size=True,
                               element_shape=[2])
      acc.append((held, batches))
    return acc

  def record(model, acc, pass_index, step, batch):
    inputs = model_inputs(model, batch)
    operand = tf.cast(operand_index(pass_index, step), tf.int32)
    recorded = []
    for capture, (held, batches) in zip(captures(model), acc, strict=True):
      left = capture.left_operand(inputs, training=True)
      rows = tf.shape(left, out_type=tf.int32)[0]
      # All rows with their operand's, none with the others' (a slice of
      # leading rows shares the buffer): no branch to run a batch.
      held = tuple(
          array.write(array.size(), left[:tf.where(tf.equal(operand, j),
                                                   rows, 0)])
          for j, array in enumerate(held))
      recorded.append((held, batches.write(batches.size(),
                                           tf.stack([operand, rows]))))
    return recorded

  def compute(model, acc):
    for capture, (held, batches) in zip(captures(model), acc, strict=True):
      batches = batches.stack()
      operands, rows = batches[:, 0], batches[:, 1]
      ends = tf.cumsum(rows)
      starts = ends - rows
      positions, products = [], []
      for j, operand in enumerate([capture.layer.kernel] + capture.shifted):
        mine = tf.equal(operands, j)
        positions.append(tf.ragged.range(
            tf.boolean_mask(starts, mine),
            tf.boolean_mask(ends, mine)).flat_values)
        products.append(tf.matmul(held[j].concat(), operand)[1:])
      capture.table.assign(tf.dynamic_stitch(positions, products))
      capture.table_starts.assign(starts)

  def select(model, index):
    for capture in captures(model):
      capture.table_row.assign(index)

  return round_lib.SharedProducts(
      initial=initial, record=record, compute=compute, select=select,
      clients_per_chunk=clients_per_chunk)


def captures(model) -> list[_Capture]:
  return _captures.get(model, [])


def start_group(model, kernels_x, server_control_variates) -> None:
  """Sets the kernels to x and their shifts x - k eta c, once for a
  group's clients: no client changes them."""
  for capture, x, server in zip(captures(model), kernels_x,
                                server_control_variates, strict=True):
    capture.layer.kernel.assign(x)
    for k, shifted in enumerate(capture.shifted, 1):
      shifted.assign(x - (k * capture.learning_rate) * server)
    if capture.server_control_variate is not None:
      capture.server_control_variate.assign(server)


def start_client(model, control_variates) -> None:
  """A client's first rows: its c_i's factors. (The round's rows are
  written by its steps; `new_state` zeroes the rows of steps it did not
  take.)"""
  for capture, (inputs, gradients) in zip(captures(model), control_variates,
                                          strict=True):
    _write_rows(capture.rows, 0, inputs)
    _write_rows(capture.right, 0, gradients)


def forward_and_gradients(model, batch, variables, step: tf.Tensor):
  """The training forward pass of `batch` as the client's step `step` and
  the gradients of its loss at `variables` (a tff.learning model's;
  `recorded_gradients`)."""

  def forward():
    output = model.forward_pass(batch, training=True)
    return output, output.loss

  return recorded_gradients(model, forward, variables, step)


def recorded_gradients(model, forward, variables, step: tf.Tensor):
  """`forward()` -> (output, loss), run as the client's step `step`, and
  the gradients of the loss at `variables`: (output, gradients). Records,
  per captured layer, the loss's gradient at its pre-activations
  ([batch, units], zero rows past the batch). Checks that each captured
  layer ran once."""
  found = captures(model)
  for capture in found:
    capture.calls.assign(0)
    capture.step.assign(tf.cast(step, tf.int32))
  with tf.GradientTape() as tape:
    for capture in found:  # Not trainable: the tape would not watch it.
      tape.watch(capture.probe)
    output, loss = forward()
  gradients = tape.gradient(loss, list(variables) + [c.probe for c in found])
  for capture, gradient in zip(found, gradients[len(variables):]):
    once = tf.debugging.assert_equal(
        capture.calls, 1, message=f'Dense layer {capture.layer.name} ran '
        'other than once in a forward pass; pass '
        '--factored_control_variates=false')
    if gradient is None:  # The layer does not reach the loss.
      gradient = tf.zeros_like(capture.probe)
    with tf.control_dependencies([once]):
      _write_rows(capture.right, capture.step_start(tf.cast(step, tf.int32)),
                  gradient)
  return output, gradients[:len(variables)]


def new_state(capture: _Capture, num_steps: tf.Tensor
              ) -> tuple[tf.Tensor, tf.Tensor]:
  """c_i+ as (A, D / K_i): A^T (D / K_i) is the mean of the K_i
  gradients."""
  kernel = capture.kernel
  steps = tf.cast(num_steps, tf.int32)
  # The rows past the client's steps hold an earlier client's, which may
  # not be finite: zeroed, for a client that took fewer than K steps.
  end = 2 * kernel.rows
  first_unused = capture.step_start(steps)

  def zero_unused_rows():
    unused = end - first_unused
    with tf.control_dependencies([
        _write_rows(capture.rows, first_unused,
                    tf.zeros([unused, kernel.inputs])),
        _write_rows(capture.right, first_unused,
                    tf.zeros([unused, kernel.units]))]):
      return tf.constant(True)

  zeroed = tf.cond(steps < kernel.steps, zero_unused_rows,
                   lambda: tf.constant(False))
  with tf.control_dependencies([zeroed]):
    inputs = _read_rows(capture.rows)[kernel.rows:]
    gradients = _read_rows(capture.right)[kernel.rows:]
  return inputs, gradients / tf.cast(num_steps, tf.float32)


def difference(capture: _Capture, new, old) -> tf.Tensor:
  """c_i+ - c_i = A+^T E+ - A^T E, one product over the rows of both (read
  after `new_state`), so that c stays the mean of the stored c_i to the
  rounding of these products."""
  with tf.control_dependencies([new[0]]):
    inputs = _read_rows(capture.rows)
  return tf.matmul(inputs, tf.concat([-old[1], new[1]], 0), transpose_a=True)


def _update_scale(num_steps: tf.Tensor, learning_rate: float) -> tf.Tensor:
  return -tf.cast(num_steps, tf.float32) * learning_rate


def model_update(difference_: tf.Tensor, num_steps: tf.Tensor,
                 learning_rate: float, position: int,
                 message_key: str = 'control_variate',
                 summed_as: Optional[tuple[str, int]] = None,
                 common: Optional[tuple[float, int]] = None
                 ) -> round_lib.AffineUpdate:
  """The kernel's y - x = -K_i eta (c_i+ - c_i + c) ([SCAFFOLD] Alg. 1
  line 12 solved for y; the steps never formed y), c being the message's
  control variate at `position` of `message_key`: the runtime sums the
  K_i eta (c_i+ - c_i) and adds the c part once per group. With
  `summed_as`, the client's sums entry that holds the same c_i+ - c_i, and
  `common` = (weight, K) of most clients, the runtime sums that entry once
  for both (`round_lib.AffineUpdate`)."""
  common_scale = None
  if summed_as is not None:
    weight, steps = common
    common_scale = lambda: (tf.constant(weight, tf.float32) *
                            _update_scale(tf.constant(steps), learning_rate))
  return round_lib.AffineUpdate(
      tensor=difference_,
      scale=_update_scale(num_steps, learning_rate),
      offset=lambda message: message[message_key][position],
      summed_as=summed_as, common_scale=common_scale)


def set_model_updates(model_delta: list, kernels: Sequence[FactoredKernel],
                      kernel_positions: Sequence[int], dropped: tf.Tensor,
                      num_steps: tf.Tensor, learning_rate: float,
                      message_key: str = 'control_variate',
                      sums_key: Optional[str] = None,
                      common_weight: Optional[float] = None) -> None:
  """Replaces each kernel's entry of `model_delta` (its c_i+ - c_i, zeroed
  for a dropped client) by its `model_update`. `sums_key`: the client's
  sums entry holding every position's c_i+ - c_i as the kernels' entries
  (zero for a client that keeps c_i, as is its update); `common_weight`:
  the client weight when it is the same for every client that takes all
  K steps (None when it varies)."""
  # A dropped client's update is zero: so is its scale (its c_i+ - c_i
  # was zeroed; c would remain).
  update_steps = tf.where(tf.equal(dropped, 0), num_steps,
                          tf.zeros_like(num_steps))
  shared = sums_key is not None and common_weight is not None
  for kernel, position in zip(kernels, kernel_positions):
    model_delta[kernel.variable_index] = model_update(
        model_delta[kernel.variable_index], update_steps, learning_rate,
        position, message_key,
        summed_as=(sums_key, position) if shared else None,
        common=(common_weight, kernel.steps) if shared else None)


def new_control_variates(model, kernels: Sequence[FactoredKernel],
                         kernel_positions: Sequence[int],
                         num_steps: tf.Tensor, dense_new, old):
  """(c_i+, the kernels' c_i+ - c_i) of a client that took `num_steps`
  steps: the kernels' c_i+ as factors (`new_state`), the others'
  `dense_new(position)`; (c_i, zeros) of a client that took none. `old`:
  the client's c_i, one entry per position."""
  found = captures(model)
  capture_at = dict(zip(kernel_positions, found))

  def trained_client():
    new = [new_state(capture_at[p], num_steps) if p in capture_at
           else dense_new(p) for p in range(len(old))]
    return new, [difference(capture, new[p], old[p])
                 for capture, p in zip(found, kernel_positions)]

  def untrained_client():
    return list(old), [tf.zeros([k.inputs, k.units]) for k in kernels]

  return tf.cond(num_steps > 0, trained_client, untrained_client)


def control_variate_delta(updated: tf.Tensor, new, old,
                          difference_: Optional[tf.Tensor]) -> tf.Tensor:
  """c_i+ - c_i; exactly zero for a client that keeps c_i (a product of
  stacked factors would not cancel exactly). `difference_`: a factored
  kernel's product of factors, or None for a dense c_i."""
  if difference_ is None:
    return new - old
  return tf.cond(updated, lambda: difference_,
                 lambda: tf.zeros_like(difference_))


@contextlib.contextmanager
def at_x(model):
  """Forward passes traced inside compute the captured layers as plain
  Dense layers at x (their kernel variables hold x all round) and record
  nothing: passes that are not the client's steps, such as FedResAvg's
  Step 1 before them. Its steps took the first step's place and ops
  (recording, checks, the probe), which a step then rewrote: 50 ops a
  FedResAvg client of K = 2, at 7-9 us of the executor's each besides
  their work. The choice is made when a pass is traced: a tf.function
  traced earlier keeps the path it was traced with."""
  found = captures(model)
  before = [capture.traces_at_x for capture in found]
  for capture in found:
    capture.traces_at_x = True
  try:
    yield
  finally:
    for capture, value in zip(found, before):
      capture.traces_at_x = value


def fixed_on_resume(factorable: Sequence[FactoredKernel],
                    kernels: Sequence[FactoredKernel]) -> dict[str, str]:
  """The flags a resumed run may not change (`RoundDefinition`), given the
  kernels that could be factored and those that are."""
  fixed = {}
  if factorable:
    # Runs started before the flag existed kept every c_i dense
    # (binaries.flags_lib.VALUES_BEFORE_FLAG).
    fixed['factored_control_variates'] = (
        'the stored client states hold each c_i in the form the run chose; '
        'a run from before this flag existed kept them dense: '
        '--factored_control_variates=false')
  if kernels:
    fixed.update(dict.fromkeys(
        ('client_steps', 'client_batch_size'),
        'the stored factored c_i have --client_steps x --client_batch_size '
        'rows'))
  return fixed


def dense(factors) -> tf.Tensor:
  """A^T E."""
  inputs, scaled_gradients = factors
  return tf.matmul(inputs, scaled_gradients, transpose_a=True)
