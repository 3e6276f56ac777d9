"""The one training loop every algorithm runs through.

Per round: sample client ids uniformly without replacement, split them into
groups, run the algorithm's round on the chosen runtime, commit the clients'
new state versions, log metrics, evaluate and checkpoint on schedule.
Sampling, client shuffle seeds and the central data seed are pure functions
of (seed, round), and client states are files the clients' own computations
wrote, named by the index of versions (`tff_algos.runtime.client_states`);
so a checkpoint holds the round number, the server state and that index, and
a resumed run is bit-identical to an uninterrupted one.
"""

import collections
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tqdm

from pipeline import errors
from pipeline import evaluation
from pipeline import export as export_lib
from pipeline import heap
from pipeline import interrupts
from pipeline import run_directory
from pipeline import tff_runtime
from pipeline.errors import UsageError
from tasks import base
from tff_algos.aggregation import accounting
from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import batched
from tff_algos.runtime import client_states
from tff_algos.runtime import page_cache
from tff_algos.runtime import cohort
from tff_algos.runtime import native
from tff_algos.runtime import tff_process

CHECKPOINT_PREFIX = 'round_'
RUNTIMES = ('tff', 'native')
CLIENT_STATE_DIR = 'client_states'


@dataclasses.dataclass(frozen=True)
class RunConfig:
  root_output_dir: str
  experiment_name: str
  total_rounds: int
  clients_per_round: int
  rounds_per_eval: int = 1
  rounds_per_checkpoint: int = 5
  seed: int = 0
  # Where client states live; None: <run dir>/client_states. Remote
  # workers need a path they share.
  client_state_dir: Optional[str] = None
  # Clients per group (one compiled computation each); 0: chosen from the
  # cohort and the runtime (`cohort.clients_per_group`).
  clients_per_group: int = 0
  checkpoints_to_keep: int = 3
  export: bool = True
  # 'tff' (TFF's runtime) or 'native' (in-process TF).
  runtime: str = 'tff'
  # Resume even if flags that change results differ from hparams.json's
  # (the changes are recorded there).
  allow_flag_changes: bool = False
  # Native runtime: a group's clients side by side over a client axis
  # ('auto': on a GPU; `tff_algos.runtime.batched`) or one after another.
  batched_cohorts: str = 'auto'

  @property
  def run_dir(self) -> str:
    return os.path.join(self.root_output_dir, self.experiment_name)

  @property
  def state_dir(self) -> str:
    return self.client_state_dir or os.path.join(self.run_dir,
                                                 CLIENT_STATE_DIR)

  def validate(self, num_train_clients: int) -> None:
    if self.total_rounds < 1:
      raise UsageError(f'--total_rounds must be >= 1, got {self.total_rounds}')
    if num_train_clients == 0:
      raise UsageError('the task has no train clients (its data hold none '
                       'with training examples)')
    if not 1 <= self.clients_per_round <= num_train_clients:
      raise UsageError(
          f'--clients_per_round={self.clients_per_round} is impossible: the '
          f'task has {num_train_clients} train clients (allowed: 1..'
          f'{num_train_clients})')
    for flag in ('rounds_per_eval', 'rounds_per_checkpoint'):
      if getattr(self, flag) < 1:
        raise UsageError(f'--{flag} must be >= 1, got {getattr(self, flag)}')
    if self.clients_per_group < 0:
      raise UsageError('--clients_per_group must be >= 0 (0: automatic), '
                       f'got {self.clients_per_group}')
    if self.runtime not in RUNTIMES:
      raise UsageError(f'--runtime={self.runtime!r} is unknown; allowed: '
                       f'{", ".join(RUNTIMES)}')
    if self.batched_cohorts not in batched.MODES:
      raise UsageError(f'--batched_cohorts={self.batched_cohorts!r} is '
                       f'unknown; allowed: {", ".join(batched.MODES)}')
    run_directory.run_dir_path(self.root_output_dir, self.experiment_name)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  client_indices: np.ndarray
  client_seeds: np.ndarray
  server_seed: np.int64


def plan_round(seed: int, round_num: int, num_clients: int,
               clients_per_round: int) -> RoundPlan:
  """Seeded uniform sampling without replacement, and the round's data seeds."""
  rng = np.random.default_rng([seed, round_num])
  indices = rng.choice(num_clients, size=clients_per_round, replace=False)
  seeds = rng.integers(0, 2**62, size=clients_per_round, dtype=np.int64)
  return RoundPlan(indices, seeds, np.int64(rng.integers(0, 2**62)))


