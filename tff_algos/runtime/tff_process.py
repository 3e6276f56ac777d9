"""One TFF process for every algorithm, built from its round definition.

`build(definition, ...)` interprets a `tff_algos.algorithms.round.
RoundDefinition` as TFF computations:

  initialize: ( -> state@SERVER)
  prepare:    (state@SERVER, round@SERVER -> central@SERVER)
              only when the broadcast needs central work (1-w GT)
  next:       (state@SERVER, cohort@CLIENTS, round@SERVER[, central@SERVER])
              -> <state@SERVER, metrics@SERVER>

`round` is <round_num, server_seed>; each TFF client of `cohort` is a group
of the round's clients <ids, seeds[, versions]> (`runtime.cohort`): its
computation builds every client's dataset, reads and writes every client's
state, and returns the group's sums, so per client only an id, a seed and a
version cross into the runtime, and nothing comes back but sums.

Why not a `tff.learning.templates.LearningProcess` composed from
tff.learning's distributor / client work / aggregator / finalizer parts:
its `next` takes exactly (state, client data), while every algorithm here
also needs a server-placed round input (the version its clients write, the
central data's seed); mixed FL's central work and 2-w GT's augmenting
gradients couple what a composer keeps apart (the broadcast, the client
work and the finalizer). The parts that do fit are TFF's own: the model
update goes through a `tff.aggregators` factory, and optimizers are
`tff.learning.optimizers`.

The model update's aggregation: by default the example- (or uniformly)
weighted mean, computed from the groups' weighted sums, which is what
`tff.federated_mean(value, weight)` computes per client; any other
`tff.aggregators` factory (DP, clipping, compression, secure sum) gets one
client per TFF client (group size 1), since such aggregators act on each
client's own update. Everything else a client sends is summed in the clear.

Under TFF's mergeable execution (several workers or sub-rounds), each
group's client work runs once: `next` returns nothing placed at CLIENTS, so
nothing is recomputed after the merge, and central work either runs in
`prepare` or with the server update, after the merge - once per round.
"""

import collections
import dataclasses
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import client_states
from tff_algos.runtime import cohort
from tff_algos.runtime import communication
from tff_algos.runtime import tff_compiler

ROUND_TYPE = tff.StructWithPythonType(
    [('round_num', np.int64), ('server_seed', np.int64)],
    collections.OrderedDict)


@dataclasses.dataclass(frozen=True)
class DataFunctions:
  """The task's TF functions the round builds its data with."""
  # (client id, seed) -> the client's batches.
  client_dataset_fn: Callable
  # seed -> the round's central batches; None when the task has none.
  server_dataset_fn: Optional[Callable] = None
  # dataset -> analytic per-client costs (`Task.client_cost_fn`); optional.
  client_cost_fn: Optional[Callable] = None


def group_type(has_client_state: bool) -> tff.Type:
  fields = [('ids', tff.TensorType(np.str_, [None])),
            ('seeds', tff.TensorType(np.int64, [None]))]
  if has_client_state:
    fields.append(('versions', tff.TensorType(np.int64, [None])))
  return tff.StructWithPythonType(fields, collections.OrderedDict)


def _specs_of(value_type: tff.Type):
  return tff.types.type_to_tf_tensor_specs(value_type)


class RoundProcess:
  """A definition's TFF computations, with the driver's interface.

  initialize() -> server state
  next(state, groups, round_num, server_seed) -> (state, metrics)
  """

  def __init__(self, initialize_comp, prepare_comp, next_comp):
    self.initialize_computation = initialize_comp
    self.prepare_computation = prepare_comp
    self.next_computation = next_comp

  def initialize(self):
    return self.initialize_computation()

  def next(self, state, groups, round_num: int, server_seed: int):
    round_info = collections.OrderedDict(round_num=np.int64(round_num),
                                         server_seed=np.int64(server_seed))
    if self.prepare_computation is None:
      return self.next_computation(state, groups, round_info)
    central = self.prepare_computation(state, round_info)
    return self.next_computation(state, groups, round_info, central)


