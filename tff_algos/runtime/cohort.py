"""A group of a round's clients, run as one compiled TF computation.

Under TFF, a TFF client stands for a group of the round's clients; the
native runtime runs the cohort as groups too. A group's computation streams
the batches of all its clients through ONE tf.data pipeline (each client's
dataset built from its (id, seed), in order, each pass of a client followed
by an end-of-pass marker) and loops over that stream inside the graph: a
loop over the group's clients reads a client's state and starts its work
(`ClientWork.start`), runs one inner loop per pass that takes a step per
batch up to the pass's marker, then finishes, writes the client's new state
and adds its results into the group's sums.

Why nested loops, not one loop over the stream that branches on what an
element is: TF lowers a `tf.cond` in a loop to switches, and its executor
visits every op of a branch not taken, as dead, at every iteration. With
one loop, each batch's step visited the ops of every other pass's step and
of the client's finish; a FedResAvg client's 6 loop iterations spent about
1.3 ms on that, 7% of its work (TF profile of the benchmark's rounds).
Each inner loop holds one pass's step, and the finish runs once a client.
Nor a cond inside an inner loop: each iteration steps on the batch the one
before it read and then reads the next, and the loop's condition stops at
the marker. A cond around the step passed the carry and every value the
step reads through switches at each batch: without it a benchmark client
runs 11% (FedAvg) to 20% (FedResAvg) fewer ops (TF profile: 624 against
698, 1303 against 1638), the same computing ops in the same order (the same
results); the rounds' time moved within the machine's noise.

Why one stream: making a tf.data iterator instantiates the pipeline's
functions (each `map`), and TF optimizes every instantiated function with
grappler - about 10 ms a `map` per client here, more than a small model's
training steps. Inner iterators of one stream share its function cache, so
a group pays that once. The stream's own `flat_map` function is marked to be
instantiated without grappler (`single_device_flat_map`): its iterator,
made once per group and round, cost 35-63 ms with it. With the per-client
loop inside the graph, no per-client call, dispatch or value crosses the
runtime either, and one client's weights at a time are live, which keeps a
CPU round compute-bound.

A work with `shared_products` (`round_lib.SharedProducts`: FedResAvg's
factored first layer, whose products with w and w - k eta c every client of
a group takes) runs its clients a chunk at a time: the chunk's batches are
read from the stream and held, the products of all of them computed at once
(one product of many clients' rows costs a fraction a row of one of a
batch's 5 rows: `benchmarks.weight_passes`), then the clients' steps run on
the held batches, each step reading its rows of those products.

A group's result (an OrderedDict):
  model_update      sum_i w_i * u_i over its clients, or, for a group of one
                    client fed to a per-client aggregator, u_i itself (an
                    `AffineUpdate` part of u_i, scale * (t_i + offset), is
                    summed as sum_i w_i scale_i t_i plus
                    (sum_i w_i scale_i) offset)
  weight            sum_i w_i (w_i for a per-client group)
  num_clients       clients in the group (int32)
  sums              the algorithm's sums over the group
  measurements      its summed measurements (not sent by a deployed client)
  metrics           its summed unfinalized metrics
  model_update_sum  sum_i u_i (algorithms that ask for it)
  client_costs      summed analytic costs (tasks that model them)

Each client computes exactly what it computes alone; only the order of float
additions across clients depends on the grouping.
"""

import collections
import os
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from pipeline.errors import UsageError
from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import client_states
from tff_algos.runtime import single_device_flat_map


def _weighted(update, weight):
  """(w * u, with each `AffineUpdate` scale * (tensor + offset) as
  (w * scale) * tensor; the w * scale; [(flat index, AffineUpdate)] of
  those; {flat index: (w * scale - common, tensor)} of those with a common
  scale (`AffineUpdate.summed_as`), whose entries of w * u are their tensor
  only for its shape: `_add_contribution` adds them)."""
  flat = tf.nest.flatten(update)
  weighted, scales, affine, residuals = [], [], [], {}
  for index, u in enumerate(flat):
    if isinstance(u, round_lib.AffineUpdate):
      scale = tf.cast(weight, u.scale.dtype) * u.scale
      if u.summed_as is not None:
        residuals[index] = (tf.cast(scale - u.common_scale(), u.tensor.dtype),
                            u.tensor)
        weighted.append(u.tensor)
      else:
        weighted.append(u.tensor * tf.cast(scale, u.tensor.dtype))
      scales.append(scale)
      affine.append((index, u))
    else:
      weighted.append(u * tf.cast(weight, u.dtype))
  return (tf.nest.pack_sequence_as(update, weighted), scales, affine,
          residuals)


