"""Mixed FL rounds in-process (the native runtime, `--runtime=native`).

The same `mixed_tf` round pieces as `mixed_tff`'s process, in its order:
central work at x, broadcast of x (and the augmenting gradient), client work,
p_i-weighted mean of the client deltas (plus their sums for 2-w GT), server
update; metrics summed then finalized.
"""

import collections
import functools
from typing import Callable

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos import communication
from tff_algos import mixed_tf
from tff_algos import native


class MixedRounds:
  """Rounds of `mixed_tff.build_mixed(name, ...)`'s process."""

  def __init__(self, name: str, settings: mixed_tf.RoundSettings,
               model_fn: Callable,
               client_optimizer: tff.learning.optimizers.Optimizer,
               server_optimizer: tff.learning.optimizers.Optimizer,
               central_optimizer, merge_optimizer, central_loss,
               metric_finalizers, communication_bytes: tuple[int, int, int]):
    self._name = name
    self._settings = settings
    # One model for the clients (metrics reset per client, as TFF builds a
    # fresh model for each), one for the central work.
    self._client_model = model_fn()
    self._central_model = model_fn()
    self._client_optimizer = client_optimizer
    self._server_optimizer = server_optimizer
    self._central_optimizer = central_optimizer
    self._merge_optimizer = merge_optimizer
    self._central_loss = central_loss
    self._metric_finalizers = metric_finalizers
    self._communication = communication.metrics(*communication_bytes)
    # Traced, as inside the TFF computation: optimizers take tensors.
    self._server_update = tf.function(functools.partial(
        mixed_tf.server_update, settings, server_optimizer, merge_optimizer))

  def initialize(self):
    return native.to_numpy(mixed_tf.initial_server_state(
        self._settings, self._client_model, self._server_optimizer,
        self._merge_optimizer))

  def next(self, server_state, datasets, client_states=None,
           server_data=None):
    del client_states  # Mixed FL keeps no client state.
    settings = self._settings
    central = native.to_numpy(mixed_tf.central_work(
        settings, self._central_model, self._central_optimizer,
        self._central_loss, server_state['global_model_weights'],
        server_state.get('gtilde_f'), server_data))

    payload = collections.OrderedDict(
        model_weights=server_state['global_model_weights'])
    if settings.transfers_gradients:
      payload['augmenting_gradient'] = (
          central['gradient'] if not settings.keeps_augmenting_gradients
          else server_state['gtilde_c'])
    outputs = []
    for dataset in datasets:
      self._client_model.reset_metrics()
      outputs.append(native.to_numpy(mixed_tf.client_work(
          settings, self._client_model, self._client_optimizer, payload,
          dataset)))
    uploads = [o['upload'] for o in outputs]
    weights = [u['weight'] for u in uploads]
    deltas = [u['delta'] for u in uploads]
    client_delta_sum = client_steps_sum = None
    if settings.keeps_augmenting_gradients:
      client_delta_sum = native.sum_structures(deltas)
      client_steps_sum = native.sum_structures(
          [u['num_steps'] for u in uploads])
    new_state = native.to_numpy(self._server_update(
        server_state, central, native.weighted_mean(deltas, weights),
        native.sum_structures(weights), client_delta_sum, client_steps_sum))

    metrics = collections.OrderedDict(
        train=native.sum_then_finalize(self._metric_finalizers,
                                       [u['metrics'] for u in uploads]),
        central=collections.OrderedDict(loss=central['loss'],
                                        num_steps=central['num_steps']))
    if settings.diagnostics:
      central_gradient = (central['gradient']
                          if not settings.has_central_model
                          else central['first_gradient'])
      metrics['diagnostics'] = native.to_numpy(mixed_tf.mixing_diagnostics(
          native.mean([o['first_gradient'] for o in outputs]),
          list(central_gradient), settings.federated_weight,
          settings.central_weight))
    metrics['communication'] = self._communication
    return new_state, None, metrics