def build(definition: round_lib.RoundDefinition, data: DataFunctions,
          state_format: Optional[client_states.StateFormat] = None,
          model_aggregator: Optional[Any] = None) -> RoundProcess:
  """The TFF process of `definition` (see the module docstring).

  Args:
    definition: the algorithm's round.
    data: the task's dataset functions.
    state_format: where and how client states are stored (required when
      the algorithm keeps client state).
    model_aggregator: a `tff.aggregators` factory for the model update, or
      None for the weighted mean from group sums. With a factory every
      group must hold one client.
  """
  central = definition.central
  if central is not None and central.uses_data and (
      data.server_dataset_fn is None):
    raise ValueError(f'{definition.name} needs central data and the task '
                     'has none')
  per_client = model_aggregator is not None

  @tff.tensorflow.computation
  def initial_algorithm_state():
    return definition.initial_server_state()

  algorithm_state_type = initial_algorithm_state.type_signature.result

  central_comp = central_type = None
  if central is not None:

    @tff.tensorflow.computation(algorithm_state_type, np.int64)
    def central_comp(state, seed):
      tff_compiler.mark_without_recomputation()  # Trains in a loop.
      elements = (data.server_dataset_fn(seed) if central.uses_data
                  else None)
      return central.run(central.context(), state, elements)

    central_type = central_comp.type_signature.result

  def broadcast_fn(state, round_num, central_result):
    return collections.OrderedDict(
        message=definition.broadcast(state, central_result),
        round_num=round_num)

  if central is not None and central.before_clients:
    broadcast_comp = tff.tensorflow.computation(
        broadcast_fn, algorithm_state_type, np.int64, central_type)
  else:
    broadcast_comp = tff.tensorflow.computation(
        lambda state, round_num: broadcast_fn(state, round_num, None),
        algorithm_state_type, np.int64)
  payload_type = broadcast_comp.type_signature.result

  state_format_used = state_format if definition.has_client_state else None
  run_group = cohort.build_group_update(
      definition, data.client_dataset_fn, state_format_used,
      data.client_cost_fn, per_client=per_client)

  @tff.tensorflow.computation(payload_type,
                              group_type(definition.has_client_state))
  def group_comp(payload, group):
    # Graph optimization without recomputation heuristics, which break the
    # group loop's gradients (runtime.tff_compiler).
    tff_compiler.mark_without_recomputation()
    run = run_group(definition.client_context())
    return run(payload['message'], payload['round_num'], group)

  result_type = group_comp.type_signature.result
  # `in` on a TFF struct type tests its values, not its names.
  has_client_costs = 'client_costs' in tff.structure.name_list(result_type)
  aggregation = None
  if model_aggregator is not None:
    update_type = result_type.model_update
    if isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory):
      aggregation = model_aggregator.create(update_type, result_type.weight)
    else:
      aggregation = model_aggregator.create(update_type)

  mean_type = result_type.model_update
  aggregates_fields = [('model_update', mean_type),
                       ('weight_sum', np.float32), ('num_clients', np.int32),
                       ('sums', result_type.sums),
                       ('measurements', result_type.measurements)]
  if definition.sums_model_update:
    aggregates_fields.append(('model_update_sum', mean_type))
  aggregates_type = tff.StructWithPythonType(aggregates_fields,
                                             collections.OrderedDict)
  bytes_down, bytes_up = communication.per_client_bytes(
      payload_type.message, result_type, definition.uploads_weight)
  augmenting_bytes = communication.augmenting_bytes(
      payload_type.message, definition.augmenting_message)

  server_inputs = [('state', algorithm_state_type),
                   ('aggregates', aggregates_type),
                   ('metric_sums', result_type.metrics),
                   ('round', ROUND_TYPE)]
  if has_client_costs:
    server_inputs.append(('client_costs', result_type.client_costs))
  if central is not None and central.before_clients:
    server_inputs.append(('central', central_type))
  server_input_type = tff.StructWithPythonType(server_inputs,
                                               collections.OrderedDict)

  @tff.tensorflow.computation(server_input_type)
  def server_comp(inputs):
    aggregates = collections.OrderedDict(inputs['aggregates'])
    central_result = inputs.get('central')
    if central is not None and not central.before_clients:
      tff_compiler.mark_without_recomputation()  # Central training loop.
      elements = (data.server_dataset_fn(inputs['round']['server_seed'])
                  if central.uses_data else None)
      central_result = central.run(central.context(), inputs['state'],
                                   elements)
    new_state, algorithm_metrics = definition.server_update(
        inputs['state'], aggregates, central_result)
    metrics = collections.OrderedDict(
        train=definition.finalize_metrics(inputs['metric_sums']))
    for key, value in algorithm_metrics.items():
      metrics[key] = value
    metrics['communication'] = tf.nest.map_structure(
        tf.constant, communication.metrics(bytes_down, bytes_up,
                                           augmenting_bytes))
    if 'client_costs' in inputs:
      metrics = communication.with_client_costs(
          metrics, tf.nest.map_structure(
              lambda c: c / tf.cast(aggregates['num_clients'], c.dtype),
              inputs['client_costs']))
    return new_state, metrics

  @tff.tensorflow.computation(mean_type, np.float32)
  def weighted_mean(weighted_sum, weight_sum):
    # What tff.federated_mean(value, weight) computes from the sums.
    return tf.nest.map_structure(lambda s: tf.divide(s, weight_sum),
                                 weighted_sum)

  if aggregation is None:
    state_type = algorithm_state_type

    @tff.federated_computation
    def initialize():
      return tff.federated_eval(initial_algorithm_state, tff.SERVER)
  else:

    @tff.tensorflow.computation(algorithm_state_type,
                                aggregation.initialize.type_signature.result.member)
    def with_aggregator(state, aggregator_state):
      merged = collections.OrderedDict(state)
      merged['aggregator'] = aggregator_state
      return merged

    @tff.federated_computation
    def initialize():
      return tff.federated_map(with_aggregator, (
          tff.federated_eval(initial_algorithm_state, tff.SERVER),
          aggregation.initialize()))

    state_type = initialize.type_signature.result.member

  @tff.tensorflow.computation(state_type)
  def algorithm_part(state):
    return collections.OrderedDict(
        (k, v) for k, v in state.items() if k != 'aggregator')

  def round_body(state, groups, round_info, central_result=None):
    algorithm_state = (state if aggregation is None else
                       tff.federated_map(algorithm_part, state))
    if central_result is None:
      payload = tff.federated_map(broadcast_comp, (
          algorithm_state, round_info.round_num))
    else:
      payload = tff.federated_map(broadcast_comp, (
          algorithm_state, round_info.round_num, central_result))
    results = tff.federated_map(group_comp,
                                (tff.federated_broadcast(payload), groups))
    weight_sum = tff.federated_sum(results.weight)
    measurements = None
    if aggregation is None:
      mean = tff.federated_map(weighted_mean, (
          tff.federated_sum(results.model_update), weight_sum))
    else:
      output = aggregation.next(state.aggregator, results.model_update,
                                *([results.weight] if isinstance(
                                    model_aggregator,
                                    tff.aggregators.WeightedAggregationFactory)
                                  else []))
      mean = output.result
      measurements = output.measurements
    aggregates = collections.OrderedDict(
        model_update=mean, weight_sum=weight_sum,
        num_clients=tff.federated_sum(results.num_clients),
        sums=tff.federated_sum(results.sums),
        measurements=tff.federated_sum(results.measurements))
    if definition.sums_model_update:
      aggregates['model_update_sum'] = tff.federated_sum(
          results.model_update_sum)
    server_inputs = collections.OrderedDict(
        state=algorithm_state, aggregates=tff.federated_zip(aggregates),
        metric_sums=tff.federated_sum(results.metrics), round=round_info)
    if has_client_costs:
      server_inputs['client_costs'] = tff.federated_sum(results.client_costs)
    if central_result is not None:
      server_inputs['central'] = central_result
    updated = tff.federated_map(server_comp, tff.federated_zip(server_inputs))
    new_state, metrics = updated[0], updated[1]
    if aggregation is not None:
      new_state = tff.federated_map(with_aggregator, (new_state, output.state))
      metrics = tff.federated_map(
          _with_measurements(metrics.type_signature.member,
                             measurements.type_signature.member),
          (metrics, measurements))
    return new_state, metrics

  server_state = tff.FederatedType(state_type, tff.SERVER)
  cohort_type = tff.FederatedType(group_type(definition.has_client_state),
                                  tff.CLIENTS)
  round_at_server = tff.FederatedType(ROUND_TYPE, tff.SERVER)
  prepare = None
  if central is not None and central.before_clients:

    @tff.federated_computation(server_state, round_at_server)
    def prepare(state, round_info):
      algorithm_state = (state if aggregation is None else
                         tff.federated_map(algorithm_part, state))
      return tff.federated_map(central_comp,
                               (algorithm_state, round_info.server_seed))

    @tff.federated_computation(server_state, cohort_type, round_at_server,
                               tff.FederatedType(central_type, tff.SERVER))
    def next_fn(state, groups, round_info, central_result):
      return round_body(state, groups, round_info, central_result)
  else:

    @tff.federated_computation(server_state, cohort_type, round_at_server)
    def next_fn(state, groups, round_info):
      return round_body(state, groups, round_info)

  return RoundProcess(initialize, prepare, next_fn)


def _with_measurements(metrics_type, measurements_type):

  @tff.tensorflow.computation(metrics_type, measurements_type)
  def merge(metrics, measurements):
    merged = collections.OrderedDict(metrics)
    merged['aggregator'] = measurements
    return merged

  return merge