def _add_contribution(total, part, residuals):
  """total + part; an entry of `residuals` ({flat index of the model
  update: (coefficient, tensor)}) adds coefficient * tensor, and nothing
  (no pass over the tensor) when the coefficient is 0."""
  if not residuals:
    return _add(total, part)
  summed = collections.OrderedDict(
      (key, value if key == 'model_update' else _add(value, part[key]))
      for key, value in total.items())
  flat = tf.nest.flatten(total['model_update'])
  for index, value in enumerate(tf.nest.flatten(part['model_update'])):
    if index in residuals:
      coefficient, tensor = residuals[index]
      flat[index] = tf.cond(
          tf.not_equal(coefficient, 0.0),
          lambda t=flat[index], c=coefficient, x=tensor: t + c * x,
          lambda t=flat[index]: t)
    else:
      flat[index] = flat[index] + value
  summed['model_update'] = tf.nest.pack_sequence_as(total['model_update'],
                                                    flat)
  return summed


def _add_affine_parts(total, affine, message):
  """The group's sum of w_i * u_i: each `AffineUpdate`'s part gets its
  (sum_i w_i scale_i) offset and, with a common scale, common * the group's
  sum of its `summed_as` entry."""
  total = collections.OrderedDict(total)
  scales = total.pop(_UPDATE_SCALES)
  flat = tf.nest.flatten(total['model_update'])
  for scale, (index, u) in zip(scales, affine, strict=True):
    value = u.offset(message)
    flat[index] = flat[index] + tf.cast(scale, value.dtype) * value
    if u.summed_as is not None:
      key, position = u.summed_as
      flat[index] = flat[index] + tf.cast(
          u.common_scale(), value.dtype) * total['sums'][key][position]
  total['model_update'] = tf.nest.pack_sequence_as(total['model_update'],
                                                   flat)
  return total


# The contribution's entry of its `AffineUpdate` scales, summed by the
# group and spent at its end (`_add_affine_parts`).
_UPDATE_SCALES = 'update_scales'


def _add(a, b):
  return tf.nest.map_structure(tf.add, a, b)


def empty_batch(element_spec):
  """A batch of no examples with `element_spec`'s structure (a marker's)."""
  return tf.nest.map_structure(
      lambda spec: tf.zeros([0 if d is None else d for d in spec.shape],
                            spec.dtype), element_spec)


def group_stream(client_dataset_fn: Callable, ids: tf.Tensor,
                  seeds: tf.Tensor, passes: int) -> tf.data.Dataset:
  """((client index, pass, end-of-pass marker?), batch) of a group, in order.

  Each batch is zipped with its tag rather than mapped to one: a `map` is a
  function every client's iterator instantiates and calls per batch.
  """

  def client_elements(index, client_id, seed):
    dataset = client_dataset_fn(client_id, seed)
    marker_batch = empty_batch(dataset.element_spec)
    elements = None
    for pass_index in range(passes):
      # Each pass iterates the same dataset again, as a second loop over a
      # dataset value does (a shuffled dataset reshuffles).
      pass_tensor = tf.constant(pass_index, tf.int32)
      tags = tf.data.Dataset.from_tensors(
          (index, pass_tensor, tf.constant(False))).repeat()
      marker = tf.data.Dataset.from_tensors(
          ((index, pass_tensor, tf.constant(True)), marker_batch))
      part = tf.data.Dataset.zip((tags, dataset)).concatenate(marker)
      elements = part if elements is None else elements.concatenate(part)
    return elements

  indices = tf.range(tf.shape(ids, out_type=tf.int32)[0])
  options = tf.data.Options()
  # The same options as the task's client pipelines (tasks.base): the group
  # stream is iterated once.
  options.experimental_optimization.apply_default_optimizations = False
  options.autotune.enabled = False
  return single_device_flat_map.flat_map(
      tf.data.Dataset.from_tensor_slices((indices, ids, seeds)),
      client_elements).with_options(options)


