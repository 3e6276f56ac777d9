"""The one training loop every algorithm runs through.

Per round: sample client ids uniformly without replacement, read their stored
states, run the by-id TFF process, write the new states, log metrics, evaluate
and checkpoint on schedule. Sampling, client shuffle seeds and the central
data seed are pure functions of (seed, round), so the only things a checkpoint
needs are the round number, the server state and the client-state store.
"""

import asyncio
import collections
import dataclasses
import json
import logging
import os
import time
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tqdm

from pipeline import client_store as client_store_lib
from pipeline import evaluation
from pipeline import export as export_lib
from pipeline.errors import UsageError
from tasks import base
from tff_algos import contract
from tff_algos import native

CHECKPOINT_PREFIX = 'round_'


@dataclasses.dataclass(frozen=True)
class RunConfig:
  root_output_dir: str
  experiment_name: str
  total_rounds: int
  clients_per_round: int
  rounds_per_eval: int = 1
  rounds_per_checkpoint: int = 5
  seed: int = 0
  client_state_store: str = 'auto'
  checkpoints_to_keep: int = 3
  export: bool = True
  # 'tff' (TFF's runtime) or 'native' (in-process TF).
  runtime: str = 'tff'

  @property
  def run_dir(self) -> str:
    return os.path.join(self.root_output_dir, self.experiment_name)

  def validate(self, num_train_clients: int) -> None:
    if self.total_rounds < 1:
      raise UsageError(f'--total_rounds must be >= 1, got {self.total_rounds}')
    if not 1 <= self.clients_per_round <= num_train_clients:
      raise UsageError(
          f'--clients_per_round={self.clients_per_round} is impossible: the '
          f'task has {num_train_clients} train clients (allowed: 1..'
          f'{num_train_clients})')
    for flag in ('rounds_per_eval', 'rounds_per_checkpoint'):
      if getattr(self, flag) < 1:
        raise UsageError(f'--{flag} must be >= 1, got {getattr(self, flag)}')
    if self.client_state_store not in ('auto',) + client_store_lib.BACKENDS:
      raise UsageError(
          f'--client_state_store={self.client_state_store!r} is unknown; '
          f'allowed: auto, {", ".join(client_store_lib.BACKENDS)}')
    if self.runtime not in native.RUNTIMES:
      raise UsageError(f'--runtime={self.runtime!r} is unknown; allowed: '
                       f'{", ".join(native.RUNTIMES)}')
    if not self.experiment_name or os.sep in self.experiment_name:
      raise UsageError(f'--experiment_name={self.experiment_name!r} must be a '
                       'non-empty name without path separators')


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


def compose_process(algorithm: contract.FederatedAlgorithm, task: base.Task,
                    runtime: str = 'tff'):
  """The by-id process the driver runs, on the chosen runtime.

  Both have `initialize()` and `next(server_state, client_inputs,
  server_seed)` with the same Python structures in and out.
  """
  if runtime == 'native':
    return native.compose_by_id(algorithm, task.client_dataset_fn,
                                task.server_dataset_fn, f'--task={task.name}',
                                task.client_cost_fn)
  return contract.compose_by_id(algorithm, task.client_dataset_computation,
                                task.server_dataset_computation,
                                task.client_cost_fn)


def program_state_structure(algorithm: contract.FederatedAlgorithm,
                            round_num: int, process=None):
  """The structure a checkpoint of `algorithm` is loaded into; `process` is
  the composed process to initialize (default: the TFF one)."""
  process = process or algorithm.process
  return _program_state(round_num, process.initialize(), b'')


def _program_state(round_num: int, server_state, store_bytes: bytes):
  return collections.OrderedDict(
      round_num=np.int64(round_num), server_state=server_state,
      client_store=store_bytes)


class CheckpointManager:
  """Server state + round + client store, via tff.program's state manager."""

  def __init__(self, checkpoint_dir: str, keep: int):
    self._dir = checkpoint_dir
    self._manager = tff.program.FileProgramStateManager(
        checkpoint_dir, prefix=CHECKPOINT_PREFIX, keep_total=keep,
        keep_first=False)

  def latest_round(self) -> Optional[int]:
    versions = asyncio.run(self._manager.get_versions())
    return versions[-1] if versions else None

  def load(self, round_num: int, structure, store=None):
    """The checkpoint of `round_num`; also rolls `store` back to it."""
    path = os.path.join(self._dir, f'{CHECKPOINT_PREFIX}{round_num}')
    try:
      state = asyncio.run(self._manager.load(round_num, structure))
    except Exception as e:  # pylint: disable=broad-except
      raise UsageError(f'checkpoint {path} is corrupted or incompatible with '
                       f'these flags ({type(e).__name__}); delete it to '
                       'resume from an earlier one') from e
    if int(state['round_num']) != round_num:
      raise UsageError(f'checkpoint {path} holds round {state["round_num"]}')
    if store:
      store.restore(round_num, state['client_store'], self._dir)
    return state

  def save(self, round_num: int, server_state, store=None) -> None:
    """Checkpoints the server state together with the client store."""
    os.makedirs(self._dir, exist_ok=True)
    # A memory store writes its database into a file here first.
    store_bytes = store.checkpoint(round_num, self._dir) if store else b''
    asyncio.run(self._manager.save(
        _program_state(round_num, server_state, store_bytes), round_num))
    # Client-store files of checkpoints the manager dropped (or of a save
    # that never completed).
    kept = set(asyncio.run(self._manager.get_versions()) or ())
    for name in os.listdir(self._dir):
      file_round = client_store_lib.checkpoint_file_round(name)
      if file_round is not None and file_round not in kept:
        os.remove(os.path.join(self._dir, name))