@dataclasses.dataclass
class TrainResult:
  round_num: int
  server_state: Any
  model_weights: tff.learning.models.ModelWeights
  last_metrics: dict[str, float]


def initial_model_weights(task: base.Task,
                          seed: int) -> tff.learning.models.ModelWeights:
  """Seeded initial weights, so a run is reproducible from its flags."""
  tf.keras.utils.set_random_seed(seed)
  return tff.learning.models.ModelWeights.from_model(task.keras_model_fn())


def state_format(definition: round_lib.RoundDefinition,
                 directory: str) -> Optional[client_states.StateFormat]:
  """How `definition`'s client states are stored under `directory`."""
  if not definition.has_client_state:
    return None
  specs = tf.nest.map_structure(
      lambda t: tf.TensorSpec(t.shape, t.dtype),
      definition.initial_client_state())
  return client_states.StateFormat(directory, specs,
                                   definition.initial_client_state)


def compose_process(definition: round_lib.RoundDefinition, task: base.Task,
                    runtime: str = 'tff',
                    formats: Optional[client_states.StateFormat] = None,
                    model_aggregator=None, batched_cohorts: str = 'auto'):
  """The process the driver runs, on the chosen runtime.

  Both have `initialize()` and `next(state, groups, round_num, server_seed)
  -> (state, metrics)` with the same Python structures in and out.
  """
  if task.client_dataset_fn is None:
    raise UsageError(
        f'--task={task.name} builds its client datasets only as a TFF '
        'computation; its clients cannot be run by id')
  if definition.uses_server_data and task.server_dataset_fn is None:
    raise UsageError(
        f'--algorithm={definition.name} needs central (server) data or a '
        'data-free central loss; the task, with these flags, has neither')
  data = tff_process.DataFunctions(
      client_dataset_fn=task.client_dataset_fn,
      server_dataset_fn=task.server_dataset_fn,
      client_cost_fn=task.client_cost_fn)
  if runtime == 'native':
    if model_aggregator is not None:
      raise UsageError('--runtime=native runs the mean aggregator only; '
                       'use --runtime=tff for other aggregators')
    return native.NativeProcess(definition, data, formats, batched_cohorts)
  return tff_process.build(definition, data, formats, model_aggregator,
                           server_context_fn=tff_runtime.server_context,
                           split_fn=lambda: tff_runtime.partitions() > 1)


def _program_state(round_num: int, server_state, versions: np.ndarray):
  return collections.OrderedDict(
      round_num=np.int64(round_num), server_state=server_state,
      client_versions=np.asarray(versions, np.int64))


def program_state_structure(process, round_num: int, num_train_clients: int,
                            has_client_state: bool):
  """The structure a checkpoint is loaded into."""
  return _program_state(
      round_num, process.initialize(),
      np.zeros([num_train_clients if has_client_state else 0], np.int64))


