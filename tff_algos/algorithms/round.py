"""What an algorithm declares about its round, once, for every runtime.

An algorithm is a `RoundDefinition`: plain TF functions for the server's
initial state, what the server broadcasts, one client's update, the server's
update and, for mixed FL, the central work at the server; plus what each
client keeps (its persistent state) and what it sends. Nothing here knows
about placements. Two interpreters run a definition:

- `tff_algos.runtime.tff_process` builds a TFF process: the server state and
  round inputs at SERVER, the sampled clients (in groups) at CLIENTS, the
  broadcast, the per-client work (each client's data built and its state read
  and written inside its own computation), the aggregation through a
  `tff.aggregators` factory, and the server update;
- `tff_algos.runtime.native` runs the same functions in-process (the
  `--runtime=native` path, a GPU when TF sees one).

A round, as both interpret it:

  central     = central.run(state, central_data)          (if any; before the
                                                            clients when the
                                                            broadcast needs it)
  message     = broadcast(state, central)                  at the server
  per client  : result = client_work over the client's batches (ClientWork)
                state_i <- result.state                     (on the client)
  aggregates  = model_update: mean of result.model_update weighted by
                              result.weight (the model aggregator: a
                              tff.aggregators factory, default the mean)
                sums:         sum over the cohort of every result.sums and
                              result.measurements entry (in the clear)
                model_update_sum: the plain sum of the model updates, for
                              algorithms that ask (in the clear)
                num_clients, weight_sum
  state, m    = server_update(state, aggregates, central)
  metrics     = train: finalize_metrics(sum of result.metrics), m, ...

Conventions: a server state is an OrderedDict whose `global_model_weights`
entry is the global model (`tff.learning.models.ModelWeights`); every value
is a structure of tensors of fixed shapes.
"""

import collections
import dataclasses
from typing import Any, Callable, Mapping, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

GLOBAL_MODEL = 'global_model_weights'


@dataclasses.dataclass(frozen=True)
class AffineUpdate:
  """A part of a client's model update sent as scale * (tensor + offset),
  `offset(message)` the same for every client (a value of the message).

  The runtime then sums sum_i w_i scale_i tensor_i over a group and adds
  (sum_i w_i scale_i) offset once: two passes over the tensor a client
  fewer than forming each update (SCAFFOLD's factored kernels,
  y - x = -K eta (c_i+ - c_i + c)). The sum rounds differently from that
  of the formed updates. `dense_update` forms it, where a client's own
  update is needed (per-client aggregators).

  When the client's sums hold the same tensor (`summed_as`: (key, index) of
  `ClientResult.sums[key][index]`) and most clients send the same w_i
  scale_i (`common_scale()`, built with the same ops as theirs: equal bits),
  the runtime writes sum_i w_i scale_i tensor_i as common * (the group's sum
  of that entry) + sum_i (w_i scale_i - common) tensor_i, whose terms are 0
  for those clients and skipped: one more pass over the tensor a client
  fewer (SCAFFOLD's and FedResAvg's c_i+ - c_i, K_i = K).
  """
  tensor: tf.Tensor
  scale: tf.Tensor  # A float32 scalar.
  offset: Callable[[Any], tf.Tensor]
  summed_as: Optional[tuple[str, int]] = None
  common_scale: Optional[Callable[[], tf.Tensor]] = None


def switch(index: tf.Tensor, branches):
  """branches[index](); a single branch is called without a switch."""
  if len(branches) == 1:
    return branches[0]()
  return tf.switch_case(index, branches)


def dense_update(update, message):
  """The model update with every `AffineUpdate` formed."""
  return tf.nest.map_structure(
      lambda u: (u.scale * (u.tensor + u.offset(message))
                 if isinstance(u, AffineUpdate) else u), update)


@dataclasses.dataclass(frozen=True)
class ClientResult:
  """What one client's update returns (TF values)."""
  # Aggregated by the model aggregator, weighted by `weight`; tensors or
  # `AffineUpdate`s.
  model_update: Any
  # p_i: examples processed, or 1 under uniform weighting (float32).
  weight: tf.Tensor
  # Summed over the cohort in the clear: name -> structure.
  sums: Mapping[str, Any]
  # Unfinalized metric sums of this client (summed over the cohort).
  metrics: Any
  # Summed like `sums`, but measurements of the simulation that a deployed
  # client would not send (e.g. drift diversity's norms): not counted in the
  # communication metrics.
  measurements: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # The client's new persistent state; None when the algorithm keeps none.
  state: Any = None


@dataclasses.dataclass(frozen=True)
class ClientWork:
  """One client's update as steps over its batches; the runtime loops.

  A client goes over its dataset `len(steps)` times in a round (SCAFFOLD
  Option I and FedResSGD/Avg twice); each pass draws the batches a fresh
  iteration of the client's dataset draws (so a shuffled dataset reshuffles).
  The runtime streams the batches of a whole group of clients through one
  pipeline and calls, once per group, `prepare(context, message)` (if
  given), then per client:

    carry = start(context, message, client_state)
    for each pass p: for each batch: carry = steps[p](context, message,
                                                     client_state, carry,
                                                     batch)
                     carry = end_pass[p](context, message, client_state,
                                         carry)        (if given)
    result = finish(context, message, client_state, carry)

  `carry` is a structure of tensors of fixed shapes (counts, sums, optimizer
  states), the same structure and shapes from `start` to `finish`: every
  step and `end_pass` returns it as it got it (the runtime's loops carry it,
  and it finds the shapes of a client's result by tracing `finish` on
  `start`'s carry); the client's model lives in the context's variables,
  which `start` sets. `client_state` is None when the algorithm keeps none.
  """
  start: Callable[[Any, Any, Any], Any]
  steps: tuple[Callable[[Any, Any, Any, Any, Any], Any], ...]
  finish: Callable[[Any, Any, Any, Any], 'ClientResult']
  end_pass: Optional[tuple[Callable[[Any, Any, Any, Any], Any], ...]] = None
  # Sets context variables that stay the same for every client of a group
  # (values of the message that no client changes), once per group.
  prepare: Optional[Callable[[Any, Any], None]] = None
  # Products whose right operand is the same for every client of a group:
  # the runtime reads a chunk of clients' batches first, has them computed
  # together, then runs the clients' steps on the read batches.
  shared_products: Optional['SharedProducts'] = None

  @property
  def passes(self) -> int:
    return len(self.steps)


