"""FedRes rounds run in-process, without TFF (`--runtime=native`).

Runs the same per-client function as the TFF process (`fedres_tf.client_round`,
eagerly: its batch steps are compiled, its loops are Python) client by client,
then aggregates as the process does: uniform mean of the deltas, sum of the
control deltas over N (`fedres_tff.server_update`). Parity with the TFF
process is tested. On tiny problems TFF's per-round overhead dominates, so
scripted experiments and long convergence tests use this, and so does the
driver under `--runtime=native` (`tff_algos.native`).
"""

import collections
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tasks import base
from tff_algos import communication
from tff_algos import fedres_tf
from tff_algos import fedres_tff
from tff_algos.config import AlgorithmConfig


def _to_numpy(structure):
  return tf.nest.map_structure(np.asarray, structure)


def _stack(tensors) -> np.ndarray:
  return np.stack([np.asarray(t) for t in tensors])


class InProcessRounds:
  """initialize() -> server state; next(state, datasets, client states)."""

  def __init__(self, variant: str, task: base.Task, config: AlgorithmConfig):
    self.hparams = fedres_tff.hyperparameters(variant, task, config)
    self._model = fedres_tf.ResidualModel(task.residual_spec)
    self._initial_global, self.initial_local = fedres_tff.initial_weights(
        task.residual_spec)

  def initialize(self):
    return _to_numpy(fedres_tff.initial_server_state(
        self.hparams, self._initial_global))

  def initial_client_state(self):
    return _to_numpy(fedres_tf.initial_client_state(
        self.hparams, self.initial_local, self._initial_global))

  def next(self, server_state, datasets: Sequence[tf.data.Dataset],
           client_states: Sequence[Any], server_data=None):
    """One round over the given (sampled) clients, in order.

    SGD and Avg iterate a client's dataset twice (Step 1, then the pass on
    w); the second pass reshuffles, as in the TFF process.

    Returns (new server state, new client states, metrics) like the TFF
    process's `next` (a `tff_algos.native.NativeRounds`).
    """
    del server_data  # FedRes uses no server data.
    hparams = self.hparams
    options = base.without_pipeline_rewrites()
    datasets = [dataset.with_options(options) for dataset in datasets]
    message = fedres_tff.server_message(hparams, server_state)
    outputs = [
        fedres_tf.client_round(self._model, hparams, dataset, state,
                               message['global_weights'],
                               message.get('control'))
        for dataset, state in zip(datasets, client_states, strict=True)]
    mean_delta = [np.mean(_stack(per_client), axis=0) for per_client in
                  zip(*[o['weights_delta'] for o in outputs])]
    control_delta_sum = None
    if hparams.uses_control:
      control_delta_sum = [np.sum(_stack(per_client), axis=0) for per_client
                           in zip(*[o['control_delta'] for o in outputs])]
    new_state = _to_numpy(fedres_tff.server_update(
        hparams, server_state, mean_delta, control_delta_sum))
    num_examples = sum(int(o['num_examples']) for o in outputs)
    loss_sum = sum(float(o['loss_sum']) for o in outputs)
    metrics = collections.OrderedDict(
        train=collections.OrderedDict(loss=loss_sum / max(num_examples, 1),
                                      num_examples=num_examples),
        communication=communication.metrics(
            communication.value_bytes(message),
            communication.value_bytes(fedres_tff.uploaded(outputs[0]))))
    return new_state, [_to_numpy(o['state']) for o in outputs], metrics
