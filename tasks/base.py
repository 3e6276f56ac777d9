"""What a task gives the driver and the algorithms.

A task owns its data (train clients by id, optional central data, evaluation
sets), its Keras model, loss and metrics, and its serving signature. Client and
server datasets are TFF computations so they are built inside the TFF runtime
(clients by id); their shuffle seeds come from the driver so a
resumed run sees exactly the batches of an uninterrupted one.
"""

import collections
import dataclasses
import os
from typing import Any, Callable, Mapping, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tasks import residual
from tff_algos import tff_internals


def tensorflow_datasets():
  """The `tensorflow_datasets` module, imported at first use: its import is
  about 1 s of every binary's start, and only the TFDS-backed tasks (CIFAR,
  Wikipedia) read it."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  return tfds


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Batching of client and central data (from the binaries' flags)."""
  client_batch_size: int = 5
  # K local steps; None means `client_epochs` passes over the client's data.
  client_steps: Optional[int] = None
  client_epochs: int = 1
  central_batch_size: int = 500
  central_steps: int = 1
  eval_batch_size: int = 256
  # Shuffle buffer for a client's examples (clients are small).
  shuffle_buffer: int = 1000
  seed: int = 0
  use_synthetic_data: bool = False
  cache_dir: Optional[str] = None
  data_dir: Optional[str] = None
  download: bool = False
  # Task-specific options (e.g. celeba_mode).
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def validate(self) -> None:
    if self.client_batch_size < 1:
      raise UsageError('--client_batch_size must be >= 1, got '
                       f'{self.client_batch_size}')
    if self.client_steps is not None and self.client_steps < 1:
      raise UsageError(f'--client_steps must be >= 1, got {self.client_steps}')
    if self.client_epochs < 1:
      raise UsageError(
          f'--client_epochs must be >= 1, got {self.client_epochs}')
    if self.central_batch_size < 1:
      raise UsageError('--central_batch_size must be >= 1, got '
                       f'{self.central_batch_size}')
    if self.eval_batch_size < 1:
      raise UsageError('--eval_batch_size must be >= 1, got '
                       f'{self.eval_batch_size}')


@dataclasses.dataclass(frozen=True)
class ServingSpec:
  """The exported model's `serving_default`: raw input -> predictions."""
  input_name: str
  input_spec: tf.TensorSpec
  # Raw serving input -> model input.
  preprocess: Callable[[tf.Tensor], tf.Tensor]
  # Model output -> dict of named predictions.
  postprocess: Callable[[tf.Tensor], Mapping[str, tf.Tensor]]


