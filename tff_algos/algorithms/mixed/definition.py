"""Mixed FL as round definitions: Parallel Training, 1-way and 2-way
Gradient Transfer ([MixedFL] Algorithms 1 and 2, Appendix A).

The math is in `math`. The central work runs at the server on the round's
central batches (or on a data-free central loss), once per round: for 1-w GT
before the clients (its gradient g_c is broadcast with x), for PT and 2-w GT
alongside the clients' work (it starts from the same x and does not depend on
their results), its update merged with theirs at the server.

  server state  <global_model_weights=x, server_optimizer[, merge_optimizer]
                 [, gtilde_c, gtilde_f]>      (augmenting gradients: 2-w GT)
  message       <global_model_weights=x[, augmenting_gradient]>
                 (1-w GT: g_c of the round; 2-w GT: gtilde_c)
  client sends  x_i - x (model update, weighted by examples processed), its
                metrics, and for 2-w GT x_i - x and K_i summed (eq. 10)

ClientOpt and CentralOpt start fresh every round: the central model is a
"meta-client" that, like the clients, takes K steps from x. Non-trainable
weights are not trained; the server keeps its own (as tff.learning's FedAvg).

Metrics: `train/*` (the model's metrics on the clients' batches), `central/
loss` (mean unweighted central loss of the round) and `central/num_steps`,
with `--mixed_diagnostics` `diagnostics/gtilde_squared` and
`diagnostics/btilde_squared` (eq. 7).
"""

import collections
import dataclasses
from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos.algorithms import keras_model
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import settings as settings_lib
from tff_algos.algorithms.mixed import math

PARALLEL_TRAINING = 'mixed_pt'
ONE_WAY_GT = 'mixed_1wgt'
TWO_WAY_GT = 'mixed_2wgt'
NAMES = (PARALLEL_TRAINING, ONE_WAY_GT, TWO_WAY_GT)
# w_f + w_c may differ from 1 by a flag's decimal rounding (0.73 + 0.27).
WEIGHT_SUM_TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True)
class OneWayGtSettings(settings_lib.ClientOptimizerSettings):
  """1-w GT: no central model; clients add the round's central gradient."""
  central_batch_size: int = settings_lib.setting(500, 'Mixed FL: |B_c|.')
  federated_weight: float = settings_lib.setting(
      0.5, 'Mixed FL: w_f.', bound=settings_lib.NON_NEGATIVE)
  central_weight: float = settings_lib.setting(
      0.5, 'Mixed FL: w_c.', bound=settings_lib.NON_NEGATIVE)
  mixed_diagnostics: bool = settings_lib.setting(
      False, 'Mixed FL: the sampled (G, B) approximations of eq. 7.')

  def __post_init__(self):
    super().__post_init__()
    if self.central_batch_size < 1:
      raise settings_lib.SettingError(
          'central_batch_size', f'must be >= 1, got {self.central_batch_size}')
    if self.federated_weight == 0 and self.central_weight == 0:
      raise settings_lib.SettingError(
          'federated_weight', 'and --central_weight are both 0: the mixed '
          'loss would be zero; make at least one positive')
    if self.mixed_diagnostics and not (self.federated_weight > 0 and
                                       self.central_weight > 0):
      raise settings_lib.SettingError(
          'mixed_diagnostics', 'needs --federated_weight > 0 and '
          '--central_weight > 0 (eq. 7 divides by both)')
    total = self.federated_weight + self.central_weight
    if abs(total - 1) > WEIGHT_SUM_TOLERANCE:
      # Other sums only rescale the learning rates, and eq. 7's diagnostics
      # assume proportions (G^2 came out negative).
      raise settings_lib.SettingError(
          'federated_weight', f'and --central_weight are proportions of '
          f'influence that sum to 1 ([MixedFL] Def. 4.2), got '
          f'{self.federated_weight:g} + {self.central_weight:g} = {total:g}')


@dataclasses.dataclass(frozen=True)
class ParallelTrainingSettings(OneWayGtSettings):
  """PT: a central model takes K steps from x in parallel with the clients."""
  central_optimizer: str = settings_lib.setting(
      'sgd', 'Mixed FL: CentralOpt.', settings_lib.OPTIMIZERS)
  central_learning_rate: float = settings_lib.setting(
      0.01, 'Mixed FL: eta_c.', bound=settings_lib.POSITIVE)
  merge_optimizer: str = settings_lib.setting(
      'sgd', 'Mixed FL: MergeOpt.', settings_lib.OPTIMIZERS)
  merge_learning_rate: float = settings_lib.setting(
      1.0, 'Mixed FL: eta_m.', bound=settings_lib.POSITIVE)
  central_steps: Optional[int] = settings_lib.setting(
      None, 'Mixed FL: the central model\'s steps per round (default: K, '
      '--client_steps, as in the paper).')

  def __post_init__(self):
    super().__post_init__()
    if self.central_steps is not None and self.central_steps < 1:
      raise settings_lib.SettingError(
          'central_steps', f'must be >= 1, got {self.central_steps}')


