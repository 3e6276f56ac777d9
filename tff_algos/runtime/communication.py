"""Per-client communication accounting, from the types of what is sent.

Every algorithm reports, each round, the bytes one client downloads (the
message the server broadcasts) and uploads (its model update, its weight,
its sums and its metric sums; not the simulation's measurements), as
`communication/bytes_down_per_client` and `communication/bytes_up_per_client`.
The sizes come from the TFF types of those values, so a change to what an
algorithm sends changes its accounting with it. Mixed FL's gradient transfer
also reports the augmenting gradient's part of the download.

Tasks whose clients need only some rows of an embedding table (movielens) also
model per-client costs analytically (`Task.client_cost_fn`);
`with_client_costs` turns their cohort means into `train/client_*` metrics:
FLOPs, touched rows, and the floats a sparse-row implementation would send,
derived from the dense accounting above (docs/movielens.md).
"""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


def type_bytes(value_type: tff.Type) -> int:
  """Bytes of one value of `value_type` (dense, uncompressed)."""
  if isinstance(value_type, tff.FederatedType):
    return type_bytes(value_type.member)
  if isinstance(value_type, tff.TensorType):
    shape = value_type.shape
    if not tff.types.is_shape_fully_defined(shape):
      raise ValueError(f'cannot size a tensor of unknown shape: {value_type}')
    dtype = np.dtype(value_type.dtype)
    if dtype.kind in ('U', 'S', 'O'):
      raise ValueError(f'cannot size a string tensor: {value_type}')
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if isinstance(value_type, tff.StructType):
    return sum(type_bytes(element) for element in value_type.children())
  raise ValueError(f'cannot size a value of type {value_type}')


def per_client_bytes(message_type: tff.Type, group_result_type: tff.Type,
                     uploads_weight: bool = True) -> tuple[int, int]:
  """(down, up) bytes of one client, from the types a group computes."""
  uploaded = ('model_update', 'sums', 'metrics') + (
      ('weight',) if uploads_weight else ())
  up = sum(type_bytes(group_result_type[name]) for name in uploaded)
  return type_bytes(message_type), up


def augmenting_bytes(message_type: tff.Type, key):
  """Bytes of the message's augmenting gradient (0 if it has none); None
  for algorithms that report none (`key` None)."""
  if key is None:
    return None
  names = tff.structure.name_list(message_type)
  return type_bytes(message_type[key]) if key in names else 0


def metrics(bytes_down: int, bytes_up: int,
            augmenting_bytes_down=None) -> collections.OrderedDict:
  """The round's communication metrics (int64 scalars)."""
  result = collections.OrderedDict(
      bytes_down_per_client=np.int64(bytes_down),
      bytes_up_per_client=np.int64(bytes_up))
  if augmenting_bytes_down is not None:
    result['augmenting_bytes_down_per_client'] = np.int64(
        augmenting_bytes_down)
  return result


# --- Analytic per-client costs of tasks with sparse embedding rows -----------
#
# A task can model what a client of a sparse-row implementation would send and
# compute (`Task.client_cost_fn`, e.g. movielens): per client and round it
# gives these fields, computed from the batches the client trains on.
CLIENT_COST_FIELDS = (
    'flops',              # FLOPs of the client's steps in the round
    'touched_rows',       # embedding rows its batches touch (n_i)
    'model_floats',       # floats of ONE copy of the model as the client
                          # needs it (touched rows + the other weights)
    'full_model_floats',  # floats of one dense copy of the model
    'central_gradient_floats',  # floats of ONE augmenting gradient as the
                                # client needs it: its touched rows of the
                                # variables the central loss reads (the
                                # gradient is zero on all others)
)


def with_client_costs(metrics_, costs):
  """TF: metrics + cohort-mean costs -> metrics with train/client_* added.

  The dense byte counts say how many whole model-sized values an algorithm
  sends each way (FedAvg and PT: the model down and its delta up; 1-w and 2-w
  GT also the augmenting gradient down); the rest of a payload (metric sums,
  client weight, optimizer hyperparameters) is far smaller than a model.
  Each whole copy is then counted at the size the client needs: the rows its
  data touches ([MixedFL] Table 5: 2*n*d for PT, 3*n*d for GT) or, if the
  client loss needs the full table, all of it (2*N*d for the baseline). The
  augmenting gradient is counted apart, at `central_gradient_floats`: it is
  zero on the variables the central loss does not read (movielens: all but
  the embedding table), which a sparse implementation does not send.
  """
  costs = dict(costs)
  added = collections.OrderedDict(
      client_flops=costs['flops'], client_touched_rows=costs['touched_rows'])
  communication = metrics_.get('communication')
  if communication is not None:
    full_floats = costs['full_model_floats']
    augmenting_bytes = communication.get('augmenting_bytes_down_per_client')
    total = 0.0
    for direction in ('down', 'up'):
      dense_floats = tf.cast(
          communication[f'bytes_{direction}_per_client'], tf.float32) / 4.0
      floats = 0.0
      if direction == 'down' and augmenting_bytes is not None:
        augmenting_floats = tf.cast(augmenting_bytes, tf.float32) / 4.0
        dense_floats -= augmenting_floats
        floats = (tf.round(augmenting_floats / full_floats) *
                  costs['central_gradient_floats'])
      copies = tf.round(dense_floats / full_floats)
      floats += copies * costs['model_floats'] + (dense_floats -
                                                  copies * full_floats)
      added[f'client_floats_{direction}'] = floats
      total += floats
    added['client_comm_floats'] = total
  result = collections.OrderedDict(metrics_)
  train = collections.OrderedDict(result.get('train', ()))
  train.update(added)
  result['train'] = train
  return result
