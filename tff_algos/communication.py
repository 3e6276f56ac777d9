"""Per-client communication accounting, from the types of what is sent.

Every algorithm reports, each round, the bytes one client downloads (what the
server broadcasts) and uploads (what the server aggregates from it), as
`communication/bytes_down_per_client` and `communication/bytes_up_per_client`.
The sizes come from the TFF types of the broadcast and uploaded values, so a
change to what an algorithm sends changes its accounting with it.
"""

import collections

import numpy as np
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


def metrics(bytes_down: int, bytes_up: int) -> collections.OrderedDict:
  """The round's communication metrics (the native runtime's value)."""
  return collections.OrderedDict(
      bytes_down_per_client=np.int64(bytes_down),
      bytes_up_per_client=np.int64(bytes_up))


def metrics_at_server(bytes_down: int, bytes_up: int):
  """The round's communication metrics, placed at the server.

  Call inside a `tff.federated_computation`.
  """
  return tff.federated_value(metrics(bytes_down, bytes_up), tff.SERVER)