class CheckpointManager:
  """Server state + round + client-state index, via tff.program."""

  def __init__(self, checkpoint_dir: str, keep: int):
    self._dir = checkpoint_dir
    self._keep = keep
    self._tff_manager = None

  @property
  def _manager(self) -> tff.program.FileProgramStateManager:
    # Made at first use: TFF's manager makes its directory, which a command
    # that only reads (evaluate, export, a refused start) must not.
    if self._tff_manager is None:
      self._tff_manager = tff.program.FileProgramStateManager(
          self._dir, prefix=CHECKPOINT_PREFIX, keep_total=self._keep,
          keep_first=False)
    return self._tff_manager

  def rounds(self) -> list[int]:
    if os.path.exists(self._dir) and not os.path.isdir(self._dir):
      raise UsageError(f'{self._dir} is a file, not the directory of the '
                       "run's checkpoints")
    if not os.path.isdir(self._dir):
      return []
    self._refuse_other_round_names()
    return list(interrupts.run_coroutine(self._manager.get_versions()) or ())

  def _refuse_other_round_names(self) -> None:
    """TFF reads a name as `int(name without the prefix)`, so it takes
    `round_0005` for round 5, then loads and deletes `round_5`."""
    try:
      names = sorted(os.listdir(self._dir))
    except FileNotFoundError:
      return
    for name in names:
      if not name.startswith(CHECKPOINT_PREFIX):
        continue
      try:
        round_num = int(name[len(CHECKPOINT_PREFIX):])
      except ValueError:
        continue  # Not a round to TFF either (e.g. a cut-off write).
      if name != f'{CHECKPOINT_PREFIX}{round_num}':
        raise UsageError(
            f'{os.path.join(self._dir, name)} is not a checkpoint name this '
            f'pipeline writes ({CHECKPOINT_PREFIX}{round_num}); move it out of '
            f'{self._dir}')

  def latest_round(self) -> Optional[int]:
    rounds = self.rounds()
    return rounds[-1] if rounds else None

  def load(self, round_num: int, structure,
           changed_flags: Optional[str] = None):
    """The checkpoint of `round_num` loaded into `structure`. `changed_flags`:
    the flags a resume changed (`ResumePlan.changed`), which an incompatible
    checkpoint is blamed on: an earlier one cannot take them either."""
    path = os.path.join(self._dir, f'{CHECKPOINT_PREFIX}{round_num}')

    def incompatible(reason):
      if changed_flags:
        return UsageError(
            f'checkpoint {path} holds a state that the changed flags cannot '
            f'continue ({reason}): {changed_flags}; repeat the run\'s values, '
            'or train with the new ones under a new --experiment_name')
      return UsageError(f'checkpoint {path} is corrupted or incompatible with '
                        f'these flags ({reason}); use the flags it was '
                        'trained with, or delete it to resume from an '
                        'earlier one')

    try:
      state = interrupts.run_coroutine(
          self._manager.load(round_num, structure))
    except Exception as e:  # pylint: disable=broad-except
      if not os.path.lexists(path):
        # A trainer of the same run dropped it (it keeps the newest ones);
        # evaluate reads checkpoints without the run's lock.
        raise UsageError(f'checkpoint {path} was removed while it was read: '
                         'the run is still training and keeps only its '
                         'newest checkpoints; re-run, or pass a kept '
                         '--checkpoint_round') from e
      errors.raise_if_unreadable(path)
      raise incompatible(type(e).__name__) from e
    # TFF checks only the nesting: a model of another task with as many
    # variables loaded, then failed (a traceback) where it was used.
    for stored, expected in zip(tf.nest.flatten(state),
                                tf.nest.flatten(structure)):
      if np.shape(stored) != np.shape(expected):
        raise incompatible(f'a tensor of shape {list(np.shape(stored))} '
                           f'where these flags make '
                           f'{list(np.shape(expected))}')
    if int(state['round_num']) != round_num:
      raise UsageError(f'checkpoint {path} holds round {state["round_num"]}')
    return state

  def drop_unkept(self) -> list[int]:
    """Deletes the checkpoints before the newest `keep`, as a save does
    after its write; returns their rounds. A run stopped between the two
    (SIGINT cancels the save's task while its writer thread finishes the
    write; SIGTERM's handler lets it finish) left one more, which no later
    save drops when the run has no round left, and the client states it
    names with it."""
    if self._keep <= 0:
      return []
    dropped = self.rounds()[:-self._keep]
    for round_num in dropped:
      shutil.rmtree(os.path.join(self._dir, f'{CHECKPOINT_PREFIX}{round_num}'))
    return dropped

  def save(self, round_num: int, server_state, versions: np.ndarray) -> None:
    os.makedirs(self._dir, exist_ok=True)
    interrupts.run_coroutine(self._manager.save(
        _program_state(round_num, server_state, versions), round_num))


def _require_store_directory(directory: str) -> None:
  """UsageError unless `directory` is, or can be made, a directory, and
  OSError (an environment fault) unless it is writable: the clients'
  computations would otherwise fail in their first write.
  Creates nothing: it runs before the run directory is locked."""
  existing = run_directory.nearest_existing_path(directory)
  if not os.path.isdir(existing):
    raise UsageError(f'the client-state store {directory} '
                     f'(--client_state_dir) cannot be made: {existing} is a '
                     'file, not a directory')
  if not os.access(existing, os.W_OK | os.X_OK):
    # The machine's state, as any output that cannot be written (exit 3).
    code = (errno.EROFS if os.statvfs(existing).f_flag & os.ST_RDONLY
            else errno.EACCES)
    raise OSError(code, os.strerror(code), existing)


# In a client-state store: the run directory (real path) whose store it is,
# and the lock a run holds on a store outside its run directory.
STORE_OWNER_FILE = '.owner'
STORE_LOCK_FILE = STORE_OWNER_FILE + '.lock'