def build_group_update(definition: round_lib.RoundDefinition,
                       client_dataset_fn: Callable,
                       state_format: Optional[client_states.StateFormat],
                       client_cost_fn: Optional[Callable] = None,
                       per_client: bool = False) -> Callable:
  """Returns `bind(context) -> run(message, round_num, group) -> result`.

  `context` is the definition's client context, built once per computation.
  `group` holds `ids` (string [G]), `seeds` (int64 [G]) and, with client
  state, `versions` (int64 [G]: the version each client reads, -1 for the
  initial state); new states are written as version `round_num`. With
  `per_client` the group must hold one client and the result carries its
  update unweighted (for aggregators that work per client).
  """
  if definition.has_client_state and state_format is None:
    raise ValueError(f'{definition.name} keeps client state: pass a store')
  work = definition.client_work
  stateful = definition.has_client_state

  def contribution(result: round_lib.ClientResult, message, costs):
    """(The client's part of the group's result, the `AffineUpdate`s whose
    offsets the group adds at its end: [(flat index, AffineUpdate)], the
    model-update entries `_add_contribution` adds: {flat index:
    (coefficient, tensor)})."""
    affine, residuals = [], {}
    if per_client:
      model_update = round_lib.dense_update(result.model_update, message)
    else:
      model_update, scales, affine, residuals = _weighted(
          result.model_update, result.weight)
    out = collections.OrderedDict(
        model_update=model_update,
        weight=tf.cast(result.weight, tf.float32),
        num_clients=tf.constant(1, tf.int32),
        sums=collections.OrderedDict(result.sums),
        measurements=collections.OrderedDict(result.measurements),
        metrics=result.metrics)
    if affine:
      out[_UPDATE_SCALES] = scales
    if definition.sums_model_update:
      out['model_update_sum'] = round_lib.dense_update(result.model_update,
                                                       message)
    if costs is not None:
      out['client_costs'] = collections.OrderedDict(costs)
    return out, affine, residuals

  def bind(context):

    def read_state(group, index):
      if not stateful:
        return ()
      return state_format.read(group['ids'][index], group['versions'][index])

    def visible(client_state):
      # What the algorithm sees: None when it keeps no state (`read_state`
      # gives an empty structure instead).
      return client_state if stateful else None

    def start(message, client_state):
      definition.reset_client(context)
      return work.start(context, message, visible(client_state))

    def finish(message, round_num, group, index, client_state, carry):
      result = work.finish(context, message, visible(client_state), carry)
      if stateful:
        state_format.write(group['ids'][index], round_num, result.state)
      costs = None
      if client_cost_fn is not None:
        # Rebuilt from (id, seed): the batches the client trained on.
        costs = client_cost_fn(client_dataset_fn(group['ids'][index],
                                                 group['seeds'][index]))
      part, _, residuals = contribution(result, message, costs)
      return part, residuals

    def one_client(message, round_num, group, index, total, client_pass,
                   position):
      """(position, total + client `index`'s contribution): its state read,
      its passes run by `client_pass(step_fn, client_state, carry,
      position) -> (carry, position)` from `position` in the group's
      batches, its new state written."""
      client_state = read_state(group, index)
      carry = start(message, client_state)
      for pass_index, step_fn in enumerate(work.steps):
        carry, position = client_pass(step_fn, client_state, carry, position)
        if work.end_pass is not None:
          carry = work.end_pass[pass_index](context, message,
                                            visible(client_state), carry)
      return position, _add_contribution(
          total, *finish(message, round_num, group, index, client_state,
                         carry))

    def run(message, round_num, group):
      if per_client:
        tf.debugging.assert_equal(tf.size(group['ids']), 1,
                                  'a per-client group holds one client')
      if work.prepare is not None:
        work.prepare(context, message)
      specs, affine = finish_shapes(message, round_num, group)
      zero_total = tf.nest.map_structure(
          lambda t: tf.zeros(t.shape, t.dtype), specs)
      # While loops over an iterator; a loop over the dataset itself would
      # run every step inside tf.data's reduce, several times slower.
      elements = iter(group_stream(client_dataset_fn, group['ids'],
                                   group['seeds'], work.passes))

      def client_pass(step_fn, client_state, carry, position):
        """(carry, position) after the pass's steps: the stream's elements
        up to and including the pass's end-of-pass marker (the stream keeps
        its own position)."""

        def body(is_marker, batch, carry):
          del is_marker
          carry = step_fn(context, message, visible(client_state), carry,
                          batch)
          (_, _, is_marker), batch = elements.get_next()
          return is_marker, batch, carry

        # Each iteration steps on the batch read before it and reads the
        # next, so the loop's condition, not a cond around the step, stops
        # at the marker (module docstring).
        (_, _, is_marker), batch = elements.get_next()
        _, _, carry = tf.while_loop(
            lambda is_marker, *_: tf.logical_not(is_marker), body,
            (is_marker, batch, carry))
        return carry, position

      def client(index, total):
        _, total = one_client(message, round_num, group, index, total,
                              client_pass, ())
        return index + 1, total

      num_clients = tf.shape(group['ids'], out_type=tf.int32)[0]
      if work.shared_products is not None:
        total = chunks(message, round_num, group, elements, num_clients,
                       zero_total)
      else:
        _, total = tf.while_loop(
            lambda index, _: tf.less(index, num_clients), client,
            (tf.constant(0, tf.int32), zero_total))
      if affine:
        total = _add_affine_parts(total, affine, message)
      return total

    def chunks(message, round_num, group, elements, num_clients,
               zero_total):
      """The group's total, its clients taken a chunk at a time: a chunk's
      batches read and held, their shared products computed at once
      (`round_lib.SharedProducts`), then its clients' steps run on them."""
      shared = work.shared_products
      specs = tf.nest.flatten(elements.element_spec[1])

      def read_chunk(first, last):
        """(the chunk's batches as TensorArrays, whether each read element
        is an end-of-pass marker, the shared products' accumulator)."""
        arrays = [tf.TensorArray(spec.dtype, size=0, dynamic_size=True,
                                 infer_shape=False,
                                 element_shape=spec.shape)
                  for spec in specs]
        markers = tf.TensorArray(tf.bool, size=0, dynamic_size=True)
        wanted = (last - first) * work.passes

        def body(read, seen, step, arrays, markers, acc):
          (_, pass_index, is_marker), batch = elements.get_next()
          arrays = [a.write(read, t)
                    for a, t in zip(arrays, tf.nest.flatten(batch))]
          markers = markers.write(read, is_marker)
          # A marker's batch has no rows: no branch around it.
          acc = shared.record(context, acc, pass_index, step, batch)
          return (read + 1, seen + tf.cast(is_marker, tf.int32),
                  tf.where(is_marker, 0, step + 1), arrays, markers, acc)

        zero = tf.constant(0, tf.int32)
        _, _, _, arrays, markers, acc = tf.while_loop(
            lambda read, seen, *_: tf.less(seen, wanted), body,
            (zero, zero, zero, arrays, markers, shared.initial(context)))
        return arrays, markers, acc

      def chunk(first, total):
        last = tf.minimum(first + shared.clients_per_chunk, num_clients)
        arrays, markers, acc = read_chunk(first, last)
        shared.compute(context, acc)

        def element(read):
          return tf.nest.pack_sequence_as(
              elements.element_spec[1],
              [tf.ensure_shape(a.read(read), spec.shape)
               for a, spec in zip(arrays, specs)])

        def client_pass(step_fn, client_state, carry, read):
          """(carry, read) after the pass's steps, its marker read."""

          def body(read, carry):
            shared.select(context, read)
            carry = step_fn(context, message, visible(client_state), carry,
                            element(read))
            return read + 1, carry

          read, carry = tf.while_loop(
              lambda read, _: tf.logical_not(markers.read(read)), body,
              (read, carry))
          return carry, read + 1

        def client(index, read, total):
          read, total = one_client(message, round_num, group, index, total,
                                   client_pass, read)
          return index + 1, read, total

        _, _, total = tf.while_loop(
            lambda index, *_: tf.less(index, last), client,
            (first, tf.constant(0, tf.int32), total))
        return last, total

      _, total = tf.while_loop(lambda first, _: tf.less(first, num_clients),
                               chunk, (tf.constant(0, tf.int32), zero_total))
      return total

    def finish_shapes(message, round_num, group):
      # The structure and shapes of a contribution, traced but not run,
      # and its `AffineUpdate`s (whose offsets and common scales depend on
      # the message only).
      del round_num
      affine = []

      def traced():
        client_state = read_state(group, 0)
        carry = start(message, client_state)
        out, found, _ = contribution(
            work.finish(context, message, visible(client_state), carry),
            message, None if client_cost_fn is None else client_cost_fn(
                client_dataset_fn(group['ids'][0], group['seeds'][0])))
        affine.extend(found)
        return out

      specs = tf.function(traced, autograph=False
                          ).get_concrete_function().structured_outputs
      return tf.nest.map_structure(
          lambda t: tf.TensorSpec(t.shape, t.dtype), specs), affine

    # Without AutoGraph: it would convert every function the loop calls (the
    # algorithm's, the model's, its metrics', the optimizer's), about 2 s
    # of every process that builds a round, for nothing: their control flow
    # is TF's own (tf.cond), as TFF's traced computations need anyway.
    return tf.function(run, autograph=False)

  return bind


