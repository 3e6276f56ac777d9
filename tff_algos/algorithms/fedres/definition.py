"""FedResNaive, FedResSGD and FedResAvg as round definitions ([FedRes]
Algorithms 2-4).

The math is in `math`:

  server state  <global_model_weights=w[, control=c]>
  client state  <local_model=theta_i[, control=c_i]> (Option II: eligible
                 kernels' c_i as factors, `math.client_work`)
  message       <global_weights=w[, control=c]>
  client sends  w_i - w (uniform mean), c_i+ - c_i (Option II, summed),
                its loss sum and example count
  server        w <- w + alpha * mean_S(w_i - w)   (alpha = 1 for Naive, SGD)
                c <- c + sum_S(c_i+ - c_i) / N     (SCAFFOLD's |S|/N rule)

theta_i (and Option II's c_i) is persistent client state: read and written
by the client's own computation, never sent or aggregated. Only sampled
clients run, so only they update theta_i. Clients are weighted uniformly, as
in the paper's objective (1/N) sum_i L_i.
"""

import collections
import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tasks import base
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms import settings as settings_lib
from tff_algos.algorithms.fedres import evaluation
from tff_algos.algorithms.fedres import export
from tff_algos.algorithms.fedres import math
from tff_algos.algorithms.scaffold import factored

ModelWeights = tff.learning.models.ModelWeights
OPTIONS = (1, 2)
RESIDUAL_TASKS_HINT = 'fedres_toy, fedres_logistic, movielens_ratings'


@dataclasses.dataclass(frozen=True)
class FedResSettings:
  client_learning_rate: float = settings_lib.client_learning_rate()
  local_learning_rate: float = settings_lib.setting(
      0.01, 'FedRes: lambda, the SGD learning rate of the local models (0 '
      'keeps them at their zero start: FedResAvg option 1 is then FedAvg, '
      'option 2 SCAFFOLD, the baselines of experiments.fedres_logistic).',
      bound=settings_lib.NON_NEGATIVE)
  fedres_fit_unseen: bool = settings_lib.setting(
      False, 'FedRes personalized eval: fit a never-sampled client\'s local '
      'model for K steps on its train data.')

  def __post_init__(self):
    settings_lib.check(self)


@dataclasses.dataclass(frozen=True)
class FedResAvgSettings(FedResSettings):
  fedres_option: int = settings_lib.setting(
      2, 'FedResAvg: option 1 (no control variates) or 2 (control '
      'variates).', OPTIONS)
  fedres_alpha: float = settings_lib.setting(
      1.0, 'FedResAvg: alpha, the server step on the mean client delta.',
      bound=settings_lib.POSITIVE)
  factored_control_variates: bool = settings_lib.factored_control_variates()


def hyperparameters(variant: str, task: base.Task,
                    settings: FedResSettings) -> math.Hyperparameters:
  if task.residual_spec is None:
    raise settings_lib.SettingError(
        'algorithm', f'=fedres_{variant} needs a task with a global + local '
        f'(residual) model; --task={task.name} has none (tasks with one: '
        f'{RESIDUAL_TASKS_HINT})')
  is_avg = isinstance(settings, FedResAvgSettings)
  return math.Hyperparameters(
      variant=variant,
      learning_rate=settings.client_learning_rate,
      local_learning_rate=settings.local_learning_rate,
      option=settings.fedres_option if is_avg else 1,
      server_step=settings.fedres_alpha if is_avg else 1.0,
      num_train_clients=task.num_train_clients)


def initial_weights(spec) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """(w_0, theta_0) of freshly built models; theta_0 is every client's."""
  global_model = spec.global_model_fn()
  local_model = spec.local_model_fn()
  if global_model.non_trainable_weights or local_model.non_trainable_weights:
    raise ValueError('FedRes models with non-trainable weights (e.g. batch '
                     'norm statistics) are not supported')
  return ([v.numpy() for v in global_model.trainable_variables],
          [v.numpy() for v in local_model.trainable_variables])


def _factorable_kernels(hparams: math.Hyperparameters, task: base.Task,
                        num_global_variables: int
                        ) -> tuple[factored.FactoredKernel, ...]:
  """The kernels of w whose c_i Option II can keep as factors: Step 2 is
  SCAFFOLD's corrected SGD on w, so SCAFFOLD's rule picks them."""
  config = task.data_config
  if not hparams.uses_control or config is None:
    return ()
  spec = task.residual_spec
  return factored.plan(lambda: math.ResidualModel(spec),
                       (True,) * num_global_variables, config.client_steps,
                       config.client_batch_size,
                       parts=math.global_model_parts)