def _is_default_store(directory: str, run_dir: str) -> bool:
  return os.path.realpath(directory) == os.path.join(
      os.path.realpath(run_dir), CLIENT_STATE_DIR)


def _store_owner(directory: str) -> Optional[str]:
  marker = os.path.join(directory, STORE_OWNER_FILE)
  if not os.path.isfile(marker):
    return None
  with open(marker, encoding='utf-8', errors='replace') as f:
    return f.read().strip()


def _require_own_store(directory: str, run_dir: str) -> None:
  """UsageError unless `directory` can be the run's client-state store: a
  resume deletes the store's rounds after its checkpoint, which in another
  run's directory would be that run's files. Creates nothing.

  Refused: a directory inside another run directory, inside this run's
  directory but not its default store (there it would share a directory
  the run writes, such as its export), the run directory or one holding it,
  one marked as another run's store (`mark_store_directory`), or an
  unmarked one holding client states (its mark may have been lost: it can
  be another run's) or anything but client states. The default store,
  inside the run directory, is the run's even if the run was moved.
  """
  store = os.path.realpath(directory)
  run = os.path.realpath(run_dir)
  flag = f'the client-state store {directory} (--client_state_dir)'
  default = _is_default_store(directory, run_dir)
  if not default and (store == run or store.startswith(run + os.sep)):
    raise UsageError(f'{flag} lies inside the run directory {run} but is not '
                     f'its {CLIENT_STATE_DIR} directory; leave '
                     '--client_state_dir unset or name a directory outside '
                     'the run')
  if run.startswith(store + os.sep):
    raise UsageError(f'{flag} holds the run directory {run}; name a '
                     'directory of its own')
  other_run = run_directory.enclosing_run_dir(store, run)
  if other_run is not None:
    raise UsageError(f'{flag} lies inside the run directory {other_run}; '
                     'give each run a store of its own')
  owner = _store_owner(store)
  if owner is not None and owner != run and not default:
    raise UsageError(f'{flag} is the store of the run {owner}; give each run '
                     'a store of its own')
  if owner is None and os.path.isdir(store):
    names = os.listdir(store)
    others = [name for name in names
              if not (client_states.is_round_directory(name) or
                      name.startswith(STORE_OWNER_FILE))]
    if others:
      raise UsageError(f'{flag} holds files that are not client states '
                       f'(e.g. {sorted(others)[0]}); give the run an empty '
                       'or new directory')
    rounds = sorted(name for name in names
                    if client_states.is_round_directory(name))
    if rounds and not default:
      # mark_store_directory marks a store before its first round: client
      # states without the mark are another run's, or lost their mark.
      raise UsageError(
          f'{flag} holds client states ({rounds[0]}) but no '
          f'{STORE_OWNER_FILE} file naming this run: it may be another '
          'run\'s store. If it is this run\'s, write the run directory\'s '
          f'path ({run}) into {os.path.join(store, STORE_OWNER_FILE)}; '
          'otherwise give the run an empty or new directory')


def require_readable_store(directory: str, run_dir: str) -> None:
  """UsageError if the store `directory`, read for the run `run_dir`
  (evaluate, export), is marked as another run's that still exists: its
  files can pass every check (same clients, rounds and sizes) and give that
  run's client states. A mark naming a directory that is gone is a moved
  run's own store."""
  if _is_default_store(directory, run_dir):
    return
  owner = _store_owner(os.path.realpath(directory))
  if (owner is not None and owner != os.path.realpath(run_dir) and
      os.path.isdir(owner)):
    raise UsageError(f'the client-state store {directory} '
                     f'(--client_state_dir) is the store of the run {owner}, '
                     f'not of {run_dir}; name this run\'s store')


def mark_store_directory(directory: str, run_dir: str) -> None:
  """Marks a store outside the run directory (--client_state_dir) as the
  run's (its real path), which `_require_own_store` checks for other runs.
  The default store, inside the run directory, holds only its rounds."""
  store = os.path.realpath(directory)
  run = os.path.realpath(run_dir)
  if _is_default_store(directory, run_dir) or _store_owner(store) == run:
    return
  os.makedirs(store, exist_ok=True)
  marker = os.path.join(store, STORE_OWNER_FILE)
  with open(marker + '.staging', 'w', encoding='utf-8') as f:
    f.write(run + '\n')
  os.replace(marker + '.staging', marker)


