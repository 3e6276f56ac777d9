"""The server's part of a round, from the cohort's sums, for both runtimes.

`runtime.tff_process` runs `server_step` inside its server computation (on
the sums TFF's federated_sum computes) and `runtime.native` inside a
tf.function (on the sums it adds itself), so the aggregates an algorithm's
server update sees and the metrics a round reports are built in one place.
"""

import collections
from typing import Any, Optional

import tensorflow as tf

from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import communication


def communication_metrics(definition: round_lib.RoundDefinition,
                          message_type, group_result_type):
  """The round's `communication/*` metrics, from the TFF types of the
  broadcast message and of a group's result."""
  down, up = communication.per_client_bytes(
      message_type, group_result_type, definition.uploads_weight)
  return communication.metrics(down, up, communication.augmenting_bytes(
      message_type, definition.augmenting_message))


def server_step(definition: round_lib.RoundDefinition, state, totals,
                central, communication_values,
                model_update: Optional[Any] = None):
  """(new server state, round metrics), in TF.

  Args:
    definition: the algorithm's round.
    state: the algorithm's server state.
    totals: the groups' results (`runtime.cohort`), summed over the cohort.
    central: the round's central result, or None.
    communication_values: what `communication_metrics` returned.
    model_update: the model aggregator's result; None for the default, the
      weighted mean of the updates from their sums (what
      `tff.federated_mean(value, weight)` computes per client).
  """
  weight_sum = totals['weight']
  if model_update is None:
    model_update = tf.nest.map_structure(
        lambda s: tf.divide(s, weight_sum), totals['model_update'])
  aggregates = collections.OrderedDict(
      model_update=model_update, weight_sum=weight_sum,
      num_clients=totals['num_clients'], sums=totals['sums'],
      measurements=totals['measurements'])
  if definition.sums_model_update:
    aggregates['model_update_sum'] = totals['model_update_sum']
  new_state, algorithm_metrics = definition.server_update(state, aggregates,
                                                          central)
  metrics = collections.OrderedDict(
      train=definition.finalize_metrics(totals['metrics']))
  metrics.update(algorithm_metrics)
  metrics['communication'] = tf.nest.map_structure(tf.convert_to_tensor,
                                                   communication_values)
  if 'client_costs' in totals:
    metrics = communication.with_client_costs(metrics, tf.nest.map_structure(
        lambda c: c / tf.cast(totals['num_clients'], c.dtype),
        totals['client_costs']))
  return new_state, metrics