def clients_per_group(clients_per_round: int, requested: int, runtime: str,
                      per_client: bool = False) -> int:
  """Group size of a round: `requested` if set, else chosen for the runtime.

  Per-client aggregators need groups of one. TFF's worker runs its clients
  (here: groups) concurrently, one per core and partition; the native
  runtime runs one group per lane (`native_lanes`).
  """
  if per_client:
    if requested not in (0, 1):
      raise ValueError('this model aggregator works per client: groups of '
                       f'one client, not {requested}')
    return 1
  if requested > 0:
    return requested
  if runtime == 'native':
    return max(1, -(-clients_per_round // native_lanes()))
  slots = max(1, os.cpu_count() or 1) * _execution_slots()
  return max(1, -(-clients_per_round // slots))


def native_lanes() -> int:
  """Groups the native runtime runs at once: one per CPU core; one on a GPU.

  On a CPU, concurrent groups use the cores that tiny per-client batches
  leave idle; a GPU runs one group's kernels at a time anyway.
  """
  if tf.config.list_logical_devices('GPU'):
    return 1
  return max(1, os.cpu_count() or 1)


# Caps how many of the native runtime's lanes run at once (the groups stay
# one per lane, so the results do not change). The test script sets it to 1:
# its three test processes already share the cores, and each extra lane traces
# its own copy of the group computation.
CONCURRENT_LANES_ENV = 'FL_NATIVE_CONCURRENT_LANES'


def concurrent_native_lanes() -> int:
  """How many lanes the native runtime runs at once: `native_lanes()`,
  or fewer where `CONCURRENT_LANES_ENV` says so."""
  lanes = native_lanes()
  cap = os.environ.get(CONCURRENT_LANES_ENV, '')
  if not cap:
    return lanes
  try:
    cap_value = int(cap)
  except ValueError:
    cap_value = 0
  if cap_value < 1:
    raise UsageError(f'{CONCURRENT_LANES_ENV}={cap!r} must be an integer >= 1')
  return min(lanes, cap_value)


def _execution_slots() -> int:
  # pylint: disable=g-import-not-at-top
  from pipeline import tff_runtime
  return tff_runtime.partitions()


def groups(client_ids: Sequence[str], seeds: np.ndarray,
           versions: Optional[np.ndarray], size: int) -> list[dict]:
  """The round's clients, in order, as groups of at most `size`."""
  result = []
  for start in range(0, len(client_ids), size):
    group = collections.OrderedDict(
        # UTF-8 bytes: TFF encodes str values as ASCII, so a client id such
        # as 'ü' (a key of the task's sqlite file) was a UnicodeEncodeError.
        ids=np.asarray([str(c).encode('utf-8')
                        for c in client_ids[start:start + size]], object),
        seeds=np.asarray(seeds[start:start + size], np.int64))
    if versions is not None:
      group['versions'] = np.asarray(versions[start:start + size], np.int64)
    result.append(group)
  return result