def require_state_files(state_format: client_states.StateFormat,
                        index: client_states.StateIndex,
                        round_num: int, changed: Optional[str] = None
                        ) -> None:
  """UsageError unless every state file `index` names is there, whole.
  `changed`: the flags a resume changes (`run_directory.ResumePlan`), which
  may give the states another form than the stored one."""
  missing = client_states.missing_files(
      state_format, index, client_states.serialized_size(state_format.specs),
      client_states.file_header(state_format.specs))
  if missing and changed:
    # E.g. --client_steps=50 with factored c_i: too many rows to factor, so
    # the flags no longer fixed it, and the files were blamed.
    raise UsageError(
        f'{len(missing)} client state file(s) of checkpoint round '
        f'{round_num} do not have the form this command\'s flags give a '
        f'client state (e.g. {missing[0]}): the changed flags {changed} '
        'change it; repeat the run\'s values, or use a new --experiment_name')
  if missing:
    raise UsageError(
        f'{len(missing)} client state file(s) of checkpoint round '
        f'{round_num} are missing or damaged (e.g. {missing[0]}); the run '
        'cannot resume exactly. Restore the directory or start a new '
        '--experiment_name')


class ClientStateKeeper:
  """The index of client-state versions and its files, across checkpoints.

  Commits a round's clients after the round; at each checkpoint deletes the
  files no kept checkpoint names; at a resume removes what a killed run left
  and checks that every file the checkpoint names is there.
  """

  def __init__(self, state_format: client_states.StateFormat,
               client_ids, checkpoints: CheckpointManager, structure_fn):
    self.format = state_format
    self._client_ids = client_ids
    self._checkpoints = checkpoints
    self._structure_fn = structure_fn
    self.index = client_states.StateIndex(client_ids)
    self._kept = {}  # Checkpoint round -> its versions.
    # The clients (indices) of the last commit and the versions it replaced,
    # until `release_superseded` deletes them.
    self._superseded = None
    self._evictor = page_cache.ClosedFileEvictor(client_states.SUFFIX)

  def prepare(self, round_num: int, next_clients: Sequence[str]) -> None:
    """Before round `round_num`: its states leave RAM as they are written,
    but those of `next_clients`, the clients of the next round."""
    directory = client_states.round_directory(self.format.directory,
                                              round_num)
    os.makedirs(directory, exist_ok=True)
    self._evictor.follow(directory,
                         [client_states.file_name(c) for c in next_clients])

  def close(self) -> None:
    self._evictor.close()

  def start(self, round_num: int, versions: Optional[np.ndarray],
            changed: Optional[str] = None) -> None:
    """Sets the index to checkpoint `round_num`'s (None: a new run);
    `changed`: the flags a resume changes (`require_state_files`)."""
    try:
      self.index = client_states.StateIndex(self._client_ids, versions)
    except ValueError as e:  # Another --num_clients than the run's.
      raise UsageError(f'{e}; resume with the run\'s clients') from e
    foreign = client_states.foreign_entries(self.format.directory)
    if foreign:
      # Deleting them could lose a user's data (the store never does);
      # leaving them, a resume or a checkpoint's clean-up stopped at "Is a
      # directory".
      raise UsageError(
          f'{foreign[0]} is not a client-state file (the store holds only '
          '<client id, base64url>.state files in round_<r> directories); '
          f'move it out of {self.format.directory} and re-run the same '
          'command')
    client_states.recover(self.format.directory, round_num)
    require_state_files(self.format, self.index, round_num, changed)
    self._kept = {round_num: self.index.versions.copy()}
    if versions is not None:
      # A run killed after writing a checkpoint but before deleting the files
      # only the checkpoints it dropped named (after its last round, nothing
      # else would) left them behind.
      self.checkpointed(round_num)

  def commit(self, indices, round_num: int) -> None:
    """The clients at `indices` now have round `round_num`'s states. The
    versions they replace stay until `release_superseded`: until then the
    round before can still be checkpointed (a Ctrl-C during this round's
    evaluation)."""
    self.release_superseded()
    self._superseded = (np.asarray(indices, np.int64),
                        self.index.versions_of(indices))
    self.index.commit(indices, round_num)

  def release_superseded(self) -> None:
    """Deletes the versions the last commit replaced that no kept checkpoint
    names. Before the next round: it then writes its states into the
    page-cache pages they freed, which costs a fraction of fresh ones
    (docs/performance_log.md)."""
    if self._superseded is None:
      return
    indices, previous = self._superseded
    self._superseded = None
    client_states.delete_superseded(
        self.format, [self._client_ids[i] for i in indices], previous,
        [versions[indices] for versions in self._kept.values()])

  def checkpointed(self, round_num: int,
                   versions: Optional[np.ndarray] = None) -> None:
    """Round `round_num` was checkpointed with `versions` (default: the
    index's): drop unreferenced files."""
    kept_rounds = set(self._checkpoints.rounds())
    self._kept[round_num] = (self.index.versions if versions is None
                             else versions).copy()
    for old in [r for r in self._kept if r not in kept_rounds]:
      del self._kept[old]
    for checkpoint_round in kept_rounds - set(self._kept):
      loaded = self._checkpoints.load(checkpoint_round,
                                      self._structure_fn(checkpoint_round))
      self._kept[checkpoint_round] = loaded['client_versions']
    client_states.collect_garbage(
        self.format.directory,
        [client_states.StateIndex(self._client_ids, v)
         for v in self._kept.values()], round_num)

  def view(self) -> client_states.ClientStates:
    return client_states.ClientStates(self.format, self.index)


