"""One TFF process for every algorithm, built from its round definition.

`build(definition, ...)` interprets a `tff_algos.algorithms.round.
RoundDefinition` as TFF computations:

  initialize: ( -> state@SERVER)
  central:    (state@SERVER, <round_num, server_seed>@SERVER
               -> central@SERVER)
              only for algorithms with central work (mixed FL)
  next:       (state@SERVER, cohort@CLIENTS, round@SERVER)
              -> <state@SERVER, metrics@SERVER>

`round` is <round_num, server_seed[, central]>, with `central`'s result
when the broadcast needs it (1-w GT). Central work the broadcast does not
need (PT, 2-w GT) reads only the server state, so it runs alongside the
clients, as a server trains while its clients do: in `next` its call depends
on the state alone (TFF's C++ runtime runs it while the clients train), and
for TFF's mergeable context, which would run it after the last sub-round,
`next` is also split in two, `clients` (state, cohort, round) -> the
clients' aggregates@SERVER and `finish` (state, round with central,
aggregates) -> <state, metrics>, with `central` run at the same time as
`clients`. Each TFF client of `cohort` is a group
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
nothing is recomputed after the merge, and central work runs after the
merge or in a computation without clients - once per round.
"""

import collections
import concurrent.futures
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
  # (state, <round_num, server_seed>) -> central result; None without
  # central work. Run before `next` when the broadcast needs it (1-w GT),
  # else only in the split form (in `next` otherwise).
  central_computation: Optional[tff.Computation]
  # (state, groups, round) -> (state, metrics).
  next_computation: tff.Computation
  # Central work alongside the clients, split for TFF's mergeable context:
  # (state, groups, round) -> the clients' aggregates, and (state, round
  # with central, aggregates) -> (state, metrics). Else None.
  clients_computation: Optional[tff.Computation] = None
  finish_computation: Optional[tff.Computation] = None
  # () -> the context that runs the computations without clients (central,
  # finish) beside the default one, or None for the default
  # (`pipeline.tff_runtime.server_context`).
  server_context_fn: Optional[Callable[[], Any]] = None
  # () -> whether to run the split form (the driver's: whether the context
  # is TFF's mergeable one, `pipeline.tff_runtime.partitions() > 1`).
  split_fn: Optional[Callable[[], bool]] = None

  @property
  def computations(self) -> tuple[tff.Computation, ...]:
    return tuple(c for c in (
        self.initialize_computation, self.central_computation,
        self.next_computation, self.clients_computation,
        self.finish_computation) if c is not None)

  @property
  def broadcast_needs_central(self) -> bool:
    """Whether `central` runs before `next`, its result an argument (1-w GT);
    central work alongside the clients comes with the split form."""
    return (self.central_computation is not None and
            self.clients_computation is None)

  @property
  def iterative_process(self) -> tff.templates.IterativeProcess:
    """`initialize` and `next` as a `tff.templates.IterativeProcess`, for
    TFF's own tooling: next(state@SERVER, groups@CLIENTS, round@SERVER) ->
    <state, metrics>@SERVER. `round` is <round_num, server_seed> (int64),
    and for 1-w GT also `central`, the result of `central_computation`
    (state, <round_num, server_seed>), which the caller runs first, as
    `next` here does; `groups` are `runtime.cohort.groups`. Nothing is
    placed at CLIENTS in the result: client states stay in their files."""
    return tff.templates.IterativeProcess(self.initialize_computation,
                                          self.next_computation,
                                          next_is_multi_arg=True)

  def initialize(self):
    return self.initialize_computation()

  def next(self, state, groups, round_num: int, server_seed: int):
    round_info = collections.OrderedDict(round_num=np.int64(round_num),
                                         server_seed=np.int64(server_seed))
    on_server = self._server_runner()
    split = (self.finish_computation is not None and
             self.split_fn is not None and self.split_fn())
    if not split:
      if self.broadcast_needs_central:
        round_info['central'] = on_server(self.central_computation, state,
                                          round_info)
      return self.next_computation(state, groups, round_info)
    with concurrent.futures.ThreadPoolExecutor(1) as central_thread:
      central = central_thread.submit(on_server, self.central_computation,
                                      state, round_info)
      aggregates = self.clients_computation(state, groups, round_info)
      finished = collections.OrderedDict(round_info, central=central.result())
    return on_server(self.finish_computation, state, finished, aggregates)

  def _server_runner(self) -> Callable:
    """(computation, *args) -> its result, in the server context; callable
    from any thread (TFF's context stack is per thread)."""
    context = self.server_context_fn() if self.server_context_fn else None
    context = context or tff.framework.get_context_stack().current

    def run(computation, *args):
      with tff.framework.get_context_stack().install(context):
        return computation(*args)

    return run