def definition(variant: str, task: base.Task,
               settings: FedResSettings) -> round_lib.RoundDefinition:
  hparams = hyperparameters(variant, task, settings)
  spec = task.residual_spec
  initial_global, initial_local = initial_weights(spec)
  # Specs, not values: a model-sized constant in a computation costs its size
  # in every copy of the computation TFF makes (hundreds of MB here).
  global_specs = [tf.TensorSpec(w.shape, w.dtype) for w in initial_global]
  factorable = _factorable_kernels(hparams, task, len(global_specs))
  kernels = (factorable if getattr(settings, 'factored_control_variates',
                                   False) else ())
  shared = factored.shareable(lambda: math.ResidualModel(spec), kernels,
                              parts=math.global_model_parts)
  hparams = dataclasses.replace(hparams, factored_kernels=kernels,
                                shared_products=shared)

  def client_context():
    model = math.ResidualModel(spec)
    factored.install(model, kernels, hparams.learning_rate,
                     parts=math.global_model_parts, shared=shared)
    return model

  def initial_server_state():
    # A fresh model's weights, made inside the computation (the driver then
    # sets its own).
    state = collections.OrderedDict(global_model_weights=ModelWeights(
        trainable=[tf.identity(v.read_value()) for v in
                   spec.global_model_fn().trainable_variables],
        non_trainable=[]))
    if hparams.uses_control:
      state['control'] = [tf.zeros(s.shape, s.dtype) for s in global_specs]
    return state

  def broadcast(state, central):
    del central
    message = collections.OrderedDict(
        global_weights=state['global_model_weights'].trainable)
    if hparams.uses_control:
      message['control'] = state['control']
    return message

  def server_update(state, aggregates, central):
    del central
    new_state = collections.OrderedDict(global_model_weights=ModelWeights(
        trainable=math.server_weights_update(
            state['global_model_weights'].trainable,
            aggregates['model_update'], hparams.server_step),
        non_trainable=[]))
    if hparams.uses_control:
      new_state['control'] = math.server_control_update(
          state['control'], aggregates['sums']['control_delta'],
          hparams.num_train_clients)
    return new_state, collections.OrderedDict()

  def finalize_metrics(sums):
    return collections.OrderedDict(
        loss=sums['loss_sum'] / tf.cast(tf.maximum(sums['num_examples'], 1),
                                        tf.float32),
        num_examples=sums['num_examples'])

  def initial_client_state():
    return math.initial_client_state(
        hparams, [tf.constant(w) for w in initial_local], global_specs)

  return round_lib.RoundDefinition(
      name=f'fedres_{variant}', settings=settings,
      initial_server_state=initial_server_state, broadcast=broadcast,
      client_context=client_context,
      client_work=math.client_work(hparams), reset_client=lambda model: None,
      server_update=server_update, finalize_metrics=finalize_metrics,
      initial_client_state=initial_client_state,
      personalization=_personalization(task, settings, initial_local),
      uploads_weight=False,
      fixed_on_resume=factored.fixed_on_resume(factorable, kernels))


def _local_weights_of(client_state) -> list[Any]:
  return client_state['local_model']


def _personalization(task: base.Task, settings: FedResSettings,
                     initial_local: list[np.ndarray]
                     ) -> round_lib.Personalization:
  evaluators = []  # Built on first use: Keras models for in-process eval.

  def evaluator():
    if not evaluators:
      # The run's --seed shuffles the batches an unseen client's theta is
      # fitted on, as it does every other batch of the run.
      evaluators.append(evaluation.PersonalizedEvaluator(
          task.residual_spec, task.personal_eval_data,
          settings.local_learning_rate, settings.fedres_fit_unseen,
          seed=task.data_config.seed if task.data_config else 0))
    return evaluators[0]

  def evaluate(server_state, states):
    if task.personal_eval_data is None:
      return {}
    return evaluator()(server_state['global_model_weights'].trainable,
                       states, _local_weights_of)

  def export_models(server_state, states, export_dir):
    global_weights = server_state['global_model_weights'].trainable
    # With fedres_fit_unseen the evaluation fits a theta for each evaluated
    # client without a stored one; exporting those thetas makes
    # serve_personalized predict what eval_personalized/* measured (the
    # initial theta would give those clients the unfitted prediction).
    fitted = ({} if task.personal_eval_data is None else
              evaluator().fitted_local_models(global_weights, states,
                                              _local_weights_of))
    export.export_personal_models(
        task, global_weights, states, _local_weights_of, initial_local,
        export_dir, fitted)

  return round_lib.Personalization(evaluate=evaluate, export=export_models)


def fedres_naive(task, settings: FedResSettings):
  """FedResNaive ([FedRes] Algorithm 2)."""
  return definition('naive', task, settings)


def fedres_sgd(task, settings: FedResSettings):
  """FedResSGD ([FedRes] Algorithm 3)."""
  return definition('sgd', task, settings)


def fedres_avg(task, settings: FedResAvgSettings):
  """FedResAvg, Option I or II ([FedRes] Algorithm 4)."""
  return definition('avg', task, settings)