def committed_client_states(definition: round_lib.RoundDefinition,
                            task: base.Task, run_dir: str,
                            client_state_dir: Optional[str] = None,
                            round_num: Optional[int] = None
                            ) -> client_states.ClientStates:
  """Read access to the client states of a run's checkpoint (default: the
  latest), e.g. FedRes's personal models for evaluation or export."""
  formats = state_format(definition, client_state_dir or os.path.join(
      run_dir, CLIENT_STATE_DIR))
  if formats is None:
    raise ValueError(f'{definition.name} keeps no client state')
  checkpoints = CheckpointManager(os.path.join(run_dir, 'checkpoints'), keep=0)
  if round_num is None:
    round_num = checkpoints.latest_round()
    if round_num is None:
      raise UsageError(f'{run_dir}/checkpoints has no checkpoint')
  process = compose_process(definition, task, 'native', formats)
  loaded = checkpoints.load(round_num, program_state_structure(
      process, round_num, task.num_train_clients, True))
  return client_states.ClientStates(formats, client_states.StateIndex(
      task.train_client_ids, loaded['client_versions']))


def personal_models_writer(definition: round_lib.RoundDefinition,
                           server_state, states):
  """`write_more` of export_saved_model that adds the personal models of
  `states` (ClientStates), or None for algorithms without them."""
  if definition.personalization is None:
    return None
  return lambda directory: definition.personalization.export(
      server_state, states, directory)


def train(definition: round_lib.RoundDefinition, task: base.Task,
          config: RunConfig, hparams: Optional[dict] = None,
          model_aggregator=None,
          round_metrics: Optional[Callable[[int], dict]] = None,
          hparams_defaults: Optional[dict] = None,
          hparams_unused: frozenset = frozenset(),
          hparams_fixed: Optional[Mapping[str, str]] = None,
          hparams_check: Optional[Callable[[dict, str], None]] = None
          ) -> TrainResult:
  """Runs (or resumes) `config.total_rounds` rounds; exports the final model.

  `model_aggregator`: a `tff.aggregators` factory for the model update (None:
  the mean). `round_metrics(round_num)` adds values of the run so far to
  each round's metrics (e.g. the privacy spent). The run directory is
  locked meanwhile; a resume first checks `hparams` against the run's
  (`run_directory.check_resume`; keys the run's hparams.json lacks against
  `hparams_defaults`; `hparams_unused`, flags the algorithm does not read,
  not compared; `hparams_fixed`, {flag: why} of those that may not change
  even with `allow_flag_changes`; `hparams_check` refuses a damaged
  hparams.json).
  """
  config.validate(task.num_train_clients)
  # Model-sized values cross this process every round (pipeline/heap.py).
  heap.keep_freed_memory()
  if definition.has_client_state:
    _require_store_directory(config.state_dir)
    _require_own_store(config.state_dir, config.run_dir)
  with run_directory.locked(config.run_dir), _store_locked(definition, config):
    return _train_locked(definition, task, config, hparams, model_aggregator,
                         round_metrics, hparams_defaults, hparams_unused,
                         hparams_fixed, hparams_check)


