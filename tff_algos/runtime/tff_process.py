"""One TFF process for every algorithm, built from its round definition.

`build(definition, ...)` interprets a `tff_algos.algorithms.round.
RoundDefinition` as TFF computations:

  initialize: ( -> state@SERVER)
  prepare:    (state@SERVER, <round_num, server_seed>@SERVER
               -> central@SERVER)
              only when the broadcast needs central work (1-w GT)
  next:       (state@SERVER, cohort@CLIENTS, round@SERVER)
              -> <state@SERVER, metrics@SERVER>

`round` is <round_num, server_seed[, central]>, with `prepare`'s result as
`central` when there is one; each TFF client of `cohort` is a group
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
import tensorflow_federated as tff

from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import client_states
from tff_algos.runtime import cohort
from tff_algos.runtime import server
from tff_algos.runtime import tff_compiler

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


@dataclasses.dataclass(frozen=True)
class RoundProcess:
  """A definition's TFF computations, with the driver's interface.

  initialize() -> server state
  next(state, groups, round_num, server_seed) -> (state, metrics)
  """
  initialize_computation: tff.Computation
  # (state, <round_num, server_seed>) -> central result; None unless the
  # broadcast needs central work (1-w GT).
  prepare_computation: Optional[tff.Computation]
  next_computation: tff.Computation

  def initialize(self):
    return self.initialize_computation()

  def next(self, state, groups, round_num: int, server_seed: int):
    round_info = collections.OrderedDict(round_num=np.int64(round_num),
                                         server_seed=np.int64(server_seed))
    if self.prepare_computation is not None:
      round_info['central'] = self.prepare_computation(state, round_info)
    return self.next_computation(state, groups, round_info)


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
  before_clients = central is not None and central.before_clients

  @tff.tensorflow.computation
  def initial_algorithm_state():
    return definition.initial_server_state()

  algorithm_state_type = initial_algorithm_state.type_signature.result

  def run_central(state, server_seed):
    tff_compiler.mark_without_recomputation()  # Trains in a loop.
    elements = (data.server_dataset_fn(server_seed) if central.uses_data
                else None)
    return central.run(central.context(), state, elements)

  # The round's server-placed input; 1-w GT's central result joins it.
  seed_fields = [('round_num', np.int64), ('server_seed', np.int64)]
  round_fields = list(seed_fields)
  if before_clients:
    central_comp = tff.tensorflow.computation(
        run_central, algorithm_state_type, np.int64)
    round_fields.append(('central', central_comp.type_signature.result))
  round_type = tff.StructWithPythonType(round_fields, collections.OrderedDict)

  @tff.tensorflow.computation(algorithm_state_type, round_type)
  def broadcast_comp(state, round_info):
    return collections.OrderedDict(
        message=definition.broadcast(state, round_info.get('central')),
        round_num=round_info['round_num'])

  payload_type = broadcast_comp.type_signature.result
  run_group = cohort.build_group_update(
      definition, data.client_dataset_fn,
      state_format if definition.has_client_state else None,
      data.client_cost_fn,
      per_client=model_aggregator is not None)

  @tff.tensorflow.computation(payload_type,
                              group_type(definition.has_client_state))
  def group_comp(payload, group):
    # Graph optimization without recomputation heuristics, which break the
    # group loop's gradients (runtime.tff_compiler).
    tff_compiler.mark_without_recomputation()
    run = run_group(definition.client_context())
    return run(payload['message'], payload['round_num'], group)

  result_type = group_comp.type_signature.result
  communication_values = server.communication_metrics(
      definition, payload_type.message, result_type)
  summed = tff.structure.name_list(result_type)
  aggregation = None
  if model_aggregator is not None:
    summed.remove('model_update')  # Aggregated by the factory instead.
    weighted = isinstance(model_aggregator,
                          tff.aggregators.WeightedAggregationFactory)
    aggregation = model_aggregator.create(
        result_type.model_update, *([result_type.weight] if weighted else []))

  def server_fn(inputs):
    state, round_info = inputs['state'], inputs['round']
    central_result = round_info.get('central')
    if central is not None and not before_clients:
      central_result = run_central(state, round_info['server_seed'])
    new_state, metrics = server.server_step(
        definition, state, inputs['totals'], central_result,
        communication_values, inputs.get('model_update'))
    if aggregation is not None:
      new_state = _with_aggregator(new_state, inputs['aggregator_state'])
      metrics['aggregator'] = inputs['aggregator_measurements']
    return new_state, metrics

  @tff.federated_computation
  def initialize():
    state = tff.federated_eval(initial_algorithm_state, tff.SERVER)
    if aggregation is None:
      return state
    return tff.federated_map(tff.tensorflow.computation(
        _with_aggregator, algorithm_state_type,
        aggregation.initialize.type_signature.result.member), (
            state, aggregation.initialize()))

  state_type = initialize.type_signature.result.member

  @tff.tensorflow.computation(state_type)
  def algorithm_part(state):
    return collections.OrderedDict(
        (k, v) for k, v in state.items() if k != 'aggregator')

  def algorithm_state_of(state):
    return (state if aggregation is None else
            tff.federated_map(algorithm_part, state))

  server_state = tff.FederatedType(state_type, tff.SERVER)

  @tff.federated_computation(
      server_state,
      tff.FederatedType(group_type(definition.has_client_state), tff.CLIENTS),
      tff.FederatedType(round_type, tff.SERVER))
  def next_fn(state, groups, round_info):
    algorithm_state = algorithm_state_of(state)
    payload = tff.federated_map(broadcast_comp, (algorithm_state, round_info))
    results = tff.federated_map(group_comp,
                                (tff.federated_broadcast(payload), groups))
    server_inputs = collections.OrderedDict(
        state=algorithm_state, round=round_info,
        totals=tff.federated_zip(collections.OrderedDict(
            (name, tff.federated_sum(getattr(results, name)))
            for name in summed)))
    if aggregation is not None:
      output = aggregation.next(state.aggregator, results.model_update,
                                *([results.weight] if weighted else []))
      server_inputs.update(model_update=output.result,
                           aggregator_state=output.state,
                           aggregator_measurements=output.measurements)
    server_inputs = tff.federated_zip(server_inputs)
    server_comp = tff.tensorflow.computation(
        server_fn, server_inputs.type_signature.member)
    updated = tff.federated_map(server_comp, server_inputs)
    return updated[0], updated[1]

  prepare = None
  if before_clients:

    @tff.federated_computation(server_state, tff.FederatedType(
        tff.StructWithPythonType(seed_fields, collections.OrderedDict),
        tff.SERVER))
    def prepare(state, round_info):
      algorithm_state = algorithm_state_of(state)
      return tff.federated_map(central_comp, (algorithm_state,
                                              round_info.server_seed))

  return RoundProcess(initialize, prepare, next_fn)


def _with_aggregator(state, aggregator_state):
  merged = collections.OrderedDict(state)
  merged['aggregator'] = aggregator_state
  return merged
