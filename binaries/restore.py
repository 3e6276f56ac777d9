"""Rebuilds a finished or running experiment from its directory.

evaluate and export take a run directory, not the training flags again: the
run's hparams.json supplies every flag the user does not repeat, so the task
and the algorithm (and thus the checkpoint's state structure) are rebuilt
exactly as trained.
"""

import dataclasses
import json
import os
from typing import Any

from absl import flags

from binaries import flags_lib
from pipeline import driver
from pipeline import run_directory
from pipeline.errors import UsageError
from pipeline import tff_runtime
from tasks import registry as task_registry
from tff_algos.aggregation import factories
from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import client_states as client_states_lib

FLAGS = flags.FLAGS

flags.DEFINE_integer('checkpoint_round', None,
                     'Round of the checkpoint to use (default: the latest).')


# The flags that name the run directory; hparams.json records where it was
# trained.
_RUN_LOCATION = ('root_output_dir', 'experiment_name')


def run_dir() -> str:
  return run_directory.run_dir_path(FLAGS.root_output_dir,
                                    FLAGS.experiment_name)


def _hparams_path() -> str:
  return os.path.join(run_dir(), run_directory.HPARAMS_FILE)


def load_run_flags() -> None:
  """Fills flags the user did not set from the run's hparams.json; another
  value of one that changes results is a UsageError."""
  directory = run_dir()
  path = _hparams_path()
  if not os.path.lexists(path):
    raise UsageError(f'{path} not found: --experiment_name/--root_output_dir '
                     'must name a run directory made by binaries.train')
  hparams = run_directory.read_hparams(directory)
  flags_lib.check_stored_values(hparams, path)
  for name in ('task', 'algorithm'):
    if not isinstance(hparams.get(name), str) and not FLAGS[name].present:
      raise UsageError(f'{path} names no {name}: it is damaged (binaries.'
                       'train writes every flag there)')
  known = {f.name for f in FLAGS.get_flags_for_module(flags_lib.__name__)}
  for name in ('task', 'algorithm'):
    if not FLAGS[name].present:
      FLAGS[name].value = hparams[name]
  flags_lib.require_known_names(path)
  # Another value of a flag that shapes the model or data is a checkpoint
  # "corrupted or incompatible" at best, or a silently different task. A
  # moved client-state store is only read here.
  differing = []
  for name, value in hparams.items():
    if (name in known and FLAGS[name].present and
        name not in run_directory.RESULT_NEUTRAL_KEYS and
        name != 'client_state_dir' and
        FLAGS[name].value != flags_lib.parse_stored(name, value, path)):
      differing.append(f'--{name} (run: {json.dumps(value)}, now: '
                       f'{json.dumps(FLAGS[name].value)})')
  if differing:
    raise UsageError(f'{directory} was trained with other values of '
                     f'{", ".join(differing)}; leave them out (the run\'s '
                     'hparams.json gives them)')
  for name, value in hparams.items():
    # Where the run is now is where it was found (a run moved or copied
    # under the default --root_output_dir was read, and written to, at the
    # root it was trained in).
    if (name in known and not FLAGS[name].present and
        name not in _RUN_LOCATION):
      FLAGS[name].value = flags_lib.parse_stored(name, value, path)
  # A run from before such a flag existed stored its client states in the
  # form that value gives (FedRes's personalized evaluation reads them).
  for name, value in flags_lib.VALUES_BEFORE_FLAG.items():
    if name not in hparams and not FLAGS[name].present:
      FLAGS[name].value = value
  try:
    FLAGS.validate_all_flags()
  except flags.IllegalFlagValueError as e:
    raise UsageError(f'{path}: {e}') from e


def build_task():
  if FLAGS.runtime == 'tff':  # The native runtime never starts TFF's.
    tff_runtime.configure_execution(FLAGS.max_concurrent_computation_calls)
  try:
    return task_registry.build_task(FLAGS.task, flags_lib.data_config())
  except UsageError as e:
    raise flags_lib.blame_stored_value(e, _hparams_path()) from e


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  round_num: int
  definition: round_lib.RoundDefinition
  # The loaded program state (round_num, server_state, client_versions).
  state: Any

  @property
  def model_weights(self):
    return round_lib.get_model_weights(self.state['server_state'])


def load_checkpoint(task) -> Checkpoint:
  """The chosen checkpoint (--checkpoint_round, default the latest)."""
  definition = flags_lib.build_algorithm(task, _hparams_path())
  checkpoints = driver.CheckpointManager(
      os.path.join(run_dir(), run_directory.CHECKPOINTS_DIR), keep=0)
  rounds = checkpoints.rounds()
  if not rounds:
    raise UsageError(f'{run_dir()}/checkpoints has no checkpoint')
  round_num = FLAGS.checkpoint_round
  if round_num is None:
    round_num = rounds[-1]
  elif round_num not in rounds:
    raise UsageError(
        f'--checkpoint_round={round_num}: {run_dir()}/checkpoints has no '
        f'checkpoint of that round (it has rounds '
        f'{", ".join(map(str, rounds))})')
  # The run's aggregator state is part of its checkpoints' structure.
  aggregator = factories.build(
      flags_lib.aggregator_settings(task, _hparams_path()),
      FLAGS.clients_per_round)
  process = driver.compose_process(
      definition, task, FLAGS.runtime,
      driver.state_format(definition, _client_state_dir()), aggregator)
  structure = driver.program_state_structure(
      process, round_num, task.num_train_clients,
      definition.has_client_state)
  return Checkpoint(round_num, definition,
                    checkpoints.load(round_num, structure))


def _client_state_dir() -> str:
  directory = FLAGS.client_state_dir or os.path.join(run_dir(),
                                                     driver.CLIENT_STATE_DIR)
  driver.require_readable_store(directory, run_dir())
  return directory


def client_states(checkpoint: Checkpoint, task):
  """Read access to the client states of `checkpoint` (e.g. for exporting
  FedRes's personal models); UsageError if a file it names is missing."""
  state_format = driver.state_format(checkpoint.definition,
                                     _client_state_dir())
  index = client_states_lib.StateIndex(task.train_client_ids,
                                       checkpoint.state['client_versions'])
  driver.require_state_files(state_format, index, checkpoint.round_num)
  return client_states_lib.ClientStates(state_format, index)


if __name__ == '__main__':
  from pipeline import errors as _errors  # pylint: disable=g-import-not-at-top
  _errors.refuse_to_run_library_module(__spec__)