def build(definition: round_lib.RoundDefinition, data: DataFunctions,
          state_format: Optional[client_states.StateFormat] = None,
          model_aggregator: Optional[Any] = None,
          server_context_fn: Optional[Callable[[], Any]] = None,
          split_fn: Optional[Callable[[], bool]] = None) -> RoundProcess:
  """The TFF process of `definition` (see the module docstring).

  Args:
    definition: the algorithm's round.
    data: the task's dataset functions.
    state_format: where and how client states are stored (required when
      the algorithm keeps client state).
    model_aggregator: a `tff.aggregators` factory for the model update, or
      None for the weighted mean from group sums. With a factory every
      group must hold one client.
    server_context_fn, split_fn: see `RoundProcess`.
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

  # The round's server-placed input; the central result joins it where the
  # broadcast needs it (1-w GT), or the server update (PT, 2-w GT).
  seed_fields = [('round_num', np.int64), ('server_seed', np.int64)]
  seed_type = tff.StructWithPythonType(seed_fields, collections.OrderedDict)
  with_central_type = seed_type
  if central is not None:
    central_comp = tff.tensorflow.computation(
        run_central, algorithm_state_type, np.int64)
    with_central_type = tff.StructWithPythonType(
        seed_fields + [('central', central_comp.type_signature.result)],
        collections.OrderedDict)
  # What `clients` and `finish` take.
  clients_round_type = with_central_type if before_clients else seed_type
  finish_round_type = with_central_type

  @tff.tensorflow.computation(algorithm_state_type, clients_round_type)
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
    state, aggregates = inputs['state'], inputs['aggregates']
    new_state, metrics = server.server_step(
        definition, state, aggregates['totals'],
        inputs['round'].get('central'), communication_values,
        aggregates.get('model_update'))
    if aggregation is not None:
      new_state = _with_aggregator(new_state, aggregates['aggregator_state'])
      metrics['aggregator'] = aggregates['aggregator_measurements']
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
  groups_type = tff.FederatedType(group_type(definition.has_client_state),
                                  tff.CLIENTS)

  def clients_part(state, groups, round_info):
    """The clients' aggregates@SERVER: their sums, and the model update's
    aggregation by the factory, if any."""
    payload = tff.federated_map(broadcast_comp, (algorithm_state_of(state),
                                                 round_info))
    results = tff.federated_map(group_comp,
                                (tff.federated_broadcast(payload), groups))
    aggregates = collections.OrderedDict(
        totals=tff.federated_zip(collections.OrderedDict(
            (name, tff.federated_sum(getattr(results, name)))
            for name in summed)))
    if aggregation is not None:
      output = aggregation.next(state.aggregator, results.model_update,
                                *([results.weight] if weighted else []))
      aggregates.update(model_update=output.result,
                        aggregator_state=output.state,
                        aggregator_measurements=output.measurements)
    return tff.federated_zip(aggregates)

  def finish_part(state, round_info, aggregates):
    server_inputs = tff.federated_zip(collections.OrderedDict(
        state=algorithm_state_of(state), round=round_info,
        aggregates=aggregates))
    server_comp = tff.tensorflow.computation(
        server_fn, server_inputs.type_signature.member)
    updated = tff.federated_map(server_comp, server_inputs)
    return updated[0], updated[1]

  central_fn = None
  if central is not None:

    @tff.federated_computation(server_state,
                               tff.FederatedType(seed_type, tff.SERVER))
    def central_fn(state, round_info):
      return tff.federated_map(central_comp, (algorithm_state_of(state),
                                              round_info.server_seed))

  if central is None or before_clients:

    @tff.federated_computation(
        server_state, groups_type,
        tff.FederatedType(clients_round_type, tff.SERVER))
    def next_fn(state, groups, round_info):
      return finish_part(state, round_info,
                         clients_part(state, groups, round_info))

    return RoundProcess(initialize, central_fn, next_fn,
                        server_context_fn=server_context_fn)

  # Central work alongside the clients. In one computation, its call depends
  # on the server state alone, and TFF's C++ runtime runs it while the
  # clients train.
  @tff.federated_computation(
      server_state, groups_type,
      tff.FederatedType(clients_round_type, tff.SERVER))
  def next_fn(state, groups, round_info):  # pylint: disable=function-redefined
    central_result = tff.federated_map(central_comp, (
        algorithm_state_of(state), round_info.server_seed))
    finished_round = tff.federated_zip(collections.OrderedDict(
        round_num=round_info.round_num, server_seed=round_info.server_seed,
        central=central_result))
    return finish_part(state, finished_round,
                       clients_part(state, groups, round_info))

  # Split, for TFF's mergeable context (sub-rounds, several workers), which
  # runs a computation's server work after its last sub-round:
  # `RoundProcess.next` runs `central` and `clients` at the same time.
  clients_fn = tff.federated_computation(
      clients_part, server_state, groups_type,
      tff.FederatedType(clients_round_type, tff.SERVER))
  finish_fn = tff.federated_computation(
      finish_part, server_state,
      tff.FederatedType(finish_round_type, tff.SERVER),
      clients_fn.type_signature.result)
  return RoundProcess(initialize, central_fn, next_fn, clients_fn, finish_fn,
                      server_context_fn, split_fn)


def _with_aggregator(state, aggregator_state):
  merged = collections.OrderedDict(state)
  merged['aggregator'] = aggregator_state
  return merged