@dataclasses.dataclass(frozen=True)
class PersonalEvalData:
  """Per-client held-out data, for evaluating personalized models."""
  # Clients to evaluate; may include clients outside the train population.
  client_ids: tuple[str, ...]
  # client id -> batches (model input, label) of its held-out examples.
  test_dataset_fn: Callable[[str], tf.data.Dataset]
  # (client id, shuffle seed) -> the client's training batches, as the
  # client dataset computation makes them; e.g. to fit a personal model for
  # a client that never trained one.
  train_dataset_fn: Callable[[str, int], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class Task:
  """Everything the driver needs about one learning problem."""
  name: str
  train_client_ids: tuple[str, ...]
  # <id: str, seed: int64> -> batched training data of one client.
  client_dataset_computation: tff.Computation
  keras_model_fn: Callable[[], tf.keras.Model]
  loss_fn: Callable[[], tf.keras.losses.Loss]
  metrics_fn: Callable[[], list[tf.keras.metrics.Metric]]
  # Element spec of a training batch: (model input, label).
  batch_spec: Any
  # Named evaluation sets; '' is reported as eval/<metric>, others as
  # eval_<name>/<metric>.
  eval_datasets_fn: Callable[[], Mapping[str, tf.data.Dataset]]
  serving: ServingSpec
  # int64 seed -> central batches (mixed FL); None if the task has none.
  server_dataset_computation: Optional[tff.Computation] = None
  # Clients per round when --clients_per_round is not given (e.g. full
  # participation for CIFAR); None keeps the flag's default.
  default_clients_per_round: Optional[int] = None
  # A centralized loss without data (mixed FL), e.g. a regularizer of the
  # embedding table: trainable ModelWeights (variables) -> scalar. Used
  # instead of server data when set.
  central_loss_fn: Optional[
      Callable[[tff.learning.models.ModelWeights], tf.Tensor]] = None
  # Global + local model structure for FedRes; None if the task has none.
  residual_spec: Optional[residual.ResidualModelSpec] = None
  # Per-client held-out data for personalized evaluation; None if none.
  personal_eval_data: Optional[PersonalEvalData] = None
  # A client's round dataset (the batches it trains on) -> its analytic
  # costs (tff_algos.runtime.communication.CLIENT_COST_FIELDS), reported per round
  # as train/client_*; None if the task does not model them.
  client_cost_fn: Optional[
      Callable[[tf.data.Dataset], Mapping[str, tf.Tensor]]] = None
  # The data settings the task was built with (set by tasks.registry).
  data_config: Optional[DataConfig] = None

  @property
  def num_train_clients(self) -> int:
    return len(self.train_client_ids)

  @property
  def client_dataset_fn(self) -> Optional[Callable]:
    """The TF function `(id, seed) -> dataset` behind
    `client_dataset_computation` (for runtimes without TFF); None unless
    that computation was made by `client_dataset_computation` below."""
    return dataset_fn_of(self.client_dataset_computation)

  @property
  def server_dataset_fn(self) -> Optional[Callable]:
    """`seed -> dataset` behind `server_dataset_computation`, likewise."""
    return dataset_fn_of(self.server_dataset_computation)

  def model_fn(self) -> tff.learning.models.VariableModel:
    model = tff.learning.models.from_keras_model(
        self.keras_model_fn(), loss=self.loss_fn(),
        input_spec=self.batch_spec, metrics=self.metrics_fn())
    return tff_internals.without_autograph(model)


def check_batches_fit(task: Task, config: DataConfig) -> None:
  """A batch that cannot fit in this machine's memory is a usage error.

  With --client_steps a client's examples repeat until its K batches are full,
  and central batches always repeat, so a batch of B examples is really built
  whatever the data hold; a B far beyond the memory would only end, after
  minutes of swapping, in the out-of-memory killer. (Batches of
  --client_epochs and of evaluation hold at most the data there are.)
  """
  memory = os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
  example = _example_bytes(task.batch_spec)
  repeated = []
  if config.client_steps is not None:
    repeated.append(('client_batch_size', config.client_batch_size))
  if task.server_dataset_computation is not None:
    repeated.append(('central_batch_size', config.central_batch_size))
  for name, size in repeated:
    if size * example > memory:
      raise UsageError(
          f'--{name}={size} is impossible: one batch of {task.name} examples '
          f'takes at least {_gigabytes(size * example)}, more than this '
          f"machine's {_gigabytes(memory)} of memory")


def _example_bytes(batch_spec) -> int:
  """A lower bound on one example's bytes (unknown dimensions count 1)."""
  total = 0
  for spec in tf.nest.flatten(batch_spec):
    dims = spec.shape.as_list()[1:] if spec.shape.rank else []
    total += int(np.prod([d or 1 for d in dims])) * max(spec.dtype.size, 1)
  return total


def _gigabytes(num_bytes: int) -> str:
  return f'{num_bytes / 2**30:,.1f} GB'


def client_batches(examples: tf.data.Dataset, config: DataConfig,
                   seed: tf.Tensor) -> tf.data.Dataset:
  """A client's local training stream: shuffled, then K batches or E epochs.

  With `client_steps` the shuffled data repeats, so every client takes exactly
  K steps (unless it has no data); with `client_epochs` a client takes
  E * ceil(n_i / B) steps, so K_i varies with the client's size: each epoch
  is its own reshuffled pass split into batches of B, the last one smaller
  when B does not divide n_i ([FedAvg] Alg. 1). (Batching the E passes as one
  stream, as TFF's tutorials and baselines do, puts examples of two epochs
  in one batch, an example twice when n_i < B, and takes ceil(E n_i / B)
  steps.)
  """
  examples = examples.shuffle(config.shuffle_buffer, seed=seed,
                              reshuffle_each_iteration=True)
  if config.client_steps is not None:
    batches = examples.repeat().batch(config.client_batch_size).take(
        config.client_steps)
  else:
    batches = examples.batch(config.client_batch_size).repeat(
        config.client_epochs)
  return batches.with_options(without_pipeline_rewrites())


def without_pipeline_rewrites() -> tf.data.Options:
  """tf.data options for datasets iterated once per client and round.

  Making an iterator rewrites the pipeline's graph (default optimizations,
  autotuning) and instantiates its functions afresh; TFF's worker does that
  for every client of every round, where it costs more than the training
  steps of a small model. Neither option changes which elements come out or
  their order.
  """
  options = tf.data.Options()
  options.experimental_optimization.apply_default_optimizations = False
  options.autotune.enabled = False
  return options


CLIENT_DATASET_ARGS = tff.StructType([('id', np.str_), ('seed', np.int64)])
# The computations below keep the TF function they wrap under this attribute,
# so the native runtime (`--runtime=native`) builds the same datasets without TFF.
_DATASET_FN_ATTRIBUTE = 'python_dataset_fn'


def _with_dataset_fn(computation: tff.Computation,
                     dataset_fn: Callable) -> tff.Computation:
  setattr(computation, _DATASET_FN_ATTRIBUTE, dataset_fn)
  return computation


def dataset_fn_of(computation: Optional[tff.Computation]
                  ) -> Optional[Callable]:
  """The TF function a dataset computation of this module wraps, or None."""
  return getattr(computation, _DATASET_FN_ATTRIBUTE, None)


def client_dataset_computation(
    dataset_fn: Callable[[tf.Tensor, tf.Tensor], tf.data.Dataset]
) -> tff.Computation:
  """`(client_id, seed) -> dataset` as the TFF computation `compose_by_id` maps."""

  def by_id(id, seed):  # pylint: disable=redefined-builtin
    return dataset_fn(id, seed)

  return _with_dataset_fn(
      tff.tensorflow.computation(by_id, CLIENT_DATASET_ARGS), dataset_fn)


def server_dataset_computation(
    dataset_fn: Callable[[tf.Tensor], tf.data.Dataset]) -> tff.Computation:
  """`seed -> dataset` of one round's central batches, as a TFF computation."""
  return _with_dataset_fn(tff.tensorflow.computation(dataset_fn, np.int64),
                          dataset_fn)


def ordered(**kwargs) -> collections.OrderedDict:
  return collections.OrderedDict(**kwargs)