@contextlib.contextmanager
def _store_locked(definition: round_lib.RoundDefinition,
                  config: RunConfig) -> Iterator[None]:
  """A store outside the run directory locked for the run, its ownership
  checked again under the lock: the check before it is unlocked, so two runs
  started at once on one new store could both pass it and write each
  other's client states. (The default store is the run lock's.)"""
  if not definition.has_client_state or _is_default_store(config.state_dir,
                                                          config.run_dir):
    yield
    return
  with run_directory.locked(config.state_dir, lock_file=STORE_LOCK_FILE,
                            when_busy='give each run a store of its own'):
    _require_own_store(config.state_dir, config.run_dir)
    yield


def _client_versions(keeper: Optional[ClientStateKeeper]) -> np.ndarray:
  """What a checkpoint holds as its client-state index (none without)."""
  return keeper.index.versions if keeper else np.zeros([0], np.int64)


def _checkpoint_on_interrupt(checkpoints: CheckpointManager,
                             keeper: Optional[ClientStateKeeper],
                             round_num: int, server_state,
                             versions: np.ndarray) -> None:
  """Checkpoints round `round_num`, the newest finished one, with its
  server state and client-state `versions`, after a Ctrl-C: re-running the
  command then goes on from it instead of the last periodic checkpoint.
  The interrupted round's state files are left to the next start, which
  removes them (its round is after the checkpoint)."""
  if checkpoints.latest_round() == round_num:
    return
  checkpoints.save(round_num, server_state, versions)
  if keeper:
    keeper.checkpointed(round_num, versions)
  logging.info('Interrupted: checkpointed round %d', round_num)


