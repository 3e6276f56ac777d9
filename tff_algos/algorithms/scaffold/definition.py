"""SCAFFOLD and FedPVR as round definitions ([SCAFFOLD] Alg. 1, [FedPVR]).

One definition serves both: a mask over the model's trainable variables picks
those that get control variates (all of them: SCAFFOLD; the last layers:
FedPVR). The TF math is in `math`.

  server state   <global_model_weights=x, server_optimizer_state,
                  control_variate=c (masked variables)>
  client state   <control_variate=c_i>, zeros until the client is sampled
  message        <global_model_weights=x, control_variate=c>
  client sends   y_i - x (model update, weighted by p_i: examples processed,
                 or 1 with --client_weighting=uniform), c_i+ - c_i (summed)
  server         x <- ServerOpt(x, -mean_p(y_i - x))
                 c <- c + (|S|/N) * uniform mean_S(c_i+ - c_i), the paper's
                 rule, which keeps c the mean of all N clients' c_i
"""

import collections
import dataclasses
from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_algos.algorithms import keras_model
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import settings as settings_lib
from tff_algos.algorithms.scaffold import factored
from tff_algos.algorithms.scaffold import math


@dataclasses.dataclass(frozen=True)
class ScaffoldSettings(settings_lib.SgdClientSettings):
  # [SCAFFOLD] Alg. 1 line 16 and [FedPVR] eq. 8: the uniform mean over S.
  client_weighting: str = settings_lib.client_weighting('uniform')
  scaffold_option: int = settings_lib.setting(
      2, 'SCAFFOLD control variate option: 1 (c_i+ = g_i(x), one extra pass) '
      'or 2 (from the local steps).', math.OPTIONS)
  drift_diversity: bool = settings_lib.setting(
      False, 'Log drift diversity per layer ([FedPVR] Definition 1).')
  factored_control_variates: bool = settings_lib.factored_control_variates()


@dataclasses.dataclass(frozen=True)
class FedPvrSettings(ScaffoldSettings):
  # Only the variables without control variates take the client optimizer's
  # steps (the masked ones take SCAFFOLD's corrected SGD step).
  client_optimizer: str = settings_lib.client_optimizer()
  pvr_last_layers: Optional[int] = settings_lib.setting(
      None, 'FedPVR: control variates on the last L layers that have '
      'trainable variables (default 1; 0: FedAvg; >= layer count: SCAFFOLD).')
  pvr_start_variable: Optional[int] = settings_lib.setting(
      None, 'FedPVR: control variates on the trainable variables from this '
      'index on (instead of --pvr_last_layers).')

  def __post_init__(self):
    super().__post_init__()
    if self.pvr_last_layers is not None and (
        self.pvr_start_variable is not None):
      raise settings_lib.SettingError(
          'pvr_last_layers', 'and --pvr_start_variable choose the same mask; '
          'pass one of them')
    if self.pvr_last_layers is not None and self.pvr_last_layers < 0:
      raise settings_lib.SettingError(
          'pvr_last_layers', f'must be >= 0, got {self.pvr_last_layers}')


def _mask(settings, variable_names) -> tuple[bool, ...]:
  if not isinstance(settings, FedPvrSettings):
    return tuple(True for _ in variable_names)
  start = settings.pvr_start_variable
  if start is not None and not 0 <= start <= len(variable_names):
    raise settings_lib.SettingError(
        'pvr_start_variable', f'={start} is out of range: the model has '
        f'{len(variable_names)} trainable variables (allowed: 0..'
        f'{len(variable_names)})')
  last_layers = None
  if start is None:
    last_layers = (1 if settings.pvr_last_layers is None
                   else settings.pvr_last_layers)
  return math.control_variate_mask(variable_names, last_layers, start)


