"""The native runtime: a round definition run in-process in TensorFlow.

`--runtime=native` interprets the same `RoundDefinition` as
`runtime.tff_process`, with the same group computation (`runtime.cohort`),
without TFF's runtime: TF's own device placement applies (a GPU when TF sees
one) and no `worker_binary` is started. The cohort runs as the same groups,
each one compiled call, on one lane (thread) per CPU core as TFF's worker
runs its clients concurrently; the groups' sums are added here, as TFF's
federated_sum adds them; the model update is their weighted mean, as
`tff.federated_mean(value, weight)` computes it. Only the default (mean)
model aggregator runs here: TFF's other aggregators are TFF computations.

Values in and out have the structures the TFF process gives (Python
containers of numpy arrays), so checkpoints, the client-state store,
evaluation and export work unchanged, and a checkpoint written under one
runtime resumes under the other.
"""

import concurrent.futures
import dataclasses
import functools
import queue
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import batched
from tff_algos.runtime import client_states
from tff_algos.runtime import cohort
from tff_algos.runtime import server
from tff_algos.runtime import tff_process


def to_numpy(structure):
  """Tensors -> numpy arrays, containers kept (as the TFF runtime returns).

  Python numbers take the dtypes TFF's type system gives them (float32,
  int32): tff.learning's optimizers keep hyperparameters (learning rate,
  momentum) as Python floats in their state, which numpy would make float64,
  and a later step would mix dtypes.
  """
  return tf.nest.map_structure(
      lambda leaf: np.asarray(tf.convert_to_tensor(leaf))
      if isinstance(leaf, (int, float)) and not isinstance(leaf, bool)
      else np.asarray(leaf), structure)


def graph_mode_dataset_fn(dataset_fn):
  """`dataset_fn` traced as a graph, as inside a TFF computation.

  A dataset op seeded only at op level (`shuffle(seed=s)`) takes the graph's
  seed as its other half: none in a TFF computation's graph, but the global
  seed when built eagerly after `tf.random.set_seed` (which the driver calls
  to initialize the model). Clearing the graph's seed makes both runtimes
  draw the same batches for the same (client id, seed).
  """

  def build(*args):
    tf.compat.v1.get_default_graph().seed = None
    return dataset_fn(*args)

  return build


class NativeProcess:
  """initialize() -> state; next(state, groups, round_num, server_seed)."""

  def __init__(self, definition: round_lib.RoundDefinition,
               data: tff_process.DataFunctions,
               state_format: Optional[client_states.StateFormat] = None,
               batched_cohorts: str = 'auto'):
    """`batched_cohorts`: 'auto' runs a group's clients side by side over a
    client axis on a GPU and one after another on a CPU; 'on'/'off' force
    either (`runtime.batched`; unsupported rounds keep the loop)."""
    self._definition = definition
    dataset_fn = graph_mode_dataset_fn(data.client_dataset_fn)
    side_by_side = batched.group_update_or_none(
        definition, dataset_fn, data.client_cost_fn, batched_cohorts)
    self.batched = side_by_side is not None
    if self.batched:
      # Stateless functions of their inputs: lanes can share one.
      self._lanes = [side_by_side] * cohort.concurrent_native_lanes()
    else:
      group_update = cohort.build_group_update(
          definition, dataset_fn,
          state_format if definition.has_client_state else None,
          data.client_cost_fn)
      # One group computation per concurrent lane, each with its own client
      # context (models, variables): lanes must not share variables.
      self._lanes = [group_update(definition.client_context())
                     for _ in range(cohort.concurrent_native_lanes())]
    # Without AutoGraph, as TFF traces them (their control flow is TF's).
    self._broadcast = tf.function(definition.broadcast, autograph=False)
    # Eager but for the server update: metric finalizers build Keras
    # metrics, which a tf.function would build again when it retraces.
    self._server_step = functools.partial(
        server.server_step, dataclasses.replace(
            definition, server_update=tf.function(definition.server_update,
                                                  autograph=False)))
    self._central = None
    if definition.central is not None:
      self._central = tf.function(functools.partial(
          definition.central.run, definition.central.context()))
      if definition.central.uses_data:
        self._server_dataset = tf.function(
            graph_mode_dataset_fn(data.server_dataset_fn), autograph=False)
    self._communication = None

  def initialize(self):
    return to_numpy(self._definition.initial_server_state())

  def central_result(self, state, server_seed: int):
    """The round's central work alone (`benchmarks.rounds` times it)."""
    elements = None
    if self._definition.central.uses_data:
      elements = self._server_dataset(tf.constant(server_seed, tf.int64))
    return self._central(state, elements)

  def next(self, state, groups, round_num: int, server_seed: int):
    definition = self._definition
    central_work = definition.central
    central = pending = None
    with concurrent.futures.ThreadPoolExecutor(1) as central_thread:
      if central_work is not None:
        pending = central_thread.submit(self.central_result, state,
                                        server_seed)
        if central_work.before_clients:  # The broadcast carries its result.
          central, pending = pending.result(), None
      # Central work the broadcast does not need reads only the server state:
      # it runs alongside the clients, as a server trains while its clients
      # do; its result is the same as when it runs after them.
      message = self._broadcast(state, central)
      results = self._run_groups(message, round_num, groups)
      if pending is not None:
        central = pending.result()
    if self._communication is None:
      self._communication = server.communication_metrics(
          definition, _type_of(message), _type_of(results[0]))
    totals = functools.reduce(
        lambda a, b: tf.nest.map_structure(np.add, a, b), results)
    new_state, metrics = self._server_step(
        state, tf.nest.map_structure(tf.convert_to_tensor, totals), central,
        self._communication)
    return to_numpy(new_state), to_numpy(metrics)

  def _run_groups(self, message, round_num: int, groups) -> list:
    """Every group's result, in order, each run on a free lane.

    Lanes run concurrently (TF executes outside Python's GIL), as TFF's
    worker runs its clients; each group's result depends only on the group,
    so the sums do not depend on the timing.
    """
    free_lanes = queue.SimpleQueue()
    for lane in self._lanes:
      free_lanes.put(lane)

    def run(group):
      lane = free_lanes.get()
      try:
        return to_numpy(lane(message, tf.constant(round_num, tf.int64), {
            key: tf.constant(value) for key, value in group.items()}))
      finally:
        free_lanes.put(lane)

    with concurrent.futures.ThreadPoolExecutor(len(self._lanes)) as pool:
      return list(pool.map(run, groups))


def _type_of(structure) -> tff.Type:
  return tff.types.tensorflow_to_type(tf.nest.map_structure(
      lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)),
      structure))
