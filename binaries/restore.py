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
from tff_algos.aggregation import factories
from tff_algos.algorithms import round as round_lib

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
  definition = flags_lib.build_algorithm(task)
  checkpoints = driver.CheckpointManager(
      os.path.join(run_dir(), 'checkpoints'), keep=0)
  round_num = FLAGS.checkpoint_round
  if round_num is None:
    round_num = checkpoints.latest_round()
    if round_num is None:
      raise UsageError(f'{run_dir()}/checkpoints has no checkpoint')
  # The run's aggregator state is part of its checkpoints' structure.
  aggregator = factories.build(flags_lib.aggregator_settings(task),
                               FLAGS.clients_per_round)
  process = driver.compose_process(
      definition, task, FLAGS.runtime,
      driver.state_format(definition, FLAGS.client_state_dir or os.path.join(
          run_dir(), driver.CLIENT_STATE_DIR)), aggregator)
  structure = driver.program_state_structure(
      process, round_num, task.num_train_clients,
      definition.has_client_state)
  state = checkpoints.load(round_num, structure)
  return round_num, round_lib.get_model_weights(state['server_state'])