def definition(name: str, model_fn: keras_model.ModelFn, settings,
               num_train_clients: int,
               client_steps_and_batch: tuple[Optional[int], int] = (None, 0)
               ) -> round_lib.RoundDefinition:
  """The SCAFFOLD (ScaffoldSettings) or FedPVR (FedPvrSettings) round.

  `client_steps_and_batch`: (K, B) with --client_steps, else (None, B);
  factored control variates need K.
  """
  if num_train_clients < 1:
    raise ValueError('num_train_clients must be >= 1')
  info = keras_model.model_info(model_fn)
  mask = _mask(settings, info.variable_names)
  layer_of_variable = math.variable_layers(info.variable_names)
  cv_specs = math.masked_specs(info.trainable_specs, mask)
  factorable = ()
  if settings.scaffold_option == math.OPTION_FROM_LOCAL_STEPS:
    factorable = factored.plan(model_fn, mask, *client_steps_and_batch)
  kernels = factorable if settings.factored_control_variates else ()
  fixed_on_resume = factored.fixed_on_resume(factorable, kernels)
  factored_at = dict(zip(factored.positions(mask, kernels), kernels))
  server_optimizer = settings_lib.optimizer(settings.server_optimizer,
                                            settings.server_learning_rate)
  client_optimizer = settings_lib.optimizer(
      getattr(settings, 'client_optimizer', 'sgd'),
      settings.client_learning_rate)
  uniform = settings.client_weighting == 'uniform'

  def initial_server_state():
    return collections.OrderedDict(
        global_model_weights=keras_model.initial_weights(model_fn),
        server_optimizer_state=server_optimizer.initialize(
            info.trainable_specs),
        control_variate=math.zeros_like_specs(cv_specs))

  def broadcast(state, central):
    del central
    return collections.OrderedDict(
        global_model_weights=state['global_model_weights'],
        control_variate=state['control_variate'])


  def server_update(state, aggregates, central):
    del central
    weights, optimizer_state, control_variate = math.server_update(
        server_optimizer, state['global_model_weights'],
        state['server_optimizer_state'], state['control_variate'],
        aggregates['model_update'],
        aggregates['sums']['control_variate_delta'],
        aggregates['num_clients'], num_train_clients)
    metrics = collections.OrderedDict()
    if settings.drift_diversity:
      measurements = aggregates['measurements']
      metrics['drift_diversity'] = math.drift_diversity_metrics(
          measurements['layer_sq_norms'], measurements['model_delta'],
          layer_of_variable)
    return collections.OrderedDict(
        global_model_weights=weights, server_optimizer_state=optimizer_state,
        control_variate=control_variate), metrics

  fields = keras_model.client_fields(model_fn, info)
  if kernels:
    def client_context():
      model = model_fn()
      factored.install(model, kernels, settings.client_learning_rate)
      return model
    fields['client_context'] = client_context

  def initial_client_state():
    return collections.OrderedDict(control_variate=[
        factored_at[p].zeros() if p in factored_at else tf.zeros(s.shape,
                                                                 s.dtype)
        for p, s in enumerate(cv_specs)])

  return round_lib.RoundDefinition(
      name=name, settings=settings,
      initial_server_state=initial_server_state, broadcast=broadcast,
      client_work=math.build_client_work(
          client_optimizer, settings.client_learning_rate, mask,
          settings.scaffold_option, uniform, info.trainable_specs,
          layer_of_variable if settings.drift_diversity else None,
          kernels),
      server_update=server_update, initial_client_state=initial_client_state,
      fixed_on_resume=fixed_on_resume, **fields)


def scaffold(task, settings: ScaffoldSettings) -> round_lib.RoundDefinition:
  """SCAFFOLD ([SCAFFOLD] Alg. 1): control variates on every variable."""
  return definition('scaffold', task.model_fn, settings,
                    task.num_train_clients, _client_steps_and_batch(task))


def fedpvr(task, settings: FedPvrSettings) -> round_lib.RoundDefinition:
  """FedPVR ([FedPVR] Alg. I): control variates on the last layers."""
  return definition('fedpvr', task.model_fn, settings, task.num_train_clients,
                    _client_steps_and_batch(task))


def _client_steps_and_batch(task) -> tuple[Optional[int], int]:
  config = getattr(task, 'data_config', None)
  if config is None:
    return None, 0
  return config.client_steps, config.client_batch_size
