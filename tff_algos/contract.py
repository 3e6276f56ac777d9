"""The one process contract every algorithm meets, and its client-by-id form.

An algorithm builder returns a `FederatedAlgorithm` whose `process` works on
datasets:

  initialize: ( -> server_state@SERVER)
  next: (server_state@SERVER, client_inputs@CLIENTS[, server_data@SERVER])
        -> <server_state@SERVER, client_outputs@CLIENTS, metrics@SERVER>

where `client_inputs` is the client's dataset, or `<data, state>` when the
algorithm keeps persistent client state; `client_outputs` is `<state>` with the
updated client state (an empty struct when there is none); `server_data` is a
dataset of central batches (mixed FL). `metrics` is a structure whose top-level
keys become metric-name prefixes (`train/loss`, ...).

An algorithm whose client states hold personal models (FedRes theta_i) also
gives `Personalization` hooks: the driver reports their evaluation beside the
global-only one (`eval_personalized/<metric>`) and calls their export after
writing the global model.

`compose_by_id` turns that into what the driver runs: clients are passed by
id (plus a per-round shuffle seed and their stored state) and every dataset is
built inside the TFF computation, so no dataset is serialized from
Python each round. `tff_algos.native.compose_by_id` gives the same interface
for the in-process runtime (`--runtime=native`).
"""

import collections
import dataclasses
from typing import Any, Callable, Mapping, Optional

import numpy as np
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tff_algos import communication
from tff_algos import dataset_fusion

ModelWeights = tff.learning.models.ModelWeights

# Type of the per-client input of a by-id process (without the state field).
CLIENT_ID_FIELDS = (('id', np.str_), ('seed', np.int64))


@dataclasses.dataclass(frozen=True)
class Personalization:
  """Evaluation and export of the personal models kept in client states.

  Both receive the Python server state and the driver's client-state store
  (`pipeline.client_store.ClientStateStore`), which they must only read.
  """
  # (server_state, store) -> {metric name: value}.
  evaluate: Callable[[Any, Any], Mapping[str, float]]
  # (server_state, store, export_dir): writes the personal models (and how to
  # serve them) into the export directory of the global model.
  export: Callable[[Any, Any, str], None]


@dataclasses.dataclass(frozen=True)
class FederatedAlgorithm:
  """An algorithm as the driver sees it (see module docstring)."""
  name: str
  process: tff.templates.IterativeProcess
  # Python-side accessors of the global model inside a server state.
  get_model_weights: Callable[[Any], ModelWeights]
  set_model_weights: Callable[[Any, ModelWeights], Any]
  # Initial persistent state of a never-sampled client; None if stateless.
  client_state_fn: Optional[Callable[[], Any]] = None
  uses_server_data: bool = False
  # Algorithm-specific flags that apply (validated by the binaries).
  flag_names: tuple[str, ...] = ()
  # Set when client states hold personal models (needs client state).
  personalization: Optional[Personalization] = None
  # Builds the in-process equivalent of `process` for --runtime=native
  # (`tff_algos.native.NativeRounds`); None if the algorithm has none.
  native_process_fn: Optional[Callable[[], Any]] = None

  @property
  def has_client_state(self) -> bool:
    return self.client_state_fn is not None


def compose_by_id(
    algorithm: FederatedAlgorithm,
    client_dataset_computation: tff.Computation,
    server_dataset_computation: Optional[tff.Computation] = None,
    client_cost_fn: Optional[Callable[[Any], Mapping[str, Any]]] = None,
    fuse_datasets: bool = True,
) -> tff.templates.IterativeProcess:
  """Returns the process the driver runs.

  next: (server_state@SERVER, <id, seed[, state]>@CLIENTS, int64@SERVER)
        -> <server_state@SERVER, client_outputs@CLIENTS, metrics@SERVER>

  Args:
    algorithm: the dataset-level algorithm.
    client_dataset_computation: `<id: str, seed: int64> -> dataset`.
    server_dataset_computation: `int64 seed -> dataset` of central batches;
      required when the algorithm uses server data.
    client_cost_fn: optional `dataset -> analytic costs` of a client's round
      (`Task.client_cost_fn`); their cohort means are added to the metrics
      as `train/client_*` (`communication.add_client_costs`).
    fuse_datasets: build each client's dataset inside the client
      computations that consume it (`dataset_fusion`), not in a computation
      of its own; the results are the same, the rounds faster. False only to
      test that.
  """
  inner = algorithm.process
  state_type = inner.initialize.type_signature.result
  fields = list(CLIENT_ID_FIELDS)
  if algorithm.has_client_state:
    client_state_type = inner.next.type_signature.parameter[1].member.state
    fields.append(('state', client_state_type))
  client_input_type = tff.FederatedType(tff.StructType(fields), tff.CLIENTS)
  if algorithm.uses_server_data and server_dataset_computation is None:
    raise UsageError(
        f'--algorithm={algorithm.name} needs central (server) data or a '
        'data-free central loss; the task, with these flags, has neither')

  cost_computation = None
  if client_cost_fn is not None:
    cost_computation = tff.tensorflow.computation(
        client_cost_fn, client_dataset_computation.type_signature.result)

  @tff.federated_computation(state_type, client_input_type,
                             tff.FederatedType(np.int64, tff.SERVER))
  def next_fn(server_state, client_inputs, server_seed):
    client_id_and_seed = tff.federated_zip(
        collections.OrderedDict(id=client_inputs.id, seed=client_inputs.seed))
    datasets = tff.federated_map(client_dataset_computation,
                                 client_id_and_seed)
    data = datasets
    if algorithm.has_client_state:
      data = tff.federated_zip(
          collections.OrderedDict(data=data, state=client_inputs.state))
    if algorithm.uses_server_data:
      server_data = tff.federated_map(server_dataset_computation, server_seed)
      result = inner.next(server_state, data, server_data)
    else:
      result = inner.next(server_state, data)
    if cost_computation is None:
      return result
    # A dataset value is a seeded pipeline: this second pass over it sees the
    # batches the client trained on.
    metrics = communication.add_client_costs(
        result[2], tff.federated_map(cost_computation, datasets))
    return result[0], result[1], metrics

  if fuse_datasets:
    next_fn = dataset_fusion.fuse_client_datasets(next_fn)
  return tff.templates.IterativeProcess(inner.initialize, next_fn)