def _train_locked(definition: round_lib.RoundDefinition, task: base.Task,
                  config: RunConfig, hparams: Optional[dict],
                  model_aggregator, round_metrics,
                  hparams_defaults: Optional[dict],
                  hparams_unused: frozenset,
                  hparams_fixed: Optional[Mapping[str, str]],
                  hparams_check: Optional[Callable[[dict, str], None]]
                  ) -> TrainResult:
  run_dir = config.run_dir
  checkpoints = CheckpointManager(
      os.path.join(run_dir, run_directory.CHECKPOINTS_DIR),
      config.checkpoints_to_keep)
  start_round = checkpoints.latest_round()
  if start_round is not None and start_round > config.total_rounds:
    raise UsageError(
        f'--total_rounds={config.total_rounds} is below the round of the '
        f'latest checkpoint ({start_round}) in {run_dir}; pass a larger '
        '--total_rounds or a new --experiment_name')
  # Flags against hparams.json, metrics.csv readable: before any write.
  resume = run_directory.check_resume(run_dir, start_round, hparams,
                                      config.allow_flag_changes,
                                      hparams_defaults, hparams_unused,
                                      hparams_fixed, hparams_check)
  if config.export:  # Refused now, not after the last round.
    export_lib.check_replaceable(os.path.join(run_dir, export_lib.EXPORT_DIR))

  formats = state_format(definition, config.state_dir)
  process = compose_process(definition, task, config.runtime, formats,
                            model_aggregator, config.batched_cohorts)
  num_indexed = task.num_train_clients if formats else 0
  initial_state = round_lib.set_model_weights(
      process.initialize(), initial_model_weights(task, config.seed))

  def structure(round_num):
    return _program_state(round_num, initial_state,
                          np.zeros([num_indexed], np.int64))

  keeper = (ClientStateKeeper(formats, task.train_client_ids, checkpoints,
                              structure) if formats else None)
  if start_round is None:
    start_round = 0
    server_state = initial_state
    if keeper:
      mark_store_directory(config.state_dir, run_dir)
      keeper.start(0, None)
    run_directory.finish_resume(run_dir, resume)
    checkpoints.save(0, server_state, _client_versions(keeper))
  else:
    loaded = checkpoints.load(start_round, structure(start_round),
                              resume.changed)
    server_state = loaded['server_state']
    checkpoints.drop_unkept()  # Before the keeper collects unnamed states.
    if keeper:
      keeper.start(start_round, loaded['client_versions'], resume.changed)
      # Once its files are found: a resume refused for a missing store
      # makes none (the user would restore it inside the new one).
      mark_store_directory(config.state_dir, run_dir)
    run_directory.finish_resume(run_dir, resume)
    logging.info('Resuming %s from round %d', run_dir, start_round)

  if start_round < config.total_rounds:
    # It makes its file: only when a round will be logged.
    csv_metrics = tff.program.CSVFileReleaseManager(
        os.path.join(run_dir, 'metrics.csv'), key_fieldname='round_num')
  # TensorBoard's makes a new events file per run when built: built with the
  # first row, so that a run which fails before one leaves no empty file.
  tensorboard = None
  evaluator = None
  client_ids = np.asarray(task.train_client_ids, dtype=object)
  group_size = cohort.clients_per_group(
      config.clients_per_round, config.clients_per_group, config.runtime,
      per_client=model_aggregator is not None)
  row = {}
  progress = tqdm.tqdm(total=config.total_rounds, initial=start_round,
                       unit='round', desc=config.experiment_name,
                       dynamic_ncols=True, disable=None)
  def plan_of(round_num):
    return plan_round(config.seed, round_num, len(client_ids),
                      config.clients_per_round)

  next_plan = plan_of(start_round + 1)
  # The newest round with its metrics row, server state and client-state
  # versions, which a Ctrl-C checkpoints. The files of those versions stay
  # until the next round's row (`release_superseded`).
  completed = (start_round, server_state, _client_versions(keeper).copy())
  try:
    for round_num in range(start_round + 1, config.total_rounds + 1):
      interrupts.check()
      started = time.perf_counter()
      plan = next_plan
      # The next round's clients keep their new states in the page cache.
      next_plan = (plan_of(round_num + 1)
                   if round_num < config.total_rounds else None)
      versions = (keeper.index.versions_of(plan.client_indices)
                  if keeper else None)
      groups = cohort.groups(client_ids[plan.client_indices],
                             plan.client_seeds, versions, group_size)
      if keeper:
        keeper.prepare(round_num, client_ids[next_plan.client_indices]
                       if next_plan is not None else [])
      new_state, metrics = process.next(server_state, groups, round_num,
                                        plan.server_seed)
      server_state = new_state
      if keeper:
        keeper.commit(plan.client_indices, round_num)
      row = evaluation.flatten_metrics(metrics)
      row['round_seconds'] = time.perf_counter() - started
      if round_metrics is not None:
        row.update(round_metrics(round_num))
      last_round = round_num == config.total_rounds
      if round_num % config.rounds_per_eval == 0 or last_round:
        if evaluator is None:
          evaluator = evaluation.Evaluator(task)
        eval_started = time.perf_counter()
        row.update(evaluator(round_lib.get_model_weights(server_state)))
        if definition.personalization is not None:
          row.update(evaluation.flatten_metrics(
              definition.personalization.evaluate(server_state,
                                                  keeper.view()),
              'eval_personalized/'))
        row['eval_seconds'] = time.perf_counter() - eval_started
      with interrupts.deferred():  # A Ctrl-C meanwhile finds the row done.
        interrupts.run_coroutine(csv_metrics.release(row, round_num))
        if tensorboard is None:
          tensorboard = tff.program.TensorBoardReleaseManager(
              os.path.join(run_dir, 'tensorboard'))
        interrupts.run_coroutine(tensorboard.release(row, round_num))
        completed = (round_num, server_state,
                     _client_versions(keeper).copy())
      if keeper:
        keeper.release_superseded()
      if round_num % config.rounds_per_checkpoint == 0 or last_round:
        checkpoints.save(round_num, server_state, _client_versions(keeper))
        if keeper:
          keeper.checkpointed(round_num)
      progress.update(1)
      if 'train/loss' in row:
        progress.set_postfix(loss=f'{row["train/loss"]:.4f}', refresh=False)
      if 'eval_seconds' in row:
        tqdm.tqdm.write(f'round {round_num}: ' + ', '.join(
            f'{k}={v:.4g}' for k, v in row.items()
            if k in ('train/loss', accounting.EPSILON_METRIC)
            or k.startswith('eval')))
    weights = round_lib.get_model_weights(server_state)
    if config.export:
      export_lib.export_saved_model(
          task, weights, os.path.join(run_dir, export_lib.EXPORT_DIR),
          personal_models_writer(definition, server_state,
                                 keeper and keeper.view()))
  except (KeyboardInterrupt, BrokenPipeError):
    # A Ctrl-C, or the reader of the progress lines gone (`| head`).
    _checkpoint_on_interrupt(checkpoints, keeper, *completed)
    raise
  finally:
    progress.close()
    if keeper:
      keeper.close()
  return TrainResult(config.total_rounds, server_state, weights, row)
