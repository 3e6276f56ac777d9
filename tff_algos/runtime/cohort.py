"""A group of a round's clients, run as one compiled TF computation.

Under TFF, a TFF client stands for a group of the round's clients; the
native runtime runs the whole cohort as groups too. A group's computation
loops over its clients inside the graph: for each one it builds the client's
dataset from (id, seed), reads its state, runs the algorithm's client update,
writes its new state, and adds its results into the group's sums. No
per-client call, dispatch or value crosses the runtime, and one client's
weights at a time are live, which is what keeps a CPU round compute-bound
(the benchmark's FedAvg round is a few GFLOP; per-client overhead, not
arithmetic, separated this project from the fastest peers).

A group's result (an OrderedDict):
  model_update  sum_i w_i * u_i over its clients, or, for a group of one
                client fed to a per-client aggregator, u_i itself
  weight        sum_i w_i (w_i for a per-client group)
  num_clients   clients in the group (int32)
  sums          the algorithm's sums over the group
  measurements  its summed measurements (not sent by a deployed client)
  metrics       its summed unfinalized metrics
  client_costs  summed analytic costs (tasks that model them)

Each client computes exactly what it computes alone; only the order of float
additions across clients depends on the grouping.
"""

import collections
import os
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import client_states


def _weighted(update, weight):
  return tf.nest.map_structure(lambda u: u * tf.cast(weight, u.dtype), update)


def _add(a, b):
  return tf.nest.map_structure(tf.add, a, b)


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

  def one_client(context, message, round_num, group, i):
    client_id, seed = group['ids'][i], group['seeds'][i]
    state = None
    if definition.has_client_state:
      state = state_format.read(client_id, group['versions'][i])
    definition.reset_client(context)
    result = definition.client_update(
        context, message, client_dataset_fn(client_id, seed), state)
    if definition.has_client_state:
      state_format.write(client_id, round_num, result.state)
    costs = None
    if client_cost_fn is not None:
      # Rebuilt from (id, seed): the batches the client trained on.
      costs = client_cost_fn(client_dataset_fn(client_id, seed))
    return result, costs

  def contribution(result: round_lib.ClientResult, costs):
    out = collections.OrderedDict(
        model_update=(result.model_update if per_client else
                      _weighted(result.model_update, result.weight)),
        weight=tf.cast(result.weight, tf.float32),
        num_clients=tf.constant(1, tf.int32),
        sums=collections.OrderedDict(result.sums),
        measurements=collections.OrderedDict(result.measurements),
        metrics=result.metrics)
    if costs is not None:
      out['client_costs'] = collections.OrderedDict(costs)
    return out

  def bind(context):

    @tf.function
    def run(message, round_num, group):
      num_clients = tf.shape(group['ids'])[0]
      # The first client outside the loop: its results give the sums' shapes.
      total = contribution(*one_client(context, message, round_num, group, 0))
      if per_client:
        tf.debugging.assert_equal(num_clients, 1,
                                  'a per-client group holds one client')
        return total
      for i in tf.range(1, num_clients):
        total = _add(total, contribution(
            *one_client(context, message, round_num, group, i)))
      return total

    return run

  return bind


def clients_per_group(clients_per_round: int, requested: int, runtime: str,
                      per_client: bool = False) -> int:
  """Group size of a round: `requested` if set, else chosen for the runtime.

  Per-client aggregators need groups of one. TFF's worker runs its clients
  (here: groups) concurrently, one per core; the native runtime runs groups
  one after another, so it takes the cohort as one group.
  """
  if per_client:
    if requested not in (0, 1):
      raise ValueError('this model aggregator works per client: groups of '
                       f'one client, not {requested}')
    return 1
  if requested > 0:
    return requested
  if runtime == 'native':
    return clients_per_round
  slots = max(1, os.cpu_count() or 1) * _execution_slots()
  return max(1, -(-clients_per_round // slots))


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
        ids=np.asarray([str(c) for c in client_ids[start:start + size]]),
        seeds=np.asarray(seeds[start:start + size], np.int64))
    if versions is not None:
      group['versions'] = np.asarray(versions[start:start + size], np.int64)
    result.append(group)
  return result
