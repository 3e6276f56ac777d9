"""Writes a tiny celeba.sqlite in TFF's SqlClientData schema (real format)."""

import sqlite3

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tasks import client_database

ATTRIBUTES = tff.simulation.datasets.celeba.ATTRIBUTE_NAMES


def _example(rng: np.random.Generator, smiling: bool) -> bytes:
  image = rng.integers(0, 256, size=84 * 84 * 3)
  features = {'image': tf.train.Feature(
      int64_list=tf.train.Int64List(value=image.tolist()))}
  for name in ATTRIBUTES:
    value = int(smiling) if name == 'smiling' else int(rng.integers(0, 2))
    features[name] = tf.train.Feature(int64_list=tf.train.Int64List(
        value=[value]))
  return tf.train.Example(features=tf.train.Features(
      feature=features)).SerializeToString()


def write_celeba_sqlite(path, train_clients=6, test_clients=2,
                        examples_per_client=4, seed=0) -> dict:
  """Returns {split: {client_id: [smiling flags]}} of what was written."""
  rng = np.random.default_rng(seed)
  written = {}
  with sqlite3.connect(path) as connection:
    client_database.create_sql_client_data_tables(connection)
    for split, count, offset in (('split_by_clients_train', train_clients, 0),
                                 ('split_by_clients_test', test_clients, 100)):
      written[split] = {}
      for i in range(count):
        client_id = str(offset + i)
        smiles = [bool(j % 2) for j in range(examples_per_client)]
        written[split][client_id] = smiles
        client_database.insert_client_examples(
            connection, split, client_id,
            [_example(rng, smiling) for smiling in smiles])
  return written


def without_examples(path, split: str) -> None:
  """Deletes the rows of `split` from the examples table of a file in
  SqlClientData's schema (any task's), leaving its clients listed: a file
  cut short, which TFF's loader reads."""
  with sqlite3.connect(path) as connection:
    connection.execute('DELETE FROM examples WHERE split_name = ?', (split,))


def no_examples_message(path, dataset: str, role: str, split: str) -> str:
  """What a task says of a file whose `split` has no examples."""
  use = 'train' if role == 'train' else 'evaluate'
  return (f'{path} holds no {role} examples (its {split} clients have no rows '
          f'in its examples table): the run would {use} on nothing; it is cut '
          f'short or not TFF\'s {dataset}')
