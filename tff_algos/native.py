"""The native runtime (`--runtime=native`): rounds run in-process in TensorFlow.

`--runtime=native` runs the same TF functions as the TFF processes (the client,
server and central updates of the `*_tf` modules, and tff.learning's own client
updates for the baselines), client after client in this process, so TF's own
device placement (a GPU when there is one) applies and TFF's C++ runtime is
never started.

Every algorithm gives a dataset-level native process (`NativeRounds`) next to
its TFF process; `compose_by_id` turns it into what the driver runs, with the
interface of `contract.compose_by_id`'s process:

  initialize() -> server state
  next(server_state, [<id, seed[, state]>, ...], server_seed)
      -> (server state, [<[state]>, ...], metrics)

Values in and out have the structures the TFF process gives (Python
containers of numpy arrays), so checkpoints, the client-state store, the
algorithm's get/set_model_weights, evaluation and export work unchanged, and
a checkpoint written under one runtime loads under the other.
"""

import collections
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import tensorflow as tf

from pipeline.errors import UsageError
from tff_algos import communication

RUNTIMES = ('tff', 'native')


class NativeRounds(Protocol):
  """A dataset-level process run in-process (one per algorithm)."""

  def initialize(self) -> Any:
    """The server state `process.initialize()` of the TFF process gives."""

  def next(self, server_state, datasets: Sequence[tf.data.Dataset],
           client_states: Optional[Sequence[Any]],
           server_data: Optional[tf.data.Dataset]):
    """One round over the sampled clients, in order.

    `client_states` is None for algorithms without client state.
    Returns (server state, new client states or None, metrics).
    """


def to_numpy(structure):
  """Tensors -> numpy arrays, containers kept (as the TFF runtime returns)."""
  return tf.nest.map_structure(np.asarray, structure)


def graph_mode_dataset_fn(dataset_fn: Callable,
                          input_signature: Sequence[tf.TensorSpec]):
  """`dataset_fn` traced as a graph, as inside a TFF computation.

  A dataset op seeded only at op level (`shuffle(seed=s)`) takes the graph's
  seed as its other half: none in a TFF computation's graph, but the global
  seed when built eagerly after `tf.random.set_seed` (which the driver calls
  to initialize the model). Clearing the traced graph's seed makes both
  runtimes draw the same batches for the same (client id, seed).
  """

  @tf.function(input_signature=input_signature, autograph=False)
  def build(*args):
    tf.compat.v1.get_default_graph().seed = None
    return dataset_fn(*args)

  return build


class NativeProcessById:
  """A `NativeRounds` fed by client id, like `contract.compose_by_id`."""

  def __init__(self, name: str, rounds: NativeRounds, has_client_state: bool,
               client_dataset_fn: Callable,
               server_dataset_fn: Optional[Callable] = None,
               client_cost_fn: Optional[Callable] = None):
    self._rounds = rounds
    self._client_cost = (tf.function(client_cost_fn, autograph=False)
                         if client_cost_fn is not None else None)
    self._has_client_state = has_client_state
    self._client_dataset = graph_mode_dataset_fn(
        client_dataset_fn, (tf.TensorSpec([], tf.string),
                            tf.TensorSpec([], tf.int64)))
    self._server_dataset = None
    if server_dataset_fn is not None:
      self._server_dataset = graph_mode_dataset_fn(
          server_dataset_fn, (tf.TensorSpec([], tf.int64),))
    self.name = name

  def initialize(self):
    return self._rounds.initialize()

  def _dataset_of(self, client) -> tf.data.Dataset:
    return self._client_dataset(tf.constant(client['id'], tf.string),
                                tf.constant(client['seed'], tf.int64))

  def next(self, server_state, client_inputs: Sequence[Any], server_seed):
    datasets = [self._dataset_of(client) for client in client_inputs]
    client_states = ([client['state'] for client in client_inputs]
                     if self._has_client_state else None)
    server_data = None
    if self._server_dataset is not None:
      server_data = self._server_dataset(tf.constant(server_seed, tf.int64))
    server_state, new_client_states, metrics = self._rounds.next(
        server_state, datasets, client_states, server_data)
    if self._client_cost is not None:
      # As in `contract.compose_by_id`: each client's dataset built again
      # (iterating the trained-on dataset object again would reshuffle it;
      # TFF rebuilds a dataset value from its graph for every consumer),
      # cohort mean, merged into the round's metrics.
      costs = mean([to_numpy(self._client_cost(self._dataset_of(client)))
                    for client in client_inputs])
      metrics = to_numpy(communication.with_client_costs(metrics, costs))
    if self._has_client_state:
      client_outputs = [collections.OrderedDict(state=state)
                        for state in new_client_states]
    else:
      client_outputs = [collections.OrderedDict() for _ in client_inputs]
    return server_state, client_outputs, metrics