@dataclasses.dataclass(frozen=True)
class TwoWayGtSettings(ParallelTrainingSettings):
  """2-w GT: PT plus augmenting gradients kept in the server state."""

  def __post_init__(self):
    super().__post_init__()
    # Its augmenting gradients are -delta / (eta * steps): the mean gradient
    # only for plain SGD steps ([MixedFL] App. A.2).
    not_sgd = [f'--{name}={getattr(self, name)}'
               for name in ('client_optimizer', 'central_optimizer')
               if getattr(self, name) != 'sgd']
    if not_sgd:
      raise settings_lib.SettingError(
          'algorithm', f'={TWO_WAY_GT} needs plain SGD as --client_optimizer '
          'and --central_optimizer (its augmenting gradients are recovered '
          'from the deltas of plain SGD steps; docs/mixed_fl.md); got '
          + ', '.join(not_sgd))


SETTINGS = {PARALLEL_TRAINING: ParallelTrainingSettings,
            ONE_WAY_GT: OneWayGtSettings, TWO_WAY_GT: TwoWayGtSettings}


def definition(name: str, task, settings) -> round_lib.RoundDefinition:
  """The mixed FL algorithm `name` (one of NAMES) on `task`.

  The task's data-free central loss (`Task.central_loss_fn`), when it has
  one, replaces the loss on central batches.
  """
  if name not in NAMES:
    raise ValueError(f'unknown mixed FL algorithm {name!r}')
  if not isinstance(settings, SETTINGS[name]):
    raise TypeError(f'{name} takes {SETTINGS[name].__name__}')
  has_central_model = name != ONE_WAY_GT
  keeps_augmenting_gradients = name == TWO_WAY_GT
  central_steps = getattr(settings, 'central_steps', None) or (
      task.data_config.client_steps if task.data_config is not None else None)
  if has_central_model and central_steps is None:
    raise settings_lib.SettingError(
        'algorithm', f'={name} needs --client_steps (K): its central model '
        'takes K steps per round')
  model_fn = task.model_fn
  data_free = task.central_loss_fn is not None
  round_settings = math.RoundSettings(
      has_central_model=has_central_model,
      transfers_gradients=name != PARALLEL_TRAINING,
      keeps_augmenting_gradients=keeps_augmenting_gradients,
      data_free=data_free, central_steps=central_steps,
      federated_weight=settings.federated_weight,
      central_weight=settings.central_weight,
      client_learning_rate=settings.client_learning_rate,
      central_learning_rate=getattr(settings, 'central_learning_rate', None),
      diagnostics=settings.mixed_diagnostics,
      client_plain_sgd=settings.client_optimizer == 'sgd')
  client_optimizer = settings_lib.optimizer(settings.client_optimizer,
                                            settings.client_learning_rate)
  server_optimizer = settings_lib.optimizer(settings.server_optimizer,
                                            settings.server_learning_rate)
  central_optimizer = merge_optimizer = None
  if has_central_model:
    central_optimizer = settings_lib.optimizer(settings.central_optimizer,
                                               settings.central_learning_rate)
    merge_optimizer = settings_lib.optimizer(settings.merge_optimizer,
                                             settings.merge_learning_rate)
  central_loss = (math.DataFreeCentralLoss(task.central_loss_fn) if data_free
                  else math.DataCentralLoss())
  info = keras_model.model_info(model_fn)

  def initial_server_state():
    return math.initial_server_state(round_settings, model_fn(),
                                     server_optimizer, merge_optimizer)

  def run_central(model, state, central_batches):
    return math.central_work(
        round_settings, model, central_optimizer, central_loss,
        state['global_model_weights'], state.get('gtilde_f'),
        central_batches)

  def broadcast(state, central):
    message = collections.OrderedDict(
        global_model_weights=state['global_model_weights'])
    if name == ONE_WAY_GT:
      message['augmenting_gradient'] = central['gradient']
    elif name == TWO_WAY_GT:
      message['augmenting_gradient'] = state['gtilde_c']
    return message

  def server_update(state, aggregates, central):
    sums = aggregates['sums']
    new_state = math.server_update(
        round_settings, server_optimizer, merge_optimizer, state, central,
        aggregates['model_update'], aggregates['weight_sum'],
        aggregates.get('model_update_sum'), sums.get('num_steps'))
    metrics = collections.OrderedDict(central=collections.OrderedDict(
        loss=central['loss'], num_steps=central['num_steps']))
    if settings.mixed_diagnostics:
      measurements = aggregates['measurements']
      federated_gradient = [
          tf.math.divide_no_nan(g, measurements['first_gradient_count'])
          for g in measurements['first_gradient']]
      central_gradient = (central['first_gradient'] if has_central_model
                          else central['gradient'])
      metrics['diagnostics'] = math.mixing_diagnostics(
          federated_gradient, list(central_gradient),
          settings.federated_weight, settings.central_weight)
    return new_state, metrics

  return round_lib.RoundDefinition(
      name=name, settings=settings,
      initial_server_state=initial_server_state, broadcast=broadcast,
      client_work=math.client_work(round_settings, client_optimizer,
                                   info.trainable_specs),
      server_update=server_update,
      central=round_lib.CentralWork(
          context=model_fn, run=run_central,
          before_clients=name == ONE_WAY_GT, uses_data=not data_free),
      augmenting_message='augmenting_gradient',
      sums_model_update=keeps_augmenting_gradients,
      **keras_model.client_fields(model_fn, info))