def write_hparams(run_dir: str, hparams: dict) -> None:
  path = os.path.join(run_dir, 'hparams.json')
  staging = path + '.staging'
  with open(staging, 'w') as f:
    json.dump(hparams, f, indent=2, sort_keys=True, default=str)
  os.replace(staging, path)


def train(algorithm: contract.FederatedAlgorithm, task: base.Task,
          config: RunConfig, hparams: Optional[dict] = None) -> TrainResult:
  """Runs (or resumes) `config.total_rounds` rounds; exports the final model."""
  config.validate(task.num_train_clients)
  run_dir = config.run_dir
  os.makedirs(run_dir, exist_ok=True)

  process = compose_process(algorithm, task, config.runtime)
  store = None
  if algorithm.has_client_state:
    store = client_store_lib.open_store(
        algorithm.client_state_fn,
        client_store_lib.resolve_backend(config.client_state_store,
                                         task.num_train_clients), run_dir)
  checkpoints = CheckpointManager(os.path.join(run_dir, 'checkpoints'),
                                  config.checkpoints_to_keep)

  initial_state = algorithm.set_model_weights(
      process.initialize(), initial_model_weights(task, config.seed))
  start_round = checkpoints.latest_round()
  if start_round is None:
    start_round = 0
    server_state = initial_state
    if store:  # Drop rows a run that never checkpointed may have left.
      store.restore(0, b'')
    checkpoints.save(0, server_state, store)
  elif start_round > config.total_rounds:
    raise UsageError(
        f'--total_rounds={config.total_rounds} is below the round of the '
        f'latest checkpoint ({start_round}) in {run_dir}; pass a larger '
        '--total_rounds or a new --experiment_name')
  else:
    loaded = checkpoints.load(
        start_round, _program_state(start_round, initial_state, b''), store)
    server_state = loaded['server_state']
    logging.info('Resuming %s from round %d', run_dir, start_round)

  write_hparams(run_dir, hparams or {})
  csv_metrics = tff.program.CSVFileReleaseManager(
      os.path.join(run_dir, 'metrics.csv'), key_fieldname='round_num')
  tensorboard = tff.program.TensorBoardReleaseManager(
      os.path.join(run_dir, 'tensorboard'))
  evaluator = None
  client_ids = task.train_client_ids
  row = {}
  progress = tqdm.tqdm(total=config.total_rounds, initial=start_round,
                       unit='round', desc=config.experiment_name,
                       dynamic_ncols=True, disable=None)
  try:
    for round_num in range(start_round + 1, config.total_rounds + 1):
      started = time.perf_counter()
      plan = plan_round(config.seed, round_num, len(client_ids),
                        config.clients_per_round)
      ids = [client_ids[i] for i in plan.client_indices]
      client_inputs = [collections.OrderedDict(id=cid, seed=seed)
                       for cid, seed in zip(ids, plan.client_seeds)]
      if store:
        for client_input, state in zip(client_inputs, store.read(ids)):
          client_input['state'] = state
      server_state, client_outputs, metrics = process.next(
          server_state, client_inputs, plan.server_seed)
      if store:
        store.write(round_num, ids, [out['state'] for out in client_outputs])
      row = evaluation.flatten_metrics(metrics)
      row['round_seconds'] = time.perf_counter() - started
      last_round = round_num == config.total_rounds
      if round_num % config.rounds_per_eval == 0 or last_round:
        if evaluator is None:
          evaluator = evaluation.Evaluator(task)
        eval_started = time.perf_counter()
        row.update(evaluator(algorithm.get_model_weights(server_state)))
        if algorithm.personalization is not None:
          row.update(evaluation.flatten_metrics(
              algorithm.personalization.evaluate(server_state, store),
              'eval_personalized/'))
        row['eval_seconds'] = time.perf_counter() - eval_started
      asyncio.run(csv_metrics.release(row, round_num))
      asyncio.run(tensorboard.release(row, round_num))
      if round_num % config.rounds_per_checkpoint == 0 or last_round:
        checkpoints.save(round_num, server_state, store)
      progress.update(1)
      if 'train/loss' in row:
        progress.set_postfix(loss=f'{row["train/loss"]:.4f}', refresh=False)
      if 'eval_seconds' in row:
        tqdm.tqdm.write(f'round {round_num}: ' + ', '.join(
            f'{k}={v:.4g}' for k, v in row.items()
            if k in ('train/loss',) or k.startswith('eval')))
    weights = algorithm.get_model_weights(server_state)
    if config.export:
      export_dir = export_lib.export_saved_model(
          task, weights, os.path.join(run_dir, 'export'))
      if algorithm.personalization is not None:
        algorithm.personalization.export(server_state, store, export_dir)
  finally:
    progress.close()
    if store:
      store.close()
  return TrainResult(config.total_rounds, server_state, weights, row)