def compose_by_id(algorithm, client_dataset_fn: Optional[Callable],
                  server_dataset_fn: Optional[Callable] = None,
                  task_name: str = 'the task',
                  client_cost_fn: Optional[Callable] = None
                  ) -> NativeProcessById:
  """The native counterpart of `contract.compose_by_id`.

  Args:
    algorithm: a `contract.FederatedAlgorithm` with a native process.
    client_dataset_fn: `(id, seed) -> dataset` in TF (`Task.client_dataset_fn`).
    server_dataset_fn: `seed -> dataset` of central batches, when the
      algorithm uses server data.
    task_name: for error messages.
    client_cost_fn: optional `dataset -> analytic costs` of a client's round
      (`Task.client_cost_fn`), added to the metrics as in the TFF runtime.
  """
  if algorithm.native_process_fn is None:
    raise UsageError(f'--runtime=native: --algorithm={algorithm.name} has no '
                     'native process; use --runtime=tff')
  if client_dataset_fn is None:
    raise UsageError(
        f'--runtime=native: {task_name} builds its client datasets only as a '
        'TFF computation (not with tasks.base.client_dataset_computation); '
        'use --runtime=tff')
  if algorithm.uses_server_data and server_dataset_fn is None:
    raise UsageError(
        f'--algorithm={algorithm.name} needs central (server) data or a '
        'data-free central loss; the task, with these flags, has neither')
  return NativeProcessById(
      algorithm.name, algorithm.native_process_fn(),
      algorithm.has_client_state, client_dataset_fn,
      server_dataset_fn if algorithm.uses_server_data else None,
      client_cost_fn)


# ---------------------------------------------------------------------------
# Aggregation, as TFF's intrinsics and aggregators compute it.


def weighted_mean(values: Sequence[Any], weights: Sequence[Any],
                  no_nan: bool = False):
  """sum_i w_i x_i / sum_i w_i, per leaf, as `tff.aggregators.MeanFactory`
  and `tff.federated_mean(value, weight)`: each client's value times its
  weight, summed, divided by the summed weights (NaN when they are 0, unless
  `no_nan`)."""
  weights = [np.float32(w) for w in weights]
  weighted = [tf.nest.map_structure(lambda x, w=w: np.asarray(x) * w, value)
              for value, w in zip(values, weights, strict=True)]
  value_sum = sum_structures(weighted)
  weight_sum = np.float32(sum_values(weights))
  divide = tf.math.divide_no_nan if no_nan else tf.math.divide
  return tf.nest.map_structure(
      lambda x: np.asarray(divide(x, weight_sum.astype(x.dtype))), value_sum)


def mean(values: Sequence[Any]):
  """Unweighted `tff.federated_mean`."""
  return weighted_mean(values, [1.0] * len(values))


def sum_values(values: Sequence[Any]):
  total = values[0]
  for value in values[1:]:
    total = total + value
  return total


def sum_structures(structures: Sequence[Any]):
  """`tff.federated_sum` of a list of like structures (numpy)."""
  if not structures:
    raise ValueError('a round needs at least one client')
  return tf.nest.map_structure(
      lambda *leaves: np.asarray(sum_values([np.asarray(l) for l in leaves])),
      *structures)


def sum_then_finalize(metric_finalizers, unfinalized_metrics: Sequence[Any]):
  """`tff.learning.metrics.sum_then_finalize`: sum the clients' unfinalized
  metrics, then apply the model's finalizers."""
  summed = tf.nest.map_structure(tf.convert_to_tensor,
                                 sum_structures(unfinalized_metrics))
  if callable(metric_finalizers):
    return to_numpy(_eager(metric_finalizers)(summed))
  return collections.OrderedDict(
      (name, np.asarray(_eager(finalizer)(summed[name])))
      for name, finalizer in metric_finalizers.items())


def _eager(finalizer):
  # A Keras metric's finalizer is a tf.function that builds a fresh metric
  # (variables) per call: fine once per TFF computation's graph, refused by
  # a tf.function called every round. Its Python function runs eagerly.
  return getattr(finalizer, 'python_function', finalizer)
