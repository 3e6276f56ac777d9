"""Rebuilds a finished or running experiment from its directory.

evaluate and export take a run directory, not the training flags again: the
run's hparams.json supplies every flag the user does not repeat, so the task
and the algorithm (and thus the checkpoint's state structure) are rebuilt
exactly as trained.
"""

import json
import os

from absl import flags

from binaries import flags_lib
from pipeline import driver
from pipeline.errors import UsageError
from pipeline import tff_runtime
from tasks import registry as task_registry
from tff_algos import registry as algorithm_registry

FLAGS = flags.FLAGS

flags.DEFINE_integer('checkpoint_round', None,
                     'Round of the checkpoint to use (default: the latest).')


def run_dir() -> str:
  return os.path.join(FLAGS.root_output_dir, FLAGS.experiment_name)


def load_run_flags() -> None:
  """Fills flags the user did not set from the run's hparams.json."""
  path = os.path.join(run_dir(), 'hparams.json')
  if not os.path.isfile(path):
    raise UsageError(f'{path} not found: --experiment_name/--root_output_dir '
                     'must name a run directory made by binaries.train')
  try:
    with open(path) as f:
      hparams = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UsageError(f'{path} is not valid JSON: {e}') from e
  known = {f.name for f in FLAGS.get_flags_for_module(flags_lib.__name__)}
  for name, value in hparams.items():
    if name in known and not FLAGS[name].present:
      FLAGS[name].value = value


def build_task():
  if FLAGS.runtime == 'tff':  # The native runtime never starts TFF's.
    tff_runtime.configure_execution(FLAGS.max_concurrent_computation_calls)
  return task_registry.build_task(FLAGS.task, flags_lib.data_config())


def load_checkpoint_weights(task):
  """(round, ModelWeights) of the chosen checkpoint of the run."""
  algorithm = algorithm_registry.build_algorithm(
      FLAGS.algorithm, task.model_fn,
      flags_lib.algorithm_config(task.num_train_clients,
                                 task.central_loss_fn), task=task)
  checkpoints = driver.CheckpointManager(
      os.path.join(run_dir(), 'checkpoints'), keep=0)
  round_num = FLAGS.checkpoint_round
  if round_num is None:
    round_num = checkpoints.latest_round()
    if round_num is None:
      raise UsageError(f'{run_dir()}/checkpoints has no checkpoint')
  structure = driver.program_state_structure(
      algorithm, round_num,
      driver.compose_process(algorithm, task, FLAGS.runtime))
  state = checkpoints.load(round_num, structure)
  return round_num, algorithm.get_model_weights(state['server_state'])
