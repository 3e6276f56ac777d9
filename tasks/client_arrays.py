"""Per-client examples held in memory as one set of arrays.

Rows are grouped by client so a client's examples are one slice. Client ids
are the decimal strings of non-negative integer keys, so a TF graph maps an
id to its slice with a binary search over the sorted keys and two index
arrays, one entry per client (no lookup table to initialize inside TFF
computations; arrays indexed by the key itself made one user id of 9999999
in a MovieLens file a 160 MB graph constant, 8 GB of RAM for a tiny run).
"""

from typing import Callable, Mapping

import numpy as np
import tensorflow as tf

from tasks import base
from tasks import residual


class ClientArrays:
  """Columns of per-example arrays, sliced by client."""

  def __init__(self, client_keys: np.ndarray, columns: Mapping[str, np.ndarray]):
    client_keys = np.asarray(client_keys, np.int64)
    if client_keys.size and client_keys.min() < 0:
      raise ValueError('client keys must be non-negative integers')
    order = np.argsort(client_keys, kind='stable')
    self._keys = client_keys[order]
    self._columns = {name: np.asarray(values)[order]
                     for name, values in columns.items()}
    self._unique_keys = np.unique(self._keys)
    self._starts = np.searchsorted(self._keys, self._unique_keys, 'left')
    self._ends = np.searchsorted(self._keys, self._unique_keys, 'right')

  @property
  def client_ids(self) -> tuple[str, ...]:
    """Ids of the clients that have at least one example, by key."""
    return tuple(str(k) for k in self._unique_keys)

  @property
  def num_examples(self) -> int:
    return len(self._keys)

  def rows(self, client_id: str) -> dict[str, np.ndarray]:
    key = int(client_id)
    index = np.searchsorted(self._unique_keys, key)
    if index == len(self._unique_keys) or self._unique_keys[index] != key:
      return {name: values[:0] for name, values in self._columns.items()}
    return {name: values[self._starts[index]:self._ends[index]]
            for name, values in self._columns.items()}

  def dataset(self, client_id: str) -> tf.data.Dataset:
    """One client's examples (eager: sliced in numpy)."""
    return tf.data.Dataset.from_tensor_slices(self.rows(client_id))

  def all_examples(self) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(dict(self._columns))

  def graph_dataset(self, client_id: tf.Tensor) -> tf.data.Dataset:
    """One client's examples inside a TF graph (e.g. a TFF computation).

    The arrays become graph constants: keep the columns compact (ids rather
    than features looked up later).
    """
    return tf.data.Dataset.from_tensor_slices(self.graph_columns(client_id))

  def graph_columns(self, client_id: tf.Tensor) -> dict[str, tf.Tensor]:
    """One client's column slices as tensors, inside a TF graph."""
    key = tf.strings.to_number(client_id, tf.int64)
    # A last entry of the largest key (an empty slice) after the clients':
    # the search's index is always an entry.
    unique_keys = tf.constant(
        np.append(self._unique_keys, np.iinfo(np.int64).max), tf.int64)
    starts = tf.constant(np.append(self._starts, len(self._keys)), tf.int64)
    ends = tf.constant(np.append(self._ends, len(self._keys)), tf.int64)
    index = tf.searchsorted(unique_keys, tf.reshape(key, [1]),
                            out_type=tf.int64)[0]
    found = tf.equal(tf.gather(unique_keys, index), key)
    start = tf.where(found, tf.gather(starts, index), 0)
    end = tf.where(found, tf.gather(ends, index), 0)
    return {name: tf.constant(values)[start:end]
            for name, values in self._columns.items()}


def build_task(name: str, config: base.DataConfig, train: ClientArrays,
               test: ClientArrays, to_batch: Callable[[dict], tuple],
               label_spec: tf.TensorSpec, spec: residual.ResidualModelSpec,
               serving: base.ServingSpec) -> base.Task:
  """A residual task whose clients are `train`'s, evaluated on `test`.

  `to_batch` maps a batch of rows (dict of columns) to (model input, label).
  Global-only evaluation pools every client's test examples; personalized
  evaluation takes the same examples client by client.
  """

  def client_dataset(client_id, seed):
    return base.client_batches(train.graph_dataset(client_id), config,
                               seed).map(to_batch)

  def eval_datasets():
    return {'': test.all_examples().batch(config.eval_batch_size).map(
        to_batch)}

  # Personalized evaluation builds a dataset per client, eagerly. A
  # `.map(to_batch)` on each traced `to_batch` anew with every table it
  # captures (MovieLens' genres: 3.5 MB a client for movie ids up to 20000,
  # 16 GB in all for ids up to 100000). Traced once here, it maps a
  # client's rows all at once (it is row-wise) before they are batched.
  examples_to_batch = tf.function(to_batch, autograph=False,
                                  reduce_retracing=True)

  def personal_examples(arrays: ClientArrays, client_id: str):
    rows = {name: tf.convert_to_tensor(values)
            for name, values in arrays.rows(client_id).items()}
    return tf.data.Dataset.from_tensor_slices(examples_to_batch(rows))

  personal_eval_data = base.PersonalEvalData(
      client_ids=test.client_ids,
      test_dataset_fn=lambda client_id: personal_examples(
          test, client_id).batch(config.eval_batch_size),
      train_dataset_fn=lambda client_id, seed: base.client_batches(
          personal_examples(train, client_id), config, seed))
  return base.Task(
      name=name,
      train_client_ids=train.client_ids,
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=lambda: residual.global_only_model(spec),
      loss_fn=spec.loss_fn,
      metrics_fn=spec.metrics_fn,
      batch_spec=(spec.input_spec, label_spec),
      eval_datasets_fn=eval_datasets,
      serving=serving,
      residual_spec=spec,
      personal_eval_data=personal_eval_data)