@dataclasses.dataclass(frozen=True)
class SharedProducts:
  """A layer's products that every client of a group takes with the same
  right operands (its kernel at the round's weights, say), computed for a
  chunk of clients at once: one product of many clients' rows is several
  times cheaper a row than one of a batch's few rows.

  Per chunk the runtime calls `record(context, acc, pass, step, batch)` for
  each element it reads (`initial(context)` the first `acc`; `pass` and
  `step` int32 tensors: the pass and the element's place in it), an
  end-of-pass marker's batch of no rows included, then `compute(context,
  acc)`, then, before each batch's step, `select(context, index)` with the
  batch's index among the chunk's elements, in reading order.
  """
  initial: Callable[[Any], Any]
  record: Callable[[Any, Any, tf.Tensor, tf.Tensor, Any], Any]
  compute: Callable[[Any, Any], None]
  select: Callable[[Any, tf.Tensor], None]
  # Clients whose batches are read and held at once.
  clients_per_chunk: int


@dataclasses.dataclass(frozen=True)
class CentralWork:
  """Work at the server on central data (mixed FL), once per round.

  `run(context, server_state, central_data) -> result` where `context` is
  what `context()` built (the central model's variables, once per
  computation) and `central_data` the round's central batches (None for a
  data-free central loss). With `before_clients` its result is part of what
  the server broadcasts (1-w GT's central gradient), so it runs before the
  clients; otherwise it runs with the server update, after the aggregation.
  """
  context: Callable[[], Any]
  run: Callable[[Any, Any, Optional[tf.data.Dataset]], Any]
  before_clients: bool
  uses_data: bool


@dataclasses.dataclass(frozen=True)
class Personalization:
  """Evaluation and export of personal models kept in client states.

  Both receive the Python server state and a read-only view of the committed
  client states (`tff_algos.runtime.client_states.ClientStates`).
  """
  # (server_state, client_states) -> {metric name: value}.
  evaluate: Callable[[Any, Any], Mapping[str, float]]
  # (server_state, client_states, export_dir): writes the personal models
  # (and how to serve them) next to the exported global model.
  export: Callable[[Any, Any, str], None]


@dataclasses.dataclass(frozen=True)
class RoundDefinition:
  """One algorithm's round (see the module docstring)."""
  name: str
  # The algorithm's typed settings (a frozen dataclass).
  settings: Any
  # () -> server state (TF, run once; the global model is then replaced by
  # the driver's seeded initial weights).
  initial_server_state: Callable[[], Any]
  # (server_state, central result or None) -> message (TF).
  broadcast: Callable[[Any, Any], Any]
  # () -> client context: the models and variables a client computation
  # needs, built once per computation and reused by every client of a group.
  client_context: Callable[[], Any]
  # One client's update (TF), as steps over its batches.
  client_work: ClientWork
  # (context) -> None: resets per-client accumulators (e.g. Keras metrics)
  # before each client of a group.
  reset_client: Callable[[Any], None]
  # (server_state, aggregates, central result or None)
  #   -> (server_state, metrics) (TF).
  server_update: Callable[[Any, Mapping[str, Any], Any], tuple[Any, Any]]
  # (summed unfinalized metrics) -> train metrics (TF).
  finalize_metrics: Callable[[Any], Any]
  # () -> the initial state of a never-sampled client (TF); None when the
  # algorithm keeps no client state.
  initial_client_state: Optional[Callable[[], Any]] = None
  central: Optional[CentralWork] = None
  personalization: Optional[Personalization] = None
  # The key of the message that is an augmenting gradient (mixed FL's
  # gradient transfer), reported apart in the communication metrics (0 when
  # the message has no such key).
  augmenting_message: Optional[str] = None
  # Whether clients send their weight; False when every client weighs 1 (a
  # uniform mean the server takes over the number of clients).
  uploads_weight: bool = True
  # Whether the server also needs the plain sum of the model updates (2-w
  # GT's eq. 10): the same uploaded values, aggregated a second way, in the
  # clear (aggregates['model_update_sum']).
  sums_model_update: bool = False
  # {flag: why} of flags a resumed run may not change, even with
  # --allow_flag_changes: its stored client states depend on them.
  fixed_on_resume: Mapping[str, str] = dataclasses.field(
      default_factory=dict)

  @property
  def has_client_state(self) -> bool:
    return self.initial_client_state is not None

  @property
  def uses_server_data(self) -> bool:
    return self.central is not None and self.central.uses_data


def get_model_weights(server_state):
  return server_state[GLOBAL_MODEL]


def set_model_weights(server_state, weights):
  state = collections.OrderedDict(server_state)
  state[GLOBAL_MODEL] = tff.learning.models.ModelWeights(
      trainable=[np.asarray(w) for w in weights.trainable],
      non_trainable=[np.asarray(w) for w in weights.non_trainable])
  return state
