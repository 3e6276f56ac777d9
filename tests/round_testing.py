"""Rounds on given data and given client states, for hand-computed tests.

The runtimes build a client's data from (client id, seed) inside its
computation, and read its state from the client-state files, so a test that
feeds chosen batches and starting states writes them where those
computations look:

- `FileData` writes datasets, batch by batch, to files named by client id
  (or, for central data, by seed) and gives the task the dataset
  computations that read them back. A file can be rewritten between rounds:
  a round reads what is there when it runs.
- `write_client_states` writes chosen states as one version of the clients'
  state files; a round reads them when its group names that version.
- `run_round` runs one round of a composed process on the given clients, as
  one group.
"""

import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from pipeline import driver
from tasks import base
from tff_algos.algorithms import registry
from tff_algos.algorithms import round as round_lib
from tff_algos.runtime import client_states
from tff_algos.runtime import cohort

_SUFFIX = '.tfrecord'


def _serialized(batch) -> bytes:
  parts = tf.stack([tf.io.serialize_tensor(tf.convert_to_tensor(leaf))
                    for leaf in tf.nest.flatten(batch)])
  return tf.io.serialize_tensor(parts).numpy()


class FileData:
  """Datasets kept as files, read inside the runtimes' computations."""

  def __init__(self, directory: str, batch_spec: Any):
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    self._spec = batch_spec

  def _write(self, name: str, dataset: tf.data.Dataset) -> None:
    path = os.path.join(self.directory, name + _SUFFIX)
    with tf.io.TFRecordWriter(path + '.staging') as writer:
      for batch in dataset:
        writer.write(_serialized(batch))
    os.replace(path + '.staging', path)

  def set_client(self, client_id: str, dataset: tf.data.Dataset) -> str:
    """Client `client_id` trains on `dataset`'s batches (any seed)."""
    self._write(f'client_{client_id}', dataset)
    return client_id

  def set_central(self, seed: int, dataset: tf.data.Dataset) -> int:
    """The central batches of a round whose server seed is `seed`."""
    self._write(f'central_{int(seed)}', dataset)
    return seed

  def _read(self, path: tf.Tensor) -> tf.data.Dataset:
    specs = tf.nest.flatten(self._spec)

    def parse(record):
      parts = tf.io.parse_tensor(record, tf.string)
      return tf.nest.pack_sequence_as(self._spec, [
          tf.ensure_shape(tf.io.parse_tensor(parts[i], spec.dtype),
                          spec.shape) for i, spec in enumerate(specs)])

    return tf.data.TFRecordDataset(path).map(parse)

  def client_dataset(self, client_id, seed):
    del seed
    return self._read(tf.strings.join(
        [self.directory, '/client_', client_id, _SUFFIX]))

  def central_dataset(self, seed):
    return self._read(tf.strings.join(
        [self.directory, '/central_', tf.strings.as_string(seed), _SUFFIX]))

  def task(self, task: base.Task, central: bool = False) -> base.Task:
    """`task` with its client (and, if `central`, server) data read here."""
    changes = dict(client_dataset_computation=base.client_dataset_computation(
        self.client_dataset))
    if central:
      changes['server_dataset_computation'] = (
          base.server_dataset_computation(self.central_dataset))
    return dataclasses.replace(task, **changes)


def write_client_states(state_format: client_states.StateFormat,
                        states: Mapping[str, Any], version: int) -> None:
  """Writes `states` (client id -> state) as version `version`."""
  for client_id, state in states.items():
    state_format.write(tf.constant(client_id),
                       tf.constant(version, tf.int64),
                       tf.nest.map_structure(
                           lambda v, s: tf.constant(v, s.dtype), state,
                           state_format.specs))


def run_round(process, state, client_ids: Sequence[str], round_num: int = 1,
              server_seed: int = 0, versions: Optional[Sequence[int]] = None,
              seeds: Optional[Sequence[int]] = None):
  """(state, metrics) of one round of `process` on `client_ids`, one group.

  With client state, `versions` are the versions the clients read (default:
  all -1, the initial state) and the round writes version `round_num`.
  """
  ids = np.asarray(list(client_ids), dtype=object)
  if seeds is None:
    seeds = np.zeros(len(ids), np.int64)
  if versions is not None:
    versions = np.asarray(versions, np.int64)
  [group] = cohort.groups(ids, np.asarray(seeds, np.int64), versions, len(ids))
  return process.next(state, [group], round_num, server_seed)


def run_planned_rounds(definition, task: base.Task, runtime: str,
                       num_rounds: int = 2, clients_per_round: int = 3,
                       seed: int = 3) -> list:
  """[(server state, metrics)] after each of `num_rounds` rounds of a
  stateless `definition`, from the driver's initial weights, with the
  driver's sampling and data seeds, the cohort as one group."""
  process = driver.compose_process(definition, task, runtime)
  state = round_lib.set_model_weights(
      process.initialize(), driver.initial_model_weights(task, 0))
  history = []
  for round_num in range(1, num_rounds + 1):
    plan = driver.plan_round(seed, round_num, task.num_train_clients,
                             clients_per_round)
    ids = [task.train_client_ids[i] for i in plan.client_indices]
    state, metrics = run_round(process, state, ids, round_num,
                               plan.server_seed, seeds=plan.client_seeds)
    history.append((state, metrics))
  return history


class StatefulRounds:
  """Rounds of a definition that keeps client state, from chosen states.

  The client states live in `directory` (one per process: the directory is
  part of the compiled computations).
  """

  def __init__(self, definition, task: base.Task, runtime: str,
               directory: str):
    self.definition = definition
    self.format = driver.state_format(definition, directory)
    self.process = driver.compose_process(definition, task, runtime,
                                          self.format)

  def initial_client_state(self):
    return tf.nest.map_structure(np.asarray,
                                 self.definition.initial_client_state())

  def start(self, client_states: Mapping[str, Any]) -> None:
    """The clients start round 1 from `client_states` (id -> state)."""
    write_client_states(self.format, client_states, version=0)

  def next(self, state, client_ids: Sequence[str], round_num: int = 1):
    """(state, the clients' new states, metrics) of round `round_num`; the
    clients read the states of the round before."""
    state, metrics = run_round(self.process, state, client_ids, round_num,
                               versions=[round_num - 1] * len(client_ids))
    return (state, [self.format.load(c, round_num) for c in client_ids],
            metrics)


def settings_of(name: str, **values):
  """Algorithm `name`'s settings, from those of `values` it has (so one set
  of values serves several algorithms)."""
  settings_class = registry.settings_class(name)
  fields = {f.name for f in dataclasses.fields(settings_class)}
  return settings_class(**{k: v for k, v in values.items() if k in fields})
