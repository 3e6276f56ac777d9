r"""Serves one client's personalized prediction from a FedRes export.

  python -m binaries.serve_personalized --export_dir=runs/demo/export \
      --client_id=42 --inputs_npy=inputs.npy

`inputs.npy` holds a batch of the task's serving input (e.g. movie ids for
movielens_ratings), finite values only. Prints the predictions as JSON. A
client without a stored local model gets the initial one (the global
prediction plus the initial local model's), with a note on stderr.
"""

import json
import math
import os
import sys

from absl import flags
import numpy as np

from binaries import app
from pipeline.errors import UsageError

FLAGS = flags.FLAGS
flags.DEFINE_string('export_dir', None, 'Export directory of a FedRes run.')
flags.DEFINE_string('client_id', None, 'Client whose local model to use.')
flags.DEFINE_string('inputs_npy', None, '.npy file with a batch of inputs.')


def _check_data_size(path: str) -> None:
  """ValueError if the .npy file at `path` holds fewer bytes of data than
  its header's shape needs: NumPy allocates that shape before it reads, so
  a damaged header claiming terabytes was a MemoryError traceback."""
  with open(path, 'rb') as f:
    if f.read(2) == b'PK':  # np.load reads it as an .npz archive.
      raise ValueError('it is an .npz archive of arrays, not one .npy array')
    f.seek(0)
    try:
      # Every version NumPy loads (the public readers stop at 2.0; a 3.0
      # header claiming terabytes was a MemoryError traceback). Other
      # versions and damaged headers: np.load says what is wrong.
      shape, _, dtype = np.lib.format._read_array_header(  # pylint: disable=protected-access
          f, np.lib.format.read_magic(f))
    except (ValueError, EOFError):
      return
    available = os.fstat(f.fileno()).st_size - f.tell()
  needed = math.prod(shape) * dtype.itemsize
  if not dtype.hasobject and needed > available:
    raise ValueError(f'its header declares shape {shape} of {dtype} '
                     f'({needed} bytes), but it holds {available} bytes of '
                     'data')


def main(argv):
  del argv
  app.require_flags('export_dir', 'client_id', 'inputs_npy')
  if not FLAGS.client_id:
    # No client has it: the initial local model was served, with a note.
    raise UsageError('--client_id is empty; name the client whose local '
                     'model to use')
  if not os.path.isdir(FLAGS.export_dir):
    raise UsageError(f'--export_dir={FLAGS.export_dir} is not a directory '
                     '(it should be the export of a FedRes run)')
  if os.path.isdir(FLAGS.inputs_npy):
    raise UsageError(f'--inputs_npy={FLAGS.inputs_npy} is a directory, not a '
                     '.npy file')
  if not os.path.isfile(FLAGS.inputs_npy):
    raise UsageError(f'--inputs_npy={FLAGS.inputs_npy} ' + (
        'is not a regular file' if os.path.exists(FLAGS.inputs_npy) else
        'does not exist'))
  try:
    _check_data_size(FLAGS.inputs_npy)
    inputs = np.load(FLAGS.inputs_npy, allow_pickle=False)
  except (ValueError, EOFError) as e:
    raise UsageError(f'--inputs_npy={FLAGS.inputs_npy} is not a .npy array: '
                     f'{e or type(e).__name__}') from e
  # Imported here so flag errors do not wait for TensorFlow.
  from tff_algos.algorithms.fedres import export as fedres_export  # pylint: disable=g-import-not-at-top
  server = fedres_export.PersonalizedServer(FLAGS.export_dir)
  try:
    predictions, own_model = server.predict(FLAGS.client_id, inputs)
  except fedres_export.InputError as e:
    raise UsageError(f'--inputs_npy={FLAGS.inputs_npy}: {e}') from e
  if not all(np.all(np.isfinite(value)) for value in predictions.values()):
    # Finite inputs so large that the model overflows; not valid JSON.
    raise UsageError(f'--inputs_npy={FLAGS.inputs_npy}: the predictions for '
                     f'client {FLAGS.client_id!r} are not finite (NaN or '
                     'inf); the inputs are too large for the model')
  if not own_model:
    # A mistyped id would otherwise pass for a client's own predictions.
    print(f'note: {FLAGS.export_dir} has no local model of client '
          f'{FLAGS.client_id!r} (not trained, or never sampled): these are '
          'the predictions of the initial local model', file=sys.stderr)
  print(json.dumps({name: value.tolist()
                    for name, value in predictions.items()},
                   allow_nan=False))


if __name__ == '__main__':
  app.run(main)
